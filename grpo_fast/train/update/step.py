"""The policy update of one step: micro-batches, final hidden states and grpo_fast's loss, gradients accumulated.

    batch = UpdateBatch(input_ids, attention_mask, prompt_length, completion_ids, loss_mask, advantages)
    batch.ref_logps = completion_logprobs(Policy.of(ref_model), batch, config.batching, temperature)  # beta > 0
    metrics = policy_update(Policy.of(model), optimizer, batch, config.loss, config.batching, config.optimization,
                            temperature)                   # one optimizer step on the whole batch
    updates, lr = policy_updates(Policy.of(model), optimizer, scheduler, batch, config.loss, config.batching,
                                 config.optimization, temperature)   # a step's: num_iterations x mini-batches

Each function takes the config sections it reads (grpo_fast.train.config: loss, batching, optimization,
correction, scoring) and the rollouts' sampling temperature, which the log-probs divide the logits by.

The loss never sees logits: the decoder gives the final hidden states of the completion tokens
(grpo_fast.train.update.batching) and `grpo_fast.grpo_loss` takes them with the LM head's weight. The loop
(grpo_fast.train.loop) and the long-context benchmark both run this step.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

import grpo_fast as gf
from grpo_fast import packed_attention as attention
from grpo_fast import reference as full_logits
from grpo_fast.kept import KeptSet
from grpo_fast.models import lm_head
from grpo_fast.sequence_parallel import SequenceShards, summing_over
from grpo_fast.train import distributed, lora
from grpo_fast.train.update import precision
from grpo_fast.train.update.batching import (
    MicroBatch,
    completion_hidden_states,
    micro_batch,
    plan_micro_batches,
    sharded,
)
from grpo_fast.train.update.config import BatchingConfig, CorrectionConfig, OptimizationConfig, ScoringConfig
from grpo_fast.train.update.correction import importance_weights
from grpo_fast.variants import LossConfig, micro_batch_share

# the policy loss from hidden states: grpo_fast's, or the full-logits one (for memory and speed comparisons)
LOSS_IMPLEMENTATIONS = {"grpo_fast": gf.grpo_loss, "naive": full_logits.grpo_loss}


@dataclass
class UpdateBatch:
    """One step's samples as the update sees them, group_size consecutive rows per prompt.

    input_ids (B, P + C): prompts left-padded to P = prompt_length, completions right-padded to C;
    attention_mask (B, P + C) bool; completion_ids (B, C); loss_mask (B, C) bool: the completion tokens the loss
    counts (the sampled ones, without truncated completions when mask_truncated_completions is set);
    advantages (B,); old_logps, ref_logps (B, C) fp32: the sampling policy's and the reference's log-probs (None:
    on-policy, no KL); is_ratio (B, C): the batch importance-sampling correction, or None; sampling_logps (B, C)
    fp32: the engine's log-probs when the correction comes from the update's own forward (one iteration per
    step: accumulate_gradients fills is_ratio from them, as `correction`, the CorrectionConfig, says), else None.
    kept: with top-k / top-p sampling, the kept set of each of the B x C completion positions
    (grpo_fast.kept.KeptSet), over which every log-prob is taken. trained (B,) bool: the rows the step trains on
    (None: all); the others (a short step's filler groups under dynamic sampling) have no loss tokens and count in
    no normalizer, neither tokens nor sequences.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    prompt_length: int
    completion_ids: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    is_ratio: Optional[torch.Tensor] = None
    sampling_logps: Optional[torch.Tensor] = None
    correction: Optional[CorrectionConfig] = None
    kept: Optional[KeptSet] = None
    trained: Optional[torch.Tensor] = None

    @property
    def trained_rows(self) -> int:
        """The rows the step trains on: the sequences its per-sequence normalizers count."""
        return self.input_ids.shape[0] if self.trained is None else int(self.trained.sum())

    def rows(self, rows: list) -> "UpdateBatch":
        """The UpdateBatch of some rows (a mini-batch), every per-row tensor taken alike, in that order."""
        index = torch.as_tensor(rows, dtype=torch.long, device=self.input_ids.device)

        def cut(tensor):
            return None if tensor is None else tensor[index.to(tensor.device)]

        kept = None
        if self.kept is not None:
            columns = self.completion_ids.shape[1]
            positions = index.to(self.kept.ids.device)[:, None] * columns + torch.arange(
                columns, device=self.kept.ids.device)
            kept = self.kept.select(positions.reshape(-1))
        return dataclasses.replace(
            self, input_ids=cut(self.input_ids), attention_mask=cut(self.attention_mask),
            completion_ids=cut(self.completion_ids), loss_mask=cut(self.loss_mask), advantages=cut(self.advantages),
            old_logps=cut(self.old_logps), ref_logps=cut(self.ref_logps), is_ratio=cut(self.is_ratio),
            sampling_logps=cut(self.sampling_logps), kept=kept, trained=cut(self.trained))


def mini_batches(batch: UpdateBatch, count: int, group_size: int) -> list:
    """`count` UpdateBatches of whole groups of `batch` (group_size rows each), equal in size, mini-batch k holding
    groups k, k + count, k + 2 count, ...: the mini-batches a step's optimizer steps take in turn
    (steps_per_generation); [batch] itself for one. Strided, so that mini-batch k of a step is the same groups
    whether one process holds the step or each of several holds its share of whole groups (a multiple of
    `count`): data-parallel ranks step on the mini-batches one process would."""
    groups = batch.input_ids.shape[0] // group_size
    if groups % count or batch.input_ids.shape[0] % group_size:
        raise ValueError(f"steps_per_generation ({count}) must divide the step's {groups} groups of "
                         f"{group_size} into whole groups")
    if count == 1:
        return [batch]
    return [batch.rows([group * group_size + row for group in range(first, groups, count)
                        for row in range(group_size)]) for first in range(count)]


def micro_kept(batch: UpdateBatch, micro: MicroBatch) -> Optional[KeptSet]:
    """The kept sets of a micro-batch's loss and log-probs (its rows, its first completion_length positions), or
    None without kept sets."""
    if batch.kept is None:
        return None
    columns = batch.completion_ids.shape[1]
    rows = torch.as_tensor(micro.rows, device=batch.kept.ids.device)
    positions = rows[:, None] * columns + torch.arange(micro.completion_length, device=rows.device)
    return batch.kept.select(positions.reshape(-1))


@dataclass
class Policy:
    """A causal LM (its LM head, generation, checkpoints) and its trunk: the module that computes the final hidden
    states for training, HiddenStates(model), inside DDP or FSDP2 when distributed (the optimizer steps the
    trunk's parameters).

    dtype: the run's dtype option (grpo_fast.train.update.precision; "auto": bf16 autocast on CUDA, the weights'
    own dtype elsewhere). adapters_off: compute with a PEFT model's adapters disabled (the base model: a LoRA
    run's KL reference). offload: keep the activations a training forward saves for backward in (pinned) CPU
    memory (the policy section's offload_activations)."""

    model: torch.nn.Module
    trunk: torch.nn.Module
    dtype: str = "auto"
    adapters_off: bool = False
    offload: bool = False

    @classmethod
    def of(cls, model, dtype: str = "auto", adapters_off: bool = False, offload: bool = False) -> "Policy":
        return cls(model, distributed.HiddenStates(model), dtype, adapters_off, offload)

    def compute(self, device: torch.device) -> tuple:
        """(compute dtype, autocast): the torch dtype of the forward and of the loss's inputs on `device`, and
        whether the forward runs under autocast to it."""
        if self.dtype == "auto" and device.type != "cuda":
            return next(self.model.parameters()).dtype, False
        dtype = precision.resolve(self.dtype, device.type)
        return precision.compute_dtype(dtype), dtype == "bf16-autocast"


def shares_prompts(batching: BatchingConfig, model) -> bool:
    """Whether the update's micro-batches hold each group's prompt once (share_prompts): only packed, and
    only where the model runs grpo_fast's own attention, which reads the shared layout (flash-attention and sdpa
    would let the completions of a row attend to each other)."""
    return batching.share_prompts and batching.packing and attention.attention_name(model) == attention.NAME


def micro_batches(batch: UpdateBatch, batching: BatchingConfig, world: distributed.World = distributed.World(),
                  share_prompts: bool = False) -> list:
    """The step's micro-batches, at most micro_batch_size sequences and micro_batch_tokens real tokens each, as
    (micro-batch, counts) pairs. Every rank gets as many as the busiest one has, since each forward and backward of
    a DDP / FSDP2 model is a collective: a rank with fewer repeats its last one with counts=False. share_prompts:
    see shares_prompts (a shared prompt counts once against micro_batch_tokens). Under sequence parallelism each
    micro-batch is this rank's shard of it (batching.sharded)."""
    lengths = batch.attention_mask.sum(1).tolist()
    shared = attention.shared_prompt_lengths(batch.input_ids, batch.attention_mask, batch.prompt_length) \
        if share_prompts else None
    plan = plan_micro_batches(lengths, batching.micro_batch_tokens, batching.micro_batch_size, shared)
    batches = [micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, rows,
                           packed=batching.packing, share_prompts=share_prompts) for rows in plan]
    if world.sequence_parallel > 1:
        shards = SequenceShards(world.sequence_group, world.sequence_parallel, world.rank % world.sequence_parallel)
        batches = [sharded(micro, shards) for micro in batches]
    count = distributed.all_reduce_max(len(batches), world, batch.input_ids.device)
    return [(batches[min(index, len(batches) - 1)], index < len(batches)) for index in range(count)]


def completion_hidden(policy: Policy, micro: MicroBatch, offload: bool = False):
    """The final hidden states that predict each completion token (b, C, H), and the LM head's weight and the head
    (head_in's) in the same dtype, the policy's compute dtype (the backbone under autocast for bf16-autocast).
    offload: keep the activations saved for backward in (pinned) CPU memory (a training forward: policy.offload)."""
    device = micro.hidden_index.device
    if micro.held is not None and attention.attention_name(policy.model) != attention.NAME:
        raise ValueError(f"sequence parallelism exchanges heads inside grpo_fast's packed attention, but the model "
                         f"runs {attention.attention_name(policy.model)!r}: set it with "
                         f"grpo_fast.packed_attention.use_varlen_attention(model, device, flash=False)")
    dtype, autocast = policy.compute(device)
    saved = torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if offload else nullcontext()
    adapters = lora.adapters_disabled(policy.model) if policy.adapters_off else nullcontext()
    with torch.autocast(device.type, dtype=dtype, enabled=autocast), saved, adapters:
        hidden = completion_hidden_states(policy.trunk, micro)
    return (hidden.to(dtype), *head_in(policy.model, dtype))


def head_in(model, dtype: torch.dtype) -> tuple:
    """(weight, head): the model's LM head (grpo_fast.models.LMHead) with its weight and bias in `dtype`, the
    dtype of the loss's inputs, and that weight; the loss takes bias=head.bias, transform=head.transform(...)."""
    head = lm_head(model)
    head = dataclasses.replace(head, weight=head.weight.to(dtype),
                               bias=None if head.bias is None else head.bias.to(dtype))
    return head.weight, head


def micro_batch_logprobs(hidden: torch.Tensor, weight: torch.Tensor, head, completion_ids: torch.Tensor,
                         mask: torch.Tensor, temperature: float, kept: Optional[KeptSet] = None) -> torch.Tensor:
    """(token_logprobs(hidden, weight, completion_ids, bias=head.bias, transform=head.transform(temperature, kept))
    * mask).float(): a micro-batch's (b, C) log-probs in fp32, zero off `mask`, outside autocast (the loss's
    dtype), one GEMM pass; head: head_in's; kept: micro_kept's."""
    with torch.autocast(hidden.device.type, enabled=False):
        values = gf.token_logprobs(hidden, weight, completion_ids, bias=head.bias,
                                   transform=head.transform(temperature, kept))
    return (values * mask).float()


@torch.no_grad()
def completion_logprobs(policy: Policy, batch: UpdateBatch, batching: BatchingConfig, temperature: float,
                        world: distributed.World = distributed.World()) -> torch.Tensor:
    """(B, C) log-probs of the completions under `policy` at the sampling `temperature`, micro-batch by
    micro-batch (`batching`), one GEMM pass each and no logits (old and reference log-probs); zero off the loss
    mask. Under sequence parallelism each rank takes the tokens it holds and the group sums them."""
    logps = torch.zeros(batch.completion_ids.shape, dtype=torch.float32, device=batch.completion_ids.device)
    batches = micro_batches(batch, batching, world, shares_prompts(batching, policy.model))
    for micro, _ in batches:                                  # a repeated micro-batch rewrites the same values
        hidden, weight, head = completion_hidden(policy, micro)
        logps[micro.rows, :micro.completion_length] = micro_batch_logprobs(
            hidden, weight, head, micro.completion(batch.completion_ids), held_mask(batch.loss_mask, micro),
            temperature, micro_kept(batch, micro))
    if world.sequence_parallel > 1:
        torch.distributed.all_reduce(logps, group=world.sequence_group)   # each token's value from one rank
    return logps


def held_mask(loss_mask: torch.Tensor, micro: MicroBatch) -> torch.Tensor:
    """The micro-batch's (b, C) loss mask, cut to the tokens this rank holds under sequence parallelism."""
    mask = micro.completion(loss_mask)
    return mask if micro.held is None else mask & micro.held


def update_batch(generation, advantages: torch.Tensor, policy: Policy, reference_policy, scoring: ScoringConfig,
                 correction: CorrectionConfig, optimization: OptimizationConfig, batching: BatchingConfig,
                 temperature: float, world: distributed.World = distributed.World(),
                 trained: Optional[torch.Tensor] = None) -> UpdateBatch:
    """The UpdateBatch of a step's Generation (grpo_fast.train.rollout.generation) and its (B,) advantages: the
    loss mask (without truncated completions under scoring.mask_truncated_completions, and without the rows
    `trained` marks False), and the old and reference log-probs and the rollout correction
    (grpo_fast.train.update.correction) where the sections need them (one no-grad forward each, before any update).
    reference_policy: the KL reference (beta > 0), or None.

    With one optimizer step per step the rollout correction needs no forward of its own: the weights that the old
    log-probs would come from are the ones the update's forward runs, so accumulate_gradients computes the ratio
    from that forward's hidden states (batch.sampling_logps), one no-grad pass over the LM head per micro-batch.
    More optimizer steps (optimization.updates_per_step) take the old log-probs once, before the first."""
    loss_mask = generation.completion_mask
    if scoring.mask_truncated_completions:
        loss_mask = loss_mask & ~generation.truncated[:, None]
    if trained is not None:
        loss_mask = loss_mask & trained.to(loss_mask.device)[:, None]
    batch = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                        generation.completion_ids, loss_mask, advantages.to(loss_mask.device), trained=trained)
    if generation.kept_ids is not None:
        batch.kept = KeptSet.of(generation.kept_ids, generation.kept_offsets)
    correct = generation.sampling_logps is not None and correction.importance_sampling != "none"
    if correct and optimization.updates_per_step == 1 and world.sequence_parallel == 1:
        batch.sampling_logps, batch.correction = generation.sampling_logps, correction
    elif optimization.updates_per_step > 1 or correct:
        batch.old_logps = completion_logprobs(policy, batch, batching, temperature, world)
        if correct:
            batch.is_ratio = importance_weights(batch.old_logps, generation.sampling_logps, loss_mask,
                                                correction.importance_sampling, correction.importance_sampling_cap,
                                                correction.importance_sampling_min)
    if reference_policy is not None:
        batch.ref_logps = completion_logprobs(reference_policy, batch, batching, temperature, world)
    return batch


@torch.no_grad()
def own_rollout_correction(hidden: torch.Tensor, weight: torch.Tensor, completion_ids: torch.Tensor,
                           mask: torch.Tensor, sampling_logps: torch.Tensor, head, correction: CorrectionConfig,
                           temperature: float, kept: Optional[KeptSet] = None) -> torch.Tensor:
    """importance_weights(token_logprobs(hidden, weight, completion_ids) * mask, sampling_logps, mask, ...): a
    micro-batch's rollout correction (b, C) fp32 from the hidden states its loss takes, one no-grad GEMM pass over
    the LM head, instead of a forward of the trunk before the update (the same value: the same weights and
    inputs). Rows are whole sequences, so the sequence_* modes see every token of theirs."""
    logps = micro_batch_logprobs(hidden.detach(), weight.detach(), head, completion_ids, mask, temperature, kept)
    return importance_weights(logps, sampling_logps, mask, correction.importance_sampling,
                              correction.importance_sampling_cap, correction.importance_sampling_min)


class Fp32GradientSum:
    """Sums the gradients of several backward passes in fp32 for parameters held in a lower precision (bf16
    weights), which would otherwise add each micro-batch's gradient into a bf16 .grad: 8 micro-batches round the
    sum 8 times. `add()` after each backward moves .grad into the fp32 sum; `finish()` puts the sum back in .grad,
    rounded once to the parameter's dtype. One process only: DDP and FSDP2 reduce .grad as they accumulate it."""

    def __init__(self, parameters):
        self.parameters = [p for p in parameters if p.requires_grad and p.dtype != torch.float32]
        self.sums = {}

    def add(self) -> None:
        for param in self.parameters:
            if param.grad is not None:
                if param in self.sums:
                    self.sums[param] += param.grad.float()
                else:
                    self.sums[param] = param.grad.float()
                param.grad = None

    def finish(self) -> None:
        for param, total in self.sums.items():
            param.grad = total.to(param.dtype)
        self.sums = {}


def accumulate_gradients(policy: Policy, batch: UpdateBatch, loss_config: LossConfig, batching: BatchingConfig,
                         optimization: OptimizationConfig, temperature: float,
                         world: distributed.World = distributed.World()) -> dict:
    """Backward of the step's loss, micro-batch by micro-batch: the micro-batch losses are weighted
    (`variants.micro_batch_share`, over the sequences and tokens of all ranks) so that their sum is the loss of
    the whole batch at once, however it is cut, packed and spread over ranks (rows that batch.trained marks False
    count in no normalizer). Every rank runs as many backward
    passes as the busiest (extra ones weigh 0) and reduces gradients in the last. Returns the loss and the loss
    metrics (token-weighted means over micro-batches), summed over ranks. With one process and grad_accum_dtype
    fp32 (the default), gradients of bf16 weights accumulate over micro-batches in fp32 (Fp32GradientSum). With
    batch.sampling_logps set, each micro-batch's rollout correction comes from its own hidden states
    (own_rollout_correction, with batch.correction) and fills batch.is_ratio."""
    loss_function = LOSS_IMPLEMENTATIONS[optimization.loss_implementation]
    device = batch.loss_mask.device
    totals = distributed.sum_over_groups({"sequences": batch.trained_rows,
                                          "tokens": float(batch.loss_mask.sum())}, world, device)
    batches = micro_batches(batch, batching, world, shares_prompts(batching, policy.model))
    fp32_sum = None
    if optimization.grad_accum_dtype == "fp32" and world.size == 1 and len(batches) > 1:
        fp32_sum = Fp32GradientSum(policy.trunk.parameters())
    summed = {"loss": 0.0}
    if batch.sampling_logps is not None:
        batch.is_ratio = torch.ones(batch.loss_mask.shape, dtype=torch.float32, device=device)
    for index, (micro, counts) in enumerate(batches):
        hidden, weight, head = completion_hidden(policy, micro, policy.offload)
        mask = held_mask(batch.loss_mask, micro)
        kept = micro_kept(batch, micro)
        if batch.sampling_logps is not None:
            batch.is_ratio[micro.rows, :micro.completion_length] = own_rollout_correction(
                hidden, weight, micro.completion(batch.completion_ids), mask, micro.completion(batch.sampling_logps),
                head, batch.correction, temperature, kept)
        group = summing_over(world.sequence_group) if world.sequence_parallel > 1 else nullcontext()
        with torch.autocast(hidden.device.type, enabled=False), group:
            loss, metrics = loss_function(
                hidden, weight, micro.completion(batch.completion_ids), batch.advantages[micro.rows], mask,
                old_logps=micro.completion(batch.old_logps), ref_logps=micro.completion(batch.ref_logps),
                bias=head.bias, config=loss_config, transform=head.transform(temperature, kept),
                weights=gf.TokenWeights(num_items_in_batch=totals["tokens"], is_ratio=micro.completion(batch.is_ratio)),
            )
        whole = micro.completion(batch.loss_mask)             # the micro-batch's, on every rank of its group
        share = micro_batch_share(whole, loss_config, totals["sequences"], totals["tokens"]) if counts else 0.0
        loss = loss * share
        with distributed.gradient_sync(policy.trunk, enabled=index == len(batches) - 1):
            (loss * world.size).backward()          # DDP and FSDP2 average gradients over ranks
        if fp32_sum is not None:
            fp32_sum.add()
        summed["loss"] += loss.item()
        token_share = float(mask.sum()) / max(1.0, totals["tokens"]) if counts else 0.0
        for name, value in metrics.items():
            summed[name] = summed.get(name, 0.0) + value.item() * token_share
    if fp32_sum is not None:
        fp32_sum.finish()
    return distributed.sum_over_ranks(summed, world, device)


def policy_update(policy: Policy, optimizer, batch: UpdateBatch, loss_config: LossConfig, batching: BatchingConfig,
                  optimization: OptimizationConfig, temperature: float,
                  world: distributed.World = distributed.World()) -> dict:
    """One optimizer step of grpo_loss over the batch (accumulate_gradients), with grad-norm clipping at
    optimization.max_grad_norm. A loss or gradient norm that is
    not finite never reaches the weights: the step is skipped (metrics["skipped"] = 1) and the gradients dropped.
    Every rank decides alike: both values are already reduced over ranks."""
    summed = accumulate_gradients(policy, batch, loss_config, batching, optimization, temperature, world)
    norm = torch.nn.utils.clip_grad_norm_(policy.trunk.parameters(), optimization.max_grad_norm)
    summed["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    finite = math.isfinite(summed["loss"]) and math.isfinite(summed["grad_norm"])
    if finite:
        optimizer.step()
    summed["skipped"] = 0.0 if finite else 1.0
    optimizer.zero_grad(set_to_none=True)
    return summed


def policy_updates(policy: Policy, optimizer, scheduler, batch: UpdateBatch, loss_config: LossConfig,
                   batching: BatchingConfig, optimization: OptimizationConfig, temperature: float, group_size: int,
                   world: distributed.World = distributed.World()) -> tuple:
    """(update metrics, the learning rate of the first): a step's optimizer steps, each a policy_update (its own
    normalizer) on a mini-batch of whole groups (mini_batches: optimization.steps_per_generation of them, in
    turn), num_iterations passes over them (TRL's order), the scheduler stepped after each. A mini-batch with no
    row to train on (a short step's fillers, on every rank) takes no optimizer step (the schedule still moves:
    it counts a step's optimizer steps alike in every step); its metrics are left out."""
    parts = mini_batches(batch, optimization.steps_per_generation, group_size)
    device = batch.loss_mask.device
    trained = [distributed.sum_over_ranks({"rows": float(part.trained_rows)}, world, device)["rows"] for part in parts]
    lr, updates = float(scheduler.get_last_lr()[0]), []
    for _ in range(optimization.num_iterations):
        for part, rows in zip(parts, trained):
            if rows:
                updates.append(policy_update(policy, optimizer, part, loss_config, batching, optimization,
                                             temperature, world))
            scheduler.step()
    return updates, lr
