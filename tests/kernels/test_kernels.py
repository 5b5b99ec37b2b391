"""The Triton kernels on their own, against the torch backend's passes (CPU interpreter without a GPU)."""

import pytest
import torch

from tests import gpu_arithmetic
from tests.helpers import DEVICE, assert_close

pytest.importorskip("triton")
pytestmark = pytest.mark.triton_path

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from grpo_fast.backends import torch_ops  # noqa: E402
from grpo_fast.kernels import dlogits_, logprob_forward  # noqa: E402
from grpo_fast.kernels.launch import compiled  # noqa: E402
from grpo_fast.kernels.transform import one_minus_exp, tanh  # noqa: E402
from grpo_fast.numerics import LogitTransform  # noqa: E402


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("vocab", [5, 2048, 4096 + 77])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=1.2, softcap=3.0, temperature=0.7)])
def test_kernels_match_torch_passes(dtype, rtol, vocab, transform):
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    g_logp = torch.randn(rows, generator=gen).to(DEVICE)
    g_entropy = torch.randn(rows, generator=gen).to(DEVICE)

    expected_buffer = logits.double()          # the torch passes in float64: the oracle
    state = torch_ops.stats_(expected_buffer, targets, transform, need_entropy=True)
    stats = logprob_forward(logits, targets, scale=transform.scale, temperature=transform.temperature,
                            softcap=transform.softcap)
    lse, logp, entropy = stats[:3]
    assert_close(lse, state.lse, rtol, name="lse")
    assert_close(logp, state.logp, rtol, atol=rtol, name="logp")
    assert_close(entropy, state.entropy, rtol, atol=rtol, name="entropy")

    torch_ops.dlogits_(expected_buffer, state, targets, g_logp.double(), g_entropy.double(), transform)
    poisoned = logits.clone()
    dlogits_(poisoned, targets, stats, g_logp, g_entropy=g_entropy, scale=transform.scale,
             temperature=transform.temperature, softcap=transform.softcap)
    assert_close(poisoned, expected_buffer, rtol, name="dlogits")

    _, logp_only, none, *_ = logprob_forward(logits, targets, compute_entropy=False, scale=transform.scale,
                                             temperature=transform.temperature, softcap=transform.softcap)
    assert none is None
    assert torch.equal(logp_only, logp)


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-5)])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(scale=1.2, softcap=3.0, temperature=0.7)])
def test_sum_pi_squared_over_tiles_and_kept_sets(dtype, rtol, transform):
    """sum_v p_v^2 of both stats kernels against float64, on rows whose max grows from tile to tile (the running
    sum is rescaled by alpha^2) and kept sets longer than one BLOCK_K tile; asking for it leaves the other outputs
    bit for bit as they were."""
    from grpo_fast.kernels import kept_logprob_forward

    gen = torch.Generator().manual_seed(7)
    rows, vocab = 4, 3 * 4096 + 77
    ramp = torch.linspace(0.0, 6.0, vocab)                         # the max moves into every later tile
    logits = (torch.randn(rows, vocab, generator=gen) + ramp * torch.tensor([0.0, 1.0, 2.0, 4.0])[:, None])
    logits = logits.to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    z = logits.double() * transform.scale
    if transform.softcap is not None:
        z = transform.softcap * torch.tanh(z / transform.softcap)
    probs = torch.softmax(z / transform.temperature, -1)
    kw = dict(scale=transform.scale, temperature=transform.temperature, softcap=transform.softcap)
    plain = logprob_forward(logits, targets, **kw)
    stats = logprob_forward(logits, targets, compute_sum_pi_squared=True, **kw)
    sum_pi_squared = stats.sum_pi_squared
    assert plain.sum_pi_squared is None
    assert all(torch.equal(a, b) for a, b in zip(stats, plain) if b is not None)
    assert_close(sum_pi_squared, probs.square().sum(-1), rtol, name="sum_pi_squared")

    kept = torch.rand(rows, vocab, generator=gen) < 0.1            # about 1200 ids a row: 5 tiles of 256
    kept[torch.arange(rows), targets.cpu()] = True
    ids = kept.nonzero()[:, 1].to(DEVICE)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), kept.sum(1).cumsum(0)]).to(DEVICE)
    kept_sum = kept_logprob_forward(logits, targets, ids, offsets, compute_sum_pi_squared=True, **kw).sum_pi_squared
    kept_probs = torch.softmax((z / transform.temperature).masked_fill(~kept.to(DEVICE), float("-inf")), -1)
    assert_close(kept_sum, kept_probs.square().sum(-1), rtol, name="kept sum_pi_squared")


def test_dlogits_without_entropy_gradient():
    logits = torch.randn(3, 100).to(DEVICE)
    targets = torch.tensor([0, 50, 99]).to(DEVICE)
    g_logp = torch.tensor([1.0, -2.0, 0.5]).to(DEVICE)
    stats = logprob_forward(logits, targets, compute_entropy=False)
    expected = g_logp[:, None] * (torch.nn.functional.one_hot(targets, 100) - logits.softmax(-1))
    dlogits_(logits, targets, stats, g_logp)
    assert_close(logits, expected, 1e-5)


POLICY_OPTIONS = [
    dict(loss_type="dapo"),
    dict(loss_type="dapo", epsilon_high=0.28, delta=1.3, beta=0.04),
    dict(loss_type="grpo", beta=0.1, use_bias_correction_kl=True),
    dict(loss_type="cispo", epsilon_high=1.5, beta=0.04),
    dict(loss_type="sapo", beta=0.02, use_bias_correction_kl=True),
    dict(loss_type="bnpo", delta=0.9),       # a cap below 1 + epsilon_high: the unclipped branch saturates
    # verl's clamps, tight enough to bind on part of the tokens: the log-ratios at +-0.3, the KL at 0.02
    dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, log_ratio_clamp=0.3, kl_clamp=0.02),
    dict(loss_type="sapo", beta=0.1, log_ratio_clamp=0.3, kl_clamp=0.02),
]


@pytest.mark.parametrize("options", POLICY_OPTIONS)
@pytest.mark.parametrize("on_policy", [False, True])
@pytest.mark.parametrize("with_is_ratio", [False, True])
def test_policy_grad_kernel_matches_autograd(options, on_policy, with_is_ratio):
    from grpo_fast.kernels import policy_grad
    from grpo_fast.variants import LossConfig, TokenTerms, token_loss_grad

    gen = torch.Generator().manual_seed(len(options) + 2 * on_policy + with_is_ratio)
    n = 1500                                            # more than one 1024-wide block, not a multiple of it
    logp = -torch.rand(n, generator=gen) * 5
    old = logp + 0.4 * torch.randn(n, generator=gen)
    old[:100] = logp[:100]                              # ratio exactly 1: ties inside the clip range
    # Ratios 1.2 (1 +- 1e-5), either side of the default upper boundary. Not on it: a GPU computes exp within 2 ulps
    # (ex2.approx), so which side of 1.2 a ratio of exactly 1.2 in float64 lands on, or whether its products with A
    # tie, is up to the last bits of the hardware's exp.
    old[100:200] = logp[100:200] - torch.log(torch.tensor(1.2)) - 1e-5 * (-1) ** torch.arange(100)
    advantages = torch.randn(n, generator=gen)
    advantages[200:250] = 0.0
    terms = TokenTerms(
        LossConfig(**options), advantages=advantages, weights=torch.rand(n, generator=gen) / n,
        old_logps=None if on_policy else old, ref_logps=logp + 0.3 * torch.randn(n, generator=gen),
        is_ratio=0.5 + torch.rand(n, generator=gen) if with_is_ratio else None,
    )
    terms = TokenTerms(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v) for k, v in vars(terms).items()})
    logp = logp.to(DEVICE)
    expected = token_loss_grad(logp.double(), TokenTerms(**{
        k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in vars(terms).items()}))
    actual = policy_grad(logp, terms)
    assert_close(actual, expected, 1e-5, atol=1e-9, name="dloss/dlogp")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_padded_rows_match_unpadded_and_keep_the_padding_out(dtype, softcap):
    """Rows padded to 16 elements (as chunked_pass allocates them) holding NaN in their padding: the results of a
    contiguous buffer to fp32 rounding (the two layouts read in different vector widths, so their sums run in
    different orders), the padding overwritten with zeros, nothing outside the rows touched."""
    from grpo_fast.kernels.launch import has_padding, padded_width

    gen = torch.Generator().manual_seed(3)
    rows, vocab = 5, 4096 + 77
    width = padded_width(vocab)
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE, dtype)
    storage = torch.full((rows + 1, width), float("nan"), dtype=dtype, device=DEVICE)
    padded = storage[:rows, :vocab]
    padded.copy_(logits)
    assert has_padding(padded) and not has_padding(logits)
    targets = torch.randint(0, vocab, (rows, 2), generator=gen).to(DEVICE)[:, 1]
    kw = dict(temperature=0.8, softcap=softcap)
    expected = logprob_forward(logits, targets.contiguous(), **kw)
    actual = logprob_forward(padded, targets, padded=True, **kw)
    for name in ("lse", "logp", "entropy", "row_max", "log_sum"):
        assert_close(getattr(actual, name), getattr(expected, name), 1e-6, name=name)
    g_logp, g_entropy = torch.randn(2, rows, generator=gen).to(DEVICE)
    dlogits_(logits, targets.contiguous(), expected, g_logp, g_entropy=g_entropy, **kw)
    dlogits_(padded, targets, expected, g_logp, g_entropy=g_entropy, padded=True, **kw)
    assert_close(padded, logits, 1e-6 if dtype == torch.float32 else 1e-3, name="dlogits")
    assert torch.all(storage[:rows, vocab:] == 0)
    assert torch.isnan(storage[rows]).all()                       # the row after the buffer is untouched


def test_a_single_row_view_does_not_own_the_next_row():
    """A (1, V) slice of a larger tensor is not followed by padding of its own: the next row belongs to the caller
    and a dlogits pass must leave it as it was (it zeroed its first columns when any 1-row view counted as
    padded)."""
    from grpo_fast.backends import triton_ops
    from grpo_fast.kernels.launch import has_padding

    vocab = 100                                                   # not a multiple of 16: 12 padding columns
    whole = torch.randn(3, vocab).to(DEVICE)
    before = whole.clone()
    row = whole[1:2]
    assert not has_padding(row)
    targets = torch.tensor([7]).to(DEVICE)
    state = triton_ops.stats_(row, targets, LogitTransform(), need_entropy=True)
    triton_ops.dlogits_(row, state, targets, torch.ones(1).to(DEVICE), None, LogitTransform())
    assert torch.equal(whole[2], before[2]) and torch.equal(whole[0], before[0])
    own = torch.empty(1, 112).to(DEVICE)[:, :vocab]               # a row with its padding allocated after it
    assert has_padding(own)


def test_launchers_run_on_the_tensors_device(monkeypatch):
    """Triton launches on the current CUDA device: every launcher makes it the logits' own."""
    import importlib
    from contextlib import nullcontext
    from types import SimpleNamespace

    from grpo_fast.kernels import launch, policy_grad
    from grpo_fast.variants import LossConfig, TokenTerms

    guard = launch.on_device(SimpleNamespace(is_cuda=True, device=torch.device("cuda", 1)))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1

    seen = []
    for name in ("logprob_forward", "dlogits", "policy_grad"):
        module = importlib.import_module(f"grpo_fast.kernels.{name}")
        monkeypatch.setattr(module, "on_device", lambda t: seen.append(t) or nullcontext())
    logits = torch.randn(3, 40).to(DEVICE)
    targets = torch.tensor([1, 2, 3]).to(DEVICE)
    stats = logprob_forward(logits, targets)
    dlogits_(logits, targets, stats, stats.logp)
    terms = TokenTerms(LossConfig(), advantages=torch.ones(3).to(DEVICE), weights=torch.ones(3).to(DEVICE))
    policy_grad(stats.logp, terms)
    assert [t is logits for t in seen[:2]] == [True, True] and seen[2] is not None and len(seen) == 3


def test_tanh_is_accurate_to_fp32_where_the_series_hands_over():
    """The soft-cap's tanh: max relative error 3e-7 over [-3, 3] with exact exp and division (the interpreter; was
    4.3e-7 with 1 - 2 / (e^2x + 1), whose cancellation is 5x on the negative side), 1.5e-6 with the GPU's
    approximate exp2 and division (2 ulp each, times the form's cancellation of 2.5 at the hand-over to the
    series: on a GPU and under --gpu-arithmetic); exactly +-1 far out, where e^2x overflows."""
    x = torch.cat([torch.linspace(-3, 3, 4001), torch.tensor([-1e4, -100.0, 100.0, 1e4])]).to(DEVICE)
    y = torch.empty_like(x)
    _tanh_kernel[(1,)](x, y, x.numel(), BLOCK=4096 * 2, COMPILED=compiled(_tanh_kernel))
    exact = torch.tanh(x.double())
    bound = 1.5e-6 if compiled(_tanh_kernel) or gpu_arithmetic.active() else 3e-7
    assert ((y.double() - exact).abs() / exact.abs().clamp(min=1e-30)).max() < bound
    assert y[-4:].tolist() == [-1.0, -1.0, 1.0, 1.0]


@triton.jit
def _tanh_kernel(X, Y, n, BLOCK: tl.constexpr, COMPILED: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tanh(tl.load(X + offs, mask=offs < n), COMPILED), mask=offs < n)


def test_one_minus_exp_keeps_relative_accuracy_near_zero():
    """1 - e^x, a sure token's 1 - p from its log-prob, to 1e-6 of its own size from x = -1e-30 to -30 (the series
    above -0.25, 1 - e^x below, where it is at least 0.22) under the interpreter's and the GPU's arithmetic: 1 - p
    from p itself would be 0 below x = -6e-8. -inf gives 1, NaN passes."""
    x = torch.cat([-torch.logspace(-30, 1.5, 4000), torch.tensor([-0.25, 0.0, float("-inf"), float("nan")])])
    x = x.to(DEVICE)
    y = torch.empty_like(x)
    _one_minus_exp_kernel[(1,)](x, y, x.numel(), BLOCK=4096)
    exact = -torch.expm1(x.double())
    relative = ((y.double() - exact).abs() / exact.abs().clamp(min=1e-300))[:-3]
    assert relative.max() < 1e-6, relative.max()
    assert y[-3:-1].tolist() == [0.0, 1.0] and torch.isnan(y[-1])


@triton.jit
def _one_minus_exp_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, one_minus_exp(tl.load(X + offs, mask=offs < n)), mask=offs < n)
