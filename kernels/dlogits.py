"""dL/dlogits written over the logits buffer, from per-row gradients of the log-prob and the entropy.

Reference (what it computes), with z = transform(y), p = softmax(z), lse and entropy H from logprob_forward:
    dz = g_logp[:, None] * (onehot(targets) - p) - g_entropy[:, None] * p * (z - lse[:, None] + H[:, None])
    y[:] = dz * dz/dy
Logits below -1e20 (a -inf bias on banned tokens) get a zero gradient, as their probability is 0.
Grid: rows on axis 0, vocabulary tiles on axis 1; each element is read once and written once.
"""

import triton
import triton.language as tl

from grpo_fast.kernels.launch import compiled, load_width, on_device, transform_constants
from grpo_fast.kernels.transform import LN2, LOG2E, NEG_BIG, nan_max, tanh
from grpo_fast.kernels.tuning import DLOGITS


@triton.jit
def _dlogits_kernel(
    Logits, Targets, Lse, Entropy, GradLogp, GradEntropy,
    V, V_LOAD, stride_row,
    in_scale, out_scale, grad_scale,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
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
    target = tl.load(Targets + row)
    dy = grad_logits(y, cols == target, row, Lse, Entropy, GradLogp, GradEntropy, in_scale, out_scale, grad_scale,
                     HAS_SOFTCAP, HAS_GRAD_ENTROPY, COMPILED)
    dy = tl.where(in_vocab, dy, 0.0)
    tl.store(ptrs, dy.to(Logits.dtype.element_ty), mask=in_row)


@triton.jit
def grad_logits(y, is_target, row, Lse, Entropy, GradLogp, GradEntropy, in_scale, out_scale, grad_scale,
                HAS_SOFTCAP: tl.constexpr, HAS_GRAD_ENTROPY: tl.constexpr, COMPILED: tl.constexpr):
    """dL/dy at logits y (fp32) of row `row`: (g_logp 1[target] - p (g_logp + g_H (z - lse + H))) dz/dy, with p
    = exp(z - lse) over whatever set lse was taken (the vocabulary, or a kept set)."""
    lse2 = tl.load(Lse + row) * LOG2E
    g_logp = tl.load(GradLogp + row)
    # In base 2: p = 2^u with u = (z - lse) * log2(e), one fused multiply-add from y. u is floored at NEG_BIG, so
    # that a -inf logit gives p = 0 and a finite coefficient below (0 * -inf would be NaN).
    if HAS_SOFTCAP:
        t = tanh(y * in_scale, COMPILED)
        u = t * (out_scale * LOG2E) - lse2
        dz_dy = (1.0 - t * t) * grad_scale
    else:
        u = y * (in_scale * LOG2E) - lse2
        dz_dy = grad_scale
    u = nan_max(u, NEG_BIG)
    probs = tl.exp2(u)
    if HAS_GRAD_ENTROPY:
        # g_logp + g_H (z - lse + H), with z - lse = u ln 2: one fused multiply-add per element
        g_entropy = tl.load(GradEntropy + row)
        coef = (g_logp + g_entropy * tl.load(Entropy + row)) + (g_entropy * LN2) * u
    else:
        coef = g_logp
    dz = tl.where(is_target, g_logp, 0.0) - probs * coef
    return dz * dz_dy


def dlogits_(logits, targets, lse, g_logp, *, entropy=None, g_entropy=None, scale=1.0, temperature=1.0,
             softcap=None, padded=False):
    """Overwrites logits (C, V) with dL/dlogits, as in the module docstring.

    logits: (C, V) fp32 / bf16 / fp16 with unit column stride. targets (C,) int, any stride; lse, g_logp,
    entropy, g_entropy (C,) fp32. padded: as in `logprob_forward`; the padding columns are overwritten with 0.
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert (g_entropy is None) or (entropy is not None), "the entropy gradient needs the entropy"
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
            logits, targets.contiguous(), lse.contiguous(),
            entropy.contiguous() if has_grad_entropy else lse, g_logp.contiguous(),
            g_entropy.contiguous() if has_grad_entropy else g_logp,
            vocab_size, width, logits.stride(0),
            in_scale, out_scale, grad_scale,
            BLOCK_V=DLOGITS["BLOCK_V"],
            HAS_SOFTCAP=softcap is not None,
            HAS_GRAD_ENTROPY=has_grad_entropy,
            COMPILED=compiled(_dlogits_kernel),
            num_warps=DLOGITS["num_warps"],
        )
    return logits
