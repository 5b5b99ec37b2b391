"""Micro-batches of a step's rollouts, sized by tokens: packed without padding, or padded to their own lengths.

    plan = plan_micro_batches(sequence_lengths, max_tokens=16384, max_sequences=8)
    for rows in plan:
        batch = micro_batch(input_ids, attention_mask, prompt_length, rows, packed=True)
        hidden = completion_hidden_states(HiddenStates(model), batch)    # (b, C, H) for the loss

A rollout row is a left-padded prompt followed by a right-padded completion, so its real tokens are one
contiguous run. Packed, the runs of a micro-batch are laid end to end in a single row whose position_ids restart
at each sequence, and no token is padding; model_inputs also carries the sequence boundaries (cu_seq_lens_q / _k,
max_length_q / _k, transformers' FlashAttentionKwargs), which flash-attention and grpo_fast.packed_attention's
per-sequence attention read, so that attention costs memory linear in the tokens (transformers' sdpa would build a
dense (N, N) block-diagonal mask over the packed row instead: grpo_fast.packed_attention.use_varlen_attention).
Padded, the rows keep their layout, cut down to the micro-batch's own longest prompt and completion. Either way
the loss sees the same (b, C) completion tensors.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.packed_attention import shared_prompt_row, states_at
from grpo_fast.sequence_parallel import SequenceShards, shard_row, states_here


def plan_micro_batches(lengths: list, max_tokens: Optional[int], max_sequences: int,
                       shared: Optional[list] = None) -> list:
    """Consecutive row indices per micro-batch: rows are added while the micro-batch stays within max_tokens
    real tokens (None: no limit) and max_sequences rows; a row longer than max_tokens gets a micro-batch alone.
    shared[row]: the tokens a row does not add when it follows row - 1 in the same micro-batch (its prompt's,
    when the two share it: grpo_fast.packed_attention.shared_prompt_lengths), 0 otherwise; None: no sharing."""
    if max_sequences <= 0:
        raise ValueError(f"max_sequences must be > 0, got {max_sequences}")
    if max_tokens is not None and max_tokens <= 0:
        raise ValueError(f"max_tokens must be > 0 or None, got {max_tokens}")
    plan, current, tokens = [], [], 0
    for row, length in enumerate(lengths):
        added = length - (shared[row] if shared is not None and current else 0)
        full = len(current) == max_sequences or (max_tokens is not None and tokens + added > max_tokens)
        if current and full:
            plan.append(current)
            current, tokens, added = [], 0, length
        current.append(row)
        tokens += added
    if current:
        plan.append(current)
    return plan


@dataclass
class MicroBatch:
    """Model inputs of some rollout rows and where each completion token's predicting hidden state lands.

    model_inputs: keyword arguments of the decoder (input_ids with attention_mask, or with position_ids and the
    sequence boundaries cu_seq_lens_q / _k (int32, [0, L_0, L_0 + L_1, ...]) and max_length_q / _k when packed);
    hidden_index (b, C): flat positions in the decoder output (rows x length) of the hidden state that predicts
    completion token t (0 where the completion has ended); rows: the rollout rows; completion_length: C.
    held (b, C) bool, under sequence parallelism (sharded): the tokens whose predicting state this rank computes
    (hidden_index then indexes its shard's output, and its length where another rank holds the state).
    """

    rows: list
    model_inputs: dict
    hidden_index: torch.Tensor
    completion_length: int
    held: Optional[torch.Tensor] = None

    def completion(self, tensor: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This micro-batch's rows of a (B, C_step) completion tensor, cut to (b, C)."""
        if tensor is None:
            return None
        return tensor[self.rows][:, :self.completion_length]


def micro_batch(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int, rows: list,
                packed: bool, share_prompts: bool = False) -> MicroBatch:
    """The micro-batch of `rows` of a rollout laid out as in grpo_fast.train.rollout.engines.Generation.
    share_prompts (packed only): consecutive rows with the same prompt hold it once (SharedPrompts)."""
    device = input_ids.device
    mask = attention_mask[rows].bool()
    prompt_lengths = mask[:, :prompt_length].sum(1)
    completion_lengths = mask[:, prompt_length:].sum(1)
    completion_length = max(1, int(completion_lengths.max()))
    steps = torch.arange(completion_length, device=device)
    if packed and share_prompts:
        model_inputs, predicting = shared_prompt_row(input_ids[rows], attention_mask[rows], prompt_length,
                                                     completion_length, rows)
    elif packed:
        lengths = prompt_lengths + completion_lengths
        starts = torch.cumsum(lengths, 0) - lengths
        tokens = input_ids[rows][mask]                            # the real tokens, row after row
        position_ids = torch.cat([torch.arange(int(n), device=device) for n in lengths])
        # the sequence boundaries, for variable-length attention (grpo_fast.packed_attention, flash-attention)
        cu_seq_lens = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)]).to(torch.int32)
        longest = int(lengths.max())
        model_inputs = {"input_ids": tokens[None], "position_ids": position_ids[None], "attention_mask": None,
                        "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens, "max_length_q": longest,
                        "max_length_k": longest}
        predicting = starts[:, None] + prompt_lengths[:, None] - 1 + steps[None]
    else:
        longest_prompt = int(prompt_lengths.max())
        columns = slice(prompt_length - longest_prompt, prompt_length + completion_length)
        model_inputs = {"input_ids": input_ids[rows][:, columns], "attention_mask": mask[:, columns].long()}
        width = longest_prompt + completion_length
        predicting = (torch.arange(len(rows), device=device)[:, None] * width + longest_prompt - 1 + steps[None])
    in_completion = steps[None] < completion_lengths[:, None]
    return MicroBatch(rows=list(rows), model_inputs=model_inputs,
                      hidden_index=torch.where(in_completion, predicting, 0), completion_length=completion_length)


def sharded(batch: MicroBatch, shards: SequenceShards) -> MicroBatch:
    """This rank's part of a packed micro-batch under sequence parallelism (grpo_fast.sequence_parallel.shard_row):
    its shard of the row's tokens, where the states it computes land, and which it holds (`held`)."""
    model_inputs, hidden_index, held = shard_row(batch.model_inputs, batch.hidden_index, shards)
    return dataclasses.replace(batch, model_inputs=model_inputs, hidden_index=hidden_index, held=held)


def completion_hidden_states(hidden_states, batch: MicroBatch) -> torch.Tensor:
    """(b, C, H): the final hidden state that predicts each completion token (garbage where it has ended; zero
    where another rank of a sequence-parallel group holds it). hidden_states: a module mapping decoder inputs to
    final hidden states (grpo_fast.train.distributed.HiddenStates, possibly inside DDP / FSDP2)."""
    hidden = hidden_states(**batch.model_inputs)
    if batch.held is not None:
        return states_here(hidden, batch.hidden_index)
    return states_at(hidden, batch.hidden_index)
