"""Triton's CPU interpreter made to compute as compiled GPU code may, so that a kernel test that passes here holds
on a GPU too.

The interpreter computes numpy float32: every product, sum and quotient rounded to nearest, elementwise max / min
propagating NaN, exact exp2 / log2 / division, subnormals kept. Code compiled for sm_80 / sm_90 differs in four
ways, each emulated here on fp32 values (other dtypes are left as they are):

1. Contraction: LLVM fuses `a * b + c` into one fma.rn.f32, so a product may go unrounded. Here each fp32 sum,
   difference, product and fma is rounded to one of the two fp32 neighbours of its exact value (in mode "random"
   a hash picks one per element and per source position, see below; "up" / "down" always take the upper / lower
   one) instead of the nearer one. That covers every result a contracted expression can give, and then some;
   tl.sum's partial sums are rounded the same way, in a tree, as a GPU reduces.
2. maxNum: tl.maximum / tl.minimum without `propagate_nan=tl.PropagateNan.ALL` lower to max.f32 / min.f32, which
   return the other operand when one is NaN. Here they do the same (np.fmax / np.fmin), as does tl.clamp.
3. ex2.approx.ftz.f32 (tl.exp2) is within 2 ulp and flushes subnormal inputs and results to zero; tl.exp is
   ex2.approx.f32 of x * log2(e) rounded (subnormals kept). Here their results are moved by up to 2 ulp (exact
   where the exponent is an integer, as 2^0 = 1 is on the hardware), with those flushes. tl.log is libdevice's
   logf (1 ulp): rounded to either neighbour. tl.log2 is lg2.approx.f32: within 2 ulp, exact at powers of 2.
4. fp32 `/` lowers to div.full.f32 (2 ulp): quotients are moved by up to 2 ulp, exact only for a power-of-two
   divisor. (Kernels that ask for div.approx run the plain division here: the inline PTX cannot run on a CPU.)

Which neighbour, and how many ulps, is a hash of the operands, the seed and, for arithmetic, the kernel source
position that issued the operation: the same expression on the same operands always gives the same result, as
compiled code does (a kernel run twice agrees with itself), while twin expressions may differ, as a contracted
product and its uncontracted twin do. Mode "random" is the sharp one; "up" and "down" round every operation the
same way, which shows drift in long sums but not the residual of `x * s - m * s`.
`install(mode, seed)` patches the interpreter in this process (before or after the kernels are decorated: the
interpreter looks its operations up at each call); `emulating(mode, seed)` does so for a `with` block;
`reseed(seed)` changes the hash; `active()` says whether it is on. tests/conftest.py turns it on with
`--gpu-arithmetic MODE`.
"""

from __future__ import annotations

import contextlib
import os
import sys
import zlib

import numpy as np

MODES = ("random", "up", "down")
_STATE = {"mode": None, "seed": 0, "triton": None}
_F32 = np.float32
_TINY = np.float64(np.finfo(np.float32).tiny)      # 2^-126: below it a flushing unit reads and writes zero


def active() -> bool:
    """Whether the interpreter computes with the GPU's arithmetic in this process."""
    return _STATE["mode"] is not None


def reseed(seed: int) -> None:
    _STATE["seed"] = seed


@contextlib.contextmanager
def emulating(arithmetic: str, seed: int = 0):
    """Within the block the interpreter computes as compiled GPU code may (see install); after it, as before."""
    previous = {"mode": _STATE["mode"], "seed": _STATE["seed"]}
    install(arithmetic, seed)
    try:
        yield
    finally:
        _STATE.update(previous)


# ----------------------------------------------------------------------------------------------- rounding
# The coin of an arithmetic operation is a hash of its operands' bits, its kind, the kernel source position that
# issued it (file, line and column; a helper's own lines, whoever calls it) and the seed. Like compiled code, the
# same expression on the same operands gives the same result every time (a kernel run twice agrees with itself bit
# for bit), while two expressions computing the same value may round differently, as when one product is
# contracted into an fma and its twin is not (`x * s - m * s` at x == m). Approximate functions (exp2, exp, log,
# division) are functions of their operands alone, as the hardware units are.
_POSITIONS = {}


def _site() -> int:
    """The kernel source position (file name, line, column) of the operation being interpreted, as an integer: the
    file's name alone, not its path, so that a run's rounding is the same wherever the repository is checked out."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_STATE["triton"]) or
                                 frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return 0
    code = frame.f_code
    positions = _POSITIONS.get(code)
    if positions is None:
        positions = _POSITIONS[code] = list(code.co_positions())
    return zlib.crc32(f"{os.path.basename(code.co_filename)}:{positions[frame.f_lasti // 2]}".encode())


def _mix(h):
    """splitmix64's finalizer: every output bit depends on every input bit."""
    h = h ^ (h >> np.uint64(30))
    h = h * np.uint64(0xBF58476D1CE4E5B9)
    h = h ^ (h >> np.uint64(27))
    h = h * np.uint64(0x94D049BB133111EB)
    return h ^ (h >> np.uint64(31))


def operand_hash(kind: int, *operands, site: int = 0) -> np.ndarray:
    """A uint64 per element of the operands' broadcast shape. Not the element's position: on a GPU the same code
    gives the same result for the same value wherever it sits (the target's logit, read apart, and its copy in the
    loop, say). So a value repeated across a block (the NEG_BIG floor) meets one coin per seed and site, and CI
    runs several seeds."""
    with np.errstate(all="ignore"):
        h = _mix(np.uint64((_STATE["seed"] * 1000003 + kind * 65537 + site) & 0xFFFFFFFFFFFFFFFF))
        for operand in np.broadcast_arrays(*[np.asarray(x, dtype=_F32) for x in operands]):
            h = _mix(h ^ operand.view(np.uint32).astype(np.uint64))
    return np.asarray(h)


def round_faithfully(exact: np.ndarray, h: np.ndarray) -> np.ndarray:
    """fp32 results of float64 values: the nearest fp32 or the neighbour on the value's other side (mode "random":
    by the low bit of the hash h; "up" / "down": always the upper / lower one)."""
    exact = np.asarray(exact, dtype=np.float64)
    with np.errstate(all="ignore"):
        nearest = exact.astype(_F32)
        back = nearest.astype(np.float64)
    below, above = back < exact, back > exact           # False for exact results, NaN and matching infinities
    if _STATE["mode"] == "up":
        up, down = below, np.zeros_like(below)
    elif _STATE["mode"] == "down":
        up, down = np.zeros_like(above), above
    else:
        coin = (np.broadcast_to(h, exact.shape) & np.uint64(1)) == 1
        up, down = below & coin, above & coin
    out = np.where(up, np.nextafter(nearest, _F32(np.inf)), nearest)
    return np.where(down, np.nextafter(nearest, _F32(-np.inf)), out).astype(_F32)


def _ulps(h: np.ndarray, shape):
    """Whole ulps to move an approximate result by: in [-2, 2] ("random", from the hash), 2 ("up"), -2 ("down")."""
    if _STATE["mode"] == "up":
        return np.full(shape, 2)
    if _STATE["mode"] == "down":
        return np.full(shape, -2)
    return (np.broadcast_to(h, shape) >> np.uint64(1)) % np.uint64(5) - 2


def _move(values: np.ndarray, steps: np.ndarray, where: np.ndarray) -> np.ndarray:
    """values moved by `steps` ulps where `where` (never onto or off an infinity, never across zero)."""
    out = values.astype(_F32)
    steps = steps.astype(np.int64)
    for i in range(2):
        moved_up = np.nextafter(out, _F32(np.inf))
        moved_down = np.nextafter(out, _F32(-np.inf))
        out = np.where(where & (steps > i) & np.isfinite(moved_up) & (np.sign(moved_up) == np.sign(out)),
                       moved_up, out)
        out = np.where(where & (steps < -i) & np.isfinite(moved_down) & (np.sign(moved_down) == np.sign(out)),
                       moved_down, out)
    return out.astype(_F32)


def _approximate(exact: np.ndarray, exact_where: np.ndarray, h: np.ndarray) -> np.ndarray:
    """An approximate unit's fp32 result: the nearest fp32, moved by up to 2 ulps except where `exact_where`."""
    with np.errstate(all="ignore"):
        nearest = np.asarray(exact, dtype=np.float64).astype(_F32)
    movable = ~exact_where & np.isfinite(nearest) & (nearest != 0)
    return _move(nearest, _ulps(h, nearest.shape), movable)


def _flush(values: np.ndarray) -> np.ndarray:
    """Subnormals to (signed) zero, as .ftz instructions read and write them."""
    return np.where(np.abs(values) < _TINY, np.copysign(_F32(0), values), values).astype(_F32)


# ----------------------------------------------------------------------------------------------- operations
ADD, SUB, MUL, DIV, FMA, EXP2, EXP, LOG, LOG2, SUM = range(10)     # hash kinds


def add(a, b, site=0):
    return round_faithfully(a.astype(np.float64) + b, operand_hash(ADD, a, b, site=site))


def subtract(a, b, site=0):
    return round_faithfully(a.astype(np.float64) - b, operand_hash(SUB, a, b, site=site))


def multiply(a, b, site=0):
    return round_faithfully(a.astype(np.float64) * b, operand_hash(MUL, a, b, site=site))


def fma(a, b, c, site=0):
    return round_faithfully(a.astype(np.float64) * b + c, operand_hash(FMA, a, b, c, site=site))


def exp2_ftz(x: np.ndarray) -> np.ndarray:
    """ex2.approx.ftz.f32"""
    x = _flush(x)
    exact = np.exp2(x.astype(np.float64))
    return _flush(_approximate(exact, np.floor(x) == x, operand_hash(EXP2, x)))


def exp(x: np.ndarray) -> np.ndarray:
    """Triton's tl.exp on fp32: ex2.approx.f32 (no flush) of x * log2(e) rounded."""
    scaled = multiply(x, _F32(1.4426950408889634))
    exact = np.exp2(scaled.astype(np.float64))
    return _approximate(exact, np.floor(scaled) == scaled, operand_hash(EXP, x))


def log(x: np.ndarray) -> np.ndarray:
    """libdevice logf: within 1 ulp."""
    return round_faithfully(np.log(x.astype(np.float64)), operand_hash(LOG, x))


def log2(x: np.ndarray) -> np.ndarray:
    """lg2.approx.f32"""
    mantissa, _ = np.frexp(x)
    return _approximate(np.log2(x.astype(np.float64)), np.abs(mantissa) == 0.5, operand_hash(LOG2, x))


def divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """div.full.f32: within 2 ulp; exact for a power-of-two divisor."""
    exact = a.astype(np.float64) / b.astype(np.float64)
    mantissa, _ = np.frexp(b)
    exact_where = np.broadcast_to(np.abs(mantissa) == 0.5, np.shape(exact))
    return _approximate(exact, exact_where, operand_hash(DIV, a, b))


def tree_sum(data: np.ndarray, axis, keep_dims: bool, site=0):
    """fp32 sum along `axis` in a binary tree of faithfully rounded additions (a GPU's reduction order)."""
    values = data.reshape(-1) if axis is None else np.moveaxis(data, axis, -1)
    values = values.astype(_F32)
    while values.shape[-1] > 1:
        if values.shape[-1] % 2:
            values = np.concatenate([values, np.zeros(values.shape[:-1] + (1,), _F32)], axis=-1)
        half = values.shape[-1] // 2
        low, high = values[..., :half], values[..., half:]
        values = round_faithfully(low.astype(np.float64) + high, operand_hash(SUM, low, high, site=site))
    total = values[..., 0] if values.shape[-1] else np.zeros(values.shape[:-1], _F32)
    if keep_dims:
        total = np.expand_dims(total, axis) if axis is not None else total.reshape((1,) * data.ndim)
    return total


# ------------------------------------------------------------------------------------------------ patching
def _emulated(*handles) -> bool:
    """Whether the GPU arithmetic applies: on, and every operand fp32 (else the interpreter's own operation runs)."""
    return _STATE["mode"] is not None and all(h.data.dtype == _F32 for h in handles)


def install(arithmetic: str, seed: int = 0) -> None:
    """Make Triton's interpreter compute as compiled GPU code may (mode "random", "up" or "down"), from now on in
    this process."""
    if arithmetic not in MODES:
        raise ValueError(f"gpu arithmetic mode must be one of {MODES}, got {arithmetic!r}")
    import triton
    from triton.runtime import interpreter

    _STATE["triton"] = os.path.dirname(triton.__file__)

    builder, reduce_ops, handle = interpreter.InterpreterBuilder, interpreter.ReduceOps, interpreter.TensorHandle
    _STATE["mode"] = arithmetic
    reseed(seed)
    if getattr(builder, "_gpu_arithmetic", False):
        return

    def patched(original, gpu_op, by_site):
        """The builder operation `original`, computing gpu_op on fp32 operands while the mode is on; arithmetic
        (by_site) also gets the source position that issued it."""
        def op(self, *args):
            if not _emulated(*args):
                return original(self, *args)
            with np.errstate(all="ignore"):
                data = [arg.data for arg in args]
                result = gpu_op(*data, site=_site()) if by_site else gpu_op(*data)
            return handle(result, args[0].dtype.scalar)
        return op

    operations = {"create_fadd": (add, True), "create_fsub": (subtract, True), "create_fmul": (multiply, True),
                  "create_fma": (fma, True), "create_fdiv": (divide, False), "create_maxnumf": (np.fmax, False),
                  "create_minnumf": (np.fmin, False), "create_exp2": (exp2_ftz, False), "create_exp": (exp, False),
                  "create_log": (log, False), "create_log2": (log2, False)}
    for name, (gpu_op, by_site) in operations.items():
        setattr(builder, name, patched(getattr(builder, name), gpu_op, by_site))

    original_clamp = builder.create_clampf

    def create_clampf(self, arg, lo, hi, propagate_nans):
        import triton.language as tl

        if propagate_nans == tl.PropagateNan.ALL or not _emulated(arg, lo, hi):
            return original_clamp(self, arg, lo, hi, propagate_nans)
        return handle(np.fmin(np.fmax(arg.data, lo.data), hi.data), arg.dtype.scalar)

    original_sum = reduce_ops.sum

    def tree_sum_op(self, input):
        if not _emulated(input.handle):
            return original_sum(self, input)
        with np.errstate(all="ignore"):
            return self.to_tensor(tree_sum(input.handle.data, self.axis, self.keep_dims, site=_site()), input.dtype)

    builder.create_clampf, reduce_ops.sum = create_clampf, tree_sum_op
    builder._gpu_arithmetic = True
