"""What every engine hands back: one step's rollouts as padded tensors (Generation), built from token lists
(pack), and the two errors an engine raises.

A leaf module: the engines, the rollout process and the update import it; it imports nothing of the trainer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


class EngineError(RuntimeError):
    """The rollout engine failed: its error, or its process (grpo_fast.train.rollout.process) died."""


class EngineStartError(EngineError, ValueError):
    """The engine could not start: a ValueError too, as the loop's other setup errors (what to change, in one
    line)."""


@dataclass
class Generation:
    """One step's rollouts, `group_size` consecutive rows per prompt.

    input_ids (B, P + C): prompts left-padded to P, completions right-padded to C; attention_mask (B, P + C) bool;
    completion_ids (B, C); completion_mask (B, C) bool, the sampled tokens up to and including the first EOS;
    truncated (B,) bool, no EOS within max_completion_length; sampling_logps (B, C) fp32 or None, the engine's
    log-prob of each sampled token (zero off the mask). kept_ids, kept_offsets: with top-k / top-p sampling, the
    kept set of each of the B x C completion positions in CSR (grpo_fast.kept), the set the engine sampled from
    (padding positions hold their pad token alone), else None.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    sampling_logps: Optional[torch.Tensor] = None
    kept_ids: Optional[torch.Tensor] = None
    kept_offsets: Optional[torch.Tensor] = None

    def token_ids(self) -> list:
        """Each row's sampled tokens (completion_ids on completion_mask) as a list of ints: a reward's
        completion_ids column."""
        return [ids[mask].tolist() for ids, mask in zip(self.completion_ids.cpu(), self.completion_mask.cpu())]


def unpack(generation: Generation) -> list:
    """pack's inverse, row by row: (prompt ids, completion ids, truncated, sampling log-probs or None, kept set
    (ids, sizes) or None) of each row, as lists."""
    rows = []
    prompt_length, columns = generation.prompt_length, generation.completion_ids.shape[1]
    input_ids, mask = generation.input_ids.cpu(), generation.attention_mask.cpu()
    logps = None if generation.sampling_logps is None else generation.sampling_logps.cpu()
    offsets = None if generation.kept_offsets is None else generation.kept_offsets.cpu()
    kept_ids = None if generation.kept_ids is None else generation.kept_ids.cpu()
    for row in range(input_ids.shape[0]):
        prompt = input_ids[row, :prompt_length][mask[row, :prompt_length]].tolist()
        completion = input_ids[row, prompt_length:][mask[row, prompt_length:]].tolist()
        length = len(completion)
        kept = None
        if offsets is not None:
            first = row * columns
            bounds = offsets[first:first + length + 1]
            kept = (kept_ids[bounds[0]:bounds[-1]].tolist(), bounds.diff().tolist())
        rows.append((prompt, completion, bool(generation.truncated[row]),
                     None if logps is None else logps[row, :length].tolist(), kept))
    return rows


def select_rows(generations: list, picks: list, pad_token_id: int) -> Generation:
    """One Generation of rows from several: picks, (index into generations, row) pairs, in order (the rows of
    each are re-padded together, as pack pads them)."""
    unpacked = {index: unpack(generations[index]) for index in {index for index, _ in picks}}
    rows = [unpacked[index][row] for index, row in picks]
    with_logps = all(row[3] is not None for row in rows)
    with_kept = all(row[4] is not None for row in rows)
    return pack([row[0] for row in rows], [row[1] for row in rows], [row[2] for row in rows], pad_token_id,
                [row[3] for row in rows] if with_logps else None, generations[0].input_ids.device,
                [row[4] for row in rows] if with_kept else None)


def kept_csr(kept_sets: list, completion_length: int, pad_token_id: int) -> tuple:
    """(kept_ids, kept_offsets) over rows x completion_length positions from per-row (ids, sizes), sizes one per
    sampled token; the positions past a row's completion get {pad_token_id}, the token there."""
    parts, sizes = [], []
    for ids, row_sizes in kept_sets:
        padding = completion_length - len(row_sizes)
        parts += [torch.as_tensor(ids, dtype=torch.long), torch.full((padding,), pad_token_id, dtype=torch.long)]
        sizes += list(row_sizes) + [1] * padding
    offsets = torch.zeros(len(sizes) + 1, dtype=torch.long)
    torch.cumsum(torch.tensor(sizes, dtype=torch.long), 0, out=offsets[1:])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long), offsets


def pack(prompt_ids: list, completions: list, truncated: list, pad_token_id: int, sampling_logps=None,
         device="cpu", kept_sets: Optional[list] = None) -> Generation:
    """Token lists -> a Generation. prompt_ids: one list per row; completions: the sampled tokens of each row
    (ending with EOS unless truncated); sampling_logps: one list of floats per row, or None; kept_sets: per row
    (ids, sizes), the kept sets of its sampled tokens one after another and their sizes, or None."""
    prompt_length = max(len(ids) for ids in prompt_ids)
    completion_length = max(1, max(len(ids) for ids in completions))
    rows = len(prompt_ids)
    input_ids = torch.full((rows, prompt_length + completion_length), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros(input_ids.shape, dtype=torch.bool)
    logps = torch.zeros(rows, completion_length) if sampling_logps is not None else None
    for row, (prompt, completion) in enumerate(zip(prompt_ids, completions)):
        input_ids[row, prompt_length - len(prompt):prompt_length] = torch.tensor(prompt, dtype=torch.long)
        input_ids[row, prompt_length:prompt_length + len(completion)] = torch.tensor(completion, dtype=torch.long)
        attention_mask[row, prompt_length - len(prompt):prompt_length + len(completion)] = True
        if logps is not None:
            logps[row, :len(completion)] = torch.tensor(sampling_logps[row], dtype=torch.float32)
    kept_ids, kept_offsets = kept_csr(kept_sets, completion_length, pad_token_id) if kept_sets else (None, None)
    to = lambda t: None if t is None else t.to(device)  # noqa: E731
    return Generation(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                      prompt_length=prompt_length, completion_ids=input_ids[:, prompt_length:].to(device),
                      completion_mask=attention_mask[:, prompt_length:].to(device),
                      truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
                      sampling_logps=to(logps), kept_ids=to(kept_ids), kept_offsets=to(kept_offsets))
