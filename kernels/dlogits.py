"""dL/dlogits written over the logits buffer, from per-row gradients of the log-prob and the entropy.

Reference (what it computes), with z = transform(y), p = softmax(z), lse and entropy H from logprob_forward:
    dz = g_logp[:, None] * (onehot(targets) - p) - g_entropy[:, None] * p * (z - lse[:, None] + H[:, None])
    y[:] = dz * dz/dy
Grid: rows on axis 0, vocabulary tiles on axis 1; each element is read once and written once.
"""

import triton
import triton.language as tl

from grpo_fast.kernels.transform import transform
from grpo_fast.kernels.tuning import DLOGITS


@triton.jit
def _dlogits_kernel(
    Logits, Targets, Lse, Entropy, GradLogp, GradEntropy,
    V, stride_row,
    scale, inv_temperature, softcap,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_GRAD_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_vocab = cols < V
    ptrs = Logits + row * stride_row + cols
    y = tl.load(ptrs, mask=in_vocab, other=0.0).to(tl.float32)
    z, dz_dy = transform(y, scale, inv_temperature, softcap, HAS_SOFTCAP)
    lse = tl.load(Lse + row)
    g_logp = tl.load(GradLogp + row)
    probs = tl.exp(z - lse)
    coef = g_logp + tl.zeros_like(z)
    if HAS_GRAD_ENTROPY:
        g_entropy = tl.load(GradEntropy + row)
        entropy = tl.load(Entropy + row)
        coef += g_entropy * (z - lse + entropy)
    target = tl.load(Targets + row)
    dz = tl.where(cols == target, g_logp, 0.0) - probs * coef
    tl.store(ptrs, (dz * dz_dy).to(Logits.dtype.element_ty), mask=in_vocab)


def dlogits_(logits, targets, lse, g_logp, *, entropy=None, g_entropy=None, scale=1.0, temperature=1.0,
             softcap=None):
    """Overwrites logits (C, V) with dL/dlogits. targets (C,) int; lse, g_logp, entropy, g_entropy (C,) fp32."""
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert (g_entropy is None) or (entropy is not None), "the entropy gradient needs the entropy"
    num_rows, vocab_size = logits.shape
    if num_rows == 0:
        return logits
    has_grad_entropy = g_entropy is not None
    grid = (num_rows, triton.cdiv(vocab_size, DLOGITS["BLOCK_V"]))
    _dlogits_kernel[grid](
        logits, targets, lse,
        entropy if has_grad_entropy else lse, g_logp, g_entropy if has_grad_entropy else g_logp,
        vocab_size, logits.stride(0),
        float(scale), 1.0 / float(temperature), float(softcap or 1.0),
        BLOCK_V=DLOGITS["BLOCK_V"],
        HAS_SOFTCAP=softcap is not None,
        HAS_GRAD_ENTROPY=has_grad_entropy,
        num_warps=DLOGITS["num_warps"],
    )
    return logits
