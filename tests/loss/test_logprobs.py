"""token_logprobs against the full-logits reference: values, entropies and their gradients."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import DEVICE, assert_close, grouped


def inputs(dtype=torch.float32, shape=(3, 5), hidden_size=16, vocab=53, bias=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*shape, hidden_size, generator=gen).to(DEVICE, dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen) * 0.5).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, shape, generator=gen).to(DEVICE)
    b = (torch.randn(vocab, generator=gen) * 0.3).to(DEVICE, dtype) if bias else None
    return hidden, weight, targets, b


TRANSFORMS = [dict(), dict(temperature=0.6), dict(logit_scale=1.5, logit_softcap=4.0)]


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("shape", [(3, 5), (11,)])
def test_values_and_gradients(transform, shape, backend):
    hidden, weight, targets, bias = inputs(shape=shape, bias=True)
    grads_of = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp, entropy = gf.token_logprobs(grads_of[0], grads_of[1], targets, bias=grads_of[2], return_entropy=True,
                                      **grouped(backend=backend, **transform))
    assert logp.shape == entropy.shape == shape and logp.dtype == torch.float32
    ref_of = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    ref_logp, ref_entropy = reference.token_logprobs(ref_of[0], ref_of[1], targets, bias=ref_of[2],
                                                     return_entropy=True, **transform)
    assert_close(logp, ref_logp, 1e-5, name="logp")
    assert_close(entropy, ref_entropy, 1e-5, name="entropy")
    # A loss that weighs both outputs, so the entropy gradient is exercised as well.
    gen = torch.Generator().manual_seed(1)
    w_logp, w_entropy = torch.randn(shape, generator=gen).to(DEVICE), torch.randn(shape, generator=gen).to(DEVICE)
    grads = torch.autograd.grad((logp * w_logp).sum() + (entropy * w_entropy).sum(), grads_of)
    ref_grads = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_entropy * w_entropy).sum(), ref_of)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert g.dtype == torch.float32
        assert_close(g, r, 1e-5, atol=1e-7, name=f"d{name}")


def test_logprob_only_output(backend):
    hidden, weight, targets, _ = inputs()
    logp = gf.token_logprobs(hidden, weight, targets, **grouped(backend=backend))
    assert isinstance(logp, torch.Tensor)
    assert_close(logp, reference.token_logprobs(hidden.double(), weight.double(), targets), 1e-5)


def test_no_grad_keeps_nothing_for_backward(backend):
    hidden, weight, targets, _ = inputs()
    with torch.no_grad():
        logp = gf.token_logprobs(hidden.requires_grad_(), weight, targets, **grouped(backend=backend))
    assert logp.grad_fn is None


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gradcheck_float64_torch_backend(transform):
    hidden, weight, targets, bias = inputs(dtype=torch.float64, shape=(2, 3), hidden_size=4, vocab=7, bias=True)
    hidden, weight, bias = (t.requires_grad_() for t in (hidden, weight, bias))

    def logp_and_entropy(h, w, b):
        return gf.token_logprobs(h, w, targets, bias=b, return_entropy=True, **grouped(backend="torch", chunk_bytes=200,
                                                                                       **transform))

    assert torch.autograd.gradcheck(logp_and_entropy, (hidden, weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_return_fp32_logps(dtype, backend):
    hidden, weight, targets, _ = inputs(dtype=dtype, vocab=300, hidden_size=32)
    logp, entropy = gf.token_logprobs(hidden, weight, targets, return_entropy=True, **grouped(backend=backend))
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = reference.token_logprobs(hidden.double(), weight.double(), targets,
                                                     return_entropy=True)
    assert_close(logp, ref_logp, 2e-2, name="logp")
    assert_close(entropy, ref_entropy, 2e-2, name="entropy")


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_banned_tokens_with_a_minus_inf_bias(transform, backend):
    """A -inf bias on banned tokens: every output and gradient finite. Without a soft-cap the banned tokens have
    probability 0, so log-probs, entropies and gradients are those of the vocabulary without them (the Triton
    stats kernel gave NaN lse and log-probs, both backends a NaN entropy from 0 * -inf); with one, -inf is capped
    like any other logit, as in the reference."""
    hidden, weight, targets, bias = inputs(shape=(3, 5), bias=True, vocab=53)
    banned = torch.zeros(53, dtype=torch.bool, device=DEVICE)
    banned[[0, 5, 17, 18, 52]] = True
    targets = torch.where(banned[targets], 1, targets)            # banned tokens are never sampled
    bias = bias.masked_fill(banned, float("-inf"))
    ours = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    logp, entropy = gf.token_logprobs(ours[0], ours[1], targets, bias=ours[2], return_entropy=True,
                                      **grouped(backend=backend, **transform))
    gen = torch.Generator().manual_seed(2)
    w_logp, w_entropy = torch.randn(2, *targets.shape, generator=gen).to(DEVICE)
    grads = torch.autograd.grad((logp * w_logp).sum() + (entropy * w_entropy).sum(), ours)
    assert all(torch.isfinite(t).all() for t in (logp, entropy, *grads))
    softcap = "logit_softcap" in transform
    kept = torch.ones_like(banned) if softcap else ~banned
    ref_targets = torch.cumsum(kept.long(), 0)[targets] - 1                # the ids among the kept tokens
    ref = [hidden.double().requires_grad_(), weight[kept].double().requires_grad_(),
           bias[kept].double().requires_grad_()]
    ref_logp, ref_entropy = reference.token_logprobs(ref[0], ref[1], ref_targets, bias=ref[2], return_entropy=True,
                                                     **transform)
    ref_grads = torch.autograd.grad((ref_logp * w_logp).sum() + (ref_entropy * w_entropy).sum(), ref)
    assert_close(logp, ref_logp, 1e-5, name="logp")
    assert_close(entropy, ref_entropy, 1e-5, name="entropy")
    assert_close(grads[0], ref_grads[0], 1e-5, name="d hidden")
    for name, grad, ref_grad in (("d weight", grads[1], ref_grads[1]), ("d bias", grads[2], ref_grads[2])):
        assert_close(grad[kept], ref_grad, 1e-5, name=name)
        assert softcap or torch.all(grad[banned] == 0), name


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_peaked_distributions_keep_the_relative_accuracy_of_entropy_and_logp(temperature, backend):
    """Entropies from 1e-4 down to 1e-8 within 1e-3 relative of float64, and so the log-prob of the peak: fp32
    loses all relative accuracy of lse - E[z] below about 1e-6 |z_max| (here logits near 15). Rows with two equal
    peaks (entropy near ln 2) keep the ordinary accuracy."""
    gen = torch.Generator().manual_seed(4)
    rows, vocab = 24, 300
    gap = torch.linspace(16.0, 30.0, rows)[:, None] * temperature          # peak minus the others, in logits
    logits = 15.0 - gap + 0.5 * torch.randn(rows, vocab, generator=gen)
    peak = torch.randint(0, vocab, (rows,), generator=gen)
    logits[torch.arange(rows), peak] = 15.0
    logits[-2:, (peak[-2:] + 7) % vocab] = 15.0                            # two rows with a tie at the top
    hidden = torch.eye(rows).to(DEVICE)                                   # hidden @ weight.T = logits, exactly
    weight = logits.t().contiguous().to(DEVICE)
    targets = peak.to(DEVICE)
    logp, entropy = gf.token_logprobs(hidden, weight, targets, return_entropy=True, **grouped(temperature=temperature,
                                                                                              backend=backend))
    ref_logp, ref_entropy = reference.token_logprobs(hidden.double(), weight.double(), targets,
                                                     temperature=temperature, return_entropy=True)
    assert ref_entropy[:-2].min() < 1e-8 and ref_entropy[:-2].max() > 1e-4
    for name, ours, ref in (("entropy", entropy, ref_entropy), ("logp", logp, ref_logp)):
        relative = ((ours.double() - ref).abs() / ref.abs()).max().item()
        assert relative <= 1e-3, f"{name}: relative error {relative:.2e}"
