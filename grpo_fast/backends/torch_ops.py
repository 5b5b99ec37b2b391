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
    sum_pi_squared: Optional[torch.Tensor] = None  # (C,) fp32: sum_v p_v^2, when asked for


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


def stats_(buffer, targets, transform, need_entropy, need_sum_pi_squared=False) -> ChunkState:
    """lse, logp and entropy relative to the row max m, with s = sum exp(z - m) and s - 1 summed without the
    max's own 1 (adding it would absorb a peaked row's small terms): lse = m + log1p(s - 1), logp = (z_t - m) -
    log1p(s - 1), H = log1p(s - 1) - sum p (z - m), each accurate to its own size (tested down to H = 1e-8;
    lse - sum p z loses all relative accuracy below about 1e-6 |m| in fp32). need_sum_pi_squared: also
    sum_v p_v^2 (the collision probability, in [1/V, 1])."""
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
    sum_pi_squared = torch.linalg.vecdot(probs, probs) if need_sum_pi_squared else None
    return ChunkState(z, probs, lse, logp, entropy, sum_pi_squared)


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


@dataclass
class KeptState:
    """The statistics of a chunk over its kept sets (grpo_fast.kept): only the K kept logits are read."""

    rows: torch.Tensor               # (K,) int64: the chunk row of each kept id
    cols: torch.Tensor               # (K,) int64: its column in the buffer
    is_target: torch.Tensor          # (K,) bool: the id is its row's target
    logits: torch.Tensor             # (K,) z at the kept ids, fp32
    probs: torch.Tensor              # (K,) softmax over each row's kept set
    lse: torch.Tensor                # (C,) log-sum-exp over the kept set
    logp: torch.Tensor               # (C,)
    entropy: Optional[torch.Tensor]  # (C,) entropy of the kept-set distribution
    sum_pi_squared: Optional[torch.Tensor] = None  # (C,) sum_{j in S} (p^S_j)^2, when asked for


def kept_stats_(buffer, targets, transform, need_entropy, kept, need_sum_pi_squared=False) -> KeptState:
    """stats_ over each row's kept set S (a grpo_fast.kept.KeptChunk; every row holds K >= 1 ids, its target
    among them): lse_S = logsumexp_{j in S} z_j, logp = z_target - lse_S, H_S = lse_S - sum_{j in S} p^S_j z_j,
    with the same split of the largest term as stats_ (peaked rows keep their relative accuracy); and, with
    need_sum_pi_squared, sum_{j in S} (p^S_j)^2."""
    rows, cols = kept.rows(), kept.ids
    num_rows, num_kept = buffer.shape[0], cols.numel()
    z = transformed_(buffer[rows, cols], transform)        # a (K,) copy: the buffer keeps its logits
    stat = z.new_zeros(num_rows)
    row_max = z.new_full((num_rows,), NEG_BIG).scatter_reduce_(0, rows, z, "amax")
    shifted = z - row_max.index_select(0, rows)
    # s - 1: every term but one at each row's max (its first id there)
    position = torch.arange(num_kept, device=z.device)
    first = torch.full((num_rows,), num_kept, dtype=torch.long, device=z.device).scatter_reduce_(
        0, rows, torch.where(shifted == 0, position, num_kept), "amin")
    rest = stat.clone().index_add_(0, rows, shifted.exp().index_fill_(0, first, 0.0))
    log_sum = rest.log1p()
    probs = (shifted - log_sum.index_select(0, rows)).exp_()
    is_target = cols == targets.index_select(0, rows)
    logp = stat.clone().index_add_(0, rows, torch.where(is_target, shifted, 0.0)) - log_sum
    entropy = (log_sum - stat.clone().index_add_(0, rows, probs * shifted)) if need_entropy else None
    sum_pi_squared = stat.clone().index_add_(0, rows, probs * probs) if need_sum_pi_squared else None
    return KeptState(rows, cols, is_target, z, probs, row_max + log_sum, logp, entropy, sum_pi_squared)


def kept_dlogits_(buffer, state: KeptState, g_logp, g_entropy, transform) -> None:
    """buffer <- dL/dy: (g 1[j = target] - p^S_j (g + g_H (z_j - lse_S + H_S))) dz/dy at the kept ids, 0 elsewhere
    (the tokens off the kept set do not enter the kept-set distribution)."""
    rows, z = state.rows, state.logits
    g_rows = g_logp.index_select(0, rows)
    if g_entropy is None:
        coef = g_rows
    else:
        centred = z - (state.lse - state.entropy).index_select(0, rows)
        coef = centred.mul_(g_entropy.index_select(0, rows)).add_(g_rows)
    dz = torch.where(state.is_target, g_rows, 0.0) - state.probs * coef
    if transform.softcap is not None:
        dz.mul_(1 - (z * (transform.temperature / transform.softcap)).square_())
    dz.mul_(transform.scale / transform.temperature)
    buffer.zero_()
    buffer[rows, state.cols] = dz.to(buffer.dtype)


def policy_grad(logp, terms):
    """d(loss)/d(logp) per token: autograd over the loss math of grpo_fast.variants."""
    return token_loss_grad(logp, terms)


class TorchOps(ChunkOps):
    """The passes above as a single-device backend."""

    bytes_per_logit = staticmethod(bytes_per_logit)
    policy_grad = staticmethod(policy_grad)

    @staticmethod
    def stats_(buffer, targets, transform, need_entropy, kept=None, need_sum_pi_squared=False):
        if kept is not None:
            return kept_stats_(buffer, targets, transform, need_entropy, kept, need_sum_pi_squared)
        return stats_(buffer, targets, transform, need_entropy, need_sum_pi_squared)

    @staticmethod
    def dlogits_(buffer, state, targets, g_logp, g_entropy, transform) -> None:
        if isinstance(state, KeptState):
            return kept_dlogits_(buffer, state, g_logp, g_entropy, transform)
        return dlogits_(buffer, state, targets, g_logp, g_entropy, transform)


OPS = TorchOps()
