"""dL/dlogits written over the logits buffer, from per-row gradients of the log-prob and the entropy.

Reference (what it computes), with z = transform(y), p = softmax(z), lse and entropy H from logprob_forward:
    dz = g_logp[:, None] * (onehot(targets) - p) - g_entropy[:, None] * p * (z - lse[:, None] + H[:, None])
    y[:] = dz * dz/dy
Logits below -1e20 (a -inf bias on banned tokens) get a zero gradient, as their probability is 0.
Grid: rows on axis 0, vocabulary tiles on axis 1; each element is read once and written once.

Exact where the policy is sure: p is taken relative to the row's max, p = 2^((x - max) * dz/dx * log2(e) -
log_sum * log2(e)) with the max and log_sum = ln(sum exp(z - max)) of the stats pass, never from lse, whose
rounding (ulp(lse), 2e-6 at |lse| = 20) would be the whole gradient of a token of p = 1 - 1e-8. The target's own
term g (1 - p) takes 1 - p from the target's log-prob as 1 - e^logp (= s_rest / s when the target is the max), so
that it resolves below ulp(1) and each row's gradients sum to 0 to the rounding of their own size.
"""

import triton
import triton.language as tl

from grpo_fast.kernels.launch import RowStats, compiled, load_width, negates, on_device, transform_constants
from grpo_fast.kernels.logprob_forward import _pre_exp, _z_scale
from grpo_fast.kernels.transform import LN2, LOG2E, one_minus_exp
from grpo_fast.kernels.tuning import DLOGITS


@triton.jit
def _dlogits_kernel(
    Logits, Targets, RowMax, LogSum, Logp, Entropy, GradLogp, GradEntropy,
    V, V_LOAD, stride_row,
    in_scale, out_scale, grad_scale,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    NEGATE: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
    COMPILED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    # Columns in [V, V_LOAD) are the row's padding (scratch): read and written as zeros, so that the mask, and
    # with it the loads and stores, stay 16-byte vectors when V is not a multiple of 16.
    in_row = cols < V_LOAD
    ptrs = Logits + row * stride_row + cols
    in_vocab = cols < V
    y = tl.where(in_vocab, tl.load(ptrs, mask=in_row, other=0.0).to(tl.float32), 0.0)
    target = tl.load(Targets + row).to(tl.int32)         # a column: V < 2^31; int32 compares are cheaper
    dy = grad_logits(y, cols == target, row, RowMax, LogSum, Logp, Entropy, GradLogp, GradEntropy, in_scale,
                     out_scale, grad_scale, HAS_SOFTCAP, NEGATE, HAS_GRAD_ENTROPY, COMPILED)
    dy = tl.where(in_vocab, dy, 0.0)
    tl.store(ptrs, dy.to(Logits.dtype.element_ty), mask=in_row)


@triton.jit
def grad_logits(y, is_target, row, RowMax, LogSum, Logp, Entropy, GradLogp, GradEntropy, in_scale, out_scale,
                grad_scale, HAS_SOFTCAP: tl.constexpr, NEGATE: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr,
                COMPILED: tl.constexpr):
    """dL/dy at logits y (fp32) of row `row`: (g_logp 1[target] - p (g_logp + g_H (z - lse + H))) dz/dy, with p
    = exp(z - lse) over whatever set the stats were taken (the vocabulary, or a kept set)."""
    # dz/dy is a constant without a soft-cap: folded into the row's scalars, so that no element pays a multiply
    row_scale = 1.0 if HAS_SOFTCAP else grad_scale
    g_logp = tl.load(GradLogp + row) * row_scale
    # x as the stats pass saw it (floored at NEG_BIG: a -inf logit gives p = 0 and a finite coefficient below,
    # where 0 * -inf would be NaN); u = log2 p relative to the row's max, one fused multiply-add from x - max
    x = _pre_exp(y, in_scale, HAS_SOFTCAP, NEGATE, COMPILED)
    scale2 = _z_scale(in_scale, out_scale, HAS_SOFTCAP, NEGATE) * LOG2E
    u = (x - tl.load(RowMax + row)) * scale2 - tl.load(LogSum + row) * LOG2E
    probs = tl.exp2(u)
    # the target's g (1 - p), resolved below ulp(1) from its log-prob; every other column's -g p
    dz = tl.where(is_target, g_logp * one_minus_exp(tl.load(Logp + row)), probs * -g_logp)
    if HAS_GRAD_ENTROPY:
        # - p g_H (z - lse + H), with z - lse = u ln 2 (relative to the max too): one fused multiply-add per element
        g_entropy = tl.load(GradEntropy + row) * row_scale
        dz = dz - probs * (g_entropy * tl.load(Entropy + row) + (g_entropy * LN2) * u)
    if HAS_SOFTCAP:
        dz = dz * ((1.0 - x * x) * grad_scale)          # x = tanh(y * scale / softcap)
    return dz


def dlogits_(logits, targets, stats: RowStats, g_logp, *, g_entropy=None, scale=1.0, temperature=1.0, softcap=None,
             padded=False):
    """Overwrites logits (C, V) with dL/dlogits, as in the module docstring.

    logits: (C, V) fp32 / bf16 / fp16 with unit column stride. targets (C,) int, any stride. stats: the
    `RowStats` of logprob_forward on the same logits and transform (its entropy needed with g_entropy); g_logp,
    g_entropy (C,) fp32. padded: as in `logprob_forward`; the padding columns are overwritten with 0.
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert (g_entropy is None) or (stats.entropy is not None), "the entropy gradient needs the entropy"
    assert targets.shape == logits.shape[:1] and targets.device == logits.device
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    width = load_width(logits, padded)
    has_grad_entropy = g_entropy is not None
    in_scale, out_scale, grad_scale = transform_constants(float(scale), float(temperature), softcap)
    grid = (num_rows, triton.cdiv(width, DLOGITS["BLOCK_V"]))
    with on_device(logits):
        _dlogits_kernel[grid](
            logits, targets.contiguous(), stats.row_max, stats.log_sum, stats.logp,
            stats.entropy if has_grad_entropy else stats.lse, g_logp.contiguous(),
            g_entropy.contiguous() if has_grad_entropy else g_logp,
            vocab_size, width, logits.stride(0),
            in_scale, out_scale, grad_scale,
            BLOCK_V=DLOGITS["BLOCK_V"],
            HAS_SOFTCAP=softcap is not None,
            NEGATE=negates(softcap, in_scale),
            HAS_GRAD_ENTROPY=has_grad_entropy,
            COMPILED=compiled(_dlogits_kernel),
            num_warps=DLOGITS["num_warps"],
        )
    return logits
