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
    log-prob of each sampled token (zero off the mask).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    completion_ids: torch.Tensor
    completion_mask: torch.Tensor
    truncated: torch.Tensor
    sampling_logps: Optional[torch.Tensor] = None


def pack(prompt_ids: list, completions: list, truncated: list, pad_token_id: int, sampling_logps=None,
         device="cpu") -> Generation:
    """Token lists -> a Generation. prompt_ids: one list per row; completions: the sampled tokens of each row
    (ending with EOS unless truncated); sampling_logps: one list of floats per row, or None."""
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
    return Generation(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                      prompt_length=prompt_length, completion_ids=input_ids[:, prompt_length:].to(device),
                      completion_mask=attention_mask[:, prompt_length:].to(device),
                      truncated=torch.tensor(truncated, dtype=torch.bool, device=device),
                      sampling_logps=None if logps is None else logps.to(device))
