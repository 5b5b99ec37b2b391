"""Device helpers shared by the kernels: the soft-cap's tanh, a division without range checks, log1p, 1 - e^x, and
the base-2 constants of the streaming loops. The logit transform is z = softcap * tanh(y * scale / softcap) / T,
with its constants from launch.transform_constants."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)          # exp(x) = 2^(x * LOG2E)
LN2 = tl.constexpr(0.6931471805599453)
# Logits below NEG_BIG (-inf for banned tokens, finfo.min) count as NEG_BIG: 2^(NEG_BIG * scale - max) is 0 and
# 0 * NEG_BIG is 0, where -inf would give 0 * -inf = NaN in the entropy and the gradient. Small enough that no
# real logit reaches it, large enough that NEG_BIG * scale times a count of columns stays finite in fp32.
NEG_BIG = tl.constexpr(-1e20)


@triton.jit
def nan_max(a, b):
    """max(a, b), NaN if either is NaN (max.NaN.f32, one instruction on sm_80+). A clamp must pass a NaN on: plain
    tl.maximum compiles to max.f32 (IEEE maxNum), which returns the other operand, so a NaN logit would turn into a
    finite one on a GPU while Triton's interpreter and torch give NaN."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def nan_min(a, b):
    """min(a, b), NaN if either is NaN (min.NaN.f32): see nan_max."""
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def approx_div(a, b, COMPILED: tl.constexpr):
    """a / b within 2 ulp for |b| in [2^-126, 2^126]: a reciprocal and a multiply (div.approx), without the range
    checks of Triton's default division (div.full), which cost three instructions per element. Where nothing is
    compiled (Triton's CPU interpreter runs no PTX) it is the plain division."""
    if COMPILED:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)
    else:
        return a / b


@triton.jit
def tanh(x, COMPILED: tl.constexpr):
    # tl has no tanh on every Triton release. (e^2x - 1) / (e^2x + 1) cancels for small |x| (by e^2x / (e^2x - 1),
    # 2.5x at the hand-over), so below 0.25 the Taylor series to x^9 takes over (its next term is 1e-8 relative
    # there). Both forms are odd in x as written: no abs and sign restore. e^2x is capped at 2^64, where the ratio
    # is 1 in fp32, so that it never divides inf by inf. One exponential, one division per element.
    e = tl.exp2(nan_min(x * (2.0 * LOG2E), 64.0))
    big = approx_div(e - 1.0, e + 1.0, COMPILED)         # e + 1 in [1, 2^64 + 1]
    x2 = x * x
    small = x * (1.0 - x2 * (1.0 / 3.0 - x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0 - x2 * (62.0 / 2835.0)))))
    return tl.where(tl.abs(x) < 0.25, small, big)


@triton.jit
def log1p(x):
    """ln(1 + x) for fp32 x >= 0, to full relative accuracy near 0 (Goldberg's correction of the rounded 1 + x)."""
    u = 1.0 + x
    rounded = u - 1.0                                   # x as 1 + x kept it
    return tl.where(rounded == 0.0, x, tl.log(u) * (x / tl.where(rounded == 0.0, 1.0, rounded)))


@triton.jit
def one_minus_exp(x):
    """1 - e^x (-expm1(x)) for x <= 0, to full relative accuracy where it is small: a sure token's 1 - p from its
    log-prob, where 1 - exp(logp) would cancel to the rounding of p. Taylor's series above -0.25 (the first term
    left out is 1.5e-9 of the sum there), 1 - e^x below, where it is at least 0.22. NaN passes."""
    series = -x * (1.0 + x * (0.5 + x * (1.0 / 6.0 + x * (1.0 / 24.0 + x * (1.0 / 120.0 + x * (
        1.0 / 720.0 + x * (1.0 / 5040.0)))))))
    return tl.where(x > -0.25, series, 1.0 - tl.exp(x))
