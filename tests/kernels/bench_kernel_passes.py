"""pytest-benchmark microbenchmarks of the chunk passes (outside the default test run).

python -m pytest tests/kernels/bench_kernel_passes.py --benchmark-only

One chunk of C tokens x V vocabulary: the logits GEMM, the stats pass (log-sum-exp, target log-prob, entropy),
the loss epilogue (d(loss)/d(logp)) and the dlogits pass, for each backend that runs here (Triton only on CUDA).
"""

import pytest
import torch

from grpo_fast import backends
from grpo_fast.numerics import LogitTransform
from grpo_fast.variants import LossConfig, TokenTerms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32
CHUNK, HIDDEN, VOCAB = (4096, 3584, 152064) if DEVICE == "cuda" else (256, 512, 32768)
BACKENDS = ["torch"] + (["triton"] if DEVICE == "cuda" and backends.triton_available() else [])
TRANSFORM = LogitTransform(scale=1.0, softcap=None, temperature=0.9)


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


@pytest.fixture(scope="module")
def chunk():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(CHUNK, HIDDEN, generator=gen).to(DEVICE, DTYPE)
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) / HIDDEN**0.5).to(DEVICE, DTYPE)
    targets = torch.randint(0, VOCAB, (CHUNK,), generator=gen).to(DEVICE)
    return hidden, weight, targets


def run(benchmark, fn):
    def timed():
        fn()
        sync()
    benchmark.pedantic(timed, rounds=5, warmup_rounds=1)


def test_logits_gemm(benchmark, chunk):
    hidden, weight, _ = chunk
    out = torch.empty(CHUNK, VOCAB, dtype=DTYPE, device=DEVICE)
    run(benchmark, lambda: torch.mm(hidden, weight.t(), out=out))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_pass(benchmark, chunk, backend):
    hidden, weight, targets = chunk
    ops = backends.resolve(backend, hidden.device)
    logits = hidden @ weight.t()
    buffer = torch.empty_like(logits)

    def step():
        buffer.copy_(logits)                       # the torch pass rewrites its buffer in place
        ops.stats_(buffer, targets, TRANSFORM, need_entropy=True)
    run(benchmark, step)


@pytest.mark.parametrize("backend", BACKENDS)
def test_policy_grad_epilogue(benchmark, backend):
    ops = backends.resolve(backend, torch.device(DEVICE))
    gen = torch.Generator().manual_seed(1)
    vectors = [torch.randn(CHUNK, generator=gen).to(DEVICE) for _ in range(4)]
    logp = -vectors[0].abs()
    terms = TokenTerms(LossConfig(beta=0.04, epsilon_high=0.28), advantages=vectors[1],
                       weights=torch.full((CHUNK,), 1.0 / CHUNK, device=DEVICE), old_logps=logp + 0.1 * vectors[2],
                       ref_logps=logp + 0.1 * vectors[3])
    run(benchmark, lambda: ops.policy_grad(logp, terms))


@pytest.mark.parametrize("backend", BACKENDS)
def test_stats_then_dlogits_pass(benchmark, chunk, backend):
    hidden, weight, targets = chunk
    ops = backends.resolve(backend, hidden.device)
    logits = hidden @ weight.t()
    buffer = torch.empty_like(logits)
    g_logp = torch.randn(CHUNK, device=DEVICE)

    def step():
        buffer.copy_(logits)
        state = ops.stats_(buffer, targets, TRANSFORM, need_entropy=True)
        ops.dlogits_(buffer, state, targets, g_logp, g_logp, TRANSFORM)
    run(benchmark, step)
