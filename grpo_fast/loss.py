"""The GRPO-family policy loss from hidden states: fused (gradient computed in the forward) or two-phase."""

from __future__ import annotations

import inspect
from dataclasses import fields
from typing import Optional

import torch
from torch import nn

from grpo_fast import backends
from grpo_fast.chunked import VersionGuard, chunk_plan, chunked_pass, forbid_double_backward
from grpo_fast.inputs import (
    PolicyBatch,
    check_chunk_bytes,
    check_entropy_weights,
    check_lm_head,
    check_target_range,
    check_transform,
    policy_batch,
)
from grpo_fast.kept import KeptSet, check_kept_set
from grpo_fast.logprobs import flat_token_logprobs
from grpo_fast.numerics import LogitTransform
from grpo_fast.variants import LossConfig, TokenTerms, entropy_bonus_weights, loss_config, policy_loss, token_weights


class _FusedPolicyLoss(torch.autograd.Function):
    """Forward runs the 3-GEMM chunk loop and keeps d(hidden), d(weight), d(bias); backward only scales them.

    guard: a VersionGuard of the caller's hidden, weight and bias (None when no gradient is computed).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, ops, rows, token_grads, finish, metrics_out, guard,
                kept):
        needs = ctx.needs_input_grad
        result = chunked_pass(
            hidden, weight, bias, targets, transform, ops, rows, need_entropy=True, token_grads=token_grads,
            grad_hidden=needs[0], grad_weight=needs[1], grad_bias=bias is not None and needs[2], kept=kept,
        )
        loss, metrics = finish(result.logp, result.entropy)
        metrics_out.update(metrics)
        ctx.save_for_backward(result.grad_hidden, result.grad_weight, result.grad_bias)
        ctx.guard = guard
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        forbid_double_backward("grpo_loss")
        if ctx.guard is not None:
            ctx.guard.check()
        grads = ctx.saved_tensors
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
            grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in grads)
        return (*grads, None, None, None, None, None, None, None, None, None)


def _scatter(values, index, shape):
    """(N,) values at flat positions index of a zero (B, T) tensor; differentiable."""
    flat = values.new_zeros(shape[0] * shape[1])
    return flat.index_copy(0, index, values).view(shape)


def fused_policy_loss(batch: PolicyBatch, weight, bias, config: LossConfig, transform: LogitTransform, *,
                      num_items_in_batch=None, chunk_bytes=None, backend="auto", token_stats=None, ops=None,
                      entropy_mask=None, policy_mask=None, kept: Optional[KeptSet] = None):
    """The policy loss of `batch`; see `grpo_loss`. Inputs already checked.

    token_stats: an optional dict that receives the detached (B, T) "logp" and "entropy" (zero off the mask),
    for callers that log per-token metrics of their own (the TRL integration). ops: the resolved backend
    (default: `backend` on hidden's device). entropy_mask: the (B, T) 0/1 tokens the entropy bonus averages over
    (default: the mask); policy_mask: a (B, T) factor of the policy term alone (see `policy_loss`). kept: the
    checked kept sets of the B x T tokens (grpo_fast.kept), or None for the full vocabulary.
    """
    hidden, mask = batch.hidden, batch.mask
    shape = tuple(mask.shape)
    ops, chunk_bytes, rows = chunk_plan(hidden, weight, chunk_bytes, backend, ops)
    # The caller's tensors, not the compacted copy below: those are what an in-place change would touch.
    guard = VersionGuard("grpo_loss", hidden=hidden, weight=weight, bias=bias) if torch.is_grad_enabled() else None

    # Compact the masked positions away: prompt and padding tokens cost no GEMM work.
    index = mask.reshape(-1).nonzero().squeeze(1)
    hidden_c = hidden.reshape(-1, hidden.shape[-1]).index_select(0, index)
    targets_c = batch.targets.reshape(-1).index_select(0, index).long()
    kept_c = None if kept is None else kept.select(index)
    mask_f = mask.to(batch.advantages.dtype)
    entropy_mask_f = mask_f if entropy_mask is None else entropy_mask.to(mask_f.dtype) * mask_f

    def loss_from(logp_c, entropy_c):
        logp, entropy = _scatter(logp_c, index, shape), _scatter(entropy_c, index, shape)
        if token_stats is not None:
            token_stats.update(logp=logp.detach(), entropy=entropy.detach())
        return policy_loss(
            logp, entropy, mask_f, batch.advantages,
            old_logps=batch.old_logps, ref_logps=batch.ref_logps, is_ratio=batch.is_ratio,
            num_items_in_batch=num_items_in_batch, config=config, entropy_mask=entropy_mask_f, policy_mask=policy_mask,
            loss_weights=batch.loss_weights, entropy_weights=batch.entropy_weights,
        )

    if not config.token_separable:
        # Two phases: log-probs of every token first (the sequence ratio needs them all), then autograd of the
        # loss math drives token_logprobs' backward (which recomputes each chunk): 4 GEMM passes.
        logp_c, entropy_c = flat_token_logprobs(
            hidden_c, weight, bias, targets_c, transform, return_entropy=True, chunk_bytes=chunk_bytes,
            backend=backend, ops=ops, guard=guard, kept=kept_c,
        )
        return loss_from(logp_c, entropy_c)

    def compact(t):     # detached: the kernels take values; the gradients to these inputs come from `side` below
        return None if t is None else t.detach().expand(shape).reshape(-1).index_select(0, index)

    # Token-separable objectives: the policy mask multiplies the policy term as is_ratio does, so the kernels take
    # their product.
    grad_is_ratio = batch.is_ratio
    if policy_mask is not None:
        policy_factor = policy_mask.to(mask_f.dtype)
        grad_is_ratio = policy_factor if grad_is_ratio is None else grad_is_ratio * policy_factor

    weights = token_weights(mask_f, config, num_items_in_batch) if batch.loss_weights is None \
        else batch.loss_weights * mask_f
    if batch.entropy_weights is not None:
        bonus = batch.entropy_weights * mask_f
    else:
        bonus = None if config.entropy_coef == 0.0 else entropy_bonus_weights(entropy_mask_f, config)
    terms = TokenTerms(
        config, advantages=compact(batch.advantages), weights=compact(weights),
        old_logps=compact(batch.old_logps), ref_logps=compact(batch.ref_logps), is_ratio=compact(grad_is_ratio),
        entropy_grad=None if bonus is None else -compact(bonus),
    )

    def token_grads(start, end, logp, entropy):
        # d(loss)/d(logp) and d(loss)/d(entropy) of this chunk's tokens, while its logits are in the buffer.
        chunk = terms.slice(start, end)
        return ops.policy_grad(logp, chunk), chunk.entropy_grad

    per_token_values = {}

    def finish(logp_c, entropy_c):
        per_token_values.update(logp=logp_c, entropy=entropy_c)
        with torch.no_grad():
            return loss_from(logp_c, entropy_c)

    trainable = [t for t in (hidden_c, weight, bias) if t is not None and t.requires_grad]
    if not (torch.is_grad_enabled() and trainable):     # evaluation: the log-prob pass alone, 1 GEMM pass
        token_grads = guard = None
    metrics: dict = {}
    loss = _FusedPolicyLoss.apply(hidden_c, weight, bias, targets_c, transform, ops, rows, token_grads, finish,
                                  metrics, guard, kept_c)

    side = (batch.advantages, batch.old_logps, batch.ref_logps, batch.is_ratio, batch.loss_weights,
            batch.entropy_weights)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in side):
        # A learned baseline, say: the loss is the torch loss math of the per-token log-probs and these inputs, so
        # at the kernels' (fixed) log-probs its gradient to them is that math's. Run it once more with autograd on
        # (O(tokens), no GEMM) and add it with value zero: the loss keeps the fused value, and gains their gradient.
        side_loss, _ = loss_from(per_token_values["logp"].detach(), per_token_values["entropy"].detach())
        loss = loss + (side_loss - side_loss.detach())
    return loss, metrics


def _shows_loss_options(fn):
    """fn, whose signature ends in **loss_options, with LossConfig's fields and their defaults shown in its place as
    keyword-only parameters: what help(), inspect.signature and editors that read signatures at run time show."""
    signature = inspect.signature(fn)
    own = [p for p in signature.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    options = [inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=field.default,
                                 annotation=field.type) for field in fields(LossConfig)]
    fn.__signature__ = signature.replace(parameters=own + options)
    return fn


@_shows_loss_options
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
    config: Optional[LossConfig] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    num_items_in_batch=None,
    is_ratio: Optional[torch.Tensor] = None,
    chunk_bytes: Optional[int] = None,
    backend: str = "auto",
    process_group=None,
    kept_ids: Optional[torch.Tensor] = None,
    kept_offsets: Optional[torch.Tensor] = None,
    loss_weights: Optional[torch.Tensor] = None,
    entropy_weights: Optional[torch.Tensor] = None,
    **loss_options,
):
    """GRPO-family policy loss from final hidden states and the LM-head weight, without the (N, V) logits.

    Equals (TRL 1.16's `GRPOTrainer._compute_loss`, without its division by gradient-accumulation steps)::

        logp = token_logprobs(hidden, weight, targets, ...)                 # full log-softmax + gather
        r = exp(logp - old_logps)      # per token; GSPO: exp of the masked mean over each sequence
        per_token = -min(r * A, clamp(r, 1 - epsilon_low, 1 + epsilon_high) * A)   # cispo / sapo / vespo differ
        per_token = per_token * is_ratio + beta * k3_kl(ref_logps, logp)           # vespo: is_ratio in its weight
        loss = reduce[loss_type](per_token, mask) - entropy_coef * masked_mean(entropy)

    For token-level variants (every loss type but vespo, with importance_sampling_level="token")
    the gradient is computed during the forward, chunk by chunk: 3 GEMM passes over (N, H, V) in all, 2 when the
    weight does not require grad. Sequence-level variants, vespo included, take two phases (4 passes).

    Args:
        hidden: (B, T, H) or (N, H) final hidden states (fp32 / bf16 / fp16); (N, ...) inputs form one sequence.
        weight: (V, H) LM-head weight, same dtype and device as hidden. bias: optional (V,).
        targets: (B, T) or (N,) sampled token ids; any value where mask is 0 (e.g. -100).
        advantages: (B,) per sequence or (B, T) per token (PPO); for (N, H) hidden a scalar or (N,).
        mask: (B, T) or (N,) bool/0-1: the completion tokens that count.
        old_logps: log-probs of the policy that sampled; None means on-policy (ratio 1, gradient still flows).
        ref_logps: reference-policy log-probs, required when beta > 0.
        is_ratio: optional per-token rollout importance-sampling correction (e.g. vLLM), a constant factor; vespo
            multiplies it into each sequence's ratio instead (token by token: a per-sequence ratio repeated over
            the tokens would count once per token).
        config: the loss options as one `LossConfig`; or None, and the options as keywords (**loss_options).
        loss_options: LossConfig's fields as keywords, each documented there; a keyword that is no field raises a
            ValueError naming it, and beside a config every option must keep its default:
            loss_type: grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo (default "dapo"; see
                `grpo_fast.variants.LOSS_TYPES`).
            importance_sampling_level: "token" or "sequence" (GSPO; LUSPO's paper level).
            epsilon_low, epsilon_high, delta: clipping (epsilon_high defaults to epsilon_low; delta caps r).
            beta, use_bias_correction_kl: k3 KL weight and its importance-ratio correction.
            max_completion_length: dr_grpo's normalizer.
            entropy_coef: subtract entropy_coef * masked mean entropy (the entropy gradient flows).
            sapo_temperature_pos / sapo_temperature_neg: SAPO gate temperatures.
            vespo_k_pos, vespo_lambda_pos / vespo_k_neg, vespo_lambda_neg: VESPO's gamma weight of the sequence
                ratio w, e^lambda * w^k * e^(-lambda * w), for A >= 0 / A < 0 (see `grpo_fast.variants.vespo_weights`).
        temperature, logit_scale, logit_softcap: logit transform, as in `token_logprobs`.
        num_items_in_batch: dapo / cispo / vespo normalizer (default: the number of mask tokens in this call; pass
            the global count when accumulating).
        chunk_bytes, backend: as in `token_logprobs`.
        process_group: for a vocabulary-parallel LM head: weight (and bias) hold this rank's rows of the
            vocabulary (ranks in order, any sizes); every rank passes the same hidden, targets and the rest, and
            gets the full loss, the full d(hidden) and its own slice's d(weight). Runs the PyTorch backend.
        kept_ids, kept_offsets: optional CSR kept set (top-k / top-p) of each of the B x T (or N) tokens, as in
            `token_logprobs`: logp and the entropy are then over it; where mask is 0 a set may be empty. old_logps
            and ref_logps should come over the same sets (the engine's log-probs do; `token_logprobs(...,
            kept_ids=, kept_offsets=)` for the rest), so that the ratio compares like with like.
        loss_weights: optional (B, T) or (N,) weights of the per-token losses (policy term plus KL) in place of
            loss_type's reduction: loss = sum(loss_weights * per_token) over the mask. Any engine's normalizer that
            is linear in the loss matrix (verl's agg_loss modes, OpenRLHF's means, its dp_size) is such weights;
            num_items_in_batch is then unused.
        entropy_weights: optional (B, T) or (N,) weights of the entropy bonus in place of entropy_coef's masked
            mean: the loss gets -sum(entropy_weights * entropy) over the mask (entropy_coef must stay 0).

    Returns:
        (loss, metrics): loss a 0-dim fp32 tensor; metrics a dict of detached 0-dim tensors: "ratio/mean",
        "entropy", "kl" (beta > 0), "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean"
        (clipped objectives), "cispo_clip_ratio" (cispo) or "vespo/phi_seq_mean" (vespo).

    Gradients flow to hidden, weight and bias, and to advantages, old_logps, ref_logps and is_ratio where they
    require grad (a learned baseline, say), as in the full-logits `grpo_fast.reference.grpo_loss`; those take one
    more pass of the per-token loss math (no GEMM), only when asked for. The gradient is first-order only
    (create_graph=True raises), and hidden, weight and bias must not change in place before the backward (it
    raises, as torch does for tensors saved for backward).
    """
    config = loss_config(config, **loss_options)
    transform = check_transform(temperature, logit_scale, logit_softcap)
    return checked_policy_loss(
        hidden, weight, targets, advantages, mask, config=config, transform=transform, old_logps=old_logps,
        ref_logps=ref_logps, bias=bias, is_ratio=is_ratio, num_items_in_batch=num_items_in_batch,
        chunk_bytes=chunk_bytes, backend=backend, process_group=process_group, kept_ids=kept_ids,
        kept_offsets=kept_offsets, loss_weights=loss_weights, entropy_weights=entropy_weights,
    )


def checked_policy_loss(hidden, weight, targets, advantages, mask, *, config: LossConfig, transform: LogitTransform,
                        old_logps=None, ref_logps=None, bias=None, is_ratio=None, num_items_in_batch=None,
                        chunk_bytes=None, backend="auto", token_stats=None, process_group=None, entropy_mask=None,
                        policy_mask=None, kept_ids=None, kept_offsets=None, loss_weights=None,
                        entropy_weights=None):
    """`grpo_loss` with its options already taken into a LossConfig and a LogitTransform: checks the tensors,
    resolves the backend and runs `fused_policy_loss` (token_stats, entropy_mask, policy_mask: see there). The
    entry of GRPOLoss and the TRL integration."""
    check_lm_head(hidden, weight, bias, targets)
    check_chunk_bytes(chunk_bytes)
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta = {config.beta} > 0 needs ref_logps (the reference policy's log-probs), got None")
    ops, vocab_size = backends.resolve_head(backend, hidden.device, weight.shape[0], process_group)
    check_entropy_weights(config.entropy_coef, entropy_weights)
    batch = policy_batch(hidden, targets, advantages, mask, old_logps, ref_logps, is_ratio, loss_weights,
                         entropy_weights)
    check_target_range(batch.targets, vocab_size, batch.mask)
    kept = check_kept_set(kept_ids, kept_offsets, batch.targets, vocab_size, batch.mask)
    if num_items_in_batch is not None and float(num_items_in_batch) < 0:
        raise ValueError(f"num_items_in_batch must be >= 0, got {num_items_in_batch!r}")
    for name, value in (("entropy_mask", entropy_mask), ("policy_mask", policy_mask)):
        if value is not None and tuple(value.shape) != tuple(batch.mask.shape):
            raise ValueError(f"{name} must have shape {tuple(batch.mask.shape)} like mask, got {tuple(value.shape)}")
    return fused_policy_loss(batch, weight, bias, config, transform, num_items_in_batch=num_items_in_batch,
                             chunk_bytes=chunk_bytes, backend=backend, token_stats=token_stats, ops=ops,
                             entropy_mask=entropy_mask, policy_mask=policy_mask, kept=kept)


class GRPOLoss(nn.Module):
    """`grpo_loss` as a module holding its options: `GRPOLoss(config, **options)(hidden, weight, targets,
    advantages, mask, ...)` equals `grpo_loss(hidden, weight, targets, advantages, mask, ..., config=config,
    **options)`.

        loss, metrics = GRPOLoss(loss_type="dapo", beta=0.04)(hidden, weight, targets, advantages, mask,
                                                              old_logps=..., ref_logps=...)

    Tensors, shapes, dtypes and the returned (loss, metrics) are `grpo_loss`'s: hidden (B, T, H) or (N, H) fp32 /
    bf16 / fp16, weight (V, H), targets / mask / old_logps / ref_logps / is_ratio (B, T) or (N,), advantages (B,)
    or (B, T); loss a 0-dim fp32 tensor. forward takes the tensors, num_items_in_batch, process_group and a kept
    set (kept_ids, kept_offsets).

    config: a `LossConfig`, or None to build one from **loss_options (LossConfig's fields as keywords, see
        `grpo_loss`; an unknown keyword raises a ValueError naming it; beside a config each keeps its default).
    temperature, logit_scale, logit_softcap, chunk_bytes, backend: the module's own options, as in `grpo_loss`.
    Attributes: config (the LossConfig), transform (the LogitTransform), chunk_bytes, backend.
    """

    @_shows_loss_options
    def __init__(self, config: Optional[LossConfig] = None, *, temperature: float = 1.0, logit_scale: float = 1.0,
                 logit_softcap: Optional[float] = None, chunk_bytes: Optional[int] = None, backend: str = "auto",
                 **loss_options):
        super().__init__()
        self.config = loss_config(config, **loss_options)
        self.transform = check_transform(temperature, logit_scale, logit_softcap)
        check_chunk_bytes(chunk_bytes)
        backends.check_name(backend)
        self.chunk_bytes, self.backend = chunk_bytes, backend

    def forward(self, hidden, weight, targets, advantages, mask, *, old_logps=None, ref_logps=None, bias=None,
                is_ratio=None, num_items_in_batch=None, process_group=None, kept_ids=None, kept_offsets=None,
                loss_weights=None, entropy_weights=None):
        return checked_policy_loss(
            hidden, weight, targets, advantages, mask, config=self.config, transform=self.transform,
            old_logps=old_logps, ref_logps=ref_logps, bias=bias, is_ratio=is_ratio,
            num_items_in_batch=num_items_in_batch, chunk_bytes=self.chunk_bytes, backend=self.backend,
            process_group=process_group, kept_ids=kept_ids, kept_offsets=kept_offsets, loss_weights=loss_weights,
            entropy_weights=entropy_weights,
        )

    def extra_repr(self) -> str:
        return f"{self.config}, {self.transform}, backend={self.backend!r}"
