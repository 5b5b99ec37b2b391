"""dL/dlogits over each row's kept set, written over the logits buffer: the kept-set gradient at the kept ids and
zero everywhere else (the ids off the kept set do not enter the distribution the engine sampled from).

Reference (what it computes), with lse and entropy H from kept_logprob_forward and p = exp(z - lse) on S_r
(taken relative to the set's max, and the target's 1 - p from its log-prob, as in dlogits):
    dz[r, S_r] = g_logp[r] * (onehot(targets[r]) - p) - g_entropy[r] * p * (z - lse[r] + H[r])
    y[r, :] = 0;  y[r, S_r] = dz[r, S_r] * dz/dy
One program per row, in three phases separated by barriers (the row's own threads read and write it): the K
gradients into an fp32 scratch (the row still holds the logits they need), the zeroing of the row, the scatter of
the scratch into it. The row is written once and K logits are read: cheaper than the full dlogits pass.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.dlogits import grad_logits
from grpo_fast.kernels.launch import RowStats, compiled, load_width, negates, on_device, transform_constants
from grpo_fast.kernels.tuning import KEPT


@triton.jit
def _kept_dlogits_kernel(
    Logits, Targets, KeptIds, KeptOffsets, Scratch, RowMax, LogSum, Logp, Entropy, GradLogp, GradEntropy,
    V_LOAD, stride_row,
    in_scale, out_scale, grad_scale,
    # Meta-parameters
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEGATE: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    COMPILED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    target = tl.load(Targets + row)
    first = tl.load(KeptOffsets + row)
    last = tl.load(KeptOffsets + row + 1)
    for start in range(first, last, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        in_set = k < last
        ids = tl.load(KeptIds + k, mask=in_set, other=0)
        y = tl.load(row_ptr + ids, mask=in_set, other=0.0).to(tl.float32)
        dy = grad_logits(y, ids == target, row, RowMax, LogSum, Logp, Entropy, GradLogp, GradEntropy, in_scale,
                         out_scale, grad_scale, HAS_SOFTCAP, NEGATE, HAS_GRAD_ENTROPY, COMPILED)
        tl.store(Scratch + k, dy, mask=in_set)
    tl.debug_barrier()                  # every kept logit read before the row is cleared
    for start in range(0, V_LOAD, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        tl.store(row_ptr + cols, tl.zeros([BLOCK_V], Logits.dtype.element_ty), mask=cols < V_LOAD)
    tl.debug_barrier()                  # the zeros land before the gradients that overwrite some of them
    for start in range(first, last, BLOCK_K):
        k = start + tl.arange(0, BLOCK_K)
        in_set = k < last
        ids = tl.load(KeptIds + k, mask=in_set, other=0)
        dy = tl.load(Scratch + k, mask=in_set, other=0.0)
        tl.store(row_ptr + ids, dy.to(Logits.dtype.element_ty), mask=in_set)


def kept_dlogits_(logits, targets, kept_ids, kept_offsets, stats: RowStats, g_logp, *, g_entropy=None, scale=1.0,
                  temperature=1.0, softcap=None, padded=False):
    """Overwrites logits (C, V) with dL/dlogits over each row's kept set, as in the module docstring.

    logits, targets, kept_ids, kept_offsets: as in `kept_logprob_forward`; stats: its `RowStats` on the same
    logits, kept sets and transform (its entropy needed with g_entropy); g_logp, g_entropy (C,) fp32. padded: as
    in `logprob_forward` (the padding is zeroed too).
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert (g_entropy is None) or (stats.entropy is not None), "the entropy gradient needs the entropy"
    assert targets.shape == logits.shape[:1] and kept_offsets.shape == (logits.shape[0] + 1,)
    num_rows = logits.shape[0]
    if num_rows == 0:
        return logits
    has_grad_entropy = g_entropy is not None
    in_scale, out_scale, grad_scale = transform_constants(float(scale), float(temperature), softcap)
    scratch = torch.empty(kept_ids.numel(), dtype=torch.float32, device=logits.device)
    with on_device(logits):
        _kept_dlogits_kernel[(num_rows,)](
            logits, targets.contiguous(), kept_ids.contiguous(), kept_offsets.contiguous(), scratch,
            stats.row_max, stats.log_sum, stats.logp, stats.entropy if has_grad_entropy else stats.lse,
            g_logp.contiguous(), g_entropy.contiguous() if has_grad_entropy else g_logp,
            load_width(logits, padded), logits.stride(0),
            in_scale, out_scale, grad_scale,
            BLOCK_K=KEPT["BLOCK_K"],
            BLOCK_V=KEPT["BLOCK_V"],
            HAS_SOFTCAP=softcap is not None,
            NEGATE=negates(softcap, in_scale),
            HAS_GRAD_ENTROPY=has_grad_entropy,
            COMPILED=compiled(_kept_dlogits_kernel),
            num_warps=KEPT["num_warps"],
        )
    return logits
