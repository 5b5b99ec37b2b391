"""The sweep over the vocabulary that every loss entry runs: the preamble once (`prepare`), then one of two
autograd Functions over the chunk loop (grpo_fast.chunked):

    inputs = prepare("grpo_loss", hidden, weight, targets, bias=bias, transform=transform, execution=execution,
                     mask=mask)                       # checks, the backend, masked tokens compacted away
    loss, metrics = fused(inputs, token_grads, finish)          # gradient inside the forward: 3 GEMM passes
    logp = logprobs(inputs, return_entropy=False, return_sum_pi_squared=False)    # 1 pass; backward 3 more
    logp_bt = scatter(logp, inputs)                   # back to targets' shape, zero where the mask is 0

`token_logprobs`, `fused_token_loss` and `grpo_loss` are thin layers over these.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo_fast import backends
from grpo_fast.backends.base import ChunkOps
from grpo_fast.chunked import VersionGuard, chunk_plan, chunked_pass, forbid_double_backward
from grpo_fast.inputs import check_lm_head, check_mask, check_target_range
from grpo_fast.kept import KeptSet, check_kept_set
from grpo_fast.numerics import LogitTransform, accumulation_dtype
from grpo_fast.options import Execution


@dataclass
class SweepInputs:
    """Checked inputs of one sweep, masked tokens compacted away.

    token_shape: targets' shape (the caller's). index: (n,) int64 flat positions (in targets.reshape(-1)) of the
    n tokens that count, or None when every token counts (no compaction). hidden (n, H), targets (n,) int64 and
    kept (their kept sets, or None): the compacted tokens. weight (V, H) and bias (V,) or None: the caller's.
    transform: the logit transform without its kept set (the backends take that apart, as `kept`). ops, rows: the
    backend and the tokens per chunk. guard: the caller's hidden, weight and bias, checked for in-place changes
    before a backward (None under torch.no_grad()).
    """

    token_shape: tuple
    index: Optional[torch.Tensor]
    hidden: torch.Tensor
    targets: torch.Tensor
    kept: Optional[KeptSet]
    weight: torch.Tensor
    bias: Optional[torch.Tensor]
    transform: LogitTransform
    ops: ChunkOps
    rows: int
    guard: Optional[VersionGuard]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """(end - start,) int64: compacted tokens [start, end) as positions in targets.reshape(-1)."""
        if self.index is None:
            return torch.arange(start, end, device=self.hidden.device)
        return self.index[start:end]

    def trainable(self) -> bool:
        """Whether a gradient is wanted: grad mode on and hidden, weight or bias requiring it."""
        return torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (self.hidden, self.weight, self.bias))


def option(name: str, value, kind: type):
    """value, an option group of type `kind` (LogitTransform, Execution), or kind() for None; else a TypeError."""
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise TypeError(f"{name} must be a grpo_fast.{kind.__name__} or None, got {type(value).__name__}")
    return value


def _checked_mask(mask, hidden: torch.Tensor) -> torch.Tensor:
    """mask (hidden.shape[:-1], bool or 0/1) as bool, with errors naming it."""
    check_mask(mask, hidden)
    return mask if mask.dtype == torch.bool else mask != 0


def prepare(fn_name: str, hidden, weight, targets, *, bias, transform: Optional[LogitTransform],
            execution: Optional[Execution], mask: Optional[torch.Tensor] = None) -> SweepInputs:
    """Every check of a sweep's inputs (the LM head, the option groups, the backend, the target range and the kept
    set, both where mask is 1 only), then the masked tokens compacted away and the chunk plan. fn_name names the
    entry in the errors of the backward."""
    check_lm_head(hidden, weight, bias, targets)
    transform = option("transform", transform, LogitTransform)
    execution = option("execution", execution, Execution)
    valid = None if mask is None else _checked_mask(mask, hidden)
    ops, vocab_size = backends.resolve_head(execution.backend, hidden.device, weight.shape[0],
                                            execution.process_group)
    check_target_range(targets, vocab_size, valid)
    kept = transform.kept
    if kept is not None:
        kept = check_kept_set(kept.ids, kept.offsets, targets, vocab_size, valid, kept.host_offsets)
        transform = dataclasses.replace(transform, kept=None)
    # The caller's tensors, not the compacted copies below: those are what an in-place change would touch.
    guard = VersionGuard(fn_name, hidden=hidden, weight=weight, bias=bias) if torch.is_grad_enabled() else None
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).long()
    index = None
    if valid is not None:       # prompt and padding tokens cost no GEMM work
        index = valid.reshape(-1).nonzero().squeeze(1)
        flat_hidden, flat_targets = flat_hidden.index_select(0, index), flat_targets.index_select(0, index)
        kept = None if kept is None else kept.select(index)
    ops, _, rows = chunk_plan(flat_hidden, weight, execution.chunk_bytes, execution.backend, ops)
    return SweepInputs(tuple(targets.shape), index, flat_hidden, flat_targets, kept, weight, bias, transform, ops,
                       rows, guard)


def scatter(values: torch.Tensor, inputs: SweepInputs) -> torch.Tensor:
    """(n,) values of the compacted tokens as a tensor of targets' shape, zero where the mask is 0;
    differentiable."""
    if inputs.index is None:
        return values.view(inputs.token_shape)
    flat = values.new_zeros(math.prod(inputs.token_shape))
    return flat.index_copy(0, inputs.index, values).view(inputs.token_shape)


class _FusedSweep(torch.autograd.Function):
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
        forbid_double_backward(ctx.guard.fn_name if ctx.guard is not None else "grpo_loss")
        if ctx.guard is not None:
            ctx.guard.check()
        grads = ctx.saved_tensors
        if not torch.equal(grad_loss, torch.ones_like(grad_loss)):
            grads = tuple(None if g is None else g * grad_loss.to(g.dtype) for g in grads)
        return (*grads, None, None, None, None, None, None, None, None, None)


def fused(inputs: SweepInputs, token_grads: Callable, finish: Callable) -> tuple[torch.Tensor, dict]:
    """(loss, metrics) of one sweep that computes the gradient inside its forward: 3 GEMM passes (2 with a frozen
    weight; 1, the log-probs alone, when no gradient is wanted).

    token_grads(start, end, logp, entropy) -> (g_logp, g_entropy or None): d(loss)/d(logp) (and d(entropy)) of the
    compacted tokens [start, end), while their logits are in the buffer. finish(logp, entropy) -> (loss, metrics):
    the loss from all (n,) log-probs and entropies once the sweep is over (its gradient is the chunks').
    """
    guard = inputs.guard
    if not inputs.trainable():
        token_grads = guard = None
    metrics: dict = {}
    loss = _FusedSweep.apply(inputs.hidden, inputs.weight, inputs.bias, inputs.targets, inputs.transform,
                             inputs.ops, inputs.rows, token_grads, finish, metrics, guard, inputs.kept)
    return loss, metrics


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


def logprobs(inputs: SweepInputs, return_entropy: bool, return_sum_pi_squared: bool):
    """The compacted tokens' (n,) log-probs, or a tuple of them, then entropies (return_entropy), then sum_v p_v^2
    (return_sum_pi_squared), fp32 (fp64 for fp64 inputs): one GEMM pass; their backward recomputes each chunk
    (3 more). Log-probs and entropies are differentiable with respect to hidden, weight and bias."""
    return _TokenLogprobs.apply(inputs.hidden, inputs.weight, inputs.bias, inputs.targets, inputs.transform,
                                inputs.ops, inputs.rows, return_entropy, inputs.guard, inputs.kept,
                                return_sum_pi_squared)
