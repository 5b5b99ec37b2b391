"""The GRPO-family policy loss from hidden states: fused (gradient computed in the forward) or two-phase."""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import torch
from torch import nn

from grpo_fast import sweep
from grpo_fast.inputs import PolicyBatch, check_entropy_weights, check_lm_head, policy_batch
from grpo_fast.kept import KeptSet
from grpo_fast.numerics import LogitTransform
from grpo_fast.options import (
    EXECUTION_MOVES,
    TRANSFORM_MOVES,
    WEIGHTS_MOVES,
    Execution,
    TokenWeights,
    moved_keywords,
    names_moved_keywords,
)
from grpo_fast.variants import (
    CONFIG_MOVES,
    LossConfig,
    TokenTerms,
    as_loss_config,
    entropy_bonus_weights,
    policy_loss,
    token_weights,
)

# GRPOLoss holds config, transform and execution; its forward takes the tensors, the weights and a kept set.
MODULE_MOVES = {**CONFIG_MOVES, **TRANSFORM_MOVES, **EXECUTION_MOVES}
FORWARD_MOVES = {
    **{name: f"GRPOLoss({home})" for name, home in MODULE_MOVES.items()}, **WEIGHTS_MOVES,
    "kept_ids": "kept=KeptSet(ids, offsets)", "kept_offsets": "kept=KeptSet(ids, offsets)",
}


def _policy_terms(batch: PolicyBatch, config: LossConfig, weights: TokenWeights, index, mask_f, entropy_mask_f,
                  policy_mask) -> TokenTerms:
    """The compacted per-token vectors the kernels take for a token-separable loss (detached: the gradients to
    these inputs come from fused_policy_loss's side loss)."""
    shape = tuple(batch.mask.shape)

    def compact(t):
        return None if t is None else t.detach().expand(shape).reshape(-1).index_select(0, index)

    # The policy mask multiplies the policy term as is_ratio does, so the kernels take their product.
    grad_is_ratio = batch.is_ratio
    if policy_mask is not None:
        policy_factor = policy_mask.to(mask_f.dtype)
        grad_is_ratio = policy_factor if grad_is_ratio is None else grad_is_ratio * policy_factor
    loss_weights = token_weights(mask_f, config, weights.num_items_in_batch) if batch.loss_weights is None \
        else batch.loss_weights * mask_f
    if batch.entropy_weights is not None:
        bonus = batch.entropy_weights * mask_f
    else:
        bonus = None if config.entropy_coef == 0.0 else entropy_bonus_weights(entropy_mask_f, config)
    return TokenTerms(
        config, advantages=compact(batch.advantages), weights=compact(loss_weights),
        old_logps=compact(batch.old_logps), ref_logps=compact(batch.ref_logps), is_ratio=compact(grad_is_ratio),
        entropy_grad=None if bonus is None else -compact(bonus),
    )


def fused_policy_loss(inputs: sweep.SweepInputs, batch: PolicyBatch, config: LossConfig, weights: TokenWeights, *,
                      token_stats=None, entropy_mask=None, policy_mask=None):
    """The policy loss of `batch` over the prepared sweep `inputs`; see `grpo_loss`. Inputs already checked.

    token_stats: an optional dict that receives the detached (B, T) "logp" and "entropy" (zero off the mask),
    for callers that log per-token metrics of their own (the TRL integration). entropy_mask: the (B, T) 0/1
    tokens the entropy bonus averages over (default: the mask); policy_mask: a (B, T) factor of the policy term
    alone (see `grpo_fast.variants.policy_loss`).
    """
    mask_f = batch.mask.to(batch.advantages.dtype)
    entropy_mask_f = mask_f if entropy_mask is None else entropy_mask.to(mask_f.dtype) * mask_f

    def loss_from(logp_c, entropy_c):
        logp, entropy = sweep.scatter(logp_c, inputs), sweep.scatter(entropy_c, inputs)
        if token_stats is not None:
            token_stats.update(logp=logp.detach(), entropy=entropy.detach())
        return policy_loss(
            logp, entropy, mask_f, batch.advantages, old_logps=batch.old_logps, ref_logps=batch.ref_logps,
            is_ratio=batch.is_ratio, num_items_in_batch=weights.num_items_in_batch, config=config,
            entropy_mask=entropy_mask_f, policy_mask=policy_mask, loss_weights=batch.loss_weights,
            entropy_weights=batch.entropy_weights,
        )

    if not config.token_separable:
        # Two phases: log-probs of every token first (the sequence ratio needs them all), then autograd of the
        # loss math drives the log-probs' backward (which recomputes each chunk): 4 GEMM passes.
        return loss_from(*sweep.logprobs(inputs, return_entropy=True, return_sum_pi_squared=False))

    terms = _policy_terms(batch, config, weights, inputs.index, mask_f, entropy_mask_f, policy_mask)

    def token_grads(start, end, logp, entropy):
        # d(loss)/d(logp) and d(loss)/d(entropy) of this chunk's tokens, while its logits are in the buffer.
        chunk = terms.slice(start, end)
        return inputs.ops.policy_grad(logp, chunk), chunk.entropy_grad

    per_token_values = {}

    def finish(logp_c, entropy_c):
        per_token_values.update(logp=logp_c, entropy=entropy_c)
        with torch.no_grad():
            return loss_from(logp_c, entropy_c)

    loss, metrics = sweep.fused(inputs, token_grads, finish)
    side = (batch.advantages, batch.old_logps, batch.ref_logps, batch.is_ratio, batch.loss_weights,
            batch.entropy_weights)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in side):
        # A learned baseline, say: the loss is the torch loss math of the per-token log-probs and these inputs, so
        # at the kernels' (fixed) log-probs its gradient to them is that math's. Run it once more with autograd on
        # (O(tokens), no GEMM) and add it with value zero: the loss keeps the fused value, and gains their gradient.
        side_loss, _ = loss_from(per_token_values["logp"].detach(), per_token_values["entropy"].detach())
        loss = loss + (side_loss - side_loss.detach())
    return loss, metrics


@names_moved_keywords({**CONFIG_MOVES, **TRANSFORM_MOVES, **EXECUTION_MOVES, **WEIGHTS_MOVES})
def grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    old_logps: Optional[torch.Tensor] = None,
    ref_logps: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    config: Union[LossConfig, str] = "dapo",
    transform: Optional[LogitTransform] = None,
    weights: Optional[TokenWeights] = None,
    execution: Optional[Execution] = None,
):
    """GRPO-family policy loss from final hidden states and the LM-head weight, without the (N, V) logits. Equals
    (TRL 1.16's `GRPOTrainer._compute_loss`, without its division by gradient-accumulation steps)::

        logp = torch.log_softmax(z, -1).gather(-1, targets[..., None])[..., 0]   # z: transform of hidden @ W.T + b
        r = torch.exp(logp - old_logps)        # per token; GSPO: exp of the masked mean over each sequence
        per_token = -torch.min(r * A, r.clamp(1 - epsilon_low, 1 + epsilon_high) * A)  # cispo / sapo / vespo differ
        per_token = per_token * is_ratio + beta * (torch.exp(ref_logps - logp) - (ref_logps - logp) - 1)
        loss = (per_token * token_weights(mask, config)).sum() - entropy_coef * masked_mean(entropy, mask)

    hidden: (B, T, H) or (N, H) final hidden states, fp32 / bf16 / fp16 (fp64: backend torch); (N, ...) inputs
        form one sequence. weight: (V, H), same dtype and device; bias: optional (V,) alike.
    targets: (B, T) or (N,) sampled token ids; any value where mask is 0 (e.g. -100).
    advantages: (B,) per sequence or (B, T) per token (PPO); for (N, H) hidden a scalar or (N,).
    mask: (B, T) or (N,) bool / 0-1: the completion tokens that count; the rest is compacted away before any GEMM.
    old_logps: (B, T) or (N,) log-probs of the policy that sampled; None means on-policy (ratio 1, the gradient
        still flows). ref_logps: the reference policy's, required when beta > 0. Both over the same kept sets as
        transform's (the engine's log-probs are), so that the ratio compares like with like.
    config: the loss options (`LossConfig`: loss type, clipping, KL, entropy bonus, ...) or a loss-type name.
    transform: the logit transform and kept sets (`LogitTransform`). weights: per-token factors and the
    normalizer (`TokenWeights`). execution: chunk budget, backend, vocabulary-parallel group (`Execution`).

    Returns (loss, metrics): loss a 0-dim fp32 tensor (fp64 for fp64 inputs); metrics a dict of detached 0-dim
    tensors: "ratio/mean", "entropy", "kl" (beta > 0), "clip_ratio/low_mean", "clip_ratio/high_mean",
    "clip_ratio/region_mean" (clipped objectives), "cispo_clip_ratio" (cispo) or "vespo/phi_seq_mean" (vespo).

    Token-separable variants (every loss type but vespo, at importance_sampling_level "token") compute the gradient
    during the forward, chunk by chunk: 3 GEMM passes over (N, H, V), 2 when the weight does not require grad;
    the others take two phases (4 passes). Gradients flow to hidden, weight and bias, and to advantages,
    old_logps, ref_logps and the weights' tensors where they require grad (one more pass of the per-token loss
    math, no GEMM). First-order only (create_graph=True raises); hidden, weight and bias must not change in place
    before the backward (it raises).
    """
    return checked_policy_loss(
        hidden, weight, targets, advantages, mask, config=as_loss_config(config),
        transform=LogitTransform() if transform is None else transform, old_logps=old_logps, ref_logps=ref_logps,
        bias=bias, weights=weights, execution=execution,
    )


def checked_policy_loss(hidden, weight, targets, advantages, mask, *, config: LossConfig, transform: LogitTransform,
                        old_logps=None, ref_logps=None, bias=None, weights: Optional[TokenWeights] = None,
                        execution: Optional[Execution] = None, token_stats=None, entropy_mask=None,
                        policy_mask=None):
    """`grpo_loss` with its config already a LossConfig: checks the tensors, prepares the sweep and runs
    `fused_policy_loss` (token_stats, entropy_mask, policy_mask: see there). The entry of GRPOLoss and the
    TRL and Liger integrations."""
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a grpo_fast.LossConfig, got {type(config).__name__}")
    if weights is None:
        weights = TokenWeights()
    elif not isinstance(weights, TokenWeights):
        raise TypeError(f"weights must be a grpo_fast.TokenWeights or None, got {type(weights).__name__}")
    check_lm_head(hidden, weight, bias, targets)
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta = {config.beta} > 0 needs ref_logps (the reference policy's log-probs), got None")
    check_entropy_weights(config.entropy_coef, weights.entropy_weights)
    batch = policy_batch(hidden, targets, advantages, mask, old_logps, ref_logps, weights.is_ratio,
                         weights.loss_weights, weights.entropy_weights)
    num_items = weights.num_items_in_batch
    if num_items is not None and float(num_items) < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {num_items!r}")
    for name, value in (("entropy_mask", entropy_mask), ("policy_mask", policy_mask)):
        if value is not None and tuple(value.shape) != tuple(batch.mask.shape):
            raise ValueError(f"{name} must have shape {tuple(batch.mask.shape)} like mask, got {tuple(value.shape)}")
    inputs = sweep.prepare("grpo_loss", batch.hidden, weight, batch.targets, bias=bias, transform=transform,
                           execution=execution, mask=batch.mask)
    return fused_policy_loss(inputs, batch, config, weights, token_stats=token_stats, entropy_mask=entropy_mask,
                             policy_mask=policy_mask)


class GRPOLoss(nn.Module):
    """`grpo_loss` as a module holding its options::

        GRPOLoss(config, transform=transform, execution=execution)(hidden, weight, targets, advantages, mask, ...)
        == grpo_loss(hidden, weight, targets, advantages, mask, ..., config=config, transform=transform,
                     execution=execution)

    e.g. `loss, metrics = GRPOLoss(LossConfig(beta=0.04))(hidden, weight, targets, advantages, mask,
    old_logps=old, ref_logps=ref)`. Tensors, shapes, dtypes and the returned (loss, metrics) are `grpo_loss`'s:
    hidden (B, T, H) or (N, H), weight (V, H), targets / mask / old_logps / ref_logps (B, T) or (N,), advantages
    (B,) or (B, T); loss a 0-dim fp32 tensor.

    config: a `LossConfig` or a loss-type name; transform: the module's `LogitTransform` (its kept set, if any,
    applies to every call); execution: its `Execution`. forward takes the tensors, the per-token `TokenWeights`
    and each call's kept sets (`kept=KeptSet(ids, offsets)`, which replace transform.kept for that call).
    Attributes: config (the LossConfig), transform, execution.
    """

    @moved_keywords("GRPOLoss", MODULE_MOVES)
    def __init__(self, config: Union[LossConfig, str] = "dapo", *, transform: Optional[LogitTransform] = None,
                 execution: Optional[Execution] = None):
        super().__init__()
        self.config = as_loss_config(config)
        self.transform = sweep.option("transform", transform, LogitTransform)
        self.execution = sweep.option("execution", execution, Execution)

    @moved_keywords("GRPOLoss.forward", FORWARD_MOVES)
    def forward(self, hidden, weight, targets, advantages, mask, *, old_logps=None, ref_logps=None, bias=None,
                kept: Optional[KeptSet] = None, weights: Optional[TokenWeights] = None):
        transform = self.transform if kept is None else dataclasses.replace(self.transform, kept=kept)
        return checked_policy_loss(
            hidden, weight, targets, advantages, mask, config=self.config, transform=transform, old_logps=old_logps,
            ref_logps=ref_logps, bias=bias, weights=weights, execution=self.execution,
        )

    def extra_repr(self) -> str:
        return f"{self.config}, {self.transform}, {self.execution}"
