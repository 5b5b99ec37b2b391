"""Per-token log-probs (and entropies, and sum_v p_v^2) straight from hidden states and the LM-head weight."""

from __future__ import annotations

from typing import Optional

import torch

from grpo_fast import backends
from grpo_fast.chunked import VersionGuard, chunk_plan, chunked_pass, forbid_double_backward
from grpo_fast.inputs import check_chunk_bytes, check_lm_head, check_target_range, check_transform
from grpo_fast.kept import KeptSet, check_kept_set
from grpo_fast.numerics import LogitTransform, accumulation_dtype


class _TokenLogprobs(torch.autograd.Function):
    """Forward: one GEMM pass, nothing (N, V) kept. Backward: recompute each chunk (GEMM), dlogits, two GEMMs.

    guard: a VersionGuard of the caller's tensors (hidden may reach here as a copy), or None.
    Outputs: logp, then entropy if return_entropy, then sum_pi_squared if return_sum_pi_squared (a statistic of the
    sampling distribution, no gradient).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, transform, ops, rows, return_entropy, guard, kept,
                return_sum_pi_squared):
        result = chunked_pass(hidden, weight, bias, targets, transform, ops, rows, need_entropy=return_entropy,
                              kept=kept, need_sum_pi_squared=return_sum_pi_squared)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.transform, ctx.ops, ctx.rows, ctx.guard, ctx.kept = transform, ops, rows, guard, kept
        ctx.return_entropy = return_entropy
        outputs = (result.logp,) + ((result.entropy,) if return_entropy else ())
        if return_sum_pi_squared:
            ctx.mark_non_differentiable(result.sum_pi_squared)
            outputs += (result.sum_pi_squared,)
        return outputs if len(outputs) > 1 else outputs[0]

    @staticmethod
    def backward(ctx, grad_logp, *more_grads):
        grad_entropy = more_grads[0] if ctx.return_entropy else None
        forbid_double_backward(ctx.guard.fn_name if ctx.guard is not None else "token_logprobs")
        if ctx.guard is not None:
            ctx.guard.check()          # before torch's own check of the saved tensors: this one names the tensor
        hidden, weight, bias, targets = ctx.saved_tensors
        dtype = accumulation_dtype(hidden.dtype)
        if grad_logp is None:
            grad_logp = torch.zeros(hidden.shape[0], dtype=dtype, device=hidden.device)
        grad_logp = grad_logp.to(dtype).contiguous()
        if grad_entropy is not None:
            grad_entropy = grad_entropy.to(dtype).contiguous()

        def token_grads(start, end, logp, entropy):
            return grad_logp[start:end], None if grad_entropy is None else grad_entropy[start:end]

        needs = ctx.needs_input_grad
        result = chunked_pass(
            hidden, weight, bias, targets, ctx.transform, ctx.ops, ctx.rows,
            need_entropy=grad_entropy is not None, token_grads=token_grads,
            grad_hidden=needs[0], grad_weight=needs[1], grad_bias=bias is not None and needs[2], kept=ctx.kept,
        )
        return (result.grad_hidden, result.grad_weight, result.grad_bias) + (None,) * 8


def flat_token_logprobs(hidden, weight, bias, targets, transform: LogitTransform, *, return_entropy, chunk_bytes,
                        backend, ops=None, guard: Optional[VersionGuard] = None, kept: Optional[KeptSet] = None,
                        return_sum_pi_squared: bool = False):
    """token_logprobs on checked (N, H) inputs; returns logp, (logp, entropy), (logp, sum_pi_squared) or (logp,
    entropy, sum_pi_squared), each (N,) fp32. ops: the resolved backend (default: `backend` on hidden's device).
    guard: the caller's tensors, checked for in-place changes before the backward (None: no check, for calls
    without gradients). kept: the tokens' checked kept sets."""
    ops, _, rows = chunk_plan(hidden, weight, chunk_bytes, backend, ops)
    return _TokenLogprobs.apply(hidden, weight, bias, targets, transform, ops, rows, return_entropy, guard, kept,
                                return_sum_pi_squared)


def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    temperature: float = 1.0,
    logit_scale: float = 1.0,
    logit_softcap: Optional[float] = None,
    return_entropy: bool = False,
    return_sum_pi_squared: bool = False,
    chunk_bytes: Optional[int] = None,
    backend: str = "auto",
    process_group=None,
    kept_ids: Optional[torch.Tensor] = None,
    kept_offsets: Optional[torch.Tensor] = None,
):
    """Per-token log-probability of each target, computed in chunks without the (N, V) logits.

    Equals, without allocating the logits::

        z = (hidden @ weight.T + bias).float() * logit_scale
        z = logit_softcap * torch.tanh(z / logit_softcap)          # only when logit_softcap is set
        logp = torch.log_softmax(z / temperature, -1).gather(-1, targets[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)             # logp_all: the full log-softmax
        sum_pi_squared = logp_all.exp().square().sum(-1)

    With a kept set (the tokens a top-k / top-p sampler kept at each position), z is -inf off it before the
    log-softmax: log-probs, entropies and gradients are those of the distribution the engine sampled from.

    Args:
        hidden: (B, T, H) or (N, H), fp32 / bf16 / fp16: final (normed) hidden states.
        weight: (V, H), same dtype and device as hidden: the LM-head weight.
        targets: hidden.shape[:-1], integer token ids in [0, V).
        bias: optional (V,) LM-head bias.
        temperature, logit_scale, logit_softcap: the logit transform above (softcap as in Gemma 2).
        return_entropy: also return the entropy of each position's distribution (differentiable too).
        return_sum_pi_squared: also return each position's sum_v p_v^2 (the probability that two draws agree; verl's
            optimal token baseline weighs tokens by 1 - 2 p_target + sum_v p_v^2), from the same read of each
            chunk. Not differentiable (a statistic of the sampling distribution).
        chunk_bytes: memory budget of one chunk's working set (default 256 MiB on CPU; on CUDA 1/8 of the memory
            free on the device, within [1 GiB, 8 GiB]: fewer chunks mean less d(weight) accumulator traffic).
        backend: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton".
        process_group: weight (and bias) are this rank's rows of a vocabulary-parallel head; every rank passes
            the same hidden and targets and gets the full log-probs (see `grpo_loss`).
        kept_ids, kept_offsets: optional kept set of each token, CSR (see `grpo_fast.kept`): token t's kept ids
            are kept_ids[kept_offsets[t]:kept_offsets[t + 1]], tokens in targets' row-major order; each set must
            hold its target. The entropy and sum_v p_v^2 are then the kept-set distribution's. Same GEMM passes,
            no (N, V) tensor: the kept logits are read from the chunk's logits buffer.

    Returns:
        logp, or a tuple of logp, then entropy (return_entropy), then sum_pi_squared (return_sum_pi_squared): fp32
        tensors of shape hidden.shape[:-1]. Differentiable with respect to
        hidden, weight and bias. Under torch.no_grad() this costs one GEMM pass over (N, H, V); with gradients,
        the backward recomputes each chunk (3 more passes). First-order only (create_graph=True raises); hidden,
        weight and bias must not change in place before the backward (it raises).
    """
    check_lm_head(hidden, weight, bias, targets)
    transform = check_transform(temperature, logit_scale, logit_softcap)
    check_chunk_bytes(chunk_bytes)
    ops, vocab_size = backends.resolve_head(backend, hidden.device, weight.shape[0], process_group)
    check_target_range(targets, vocab_size)
    kept = check_kept_set(kept_ids, kept_offsets, targets, vocab_size)
    token_shape = hidden.shape[:-1]
    # The caller's hidden: the reshape below copies a non-contiguous one, which no in-place change would reach.
    guard = VersionGuard("token_logprobs", hidden=hidden, weight=weight, bias=bias) if torch.is_grad_enabled() else None
    out = flat_token_logprobs(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(), transform,
        return_entropy=return_entropy, chunk_bytes=chunk_bytes, backend=backend, ops=ops, guard=guard, kept=kept,
        return_sum_pi_squared=return_sum_pi_squared,
    )
    if isinstance(out, tuple):
        return tuple(t.view(token_shape) for t in out)
    return out.view(token_shape)
