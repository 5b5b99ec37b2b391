"""The GPU-arithmetic mode of Triton's interpreter (tests/gpu_arithmetic.py) computes as compiled code may: each
emulated difference checked on a kernel of one line, against the plain interpreter's numpy arithmetic. (Not run
under --gpu-arithmetic itself: it switches the mode on and off.)"""

import numpy as np
import pytest
import torch

from tests import gpu_arithmetic
from tests.helpers import DEVICE

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from grpo_fast.kernels.launch import compiled  # noqa: E402
from grpo_fast.kernels.transform import nan_max  # noqa: E402

N = 4096


@triton.jit
def _expressions_kernel(X, M, S, Out, n, WHICH: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    m = tl.load(M + offs, mask=offs < n)
    s = tl.load(S)
    if WHICH == 0:
        out = x * s - m * s                  # contracted to fma(x, s, -(m * s)) on a GPU
    elif WHICH == 1:
        out = (x - m) * s                    # exact at x == m under any rounding
    elif WHICH == 2:
        out = tl.maximum(x, m)               # maxNum on a GPU
    elif WHICH == 3:
        out = nan_max(x, m)                  # max.NaN
    elif WHICH == 4:
        out = tl.exp2(x)
    elif WHICH == 5:
        out = x / m
    else:
        out = tl.sum(x, axis=0) + tl.zeros_like(x)
    tl.store(Out + offs, out, mask=offs < n)


def evaluate(which, x, m, s=1.4426950408889634):
    if compiled(_expressions_kernel):
        pytest.skip("the interpreter's arithmetic: on a GPU the compiled code runs")
    out = torch.empty_like(x)
    _expressions_kernel[(1,)](x, m, torch.tensor([s], device=DEVICE), out, x.numel(), WHICH=which, BLOCK=N)
    return out


def inputs():
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(N, generator=gen) * 30).to(DEVICE)
    return x, x.clone()


def test_twin_products_differ_where_one_is_contracted():
    x, m = inputs()
    x[:64] = m[:64] = torch.linspace(-1e20, -2e20, 64)        # about the NEG_BIG floor
    assert (evaluate(0, x, m) == 0).all()       # the plain interpreter: two equal roundings
    with gpu_arithmetic.emulating("random"):
        residual = evaluate(0, x, m)
        exact = evaluate(1, x, m)
    assert (residual != 0).float().mean() > 0.2          # about half of the elements
    assert residual[:64].abs().max() > 1e12              # ulp(1.4e20) and more: exp2 of it is inf
    assert (exact == 0).all()


def test_directed_modes_round_every_operation_the_same_way():
    x = torch.full((N,), 1.0, device=DEVICE)
    m = torch.full((N,), 3.0, device=DEVICE)
    nearest = evaluate(5, x, m)
    with gpu_arithmetic.emulating("up"):
        up = evaluate(5, x, m)
    with gpu_arithmetic.emulating("down"):
        down = evaluate(5, x, m)
    assert (up > nearest).all() and (down < nearest).all()      # 1 / 3, 2 ulps either way
    assert ((up.double() - 1 / 3).abs() <= 2.5 * np.spacing(np.float32(1 / 3))).all()


def test_maxnum_drops_a_nan_and_nan_max_passes_it():
    """(Triton 3.6's interpreter propagates the NaN of a plain tl.maximum, 3.9's drops it: either way, here it is
    dropped, as on a GPU.)"""
    x, m = inputs()
    x[::2] = float("nan")
    with gpu_arithmetic.emulating("random"):
        dropped = evaluate(2, x, m)
        passed = evaluate(3, x, m)
    assert torch.equal(dropped[::2], m[::2])
    assert torch.isnan(passed[::2]).all() and torch.equal(passed[1::2], torch.maximum(x, m)[1::2])


def test_exp2_is_approximate_exact_at_integers_and_flushes_subnormals():
    gen = torch.Generator().manual_seed(1)
    x = (torch.rand(N, generator=gen) * 20 - 10).to(DEVICE)
    x[:8] = torch.tensor([0.0, 1.0, -3.0, 10.0, -126.5, -140.0, -149.0, 1e-40])
    with gpu_arithmetic.emulating("random"):
        approx = evaluate(4, x, x)
    exact = torch.exp2(x.double())
    ulps = ((approx.double() - exact) / torch.from_numpy(np.spacing(exact.float().cpu().numpy())).double()).abs()
    assert approx[:4].tolist() == [1.0, 2.0, 0.125, 1024.0] and approx[4:7].tolist() == [0.0, 0.0, 0.0]
    assert approx[7] == 1.0                                       # a subnormal input reads as 0
    assert ulps[8:].max() <= 2.5 and (ulps[8:] > 0.5).any()


def test_a_kernel_run_twice_agrees_with_itself_and_seeds_differ():
    x, m = inputs()
    with gpu_arithmetic.emulating("random", seed=1):
        first, second = evaluate(6, x, m), evaluate(6, x, m)
    with gpu_arithmetic.emulating("random", seed=2):
        other = evaluate(0, x, m * 1.0001)
    with gpu_arithmetic.emulating("random", seed=3):
        other_seed = evaluate(0, x, m * 1.0001)
    assert torch.equal(first, second)
    assert not torch.equal(other, other_seed)
    assert abs(first[0].item() - x.double().sum().item()) <= 1e-3 * x.abs().sum().item()


def test_the_plain_interpreter_returns_after_the_block():
    x = torch.full((N,), 1.0, device=DEVICE)
    m = torch.full((N,), 3.0, device=DEVICE)
    with gpu_arithmetic.emulating("up"):
        assert gpu_arithmetic.active()
    assert not gpu_arithmetic.active()
    assert torch.equal(evaluate(5, x, m), x / m)
