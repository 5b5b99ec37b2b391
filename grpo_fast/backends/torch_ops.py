"""The chunk passes in plain PyTorch: the CPU path and the readable statement of what the kernels compute."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.variants import token_loss_grad


@dataclass
class ChunkState:
    logits: torch.Tensor            # z (C, V) fp32: the transformed logits (aliases the buffer when it is fp32)
    lse: torch.Tensor               # (C,) fp32
    logp: torch.Tensor              # (C,) fp32
    entropy: Optional[torch.Tensor]  # (C,) fp32


def bytes_per_logit(dtype: torch.dtype) -> int:
    # The GEMM buffer, an fp32 copy when it is not fp32, and two fp32 temporaries (probabilities, one more).
    if dtype == torch.float64:
        return 8 * 3
    return torch.finfo(dtype).bits // 8 + (0 if dtype == torch.float32 else 4) + 8


def stats_(buffer, targets, transform, need_entropy) -> ChunkState:
    z = buffer if buffer.dtype in (torch.float32, torch.float64) else buffer.float()
    if transform.scale != 1.0:
        z.mul_(transform.scale)
    if transform.softcap is not None:
        z.div_(transform.softcap).tanh_().mul_(transform.softcap)
    if transform.temperature != 1.0:
        z.div_(transform.temperature)
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(1, targets[:, None]).squeeze(1) - lse
    entropy = None
    if need_entropy:
        entropy = lse - torch.exp(z - lse[:, None]).mul_(z).sum(-1)   # H = lse - sum p z
    return ChunkState(z, lse, logp, entropy)


def dlogits_(buffer, state, targets, g_logp, g_entropy, transform) -> None:
    """buffer <- dL/dy = (g (onehot - p) - g_H p (z - lse + H)) * dz/dy."""
    z, lse = state.logits, state.lse
    dlogits = torch.exp(z - lse[:, None])                   # p
    if g_entropy is None:
        dlogits.mul_(-g_logp[:, None])
    else:
        coef = (z - (lse - state.entropy)[:, None]).mul_(g_entropy[:, None]).add_(g_logp[:, None])
        dlogits.mul_(coef).neg_()
        del coef
    dlogits.scatter_add_(1, targets[:, None], g_logp[:, None])
    if transform.softcap is not None:                      # d tanh = 1 - tanh^2, tanh = z * T / softcap
        dlogits.mul_(1 - (z * (transform.temperature / transform.softcap)).square_())
    dlogits.mul_(transform.scale / transform.temperature)
    buffer.copy_(dlogits)


def policy_grad(logp, terms):
    """d(loss)/d(logp) per token: autograd over the loss math of grpo_fast.variants."""
    return token_loss_grad(logp, terms)
