"""Row statistics over each row's kept set (the ids a top-k / top-p sampler kept), in one read of those logits.

Reference (what it computes), for y (C, V), targets (C,) and the CSR kept set (kept_ids, kept_offsets) of the C
rows, S_r = kept_ids[kept_offsets[r]:kept_offsets[r + 1]] holding targets[r]:
    z = transform(y.float());  z_S = z[r, S_r]
    lse = z_S.logsumexp(-1);  logp = z[r, targets[r]] - lse;  entropy = -(z_S.log_softmax(-1).exp() * ...).sum()
    sum_pi_squared = z_S.softmax(-1).square().sum()         # only when asked for
Only the K_r kept logits of a row are read (a gather from the chunk's logits buffer), so the cost is O(K), not
O(V). The running statistics are logprob_forward's (`_update` with one group), so peaked rows keep the same
relative accuracy, and the row's max and ln(1 + s_rest) are stored for the gradient pass (launch.RowStats); a
kept set whose logits are all -inf gives NaN, as the full pass does.

One program per row; its kept ids are walked in BLOCK_K tiles.
"""

import triton
import triton.language as tl

from grpo_fast.kernels.launch import RowStats, compiled, negates, on_device, transform_constants
from grpo_fast.kernels.logprob_forward import _pre_exp, _store_row_stats, _update, _z_scale
from grpo_fast.kernels.transform import LOG2E, NEG_BIG
from grpo_fast.kernels.tuning import KEPT


@triton.jit
def _kept_logprob_forward_kernel(
    Logits, Targets, KeptIds, KeptOffsets, Lse, Logp, Entropy, SumSq, RowMax, LogSum,
    stride_row,
    in_scale, out_scale,
    # Meta-parameters
    BLOCK_K: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEGATE: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    COMPUTE_SUM_SQ: tl.constexpr,
    COMPILED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    target = tl.load(Targets + row)
    y_target = tl.load(row_ptr + target).to(tl.float32)
    first = tl.load(KeptOffsets + row)
    last = tl.load(KeptOffsets + row + 1)
    z_scale = _z_scale(in_scale, out_scale, HAS_SOFTCAP, NEGATE)
    scale2 = z_scale * LOG2E
    group_max = tl.full([1], NEG_BIG, tl.float32)
    group_sum = tl.zeros([1], tl.float32)
    group_rest = tl.zeros([1], tl.float32)
    group_dot = tl.zeros([1], tl.float32)
    group_sq = tl.zeros([1], tl.float32)
    for start in range(first, last, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        in_set = k < last
        ids = tl.load(KeptIds + k, mask=in_set, other=0)
        y = tl.load(row_ptr + ids, mask=in_set, other=0.0).to(tl.float32)
        x = tl.where(in_set, _pre_exp(y, in_scale, HAS_SOFTCAP, NEGATE, COMPILED), NEG_BIG)
        group_max, group_sum, group_rest, group_dot, group_sq = _update(
            tl.reshape(x, [1, BLOCK_K]), group_max, group_sum, group_rest, group_dot, group_sq, scale2,
            COMPUTE_ENTROPY, COMPUTE_SUM_SQ)
    x_target = _pre_exp(y_target, in_scale, HAS_SOFTCAP, NEGATE, COMPILED)
    _store_row_stats(group_max, group_sum, group_rest, group_dot, group_sq, x_target, z_scale, scale2, row, Lse,
                     Logp, Entropy, SumSq, RowMax, LogSum, 1, COMPUTE_ENTROPY, COMPUTE_SUM_SQ)


def kept_logprob_forward(logits, targets, kept_ids, kept_offsets, *, scale=1.0, temperature=1.0, softcap=None,
                         compute_entropy=True, compute_sum_pi_squared=False) -> RowStats:
    """The statistics of each row of logits over its kept set, as in the module docstring: a `RowStats` (lse, logp,
    entropy, sum_pi_squared, row_max, log_sum), entropy and sum_pi_squared None unless asked for.

    logits: (C, V) fp32 / bf16 / fp16 with unit column stride (any row stride). targets: (C,) integer ids, each in
    its row's kept set. kept_ids (K,) int64 in [0, V), no id twice in a row; kept_offsets (C + 1,) int64 from 0,
    non-decreasing, every row K >= 1 (the caller checks: grpo_fast.kept.check_kept_set). Each output is (C,) fp32.
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert targets.shape == logits.shape[:1] and kept_offsets.shape == (logits.shape[0] + 1,)
    num_rows = logits.shape[0]
    stats = RowStats.empty(num_rows, logits.device, compute_entropy, compute_sum_pi_squared)
    if num_rows == 0:
        return stats
    in_scale, out_scale, _ = transform_constants(float(scale), float(temperature), softcap)
    with on_device(logits):
        _kept_logprob_forward_kernel[(num_rows,)](
            logits, targets.contiguous(), kept_ids.contiguous(), kept_offsets.contiguous(), *stats.pointers(),
            logits.stride(0),
            in_scale, out_scale,
            BLOCK_K=KEPT["BLOCK_K"],
            HAS_SOFTCAP=softcap is not None,
            NEGATE=negates(softcap, in_scale),
            COMPUTE_ENTROPY=compute_entropy,
            COMPUTE_SUM_SQ=compute_sum_pi_squared,
            COMPILED=compiled(_kept_logprob_forward_kernel),
            num_warps=KEPT["num_warps"],
        )
    return stats
