"""Row statistics of a logits buffer in one read: log-sum-exp, the target's log-prob and the entropy.

Reference (what it computes), for y (C, V) and targets (C,):
    z = transform(y.float());  lse = z.logsumexp(-1);  logp = z.gather(1, targets[:, None])[:, 0] - lse
    entropy = lse - (z.softmax(-1) * z).sum(-1)
One program per row walks the vocabulary in BLOCK_V tiles. Each lane of the tile keeps its own online
(max, sum exp, sum exp * z) and the lanes are combined once at the end, so the loop body is elementwise: no
block-wide reduction (and no barrier) per tile, and still one exponential per element.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import load_width, on_device, transform_constants
from grpo_fast.kernels.transform import transform
from grpo_fast.kernels.tuning import LOGPROB_FORWARD


@triton.jit
def _logprob_forward_kernel(
    Logits, Targets, Lse, Logp, Entropy,
    V, V_LOAD, stride_row,
    in_scale, out_scale,
    # Meta-parameters
    BLOCK_V: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_ENTROPY: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = Logits + row * stride_row
    target = tl.load(Targets + row)
    y_target = tl.load(row_ptr + target).to(tl.float32)     # issued early: its latency hides behind the loop
    lane_max = tl.full([BLOCK_V], -float("inf"), tl.float32)
    lane_sum = tl.zeros([BLOCK_V], tl.float32)
    lane_sum_z = tl.zeros([BLOCK_V], tl.float32)
    # V_LOAD >= V columns are readable (the padded row width when the caller owns the padding): a multiple of 16
    # keeps the mask, and so the loads, 16-byte vectors; columns past V are dropped by `valid`. NUM_STAGES > 1
    # software-pipelines the loop: the next tiles are copied to shared memory (cp.async) while this one is used.
    for start in tl.range(0, V_LOAD, BLOCK_V, num_stages=NUM_STAGES):
        cols = start + tl.arange(0, BLOCK_V)
        valid = cols < V
        y = tl.load(row_ptr + cols, mask=cols < V_LOAD, other=0.0).to(tl.float32)
        y = tl.where(valid, y, 0.0)                           # padding holds stale bits: keep them out of the math
        z, _ = transform(y, in_scale, out_scale, 1.0, HAS_SOFTCAP)
        # Whichever of (lane max, z) is smaller gets the factor exp(-|z - max|): one exponential per element.
        # A lane's first value meets max = -inf: the factor is exp(-inf) = 0 and the sum restarts at 1.
        factor = tl.exp(-tl.abs(z - lane_max))
        grows = z > lane_max
        lane_sum = tl.where(valid, tl.where(grows, lane_sum * factor + 1.0, lane_sum + factor), lane_sum)
        if COMPUTE_ENTROPY:
            lane_sum_z = tl.where(valid, tl.where(grows, lane_sum_z * factor + z, lane_sum_z + factor * z),
                                  lane_sum_z)
        lane_max = tl.where(valid & grows, z, lane_max)
    row_max = tl.max(lane_max, axis=0)
    lane_weight = tl.exp(lane_max - row_max)                  # lanes that saw no column: exp(-inf) = 0
    sum_exp = tl.sum(lane_sum * lane_weight, axis=0)
    lse = row_max + tl.log(sum_exp)
    z_target, _ = transform(y_target, in_scale, out_scale, 1.0, HAS_SOFTCAP)
    tl.store(Lse + row, lse)
    tl.store(Logp + row, z_target - lse)
    if COMPUTE_ENTROPY:
        tl.store(Entropy + row, lse - tl.sum(lane_sum_z * lane_weight, axis=0) / sum_exp)


def logprob_forward(logits, targets, *, scale=1.0, temperature=1.0, softcap=None, compute_entropy=True,
                    padded=False):
    """(lse, logp, entropy) of each row of logits, as in the module docstring.

    logits: (C, V) fp32 / bf16 / fp16 with unit column stride (any row stride).
    targets: (C,) integer ids in [0, V), any stride.
    padded: the columns between V and the row's padded width (V rounded up to 16) are scratch the kernel may
        read: rows stay 16-byte aligned and loads vectorized when V is not a multiple of 16.
    Returns (lse, logp, entropy or None), each (C,) fp32.
    """
    assert logits.ndim == 2 and logits.stride(1) == 1, "logits must be (C, V) with contiguous rows"
    assert targets.shape == logits.shape[:1] and targets.device == logits.device
    num_rows, vocab_size = logits.shape
    lse = torch.empty(num_rows, dtype=torch.float32, device=logits.device)
    logp = torch.empty_like(lse)
    entropy = torch.empty_like(lse) if compute_entropy else lse  # unused pointer when not computed
    if num_rows == 0:
        return lse, logp, (entropy if compute_entropy else None)
    in_scale, out_scale, _ = transform_constants(float(scale), float(temperature), softcap)
    with on_device(logits):
        _logprob_forward_kernel[(num_rows,)](
            logits, targets.contiguous(), lse, logp, entropy,
            vocab_size, load_width(logits, padded), logits.stride(0),
            in_scale, out_scale,
            BLOCK_V=LOGPROB_FORWARD["BLOCK_V"],
            HAS_SOFTCAP=softcap is not None,
            COMPUTE_ENTROPY=compute_entropy,
            NUM_STAGES=LOGPROB_FORWARD["num_stages"],
            num_warps=LOGPROB_FORWARD["num_warps"],
        )
    return lse, logp, (entropy if compute_entropy else None)
