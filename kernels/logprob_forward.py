"""Row statistics of a logits buffer in one read: log-sum-exp, the target's log-prob, the entropy and sum_v p_v^2.

Reference (what it computes), for y (C, V) and targets (C,):
    z = transform(y.float());  lse = z.logsumexp(-1);  logp = z.gather(1, targets[:, None])[:, 0] - lse
    entropy = -(z.log_softmax(-1).exp() * z.log_softmax(-1)).sum(-1)
    sum_pi_squared = z.softmax(-1).square().sum(-1)        # only when asked for (verl's optimal token baseline)
Logits below -1e20 (a -inf bias on banned tokens) count as -1e20: probability 0, every output finite.

One program per row walks the vocabulary in BLOCK_V tiles. Each thread owns groups of GROUP contiguous columns
(one 16-byte vector) and keeps one running max per group, so the loop body is an in-thread max over the vector,
then per element one fused multiply-add, one exp2 and three accumulations, with no block-wide reduction per tile.
The work is in base 2 (log2(e) folded into the scale), with the statistics taken relative to the running max:
    s = sum 2^d,  s_rest = the same sum without the max itself,  t = sum 2^d * d,   d = (z - max) * log2(e) <= 0
so that lse = max + ln(1 + s_rest) and entropy = ln(1 + s_rest) - ln(2) t / s keep their relative accuracy when
the distribution is peaked (tested down to an entropy of 1e-8; lse - E[z] loses all relative accuracy below about
1e-6 |max z| in fp32). sum_v p_v^2 = q / s^2 with q = sum 4^d, one more running sum (compiled out unless asked).
The row's max and ln(1 + s_rest) are stored too: the gradient pass takes p relative to the max from them
(launch.RowStats). A row with no logit above -1e20 (every token banned) has no distribution: its lse, logp and
entropy are NaN, as torch.log_softmax gives for an all -inf row.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import (
    RowStats,
    aligned_rows,
    compiled,
    load_width,
    negates,
    on_device,
    transform_constants,
)
from grpo_fast.kernels.transform import LN2, LOG2E, NEG_BIG, log1p, nan_max, nan_min, tanh
from grpo_fast.kernels.tuning import LOGPROB_FORWARD


@triton.jit
def _pre_exp(y, in_scale, HAS_SOFTCAP: tl.constexpr, NEGATE: tl.constexpr, COMPILED: tl.constexpr):
    """x, increasing in z: z = x * out_scale (softcap) or x * |in_scale| with x = +-y, clamped at NEG_BIG."""
    if HAS_SOFTCAP:
        return tanh(y * in_scale, COMPILED)
    elif NEGATE:
        return nan_max(-y, NEG_BIG)
    else:
        return nan_max(y, NEG_BIG)


@triton.jit
def _z_scale(in_scale, out_scale, HAS_SOFTCAP: tl.constexpr, NEGATE: tl.constexpr):
    """dz/dx for the x of _pre_exp."""
    if HAS_SOFTCAP:
        return out_scale
    elif NEGATE:
        return -in_scale
    else:
        return in_scale


@triton.jit
def _load_whole_tile(row_ptr, start, groups: tl.constexpr, GROUP: tl.constexpr, BF16_PAIRS: tl.constexpr):
    """The (groups, GROUP) tile at columns [start, start + groups * GROUP) as fp32, in any order within a group.

    BF16_PAIRS: read bf16 as 32-bit words and widen each half with one shift or one mask (the generic
    conversion spends two instructions on the upper half); needs rows that start on 4-byte boundaries."""
    if BF16_PAIRS:
        words = row_ptr.to(tl.pointer_type(tl.uint32)) + start // 2
        offsets = tl.arange(0, groups)[:, None] * (GROUP // 2) + tl.arange(0, GROUP // 2)[None, :]
        w = tl.load(words + offsets)
        low = (w << 16).to(tl.float32, bitcast=True)
        high = (w & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.reshape(tl.join(low, high), [groups, GROUP])
    else:
        offsets = tl.arange(0, groups)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        return tl.load(row_ptr + start + offsets).to(tl.float32)


@triton.jit
def _update(x, group_max, group_sum, group_rest, group_dot, group_sq, scale2, COMPUTE_ENTROPY: tl.constexpr,
            COMPUTE_SUM_SQ: tl.constexpr):
    """Folds a (groups, GROUP) tile of x into each group's running (max, s, s_rest, t, q); scale2 = dz/dx *
    log2(e)."""
    new_max = tl.maximum(group_max, tl.max(x, axis=1))    # maxnum: a NaN in x reaches the sums through e below
    grows = group_max < new_max
    shift = (group_max - new_max) * scale2                     # exact: no fma (0 while the max stands)
    alpha = tl.exp2(shift)
    # Subtract, then scale: exactly 0 at the max, so its e is exactly 1 under any rounding. As x * scale2 -
    # new_max * scale2 this contracted to one fma, whose residual, up to ulp(NEG_BIG * scale2) = 8e12 in a group
    # holding only the NEG_BIG floor, made e = inf (and lse NaN) on a GPU.
    d = (x - new_max[:, None]) * scale2                        # exact: no fma
    e = tl.exp2(d)
    if COMPUTE_ENTROPY:
        group_dot = alpha * (group_dot + group_sum * shift) + tl.sum(e * d, axis=1)
    # s_rest leaves out the elements at the max (each exactly 1): adding them would absorb the small terms of a
    # peaked row. When the max grows, the whole old sum lies below the new one.
    group_rest = tl.where(grows, group_sum, group_rest) * alpha + tl.sum(tl.where(d < 0.0, e, 0.0), axis=1)
    group_sum = group_sum * alpha + tl.sum(e, axis=1)
    if COMPUTE_SUM_SQ:
        # alpha^2 may flush to 0: the old terms are then below 2^-126 of the new max's own 1
        group_sq = group_sq * (alpha * alpha) + tl.sum(e * e, axis=1)
    return new_max, group_sum, group_rest, group_dot, group_sq


@triton.jit
def _logprob_forward_kernel(
    Logits, Targets, Lse, Logp, Entropy, SumSq, RowMax, LogSum,
    V, V_LOAD, V_FULL, stride_row,
    in_scale, out_scale,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEGATE: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUM_SQ: tl.constexpr,
    BF16_PAIRS: tl.constexpr,
    COMPILED: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    target = tl.load(Targets + row)
    y_target = tl.load(row_ptr + target).to(tl.float32)     # issued early: its latency hides behind the loop
    z_scale = _z_scale(in_scale, out_scale, HAS_SOFTCAP, NEGATE)      # z = x * z_scale
    scale2 = z_scale * LOG2E                                  # exp(z - max) = 2^((x - max) * scale2)
    groups: tl.constexpr = BLOCK_V // GROUP
    group_max = tl.full([groups], NEG_BIG, tl.float32)
    group_sum = tl.zeros([groups], tl.float32)
    group_rest = tl.zeros([groups], tl.float32)
    group_dot = tl.zeros([groups], tl.float32)
    group_sq = tl.zeros([groups], tl.float32)
    # Whole tiles first, without masks; NUM_STAGES > 1 software-pipelines the loop (the next tiles are copied to
    # shared memory with cp.async while this one is used).
    for start in tl.range(0, V_FULL, BLOCK_V, num_stages=NUM_STAGES):
        y = _load_whole_tile(row_ptr, start, groups, GROUP, BF16_PAIRS)
        x = _pre_exp(y, in_scale, HAS_SOFTCAP, NEGATE, COMPILED)
        group_max, group_sum, group_rest, group_dot, group_sq = _update(
            x, group_max, group_sum, group_rest, group_dot, group_sq, scale2, COMPUTE_ENTROPY, COMPUTE_SUM_SQ)
    # The last, partial tile: V_LOAD >= V columns are readable (the padded row width when the caller owns the
    # padding, a multiple of 16: the loads stay 16-byte vectors); columns past V hold stale bits and are dropped.
    if V_FULL < V:
        cols = V_FULL + tl.arange(0, groups)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        y = tl.load(row_ptr + cols, mask=cols < V_LOAD, other=0.0).to(tl.float32)
        x = tl.where(cols < V, _pre_exp(y, in_scale, HAS_SOFTCAP, NEGATE, COMPILED), NEG_BIG)
        group_max, group_sum, group_rest, group_dot, group_sq = _update(
            x, group_max, group_sum, group_rest, group_dot, group_sq, scale2, COMPUTE_ENTROPY, COMPUTE_SUM_SQ)
    x_target = _pre_exp(y_target, in_scale, HAS_SOFTCAP, NEGATE, COMPILED)
    _store_row_stats(group_max, group_sum, group_rest, group_dot, group_sq, x_target, z_scale, scale2, row, Lse,
                     Logp, Entropy, SumSq, RowMax, LogSum, groups, COMPUTE_ENTROPY, COMPUTE_SUM_SQ)


@triton.jit
def _store_row_stats(group_max, group_sum, group_rest, group_dot, group_sq, x_target, z_scale, scale2, row, Lse,
                     Logp, Entropy, SumSq, RowMax, LogSum, groups: tl.constexpr, COMPUTE_ENTROPY: tl.constexpr,
                     COMPUTE_SUM_SQ: tl.constexpr):
    """Combines the groups' running statistics into the row's lse, target log-prob, entropy, sum p^2, max and
    ln(1 + s_rest), and stores them."""
    # Combine the groups relative to the row max. 1 + s_rest of the row: the rest of the first group holding the
    # max, plus its other elements at the max (ties: then s >= 2 and nothing is lost), plus every other group.
    row_max = tl.max(group_max, axis=0)                       # maxnum: group maxima are never NaN
    shift = (group_max - row_max) * scale2                    # exact: no fma (0 for the groups at the max)
    weight = tl.exp2(shift)                                   # groups that saw no column: 2^(NEG_BIG) = 0
    sum_exp = tl.sum(group_sum * weight, axis=0)
    index = tl.arange(0, groups)
    first = tl.min(tl.where(group_max == row_max, index, groups), axis=0)
    ties = tl.floor(group_sum - group_rest + 0.5) - 1.0      # an integer: both sums hold the same small terms
    sum_rest = tl.sum(tl.where(index == first, group_rest + ties, group_sum * weight), axis=0)
    # ln(sum exp(z - max)), accurate near 0. A row whose every x is at the NEG_BIG floor (all -inf: every token
    # banned) has no distribution: NaN, which every output below carries, as torch's log_softmax gives.
    has_logit = row_max > NEG_BIG
    log_sum = tl.where(has_logit, log1p(sum_rest), float("nan"))
    tl.store(RowMax + row, row_max)
    tl.store(LogSum + row, log_sum)
    tl.store(Lse + row, row_max * z_scale + log_sum)
    # x_target is the target's x evaluated apart from the loop's copy: min'd with the max, so that logp <= 0 even
    # if the compiler rounded the two evaluations differently (a NaN passes)
    tl.store(Logp + row, (nan_min(x_target, row_max) - row_max) * z_scale - log_sum)
    if COMPUTE_ENTROPY:
        # sum 2^d d relative to the row max; groups of weight 0 left out (their shift times their sum may be huge)
        dot = tl.sum(tl.where(weight > 0.0, weight * (group_dot + group_sum * shift), 0.0), axis=0)
        tl.store(Entropy + row, log_sum - LN2 * dot / sum_exp)
    if COMPUTE_SUM_SQ:
        # q / s^2: both sums relative to the row max, over the same terms
        sum_sq = tl.sum(group_sq * (weight * weight), axis=0)
        tl.store(SumSq + row, tl.where(has_logit, sum_sq / (sum_exp * sum_exp), float("nan")))


def logprob_forward(logits, targets, *, scale=1.0, temperature=1.0, softcap=None, compute_entropy=True,
                    padded=False, compute_sum_pi_squared=False) -> RowStats:
    """The statistics of each row of logits, as in the module docstring: a `RowStats` (lse, logp, entropy,
    sum_pi_squared, row_max, log_sum), entropy and sum_pi_squared None unless asked for.

    logits: (C, V) fp32 / bf16 / fp16 with unit column stride (any row stride).
    targets: (C,) integer ids in [0, V), any stride.
    padded: the columns between V and the row's padded width (V rounded up to 16) are scratch the kernel may
        read: rows stay 16-byte aligned and loads vectorized when V is not a multiple of 16.
    Each output is (C,) fp32.
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert targets.shape == logits.shape[:1] and targets.device == logits.device
    num_rows, vocab_size = logits.shape
    stats = RowStats.empty(num_rows, logits.device, compute_entropy, compute_sum_pi_squared)
    if num_rows == 0:
        return stats
    in_scale, out_scale, _ = transform_constants(float(scale), float(temperature), softcap)
    block = LOGPROB_FORWARD["BLOCK_V"]
    width = load_width(logits, padded)
    # A group is one 16-byte vector of a row. Rows off 16-byte boundaries are read element by element anyway, and
    # a group of 1 keeps each element's running max in its own thread (a wider one would need shuffles).
    group = 16 // logits.element_size() if aligned_rows(logits) else 1
    with on_device(logits):
        _logprob_forward_kernel[(num_rows,)](
            logits, targets.contiguous(), *stats.pointers(),
            vocab_size, width, vocab_size // block * block, logits.stride(0),
            in_scale, out_scale,
            BLOCK_V=block,
            GROUP=group,
            HAS_SOFTCAP=softcap is not None,
            NEGATE=negates(softcap, in_scale),
            BF16_PAIRS=group > 1 and logits.dtype == torch.bfloat16,
            COMPILED=compiled(_logprob_forward_kernel),
            COMPUTE_ENTROPY=compute_entropy,
            COMPUTE_SUM_SQ=compute_sum_pi_squared,
            NUM_STAGES=LOGPROB_FORWARD["num_stages"],
            num_warps=LOGPROB_FORWARD["num_warps"],
        )
    return stats
