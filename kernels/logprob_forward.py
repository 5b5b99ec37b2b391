"""Row statistics of a logits buffer in one read: log-sum-exp, the target's log-prob and the entropy.

Reference (what it computes), for y (C, V) and targets (C,):
    z = transform(y.float());  lse = z.logsumexp(-1);  logp = z.gather(1, targets[:, None])[:, 0] - lse
    entropy = lse - (z.softmax(-1) * z).sum(-1)
One program per row walks the vocabulary in BLOCK_V tiles with an online (max, sum exp, sum exp * z).
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.transform import transform
from grpo_fast.kernels.tuning import LOGPROB_FORWARD


@triton.jit
def _logprob_forward_kernel(
    Logits, Targets, Lse, Logp, Entropy,
    V, stride_row,
    scale, inv_temperature, softcap,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    running_max = -float("inf")
    sum_exp = 0.0
    sum_exp_z = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        in_vocab = cols < V
        y = tl.load(row_ptr + cols, mask=in_vocab, other=0.0).to(tl.float32)
        z, _ = transform(y, scale, inv_temperature, softcap, HAS_SOFTCAP)
        z = tl.where(in_vocab, z, -float("inf"))
        new_max = tl.maximum(running_max, tl.max(z, axis=0))
        rescale = tl.exp(running_max - new_max)
        probs = tl.exp(z - new_max)
        sum_exp = sum_exp * rescale + tl.sum(probs, axis=0)
        if COMPUTE_ENTROPY:
            sum_exp_z = sum_exp_z * rescale + tl.sum(probs * tl.where(in_vocab, z, 0.0), axis=0)
        running_max = new_max
    lse = running_max + tl.log(sum_exp)
    target = tl.load(Targets + row)
    y_target = tl.load(row_ptr + target).to(tl.float32)
    z_target, _ = transform(y_target, scale, inv_temperature, softcap, HAS_SOFTCAP)
    tl.store(Lse + row, lse)
    tl.store(Logp + row, z_target - lse)
    if COMPUTE_ENTROPY:
        tl.store(Entropy + row, lse - sum_exp_z / sum_exp)


def logprob_forward(logits, targets, *, scale=1.0, temperature=1.0, softcap=None, compute_entropy=True):
    """logits (C, V) any float dtype, row-contiguous; targets (C,) int in [0, V).

    Returns (lse, logp, entropy or None), each (C,) fp32.
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert targets.shape == logits.shape[:1]
    num_rows, vocab_size = logits.shape
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if compute_entropy else lse  # unused pointer when not computed
    if num_rows > 0:
        _logprob_forward_kernel[(num_rows,)](
            logits, targets, lse, logp, entropy,
            vocab_size, logits.stride(0),
            float(scale), 1.0 / float(temperature), float(softcap or 1.0),
            BLOCK_V=LOGPROB_FORWARD["BLOCK_V"],
            HAS_SOFTCAP=softcap is not None,
            COMPUTE_ENTROPY=compute_entropy,
            num_warps=LOGPROB_FORWARD["num_warps"],
        )
    return lse, logp, (entropy if compute_entropy else None)
