"""The chunk passes of both backends against float64 on the inputs where GPU arithmetic once went wrong.

Each case is a bug that the plain interpreter could not show or that no test had a shape for:
- V below one 4096-wide tile (300, 1000): the stats loop's floor-only groups made exp2 = inf, lse NaN on a GPU;
- V in (4096k - 16, 4096k), not a multiple of 16 (4095, 8185): the padding was read as logits 0;
- a run of -inf logits at a tile's start (banned tokens), logits all below 0, peaked rows (entropy 1e-5 to 1e-8);
- a NaN logit: NaN out, as torch gives, where maxNum clamps gave finite numbers on a GPU;
- the soft-cap and temperature, fp32 / bf16 / fp16 buffers, padded and strided rows, kept sets.
Run them under `--gpu-arithmetic random|up|down` too (tests/gpu_arithmetic.py), as CI does.
"""

import pytest
import torch

from grpo_fast.backends import torch_ops
from grpo_fast.kept import KeptChunk
from grpo_fast.numerics import LogitTransform
from tests.helpers import BACKENDS, DEVICE, assert_close, grouped

pytest.importorskip("triton")

from grpo_fast.kernels.launch import padded_width  # noqa: E402

TRANSFORMS = {"plain": LogitTransform(), "softcap+T": LogitTransform(scale=1.2, softcap=30.0, temperature=0.7)}
POISON = 30.0               # in the padding: far above every logit, so that reading it as one shows
# dlogits' tolerance (of the largest |dlogits|) per transform. With the soft-cap a GPU's tanh is good to 1.5e-6
# relative (approximate exp2 and division, tests/kernels/test_kernels.py), which the cap (30) over the temperature
# (0.7) turns into up to 6e-5 absolute in z, and so relative in p; seen 1.1e-5 under --gpu-arithmetic.
DLOGITS_RTOL = {"plain": 1e-5, "softcap+T": 5e-5}


def assert_rows_close(actual, expected, rtol, name):
    """Each row within rtol of its own largest |expected|."""
    actual, expected = actual.double().cpu(), expected.double().cpu()
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    errors = (actual - expected).abs().amax(1) / expected.abs().amax(1)
    assert errors.max() <= rtol, f"{name}: rows off by {errors.tolist()} of their own size"


def ops_of(backend):
    from grpo_fast.backends import triton_ops

    return {"torch": torch_ops.OPS, "triton": triton_ops.OPS}[backend]


def make_logits(case, rows, vocab, gen):
    """(rows, V) fp32 logits and targets for one case."""
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    if case == "spread":
        logits = torch.randn(rows, vocab, generator=gen) * 3
    elif case == "below_zero":
        logits = torch.randn(rows, vocab, generator=gen) * 3 - 20
    elif case == "neg_inf_run":
        # 64 banned tokens at the start of the first tile (row 0) and of the last one (row 1); row 2 banned but for
        # its target and one other id
        logits = torch.randn(rows, vocab, generator=gen) * 3
        last_tile = (vocab - 1) // 4096 * 4096
        logits[0, :64] = float("-inf")
        logits[1, last_tile:last_tile + 64] = float("-inf")
        logits[2, :] = float("-inf")
        logits[2, vocab // 2], logits[2, vocab - 1] = 1.0, -2.0
        targets[:3] = torch.tensor([64, vocab - 1, vocab // 2])
    elif case == "peaked":
        # peak at 15, the rest `gap` lower: entropies from about 1e-5 down to below 1e-8
        gap = torch.linspace(16.0, 30.0, rows)[:, None]
        logits = 15.0 - gap + 0.5 * torch.randn(rows, vocab, generator=gen)
        logits[torch.arange(rows), targets] = 15.0
    else:
        raise ValueError(case)
    return logits, targets


def in_layout(logits, layout, dtype):
    """(rows, V) view of the logits in dtype: contiguous; padded (the row stride rounded up to 16 elements and the
    padding poisoned, as the chunk loop allocates: scratch a kernel may read and zero, never count as logits); or
    strided (a column slice of a wider tensor, whose next columns are the caller's and poisoned too)."""
    rows, vocab = logits.shape
    if layout == "contiguous":
        return logits.to(DEVICE, dtype).clone()
    width = -(-vocab // 16) * 16 if layout == "padded" else vocab + 40
    storage = torch.full((rows, width), POISON, dtype=dtype, device=DEVICE)
    storage[:, :vocab] = logits.to(dtype)
    return storage[:, :vocab]


def passes(backend, buffer, targets, transform, gen, kept=None):
    """(lse, logp, entropy, dlogits) of one chunk through a backend's stats and dlogits passes."""
    ops = ops_of(backend)
    vector_dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    g_logp, g_entropy = (torch.randn(2, buffer.shape[0], generator=gen) * 0.5).to(DEVICE, vector_dtype)
    state = ops.stats_(buffer, targets.to(DEVICE), transform, need_entropy=True, kept=kept)
    lse, logp, entropy = state.lse.clone(), state.logp.clone(), state.entropy.clone()
    ops.dlogits_(buffer, state, targets.to(DEVICE), g_logp, g_entropy, transform)
    return lse, logp, entropy, buffer


def float64_passes(logits, targets, transform, gen, kept=None):
    """The torch backend's passes on the same values in float64: the oracle."""
    return passes("torch", logits.double().to(DEVICE).clone(), targets, transform, gen, kept)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("case", ["spread", "below_zero", "neg_inf_run", "peaked"])
@pytest.mark.parametrize("vocab", [300, 1000, 4095, 8185])
def test_row_passes_against_float64(vocab, case, transform, backend):
    """lse, logp, entropy and dlogits of fp32 rows padded as the chunk loop pads them, within 1e-5 of float64 (of
    the largest value); logp <= 0; the padding never read as logits (it is zeroed by the dlogits pass)."""
    gen = torch.Generator().manual_seed(vocab + len(case))
    logits, targets = make_logits(case, 6, vocab, gen)
    buffer = in_layout(logits, "padded", torch.float32)
    expected = float64_passes(logits, targets, TRANSFORMS[transform], torch.Generator().manual_seed(1))
    actual = passes(backend, buffer, targets, TRANSFORMS[transform], torch.Generator().manual_seed(1))
    for name, a, e in zip(("lse", "logp", "entropy"), actual[:3], expected[:3]):
        assert_close(a, e, 1e-5, name=name)
    # each row to its own size: a peaked row's whole gradient is tiny (its p below 1e-8 but for the peak, whose
    # 1 - p is as small), and a tolerance of the upstream g would pass any answer there
    assert_rows_close(actual[3], expected[3], DLOGITS_RTOL[transform], name="dlogits")
    assert (actual[1] <= 0).all(), actual[1]
    storage = buffer.as_strided((buffer.shape[0], buffer.stride(0)), (buffer.stride(0), 1))
    if backend == "triton":
        assert (storage[:, vocab:] == 0).all()       # scratch, cleared
    if case == "peaked" and transform == "plain":
        # each row to its own size: the entropies (1e-5 to 1e-8) and the peak's log-prob (-s_rest)
        assert expected[2].max() > 1e-6 and expected[2].min() < 5e-8
        for name, a, e in (("entropy", actual[2], expected[2]), ("logp", actual[1], expected[1])):
            relative = ((a.double().cpu() - e.cpu()).abs() / e.cpu().abs()).max().item()
            assert relative <= 1e-3, f"{name}: relative error {relative:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["contiguous", "padded", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [1000, 4095])
def test_buffer_dtypes_and_layouts(vocab, dtype, layout, backend):
    """Every buffer dtype and row layout, logits below 0 and the soft-cap: the statistics of the rounded logits to
    fp32 accuracy (the reference reads the same rounded values), dlogits to the buffer dtype's rounding; a strided
    view's columns past the padded width (the caller's) left as they were: a row stride of at least the padded
    width makes the padding columns scratch (grpo_fast.kernels.launch.has_padding)."""
    gen = torch.Generator().manual_seed(vocab)
    logits, targets = make_logits("below_zero", 5, vocab, gen)
    buffer = in_layout(logits, layout, dtype)
    rounded = buffer.float().cpu()
    transform = TRANSFORMS["softcap+T"]
    expected = float64_passes(rounded, targets, transform, torch.Generator().manual_seed(2))
    actual = passes(backend, buffer, targets, transform, torch.Generator().manual_seed(2))
    for name, a, e in zip(("lse", "logp", "entropy"), actual[:3], expected[:3]):
        assert_close(a, e, 1e-5, name=name)
    rtol = {torch.float32: DLOGITS_RTOL["softcap+T"], torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert_close(actual[3], expected[3], rtol, name="dlogits")
    if layout == "strided":
        storage = buffer.as_strided((buffer.shape[0], buffer.stride(0)), (buffer.stride(0), 1))
        assert (storage[:, padded_width(vocab):] == POISON).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("vocab", [300, 4095])
def test_kept_sets_against_float64(vocab, transform, backend):
    """Kept sets of 1, 17, 259 (two 256-id blocks) and all V ids, one holding -inf logits, one row peaked."""
    gen = torch.Generator().manual_seed(vocab + 7)
    logits, targets = make_logits("spread", 4, vocab, gen)
    targets[0] = 100
    logits[0, :40] = float("-inf")
    logits[3] -= 25.0
    logits[3, targets[3]] = 15.0
    rows_ids = []
    for row, size in enumerate([min(vocab, 300), 1, 17, 259]):
        others = torch.randperm(vocab, generator=gen)
        others = others[others != targets[row]][:size - 1]
        rows_ids.append(torch.cat([others[: (size - 1) // 2], targets[row:row + 1], others[(size - 1) // 2:]]))
    offsets = torch.tensor([0] + [len(ids) for ids in rows_ids]).cumsum(0)
    kept = KeptChunk(torch.cat(rows_ids).to(DEVICE), offsets.to(DEVICE))
    buffer = in_layout(logits, "padded", torch.float32)
    expected = float64_passes(logits, targets, TRANSFORMS[transform], torch.Generator().manual_seed(3), kept)
    actual = passes(backend, buffer, targets, TRANSFORMS[transform], torch.Generator().manual_seed(3), kept)
    for name, a, e in zip(("lse", "logp", "entropy"), actual[:3], expected[:3]):
        assert_close(a, e, 1e-5, name=name)
    assert_close(actual[3], expected[3], DLOGITS_RTOL[transform], name="dlogits")
    assert (actual[1] <= 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("transform", sorted(TRANSFORMS))
@pytest.mark.parametrize("vocab", [300, 4095])
def test_a_nan_logit_makes_its_row_nan(vocab, transform, backend):
    """A NaN logit (a diverged run) gives NaN lse, logp, entropy and dlogits in its row, as torch does, and leaves
    the other rows as they were: on a GPU, maxNum clamps once turned it into a finite probability 0 (or +cap)."""
    gen = torch.Generator().manual_seed(vocab + 11)
    logits, targets = make_logits("spread", 4, vocab, gen)
    logits[1, (int(targets[1]) + 5) % vocab] = float("nan")
    logits[2, targets[2]] = float("nan")
    buffer = in_layout(logits, "padded", torch.float32)
    expected = float64_passes(logits, targets, TRANSFORMS[transform], torch.Generator().manual_seed(4))
    actual = passes(backend, buffer, targets, TRANSFORMS[transform], torch.Generator().manual_seed(4))
    for name, a, e in zip(("lse", "logp", "entropy", "dlogits"), actual, expected):
        a, e = a.double().cpu(), e.cpu()
        assert torch.isnan(a[1:3]).all() and torch.isnan(e[1:3]).all(), name
        assert_close(a[[0, 3]], e[[0, 3]], 1e-5, name=name)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("options", [
    dict(loss_type="dapo", beta=0.1, kl_clamp=0.02, delta=1.5),
    dict(loss_type="cispo", epsilon_high=1.5, beta=0.04),
    dict(loss_type="sapo", beta=0.1, kl_clamp=0.02),
    dict(loss_type="dapo", beta=0.1, use_bias_correction_kl=True, log_ratio_clamp=0.3, kl_clamp=0.02, delta=1.5),
])
def test_a_nan_log_prob_gives_a_nan_gradient(options, backend):
    """d(loss)/d(logp) of a NaN log-prob is NaN through the KL clamp, delta and CISPO's ratio cap, as the torch
    reference's; the other tokens keep theirs. Behind the log-ratio clamp torch's backward masks the gradient to 0
    (its value is still NaN, and so is the loss): there the kernel may give NaN or that 0, never another number
    (on a GPU maxNum once made it a finite gradient from a clamped ratio)."""
    from grpo_fast.variants import LossConfig, TokenTerms, token_loss_grad

    gen = torch.Generator().manual_seed(5)
    n = 40
    logp = -torch.rand(n, generator=gen) * 3
    terms = TokenTerms(LossConfig(**options), advantages=torch.randn(n, generator=gen),
                       weights=torch.rand(n, generator=gen) / n, old_logps=logp + 0.2 * torch.randn(n, generator=gen),
                       ref_logps=logp + 0.3 * torch.randn(n, generator=gen))
    logp[[3, 17]] = float("nan")
    expected = token_loss_grad(logp.double(), TokenTerms(**{
        k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in vars(terms).items()}))
    device_terms = TokenTerms(**{k: (v.to(DEVICE) if isinstance(v, torch.Tensor) else v)
                                 for k, v in vars(terms).items()})
    actual = ops_of(backend).policy_grad(logp.to(DEVICE), device_terms).double().cpu()
    nan = torch.zeros(n, dtype=torch.bool)
    nan[[3, 17]] = True
    assert torch.isnan(actual[torch.isnan(expected)]).all()
    assert (torch.isnan(actual[nan]) | (actual[nan] == expected[nan])).all(), (actual[nan], expected[nan])
    if options.get("log_ratio_clamp") is None:
        assert torch.isnan(expected[nan]).all()
    assert_close(actual[~nan], expected[~nan], 1e-5, name="dloss/dlogp")


def test_a_nan_bias_entry_makes_the_loss_and_its_gradients_nan(backend):
    """End to end: one NaN in the LM head's bias gives every token a NaN logit: loss and d(hidden) NaN on both
    backends (a GPU once gave finite ones)."""
    import grpo_fast as gf
    from tests.helpers import make_batch

    inputs = make_batch(vocab=300, bias=True, seed=6)
    inputs["bias"][7] = float("nan")
    inputs["hidden"].requires_grad_()
    loss, _ = gf.grpo_loss(**grouped(**inputs, beta=0.04, backend=backend))
    (grad,) = torch.autograd.grad(loss, inputs["hidden"])
    assert torch.isnan(loss)
    assert torch.isnan(grad[inputs["mask"]]).all()


def test_token_logprobs_at_a_vocabulary_just_below_a_tile(backend):
    """V = 4095 with every logit below 0, through the public API (its buffers padded to 4096): the padding was read
    as a logit 0, 4e-2 off in logp."""
    import grpo_fast as gf
    from grpo_fast import reference

    gen = torch.Generator().manual_seed(8)
    hidden = torch.randn(7, 32, generator=gen).to(DEVICE)
    weight = (torch.randn(4095, 32, generator=gen) * 0.3).to(DEVICE)
    bias = torch.full((4095,), -30.0).to(DEVICE)
    targets = torch.randint(0, 4095, (7,), generator=gen).to(DEVICE)
    logp, entropy = gf.token_logprobs(hidden, weight, targets, bias=bias, return_entropy=True,
                                      **grouped(backend=backend))
    ref_logp, ref_entropy = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double(),
                                                     return_entropy=True)
    assert_close(logp, ref_logp, 1e-5, name="logp")
    assert_close(entropy, ref_entropy, 1e-5, name="entropy")


def test_both_backends_floor_logits_at_the_same_value():
    from grpo_fast.kernels.transform import NEG_BIG

    assert NEG_BIG.value == torch_ops.NEG_BIG
