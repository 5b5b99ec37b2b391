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
    logits: Optional[torch.Tensor]   # z (C, V) kept whole (the vocabulary-parallel pass), or None: see stats_
    probs: Optional[torch.Tensor]    # softmax(z) (C, V) kept whole (vocabulary-parallel), or None: see stats_
    lse: torch.Tensor                # (C,) fp32
    logp: torch.Tensor               # (C,) fp32
    entropy: Optional[torch.Tensor]  # (C,) fp32
    sum_pi_squared: Optional[torch.Tensor] = None  # (C,) fp32: sum_v p_v^2, when asked for
    row_max: Optional[torch.Tensor] = None         # (C, 1) m = max_v z_v (stats_)
    sum_exp: Optional[torch.Tensor] = None         # (C, 1) s = sum_v exp(z_v - m) (stats_)
    holds_probs: bool = False        # stats_ left softmax(z) in the buffer (else z, or the untransformed logits)


def bytes_per_logit(dtype: torch.dtype) -> int:
    # The GEMM buffer, and room for an fp32 copy when it is not fp32 and two fp32 temporaries: more than the passes
    # below hold (their temporaries are a block's, row_blocks), a margin that also covers the vocabulary-parallel
    # pass, which keeps z and p whole.
    if dtype == torch.float64:
        return 8 * 3
    return torch.finfo(dtype).bits // 8 + (0 if dtype == torch.float32 else 4) + 8


# Logits below NEG_BIG (-inf for banned tokens) count as NEG_BIG: their probability is still 0, and 0 * NEG_BIG is
# 0 where 0 * -inf would make the entropy and the gradient NaN (the Triton kernels use the same floor).
NEG_BIG = -1e20

# The passes of a chunk run a block of rows at a time. On a CPU a block (4 MiB of fp32 logits and as much per
# temporary) stays in the caches through the ten or so elementwise passes over it, so the chunk is read from
# memory about once per sweep instead of once per pass, and no temporary of the chunk's size is allocated (the
# first touch of fresh pages costs about as much as a pass). Elsewhere a block is a quarter of the chunk: the
# (up to four) temporaries then take at most as much memory as one fp32 copy of the chunk.
CPU_BLOCK_BYTES = 4 << 20
BLOCKS_OFF_CPU = 4


def log_sum_exp_shifted(row_max: torch.Tensor, rest: torch.Tensor) -> torch.Tensor:
    """ln s = log1p(s - 1) of rows whose exp(z - max) sum to s, s - 1 = `rest` summed without one maximum's own 1;
    NaN where the row's max is at the NEG_BIG floor (every logit -inf: no distribution, as log_softmax gives)."""
    return torch.where(row_max > NEG_BIG, rest.log1p(), float("nan"))


def transformed_(buffer, transform, out=None) -> torch.Tensor:
    """z = softcap(y * scale) / temperature, floored at NEG_BIG, in place when the buffer is fp32 / fp64 (else an
    fp32 copy, into out when given)."""
    dtype = accumulation_dtype(buffer.dtype)
    if buffer.dtype == dtype:
        z = buffer
    else:
        z = buffer.to(dtype) if out is None else out.copy_(buffer)
    if transform.scale != 1.0:
        z.mul_(transform.scale)
    if transform.softcap is not None:
        z.div_(transform.softcap).tanh_().mul_(transform.softcap)
    if transform.temperature != 1.0:
        z.div_(transform.temperature)
    return z.clamp_(min=NEG_BIG)


def row_blocks(buffer) -> list:
    """Slices of the buffer's rows: CPU_BLOCK_BYTES of fp32 logits each on a CPU, a BLOCKS_OFF_CPU-th of them
    elsewhere; at least 2 rows, and never a lone last row (a multi-threaded CPU reduces one row in another order
    than several)."""
    num_rows, vocab = buffer.shape
    if buffer.device.type == "cpu":
        step = max(2, CPU_BLOCK_BYTES // (4 * max(vocab, 1)))
    else:
        step = max(2, -(-num_rows // BLOCKS_OFF_CPU))
    starts = list(range(0, num_rows, step))
    if len(starts) > 1 and num_rows - starts[-1] == 1:
        starts.pop()
    return [slice(a, b) for a, b in zip(starts, starts[1:] + [num_rows])]


def block_scratch(buffer, blocks, count) -> list:
    """count fp32 (fp64 for fp64 buffers) temporaries of the largest block's shape, reused by every block."""
    rows = max((b.stop - b.start for b in blocks), default=0)
    dtype = accumulation_dtype(buffer.dtype)
    return list(torch.empty((count, rows, buffer.shape[1]), dtype=dtype, device=buffer.device)) if count else []


def holds_probs(buffer, transform) -> bool:
    # The probabilities replace z in the buffer when it holds fp32 / fp64 and dlogits_ needs no z: without a
    # soft-cap, the entropy's gradient takes log p in place of z - lse.
    return buffer.dtype == accumulation_dtype(buffer.dtype) and transform.softcap is None


def stats_(buffer, targets, transform, need_entropy, need_sum_pi_squared=False) -> ChunkState:
    """lse, logp and entropy relative to the row max m, with s = sum exp(z - m) and s - 1 summed without the
    max's own 1 (adding it would absorb a peaked row's small terms): lse = m + log1p(s - 1), logp = (z_t - m) -
    log1p(s - 1), H = log1p(s - 1) - sum p (z - m), each accurate to its own size (tested down to H = 1e-8;
    lse - sum p z loses all relative accuracy below about 1e-6 |m| in fp32). need_sum_pi_squared: also
    sum_v p_v^2 (the collision probability, in [1/V, 1]).

    A block of rows at a time (row_blocks). The buffer then holds p = softmax(z) when it is fp32 / fp64 and there
    is no soft-cap (holds_probs), else z (fp32 / fp64) or the logits as they came; dlogits_ reads them back."""
    num_rows = buffer.shape[0]
    dtype = accumulation_dtype(buffer.dtype)
    keeps_probs = holds_probs(buffer, transform)
    row_max = buffer.new_empty((num_rows, 1), dtype=dtype)
    sum_exp = torch.empty_like(row_max)
    lse, logp = buffer.new_empty((2, num_rows), dtype=dtype)
    entropy = torch.empty_like(lse) if need_entropy else None
    sum_pi_squared = torch.empty_like(lse) if need_sum_pi_squared else None
    blocks = row_blocks(buffer)
    scratch = block_scratch(buffer, blocks, 2 if keeps_probs else 3 if buffer.dtype == dtype else 4)
    for rows in blocks:
        n = rows.stop - rows.start
        z = transformed_(buffer[rows], transform, out=scratch[-1][:n] if buffer.dtype != dtype else None)
        m = z.amax(dim=-1, keepdim=True)
        target_logit = z.gather(1, targets[rows, None])
        shifted = torch.sub(z, m, out=scratch[0][:n])          # z - m <= 0
        probs = torch.exp(shifted, out=z if keeps_probs else scratch[2][:n])
        # s - 1: the terms off the max (-sign(z - m) is 1 there, 0 at the max), and a tie's other maxima (the
        # count is exact); no index of the max, whose reduction is not vectorized and costs as much as the exp
        below_max = torch.sign(shifted, out=scratch[1][:n])
        maxima_past_first = below_max.sum(dim=-1, keepdim=True).add_(buffer.shape[1] - 1)
        rest = below_max.mul_(probs).sum(dim=-1, keepdim=True).neg_().add_(maxima_past_first)
        torch.add(rest, 1.0, out=sum_exp[rows])
        probs.div_(sum_exp[rows])
        log_sum = log_sum_exp_shifted(m, rest)                # ln s
        row_max[rows] = m
        lse[rows] = (m + log_sum).squeeze(1)
        logp[rows] = (target_logit - m - log_sum).squeeze(1)
        if need_entropy:
            entropy[rows] = log_sum.squeeze(1) - shifted.mul_(probs).sum(-1)
        if need_sum_pi_squared:
            sum_pi_squared[rows] = torch.linalg.vecdot(probs, probs)
    return ChunkState(None, None, lse, logp, entropy, sum_pi_squared, row_max, sum_exp, keeps_probs)


def target_grad(g_logp, logp, target_probs, g_entropy, entropy):
    """dL/dz at each row's target: g (1 - p) - g_H p (logp + H), with 1 - p = -expm1(logp) (= s_rest / s when the
    target is the max). For a token the policy is sure of, 1 - p is below ulp(1): from p itself it would be 0 or
    off by the rounding of p, which is then the whole gradient of the row; from the log-prob it keeps its relative
    accuracy, and the row's gradients sum to 0. Elementwise over matching shapes."""
    grad = g_logp * -torch.expm1(logp)
    if g_entropy is not None:
        grad = grad - g_entropy * target_probs * (logp + entropy)
    return grad


def dlogits_(buffer, state, targets, g_logp, g_entropy, transform, owned=None) -> None:
    """buffer <- dL/dy = (g (onehot - p) - g_H p (z - lse + H)) * dz/dy, a block of rows at a time, the target's
    own term from its log-prob (target_grad).

    owned: (C,) bool, the rows whose target column lies in this buffer (a vocabulary slice that does not hold a
    row's target passes False, and its column targets[r] is then an ordinary one); None: every row. p and z come
    from the state when it keeps them whole, else from what stats_ left in the buffer: p itself (then p (z - lse) =
    p log p), or z, from which p is recomputed."""
    blocks = row_blocks(buffer)
    if state.holds_probs:
        scratch = block_scratch(buffer, blocks, 0 if g_entropy is None else 1)
    else:
        count = 3 if state.probs is None and buffer.dtype != accumulation_dtype(buffer.dtype) else 2
        scratch = block_scratch(buffer, blocks, count)
    for rows in blocks:
        g_entropy_rows = None if g_entropy is None else g_entropy[rows, None]
        args = (buffer[rows], state, rows, targets[rows, None], g_logp[rows, None], g_entropy_rows,
                None if owned is None else owned[rows, None], transform, [t[: rows.stop - rows.start] for t in scratch])
        (dlogits_from_probs_ if state.holds_probs else dlogits_from_logits_)(*args)


def _write_target_grad_(dz, state, rows, targets, target_probs, g_logp, g_entropy, owned) -> None:
    """dz[r, targets[r]] <- target_grad of the block's rows (where owned)."""
    entropy = None if g_entropy is None else state.entropy[rows, None]
    grad = target_grad(g_logp, state.logp[rows, None], target_probs, g_entropy, entropy)
    if owned is not None:
        grad = torch.where(owned, grad, dz.gather(1, targets))
    dz.scatter_(1, targets, grad)


def dlogits_from_probs_(out, state, rows, targets, g_logp, g_entropy, owned, transform, scratch) -> None:
    """dlogits_ of a block whose buffer rows hold p (no soft-cap): -p (g + g_H (log p + H)), the target's own."""
    probs = out
    target_probs = probs.gather(1, targets)
    if g_entropy is None:
        probs.mul_(-g_logp)
    else:
        # log p for z - lse: as accurate (to ulp(log p) where z - lse carries ulp(lse)); p = 0 reads as the
        # smallest normal number, whose finite log keeps 0 * log p at 0
        log_p = torch.clamp(probs, min=torch.finfo(probs.dtype).tiny, out=scratch[0]).log_()
        coef = log_p.add_(state.entropy[rows, None]).mul_(g_entropy).add_(g_logp)
        probs.mul_(coef).neg_()
    _write_target_grad_(probs, state, rows, targets, target_probs, g_logp, g_entropy, owned)
    if transform.scale / transform.temperature != 1.0:
        probs.mul_(transform.scale / transform.temperature)


def dlogits_from_logits_(out, state, rows, targets, g_logp, g_entropy, owned, transform, scratch) -> None:
    """dlogits_ of a block from z: the state's (vocabulary-parallel), the buffer's (fp32 / fp64) or the buffer's
    logits transformed again; p the state's, or exp(z - m) / s; the target's own term from its log-prob."""
    if state.probs is not None:
        z, probs = state.logits[rows], state.probs[rows]
    else:
        exact = out.dtype == accumulation_dtype(out.dtype)
        z, probs = (out if exact else transformed_(out, transform, out=scratch[2])), None
    coef = None
    if g_entropy is not None:
        coef = torch.sub(z, (state.lse - state.entropy)[rows, None], out=scratch[0]).mul_(g_entropy).add_(g_logp)
    factor = None
    if transform.softcap is not None:                      # d tanh = 1 - tanh^2, tanh = z * T / softcap
        factor = torch.mul(z, transform.temperature / transform.softcap, out=scratch[1]).square_().neg_().add_(1)
    if probs is None:                                      # z is spent: p takes its place
        probs = z.sub_(state.row_max[rows]).exp_().div_(state.sum_exp[rows])
    target_probs = probs.gather(1, targets)
    if coef is None:
        probs.mul_(-g_logp)
    else:
        probs.mul_(coef).neg_()
    _write_target_grad_(probs, state, rows, targets, target_probs, g_logp, g_entropy, owned)
    if factor is not None:
        probs.mul_(factor)
    if transform.scale / transform.temperature != 1.0:
        probs.mul_(transform.scale / transform.temperature)
    if probs is not out:
        out.copy_(probs)


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
    log_sum = log_sum_exp_shifted(row_max, rest)
    probs = (shifted - log_sum.index_select(0, rows)).exp_()
    is_target = cols == targets.index_select(0, rows)
    logp = stat.clone().index_add_(0, rows, torch.where(is_target, shifted, 0.0)) - log_sum
    entropy = (log_sum - stat.clone().index_add_(0, rows, probs * shifted)) if need_entropy else None
    sum_pi_squared = stat.clone().index_add_(0, rows, probs * probs) if need_sum_pi_squared else None
    return KeptState(rows, cols, is_target, z, probs, row_max + log_sum, logp, entropy, sum_pi_squared)


def kept_dlogits_(buffer, state: KeptState, g_logp, g_entropy, transform) -> None:
    """buffer <- dL/dy: (g 1[j = target] - p^S_j (g + g_H (z_j - lse_S + H_S))) dz/dy at the kept ids, 0 elsewhere
    (the tokens off the kept set do not enter the kept-set distribution); the target's own term from its log-prob
    (target_grad)."""
    rows, z = state.rows, state.logits
    g_rows = g_logp.index_select(0, rows)
    g_entropy_ids = entropy_ids = None
    if g_entropy is None:
        coef = g_rows
    else:
        g_entropy_ids, entropy_ids = g_entropy.index_select(0, rows), state.entropy.index_select(0, rows)
        centred = z - (state.lse - state.entropy).index_select(0, rows)
        coef = centred.mul_(g_entropy_ids).add_(g_rows)
    dz = state.probs * coef
    dz = torch.where(state.is_target, target_grad(g_rows, state.logp.index_select(0, rows), state.probs,
                                                  g_entropy_ids, entropy_ids), dz.neg_())
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
