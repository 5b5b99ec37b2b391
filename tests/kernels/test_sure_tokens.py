"""Gradients of tokens the policy is sure of, each row against its own float64 gradient.

Late in an RL run most sampled tokens stand 15-40 above the rest of their row: p = 1 - 1e-7 ... 1 - 1e-17, and
the target's gradient g (1 - p) is tiny. Taking p from the stored log-sum-exp (p = exp(z - lse)) gives 1 - p an
absolute error of about ulp(lse), 2e-6 at |lse| = 20, which for such a row *is* its whole gradient. So each row is
compared with its own float64 gradient here, never with a tolerance of the upstream g.

Through the public API (`token_logprobs(...)` and a backward), with an identity LM head: the hidden states are the
logits, so d(hidden) is dL/dlogits itself, and no GEMM rounding hides an error. Rows are peaked at z = 10 ... 40
(in units of the transformed logits z, so that temperature 0.05 gives the same rows), under T = 1 and 0.05, huge
logits (|z| ~ 1e4), a soft-cap, fp32 / bf16 / fp16 buffers and kept sets; run under `--gpu-arithmetic` too.
"""

import math

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import DEVICE, exact_token_grads

VOCAB = 4097                      # one 4096-wide tile and one column
PEAKS = [10.0, 15.0, 20.0, 25.0, 30.0, 40.0]
# Each row within this fraction of its own largest |gradient| (fp32 buffers), or of the buffer dtype's rounding.
ROW_RTOL = {torch.float32: 1e-3, torch.bfloat16: 1e-2, torch.float16: 2e-3}
CASES = {
    # name: (LogitTransform keywords, offset of every logit in z units)
    "T=1": (dict(), 0.0),
    "T=0.05": (dict(temperature=0.05), 0.0),
    "huge": (dict(), 1e4),
    "softcap": (dict(softcap=50.0, temperature=0.7), -5.0),
}


def peaked_logits(case, peaks, vocab=VOCAB, seed=0):
    """(rows, V) logits y whose transformed z = transform(y) are N(0, 1) + offset, with each row's target at
    `peak` above that: y is z taken back through the transform (atanh for the soft-cap, times T)."""
    options, offset = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    rows = len(peaks)
    z = torch.randn(rows, vocab, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    z[torch.arange(rows), targets] = torch.tensor(peaks, dtype=torch.float64)
    z = z + offset
    temperature, softcap = options.get("temperature", 1.0), options.get("softcap")
    y = z * temperature
    if softcap is not None:
        y = softcap * torch.atanh(y / softcap)
    return y, targets, gf.LogitTransform(**options)


def upstream(rows):
    """(g_logp, g_entropy), float64 (rows,): the loss's gradients with respect to each log-prob and entropy."""
    return torch.randn(2, rows, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


def gradients(y, targets, transform, dtype, backend, kept=None):
    """(d(hidden), logp) of sum(g * logp + g_H * entropy) through token_logprobs on the backend, with hidden = y in
    dtype and an identity head (so d(hidden) = dL/dlogits). float64 CPU tensors."""
    g_logp, g_entropy = upstream(y.shape[0])
    hidden = y.to(dtype).to(DEVICE).requires_grad_()
    if kept is not None:
        transform = gf.LogitTransform(temperature=transform.temperature, softcap=transform.softcap,
                                      kept=gf.KeptSet(kept.ids.to(DEVICE), kept.offsets.to(DEVICE)))
    logp, entropy = gf.token_logprobs(hidden, torch.eye(y.shape[1], dtype=dtype, device=DEVICE),
                                      targets.to(DEVICE), transform=transform, execution=gf.Execution(backend=backend),
                                      return_entropy=True)
    loss = (logp * g_logp.to(logp)).sum() + (entropy * g_entropy.to(entropy)).sum()
    (grad,) = torch.autograd.grad(loss, hidden)
    return grad.double().cpu(), logp.detach().double().cpu()


def kept_sets(targets, sizes, vocab, seed=4):
    """A KeptSet (CPU) of sizes[r] ids for row r, its target among them (in the middle)."""
    gen = torch.Generator().manual_seed(seed)
    rows_ids = []
    for row, size in enumerate(sizes):
        others = torch.randperm(vocab, generator=gen)
        others = others[others != targets[row]][: size - 1]
        rows_ids.append(torch.cat([others[: (size - 1) // 2], targets[row:row + 1], others[(size - 1) // 2:]]))
    return gf.KeptSet(torch.cat(rows_ids), torch.tensor([0] + sizes).cumsum(0))


def test_the_exact_reference_is_torchs_where_torch_is_exact():
    """The oracle above against torch's float64 autograd on rows where 1 - p is large enough for it (peaks up to 8,
    soft-cap and kept sets too): the same gradients to 1e-10 of each row's own size."""
    for case in ("T=0.05", "softcap"):
        y, targets, transform = peaked_logits(case, [0.0, 4.0, 8.0], vocab=300)
        kept = kept_sets(targets, [1, 20, 300], 300)
        for kept_set in (None, kept):
            hidden = y.clone().requires_grad_()
            kept_args = {} if kept_set is None else dict(kept_ids=kept_set.ids, kept_offsets=kept_set.offsets)
            logp, entropy = reference.token_logprobs(hidden, torch.eye(300, dtype=torch.float64), targets,
                                                     temperature=transform.temperature,
                                                     logit_softcap=transform.softcap, return_entropy=True,
                                                     **kept_args)
            g_logp, g_entropy = upstream(3)
            (expected,) = torch.autograd.grad((logp * g_logp).sum() + (entropy * g_entropy).sum(), hidden)
            actual, exact_logp = exact_token_grads(y, targets, transform, *upstream(3), kept_set)
            assert (row_errors(actual, expected, torch.float64) <= 1e-10).all(), (case, kept_set)
            assert torch.allclose(exact_logp, logp.detach(), rtol=1e-12, atol=0)


def row_errors(actual, expected, dtype):
    """max_j |actual - expected| / max_j |expected| per row; rows whose whole float64 gradient lies below the
    dtype's smallest normal number (exp(-40) at T = 0.05 is such a row in fp16) are measured against that."""
    scale = expected.abs().amax(1).clamp(min=torch.finfo(dtype).tiny)
    return (actual - expected).abs().amax(1) / scale


def assert_rows_exact(actual, expected, dtype, what):
    errors = row_errors(actual, expected, dtype)
    assert torch.isfinite(actual).all(), f"{what}: non-finite gradients"
    worst = int(errors.argmax())
    assert errors.max() <= ROW_RTOL[dtype], (
        f"{what}: row {worst} off by {errors[worst]:.2e} of its own largest gradient (per row: "
        + ", ".join(f"{e:.1e}" for e in errors.tolist()) + ")")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sure_tokens_get_their_float64_gradient(case, backend):
    """Rows peaked at z = 10 ... 40: each row's d(hidden) within 1e-3 of its own float64 gradient (was up to 1e4
    on the Triton path under GPU arithmetic, 1.4 on the torch backend), and its dlogits sum to 0 within fp32
    rounding of the row's own size (no soft-cap, where d(logits) = d(z) * scale / T)."""
    if backend == "triton":
        pytest.importorskip("triton")
    y, targets, transform = peaked_logits(case, PEAKS)
    expected, expected_logp = exact_token_grads(y.float(), targets, transform, *upstream(len(targets)))
    actual, logp = gradients(y, targets, transform, torch.float32, backend)
    assert_rows_exact(actual, expected, torch.float32, f"{case}/{backend}")
    # the log-prob of a sure token is -(1 - p) to first order: relative accuracy, not ulp(lse)
    assert ((logp - expected_logp).abs() <= 1e-4 * expected_logp.abs()).all(), (logp, expected_logp)
    if transform.softcap is None:
        imbalance = actual.sum(1).abs() / actual.abs().sum(1)
        assert imbalance.max() <= 1e-5, f"rows' dlogits sum to {imbalance.tolist()} of their size"


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sure_tokens_in_half_precision_buffers(dtype, backend):
    """bf16 / fp16 logits buffers: each row's gradient within the dtype's rounding of its own float64 gradient (of
    the rounded logits), at peaks up to where the row's gradient is a normal number of the dtype."""
    if backend == "triton":
        pytest.importorskip("triton")
    peaks = PEAKS if dtype == torch.bfloat16 else [8.0, 10.0, 12.0]
    y, targets, transform = peaked_logits("T=1", peaks, seed=2)
    # the float64 gradient of the same rounded logits, rounded to the buffer's dtype
    expected, _ = exact_token_grads(y.to(dtype), targets, transform, *upstream(len(targets)))
    actual, _ = gradients(y, targets, transform, dtype, backend)
    assert_rows_exact(actual, expected.to(dtype).double(), dtype, f"{dtype}/{backend}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", ["T=1", "T=0.05", "softcap"])
def test_sure_tokens_over_kept_sets(case, backend):
    """Kept sets of 1, 40 and 300 ids and the whole vocabulary, the target peaked within its set: the kept-set
    passes resolve 1 - p as the full ones do."""
    if backend == "triton":
        pytest.importorskip("triton")
    y, targets, transform = peaked_logits(case, [15.0, 20.0, 30.0, 40.0], seed=3)
    kept = kept_sets(targets, [1, 40, 300, VOCAB], VOCAB)
    expected, _ = exact_token_grads(y.float(), targets, transform, *upstream(len(targets)), kept)
    actual, _ = gradients(y, targets, transform, torch.float32, backend, kept)
    assert_rows_exact(actual, expected, torch.float32, f"kept/{case}/{backend}")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_an_all_minus_inf_row_is_not_a_finite_log_prob(backend):
    """A row (or a kept set) whose logits are all -inf (a bias of -inf bans every token) has no distribution:
    logp is NaN or -inf, as torch.log_softmax gives, never the finite -ln(count) of the floor; a kept set that holds
    a finite logit keeps its value."""
    if backend == "triton":
        pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(3, 300, generator=gen).to(DEVICE)
    weight = torch.eye(300).to(DEVICE)
    targets = torch.tensor([3, 5, 20]).to(DEVICE)
    execution = gf.Execution(backend=backend)
    banned = torch.full((300,), float("-inf"), device=DEVICE)
    logp = gf.token_logprobs(hidden, weight, targets, bias=banned, execution=execution)
    assert not torch.isfinite(logp).any(), logp
    # kept sets: row 0's ids all banned, row 1's a banned id beside its target, row 2's its target alone
    bias = torch.zeros(300, device=DEVICE)
    bias[:10] = float("-inf")
    kept = gf.KeptSet(torch.tensor([0, 1, 3, 4, 25, 20]).to(DEVICE), torch.tensor([0, 3, 5, 6]).to(DEVICE))
    logp = gf.token_logprobs(hidden, weight, torch.tensor([1, 25, 20]).to(DEVICE), bias=bias,
                             transform=gf.LogitTransform(kept=kept), execution=execution).cpu()
    assert not math.isfinite(logp[0]), logp
    assert math.isfinite(logp[1]) and logp[2] == 0.0, logp
