"""Your own token-separable loss inside the vocabulary sweep: the chunk's log-probs in, d(loss)/d(logp) and the
value out, 3 GEMM passes (2 with a frozen head) and no (N, V) logits.

    def my_loss(chunk):                   # chunk.logp (n,), chunk.entropy (n,) or None, chunk.index (n,)
        adv = advantages.view(-1)[chunk.index]
        per_token = -adv * torch.exp(chunk.logp - old.view(-1)[chunk.index])
        return per_token.sum(), -adv * torch.exp(chunk.logp - old.view(-1)[chunk.index]), None
    loss = gf.fused_token_loss(hidden, weight, targets, my_loss, mask=mask)
    loss.backward()

or, with the gradient taken by autograd from the per-token expression:

    loss = gf.fused_token_loss(hidden, weight, targets, gf.autograd_token_loss(
        lambda logp, entropy, index: (-advantages.view(-1)[index] * (logp - old.view(-1)[index]).exp()).sum()),
        mask=mask)

or, from a loss written over the whole batch (an engine's own loss function) with `batch_token_loss`:

    logp = old.clone()                    # starting values; the sweep writes its log-probs in
    loss = gf.fused_token_loss(hidden, weight, targets, batch_token_loss(engine_loss, logp), mask=mask)
    value = engine_loss(logp, None)       # the value: one more evaluation, after the sweep

A loss is token-separable when it is a sum over tokens of functions of each token's own log-prob (and entropy):
then each chunk's gradient is known while its logits are in the buffer, as grpo_loss's token-level variants use
it. Normalizers known up front (a token count, a sequence length, verl's dp_size) are constants of those
functions. A loss that needs every token first (a sequence-level ratio) is not token-separable: compute
`token_logprobs` and the loss with autograd instead (4 passes). `batch_token_loss` compares, after the sweep,
the gradients its chunks returned with the loss's gradient at the final log-probs, and raises where they differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo_fast import sweep
from grpo_fast.numerics import LogitTransform, accumulation_dtype
from grpo_fast.options import EXECUTION_MOVES, TRANSFORM_MOVES, Execution, names_moved_keywords


@dataclass
class TokenChunk:
    """One chunk of the sweep, as `token_loss` sees it.

    logp: (n,) fp32 (fp64 for fp64 inputs), the chunk's log-probs (detached: return their gradient instead).
    entropy: (n,) like logp when `with_entropy`, else None.
    index: (n,) int64, the chunk's tokens as positions in targets.reshape(-1) (index per-token tensors with it).
    """

    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    index: torch.Tensor


def _loss_grads(value, leaves: list, what: str) -> list:
    """autograd's d value / d leaf for each leaf (zeros where value does not use it), with a one-line error when
    value is not a 1-element tensor or depends on none of the leaves (its gradient would silently be zero)."""
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise TypeError(f"{what} must return a 1-element tensor, got {shape}")
    grads = torch.autograd.grad(value, leaves, allow_unused=True) if value.requires_grad else [None] * len(leaves)
    if all(g is None for g in grads):
        either, both = ("logp", "logp") if len(leaves) == 1 else ("logp or entropy", "logp and entropy")
        raise ValueError(f"{what} does not depend on {either}: return a differentiable torch expression of {both} "
                         f"(no .item(), .detach() or torch.no_grad() on the way; logp.sum() * 0 for a zero loss)")
    return [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads)]


def autograd_token_loss(fn: Callable) -> Callable:
    """A `token_loss` for `fused_token_loss` from fn(logp, entropy, index) -> 0-dim tensor, the chunk's loss as a
    differentiable torch expression of logp (and entropy): its gradient is taken with torch.autograd.grad. The
    expression must be a sum over the chunk's tokens (token-separable). A loss of the entropy alone gets zero
    logp gradients; one that depends on neither (a constant, a detached value) is a ValueError."""
    def token_loss(chunk: TokenChunk):
        with torch.enable_grad():
            logp = chunk.logp.detach().requires_grad_()
            entropy = None if chunk.entropy is None else chunk.entropy.detach().requires_grad_()
            value = fn(logp, entropy, chunk.index)
            inputs = [logp] if entropy is None else [logp, entropy]
            grads = _loss_grads(value, inputs, "autograd_token_loss's fn(logp, entropy, index)")
        return value.detach(), grads[0], None if entropy is None else grads[1]
    return token_loss


class _BatchTokenLoss:
    """The token_loss of `batch_token_loss`. It also keeps the gradient each chunk returned, (N,) like logp (O(N)
    memory, never (N, V)), so that `after_sweep` can compare them with the gradient at the final values."""

    what = "batch_token_loss's loss(logp, entropy)"

    def __init__(self, loss: Callable, logp: torch.Tensor, entropy: Optional[torch.Tensor]):
        self.loss, self.logp, self.entropy = loss, logp, entropy
        self.used: Optional[list] = None       # flat d loss / d logp (and entropy) the chunks returned
        self.seen: Optional[torch.Tensor] = None   # flat bool: the entries some chunk wrote

    def _batch(self) -> list:
        return [self.logp] if self.entropy is None else [self.logp, self.entropy]

    def __call__(self, chunk: TokenChunk):
        if self.entropy is not None and chunk.entropy is None:
            raise ValueError("batch_token_loss was given entropy, but the chunks carry none: call fused_token_loss "
                             "with with_entropy=True")
        chunk_values = [chunk.logp, chunk.entropy][:len(self._batch())]
        with torch.enable_grad():
            leaves = [v.detach().to(t.dtype).requires_grad_() for v, t in zip(chunk_values, self._batch())]
            batch = [t.view(-1).index_put((chunk.index,), leaf).view_as(t) for t, leaf in zip(self._batch(), leaves)]
            grads = _loss_grads(self.loss(*batch, *[None] * (2 - len(batch))), leaves, self.what)
        if self.used is None:
            self.used = [torch.zeros(t.numel(), dtype=t.dtype, device=t.device) for t in self._batch()]
            self.seen = torch.zeros(self.logp.numel(), dtype=torch.bool, device=self.logp.device)
        for t, leaf, used, grad in zip(self._batch(), leaves, self.used, grads):
            t.view(-1)[chunk.index] = leaf.detach()
            used[chunk.index] = grad.detach()
        self.seen[chunk.index] = True
        return (chunk.logp.new_zeros(()), grads[0].to(chunk.logp.dtype),
                grads[1].to(chunk.logp.dtype) if self.entropy is not None else None)

    def after_sweep(self, gradients_used: bool) -> None:
        """Called by fused_token_loss once its sweep is over. When the chunks' gradients went into d(hidden) and
        d(weight), each chunk's (taken while later chunks' entries still held their starting values) must equal
        the loss's gradient at the final values, up to rounding: a ValueError otherwise, since the result would be
        wrong. One more evaluation of the loss and its gradient over (N,) tensors, and one device sync."""
        used, seen = self.used, self.seen
        self.used = self.seen = None
        if not gradients_used or used is None:
            return
        with torch.enable_grad():
            leaves = [t.detach().clone().requires_grad_() for t in self._batch()]
            final = _loss_grads(self.loss(*leaves, *[None] * (2 - len(leaves))), leaves, self.what)
        for name, got, want in zip(("logp", "entropy"), used, final):
            got, want = got[seen], want.detach().reshape(-1)[seen]
            # Each token against its own final gradient (a batch-wide tolerance lets a long sequence's small
            # gradients be wrong by more than they are); the floor, eps x the largest, is rounding's reach on
            # tokens whose gradient is ~0. Equal entries (infinities included) count as no difference; a NaN in
            # both is the loss's own.
            eps = torch.finfo(want.dtype).eps
            diff = torch.where(got == want, 0.0, (got - want).abs())
            allowed = eps ** 0.5 * want.abs() + eps * want.abs().max()
            wrong = diff > allowed
            if bool(wrong.any()):
                worst = int(torch.where(wrong, diff / allowed, 0.0).argmax())
                raise ValueError(
                    f"batch_token_loss's loss is not token-separable: the d loss / d {name} its chunks returned "
                    f"(taken with later tokens at their starting values) differs from the one at the sweep's "
                    f"final values at {int(wrong.sum())} of {want.numel()} tokens (worst: {float(got[worst]):.3g} "
                    f"instead of {float(want[worst]):.3g}), so the gradients would be wrong; write it as a sum of "
                    f"per-token terms of each token's own {name} (a token_loss per chunk), or compute "
                    f"token_logprobs and take the loss's gradient by autograd")


def batch_token_loss(loss: Callable, logp: torch.Tensor, entropy: Optional[torch.Tensor] = None) -> Callable:
    """A `token_loss` for `fused_token_loss` from a loss written over the whole batch, loss(logp, entropy) -> 0-dim
    tensor (an engine's own loss function, say), which must be token-separable.

    logp (and entropy, or None): the batch's tensors in the layout `loss` takes, flat in the row-major order of
    `targets`, holding starting values (e.g. the old log-probs); each chunk's values are written in as the sweep
    passes, so after it they are the sweep's. A chunk's gradient is d loss / d (its entries) with the other
    entries held at their current values, by autograd: for a token-separable loss it depends on the chunk's own
    values alone, so it is the final one. After the sweep the loss's gradient at the final values is taken once
    more and compared: a loss whose chunk gradients were not the final ones (not token-separable, and split
    across chunks) is a ValueError rather than wrong gradients. Each chunk's value is 0: the loss's value is
    loss(logp, entropy) after the sweep (one more evaluation). With `entropy` given, the chunks must carry
    entropies (with_entropy=True); a loss that ignores them gets zero entropy gradients, and one that depends
    on neither logp nor entropy is a ValueError."""
    return _BatchTokenLoss(loss, logp, entropy)


def _checked_chunk_result(result, chunk: TokenChunk):
    """(value, g_logp, g_entropy) of a token_loss, with a one-line error for anything else."""
    if not (isinstance(result, tuple) and len(result) == 3):
        raise TypeError(f"token_loss must return (value, g_logp, g_entropy), got {type(result).__name__}")
    value, g_logp, g_entropy = result
    n = chunk.logp.shape[0]
    if not isinstance(value, torch.Tensor) or value.numel() != 1:
        raise ValueError(f"token_loss's value must be a 1-element tensor, got {value!r:.80}")
    for name, grad, wanted in (("g_logp", g_logp, True), ("g_entropy", g_entropy, chunk.entropy is not None)):
        if grad is None and name == "g_entropy":
            continue
        if name == "g_entropy" and not wanted:
            raise ValueError("token_loss returned g_entropy, but fused_token_loss was called with "
                             "with_entropy=False: pass with_entropy=True")
        if not isinstance(grad, torch.Tensor) or tuple(grad.shape) != (n,):
            shape = tuple(grad.shape) if isinstance(grad, torch.Tensor) else type(grad).__name__
            raise ValueError(f"token_loss's {name} must have shape ({n},) like chunk.logp, got {shape}")
    dtype = chunk.logp.dtype
    return (value.detach().reshape(()).to(dtype), g_logp.detach().to(dtype).contiguous(),
            None if g_entropy is None else g_entropy.detach().to(dtype).contiguous())


@names_moved_keywords({**TRANSFORM_MOVES, **EXECUTION_MOVES})
def fused_token_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_loss: Callable,
    *,
    mask: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
    transform: Optional[LogitTransform] = None,
    execution: Optional[Execution] = None,
    with_entropy: bool = False,
) -> torch.Tensor:
    """sum over chunks of token_loss(chunk)[0], with the gradient computed inside the sweep. Equals::

        logp, entropy = token_logprobs(hidden, weight, targets, return_entropy=True, ...)    # all tokens
        loss = per_token_function(logp[mask], entropy[mask]).sum()                           # token-separable

    where token_loss gives, for each chunk of the masked tokens, the value of its share of the sum and its
    gradients with respect to the chunk's log-probs (and entropies). 3 GEMM passes over (N, H, V), 2 when the
    weight does not require grad; under torch.no_grad() (or without a trainable input) 1, gradients skipped.

    hidden: (B, T, H) or (N, H), fp32 / bf16 / fp16 (fp64: backend torch); weight (V, H), optional bias (V,), alike.
    targets: hidden.shape[:-1] token ids, in [0, V) where mask is 1.
    token_loss: token_loss(chunk: TokenChunk) -> (value, g_logp, g_entropy): value a 1-element tensor, g_logp
        (n,) = d(value)/d(chunk.logp), g_entropy (n,) or None (only with with_entropy). Called once per chunk, in
        order; `autograd_token_loss(fn)` builds one from a torch expression. Its optional method
        after_sweep(gradients_used: bool) runs after the last chunk (`batch_token_loss` checks there).
    mask: optional hidden.shape[:-1] bool / 0-1: the tokens that count; the others are compacted away before any
        GEMM (padding and prompt tokens cost nothing). Default: every token.
    transform, execution: the logit transform and kept sets (`LogitTransform`), the chunk budget, backend and
        vocabulary-parallel group (`Execution`), as in `token_logprobs`.

    Returns a 0-dim tensor in logp's dtype (fp32; fp64 for fp64 inputs), differentiable with respect to hidden,
    weight and bias (first order; hidden, weight and bias must not change in place before the backward).
    """
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable (chunk) -> (value, g_logp, g_entropy), got "
                        f"{type(token_loss).__name__}")
    inputs = sweep.prepare("fused_token_loss", hidden, weight, targets, bias=bias, transform=transform,
                           execution=execution, mask=mask)
    loss, _ = sweep.fused(inputs, *_chunk_callbacks(token_loss, inputs, with_entropy))
    return loss.to(accumulation_dtype(hidden.dtype))


def _chunk_callbacks(token_loss: Callable, inputs: sweep.SweepInputs, with_entropy: bool):
    """(token_grads, finish) of the sweep: each chunk's gradients from token_loss, the total from its values."""
    values = []

    def chunk_result(start, end, logp, entropy):
        chunk = TokenChunk(logp, entropy if with_entropy else None, inputs.positions(start, end))
        value, g_logp, g_entropy = _checked_chunk_result(token_loss(chunk), chunk)
        values.append(value)
        return g_logp, g_entropy

    def finish(logp, entropy):
        gradients_used = bool(values)        # the gradient pass called token_loss chunk by chunk
        if not values:                       # no gradient pass ran: the values of the log-prob pass's chunks
            for start in range(0, logp.shape[0], inputs.rows):
                end = min(start + inputs.rows, logp.shape[0])
                chunk_result(start, end, logp[start:end], None if entropy is None else entropy[start:end])
        if callable(getattr(token_loss, "after_sweep", None)):
            token_loss.after_sweep(gradients_used)
        total = torch.stack(values).sum() if values else logp.new_zeros(())
        return total, {}
    return chunk_result, finish
