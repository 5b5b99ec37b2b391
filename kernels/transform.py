"""Device helpers shared by the kernels: the logit transform z = softcap * tanh(y * scale / softcap) / T."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # tl has no tanh on every Triton release; a series below 0.05 avoids the cancellation of 1 - 2 / (e^2x + 1).
    ax = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    x2 = ax * ax
    small = ax * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0)))
    t = tl.where(ax < 0.05, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def transform(y, scale, inv_temperature, softcap, HAS_SOFTCAP: tl.constexpr):
    """Returns (z, dz/dy) for fp32 y."""
    x = y * scale
    if HAS_SOFTCAP:
        t = tanh(x / softcap)
        z = softcap * t * inv_temperature
        dz_dy = (1.0 - t * t) * scale * inv_temperature
    else:
        z = x * inv_temperature
        dz_dy = scale * inv_temperature + tl.zeros_like(y)
    return z, dz_dy
