"""Fixtures and options; the shared helpers (and the switch to Triton's CPU interpreter) are in tests/helpers.py.

--gpu-arithmetic random|up|down   Triton's interpreter computes as compiled GPU code may (tests/gpu_arithmetic.py):
                                  contracted and approximate fp32 arithmetic, maxNum, approximate exp2 / division.
                                  Only the tests that run a Triton kernel are collected: those of a module marked
                                  `triton_path` and every test parametrized with backend "triton".
--gpu-arithmetic-seed N           the seed of the hash that picks each result's rounding
"""

import os

import pytest
import torch

from tests import gpu_arithmetic
from tests.helpers import BACKENDS, interpreter_numpy_problem


def pytest_addoption(parser):
    parser.addoption("--gpu-arithmetic", choices=gpu_arithmetic.MODES, default=None,
                     help="run the Triton-path tests with the GPU's fp32 arithmetic emulated in the interpreter")
    parser.addoption("--gpu-arithmetic-seed", type=int, default=0, help="seed of --gpu-arithmetic's coin flips")


def share_the_cores():
    """Under pytest-xdist each test process takes its share of the cores for torch's threads (and its subprocesses',
    through OMP_NUM_THREADS): two processes of two threads each on two cores run several times slower than two of
    one."""
    processes = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if processes > 1:
        threads = max(1, len(os.sched_getaffinity(0)) // processes)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


def pytest_configure(config):
    share_the_cores()
    problem = interpreter_numpy_problem()
    if problem:
        pytest.exit(problem, returncode=4)
    config.addinivalue_line("markers", "triton_path: every test of the module runs a Triton kernel")
    arithmetic = config.getoption("--gpu-arithmetic")
    if arithmetic is not None:
        gpu_arithmetic.install(arithmetic, config.getoption("--gpu-arithmetic-seed"))


def runs_triton(item) -> bool:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return params.get("backend") == "triton" or item.get_closest_marker("triton_path") is not None


def pytest_collection_modifyitems(config, items):
    if config.getoption("--gpu-arithmetic") is None:
        return
    runs = {item: runs_triton(item) for item in items}
    config.hook.pytest_deselected(items=[item for item in items if not runs[item]])
    items[:] = [item for item in items if runs[item]]


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param
