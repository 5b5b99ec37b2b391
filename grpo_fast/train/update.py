"""The policy update of one step: micro-batches, final hidden states and grpo_fast's loss, gradients accumulated.

    rollout = Rollout(input_ids, attention_mask, prompt_length, completion_ids, loss_mask, advantages)
    rollout.ref_logps = completion_logprobs(Policy.of(ref_model), rollout, config)      # when beta > 0
    metrics = policy_update(Policy.of(model), optimizer, rollout, config)

The loss never sees logits: the decoder gives the final hidden states of the completion tokens
(grpo_fast.train.batching) and `grpo_fast.grpo_loss` takes them with the LM head's weight. The loop
(grpo_fast.train.loop) and the long-context benchmark both run this step.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.models import lm_head
from grpo_fast.train import distributed, lora, precision
from grpo_fast.train.batching import MicroBatch, completion_hidden_states, micro_batch, plan_micro_batches
from grpo_fast.train.config import TrainConfig
from grpo_fast.variants import micro_batch_share

# the policy loss from hidden states: grpo_fast's, or the full-logits one (for memory and speed comparisons)
LOSS_IMPLEMENTATIONS = {"grpo_fast": gf.grpo_loss, "naive": reference.grpo_loss}


@dataclass
class Rollout:
    """One step's samples as the update sees them, group_size consecutive rows per prompt.

    input_ids (B, P + C): prompts left-padded to P = prompt_length, completions right-padded to C;
    attention_mask (B, P + C) bool; completion_ids (B, C); loss_mask (B, C) bool: the completion tokens the loss
    counts (the sampled ones, without truncated completions when mask_truncated_completions is set);
    advantages (B,); old_logps, ref_logps (B, C) fp32: the sampling policy's and the reference's log-probs (None:
    on-policy, no KL); is_ratio (B, C): the rollout importance-sampling correction, or None.
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


@dataclass
class Policy:
    """A causal LM (its LM head, generation, checkpoints) and the module that computes its final hidden states
    for training: HiddenStates(model), inside DDP or FSDP2 when distributed.

    precision: the run's dtype option (grpo_fast.train.precision; "auto": bf16 autocast on CUDA, the weights' own
    dtype elsewhere). adapters_off: compute with a PEFT model's adapters disabled (the base model: a LoRA run's KL
    reference)."""

    model: torch.nn.Module
    forward: torch.nn.Module
    precision: str = "auto"
    adapters_off: bool = False

    @classmethod
    def of(cls, model, precision: str = "auto", adapters_off: bool = False) -> "Policy":
        return cls(model, distributed.HiddenStates(model), precision, adapters_off)

    def compute(self, device: torch.device) -> tuple:
        """(compute dtype, autocast): the dtype of the forward and of the loss's inputs on `device`, and whether the
        forward runs under autocast to it."""
        if self.precision == "auto" and device.type != "cuda":
            return next(self.model.parameters()).dtype, False
        dtype = precision.resolve(self.precision, device.type)
        return precision.compute_dtype(dtype), dtype == "bf16-autocast"


def micro_batches(rollout: Rollout, config: TrainConfig, world: distributed.World = distributed.World()) -> list:
    """The step's micro-batches, at most micro_batch_size sequences and micro_batch_tokens real tokens each, as
    (micro-batch, counts) pairs. Every rank gets as many as the busiest one has, since each forward and backward of
    a DDP / FSDP2 model is a collective: a rank with fewer repeats its last one with counts=False."""
    lengths = rollout.attention_mask.sum(1).tolist()
    plan = plan_micro_batches(lengths, config.micro_batch_tokens, config.micro_batch_size)
    batches = [micro_batch(rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rows,
                           packed=config.packing) for rows in plan]
    count = distributed.all_reduce_max(len(batches), world, rollout.input_ids.device)
    return [(batches[min(index, len(batches) - 1)], index < len(batches)) for index in range(count)]


def completion_hidden(policy: Policy, micro: MicroBatch, offload: bool = False):
    """The final hidden states that predict each completion token (b, C, H), and the LM head's weight and logit
    arguments in the same dtype, the policy's compute dtype (the backbone under autocast for bf16-autocast).
    offload: keep the activations saved for backward in (pinned) CPU memory."""
    device = micro.hidden_index.device
    dtype, autocast = policy.compute(device)
    saved = torch.autograd.graph.save_on_cpu(pin_memory=device.type == "cuda") if offload else nullcontext()
    adapters = lora.reference(policy.model) if policy.adapters_off else nullcontext()
    with torch.autocast(device.type, dtype=dtype, enabled=autocast), saved, adapters:
        hidden = completion_hidden_states(policy.forward, micro)
    return (hidden.to(dtype), *head_in(policy.model, dtype))


def head_in(model, dtype: torch.dtype) -> tuple:
    """(weight, logit kwargs) of the model's LM head with the weight and bias in `dtype`, the dtype of the loss's
    inputs."""
    head = lm_head(model)
    kwargs = head.logit_kwargs()
    if kwargs["bias"] is not None:
        kwargs["bias"] = kwargs["bias"].to(dtype)
    return head.weight.to(dtype), kwargs


@torch.no_grad()
def completion_logprobs(policy: Policy, rollout: Rollout, config: TrainConfig,
                        world: distributed.World = distributed.World()) -> torch.Tensor:
    """(B, C) log-probs of the completions under `policy`, micro-batch by micro-batch, one GEMM pass each and no
    logits (old and reference log-probs); zero off the loss mask."""
    logps = torch.zeros(rollout.completion_ids.shape, dtype=torch.float32, device=rollout.completion_ids.device)
    for micro, _ in micro_batches(rollout, config, world):      # a repeated micro-batch rewrites the same values
        hidden, weight, kwargs = completion_hidden(policy, micro)
        with torch.autocast(hidden.device.type, enabled=False):
            values = gf.token_logprobs(hidden, weight, micro.completion(rollout.completion_ids),
                                       **{**kwargs, "temperature": config.temperature})
        logps[micro.rows, :micro.completion_length] = (values * micro.completion(rollout.loss_mask)).float()
    return logps


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


def accumulate_gradients(policy: Policy, rollout: Rollout, config: TrainConfig,
                         world: distributed.World = distributed.World()) -> dict:
    """Backward of the step's loss, micro-batch by micro-batch: the micro-batch losses are weighted
    (`variants.micro_batch_share`, over the sequences and tokens of all ranks) so that their sum is the loss of
    the whole rollout at once, however it is cut, packed and spread over ranks. Every rank runs as many backward
    passes as the busiest (extra ones weigh 0) and reduces gradients in the last. Returns the loss and the loss
    metrics (token-weighted means over micro-batches), summed over ranks. With one process and grad_accum_dtype
    fp32 (the default), gradients of bf16 weights accumulate over micro-batches in fp32 (Fp32GradientSum)."""
    loss_config = config.loss_config()
    loss_function = LOSS_IMPLEMENTATIONS[config.loss_implementation]
    device = rollout.loss_mask.device
    totals = distributed.sum_over_ranks({"sequences": rollout.input_ids.shape[0],
                                         "tokens": float(rollout.loss_mask.sum())}, world, device)
    batches = micro_batches(rollout, config, world)
    fp32_sum = None
    if config.grad_accum_dtype == "fp32" and world.size == 1 and len(batches) > 1:
        fp32_sum = Fp32GradientSum(policy.forward.parameters())
    summed = {"loss": 0.0}
    for index, (micro, counts) in enumerate(batches):
        hidden, weight, head_kwargs = completion_hidden(policy, micro, config.offload_activations)
        mask = micro.completion(rollout.loss_mask)
        with torch.autocast(hidden.device.type, enabled=False):
            loss, metrics = loss_function(
                hidden, weight, micro.completion(rollout.completion_ids), rollout.advantages[micro.rows], mask,
                old_logps=micro.completion(rollout.old_logps), ref_logps=micro.completion(rollout.ref_logps),
                is_ratio=micro.completion(rollout.is_ratio), num_items_in_batch=totals["tokens"],
                config=loss_config, **{**head_kwargs, "temperature": config.temperature},
            )
        share = micro_batch_share(mask, loss_config, totals["sequences"], totals["tokens"]) if counts else 0.0
        loss = loss * share
        with distributed.gradient_sync(policy.forward, enabled=index == len(batches) - 1):
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


def policy_update(policy: Policy, optimizer, rollout: Rollout, config: TrainConfig,
                  world: distributed.World = distributed.World()) -> dict:
    """One optimizer step of grpo_loss over the rollout, with grad-norm clipping. A loss or gradient norm that is
    not finite never reaches the weights: the step is skipped (metrics["skipped"] = 1) and the gradients dropped.
    Every rank decides alike: both values are already reduced over ranks."""
    summed = accumulate_gradients(policy, rollout, config, world)
    norm = torch.nn.utils.clip_grad_norm_(policy.forward.parameters(), config.max_grad_norm)
    summed["grad_norm"] = float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
    finite = math.isfinite(summed["loss"]) and math.isfinite(summed["grad_norm"])
    if finite:
        optimizer.step()
    summed["skipped"] = 0.0 if finite else 1.0
    optimizer.zero_grad(set_to_none=True)
    return summed
