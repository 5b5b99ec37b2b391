"""Device helpers shared by the kernels: the logit transform z = softcap * tanh(y * scale / softcap) / T."""

import triton
import triton.language as tl


@triton.jit
def tanh(x):
    # tl has no tanh on every Triton release. 1 - 2 / (e^2x + 1) cancels for small x, so below 0.2 the Taylor
    # series to x^9 takes over (its next term is 1e-9 relative there). One exponential, one division per element.
    ax = tl.abs(x)
    big = 1.0 - 2.0 / (tl.exp(2.0 * ax) + 1.0)
    x2 = ax * ax
    small = ax * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0 - x2 * (62.0 / 2835.0)))))
    t = tl.where(ax < 0.2, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def transform(y, in_scale, out_scale, grad_scale, HAS_SOFTCAP: tl.constexpr):
    """Returns (z, dz/dy) for fp32 y; the constants come from launch.transform_constants (no divisions here).

    Without a soft-cap: z = y * in_scale, in_scale = scale / T. With one: z = tanh(y * in_scale) * out_scale,
    in_scale = scale / softcap, out_scale = softcap / T. Either way dz/dy = grad_scale * (1 - tanh^2).
    """
    if HAS_SOFTCAP:
        t = tanh(y * in_scale)
        z = t * out_scale
        dz_dy = (1.0 - t * t) * grad_scale
    else:
        z = y * in_scale
        dz_dy = grad_scale + tl.zeros_like(y)
    return z, dz_dy
