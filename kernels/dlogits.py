"""dL/dlogits written over the logits buffer, from per-row gradients of the log-prob and the entropy.

Reference (what it computes), with z = transform(y), p = softmax(z), lse and entropy H from logprob_forward:
    dz = g_logp[:, None] * (onehot(targets) - p) - g_entropy[:, None] * p * (z - lse[:, None] + H[:, None])
    y[:] = dz * dz/dy
Grid: rows on axis 0, vocabulary tiles on axis 1; each element is read once and written once.
"""

import triton
import triton.language as tl

from grpo_fast.kernels.launch import load_width, on_device, transform_constants
from grpo_fast.kernels.transform import transform
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
    lse = tl.load(Lse + row)
    g_logp = tl.load(GradLogp + row)
    z, dz_dy = transform(y, in_scale, out_scale, grad_scale, HAS_SOFTCAP)
    probs = tl.exp(z - lse)
    coef = g_logp + tl.zeros_like(z)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(GradEntropy + row)
        entropy = tl.load(Entropy + row)
        coef += g_entropy * (z - lse + entropy)
    dz = tl.where(cols == target, g_logp, 0.0) - probs * coef
    dy = tl.where(in_vocab, dz * dz_dy, 0.0)
    tl.store(ptrs, dy.to(Logits.dtype.element_ty), mask=in_row)


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
            num_warps=DLOGITS["num_warps"],
        )
    return logits
