"""The chunk passes in plain PyTorch: the CPU path and the readable statement of what the kernels compute.

The passes are module functions (the kernel tests compare against them); `OPS` is the backend built from them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.backends.base import ChunkOps
from grpo_fast.numerics import accumulation_dtype
from grpo_fast.variants import token_loss_grad


@dataclass
class ChunkState:
    logits: torch.Tensor             # z (C, V): the transformed logits (aliases the buffer when it is fp32/fp64)
    probs: torch.Tensor              # softmax(z) (C, V), reused by dlogits_
    lse: torch.Tensor                # (C,) fp32
    logp: torch.Tensor               # (C,) fp32
    entropy: Optional[torch.Tensor]  # (C,) fp32


def bytes_per_logit(dtype: torch.dtype) -> int:
    # The GEMM buffer, an fp32 copy when it is not fp32, the probabilities and one more temporary.
    if dtype == torch.float64:
        return 8 * 3
    return torch.finfo(dtype).bits // 8 + (0 if dtype == torch.float32 else 4) + 8


# Logits below NEG_BIG (-inf for banned tokens) count as NEG_BIG: their probability is still 0, and 0 * NEG_BIG is
# 0 where 0 * -inf would make the entropy and the gradient NaN (the Triton kernels use the same floor).
NEG_BIG = -1e20


def transformed_(buffer, transform) -> torch.Tensor:
    """z = softcap(y * scale) / temperature, floored at NEG_BIG, in place when the buffer is fp32 / fp64 (else an
    fp32 copy)."""
    dtype = accumulation_dtype(buffer.dtype)
    z = buffer if buffer.dtype == dtype else buffer.to(dtype)
    if transform.scale != 1.0:
        z.mul_(transform.scale)
    if transform.softcap is not None:
        z.div_(transform.softcap).tanh_().mul_(transform.softcap)
    if transform.temperature != 1.0:
        z.div_(transform.temperature)
    return z.clamp_(min=NEG_BIG)


def stats_(buffer, targets, transform, need_entropy) -> ChunkState:
    """lse, logp and entropy relative to the row max m, with s = sum exp(z - m) and s - 1 summed without the
    max's own 1 (adding it would absorb a peaked row's small terms): lse = m + log1p(s - 1), logp = (z_t - m) -
    log1p(s - 1), H = log1p(s - 1) - sum p (z - m), each accurate to its own size (tested down to H = 1e-8;
    lse - sum p z loses all relative accuracy below about 1e-6 |m| in fp32)."""
    z = transformed_(buffer, transform)
    row_max, argmax = z.max(dim=-1, keepdim=True)
    shifted = torch.sub(z, row_max)                        # z - m <= 0
    probs = shifted.exp()
    probs.scatter_(1, argmax, 0.0)
    rest = probs.sum(dim=-1, keepdim=True)                 # s - 1
    probs.scatter_(1, argmax, 1.0)
    probs.div_(rest + 1.0)
    log_sum = rest.log1p()                                 # ln s
    lse = (row_max + log_sum).squeeze(1)
    logp = (z.gather(1, targets[:, None]) - row_max - log_sum).squeeze(1)
    entropy = (log_sum.squeeze(1) - shifted.mul_(probs).sum(-1)) if need_entropy else None
    del shifted
    return ChunkState(z, probs, lse, logp, entropy)


def dlogits_(buffer, state, targets, g_logp, g_entropy, transform, onehot=None) -> None:
    """buffer <- dL/dy = (g (onehot - p) - g_H p (z - lse + H)) * dz/dy.

    onehot: the (C,) values added at the targets' columns, default g_logp (a vocabulary slice that does not
    hold a row's target passes 0 for it)."""
    z, lse = state.logits, state.lse
    dlogits = state.probs                                  # overwritten: the state is spent after this pass
    if g_entropy is None:
        dlogits.mul_(-g_logp[:, None])
    else:
        coef = (z - (lse - state.entropy)[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None])
        dlogits.mul_(coef).neg_()
        del coef
    dlogits.scatter_add_(1, targets[:, None], (g_logp if onehot is None else onehot)[:, None])
    if transform.softcap is not None:                      # d tanh = 1 - tanh^2, tanh = z * T / softcap
        dlogits.mul_(1 - (z * (transform.temperature / transform.softcap)).square_())
    dlogits.mul_(transform.scale / transform.temperature)
    buffer.copy_(dlogits)


def policy_grad(logp, terms):
    """d(loss)/d(logp) per token: autograd over the loss math of grpo_fast.variants."""
    return token_loss_grad(logp, terms)


class TorchOps(ChunkOps):
    """The passes above as a single-device backend."""

    bytes_per_logit = staticmethod(bytes_per_logit)
    stats_ = staticmethod(stats_)
    policy_grad = staticmethod(policy_grad)
    dlogits_ = staticmethod(dlogits_)


OPS = TorchOps()
