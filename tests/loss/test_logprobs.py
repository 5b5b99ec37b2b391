"""token_logprobs against the full-logits reference: values, entropies and their gradients."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import DEVICE, assert_close


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
                                      backend=backend, **transform)
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
    logp = gf.token_logprobs(hidden, weight, targets, backend=backend)
    assert isinstance(logp, torch.Tensor)
    assert_close(logp, reference.token_logprobs(hidden.double(), weight.double(), targets), 1e-5)


def test_no_grad_keeps_nothing_for_backward(backend):
    hidden, weight, targets, _ = inputs()
    with torch.no_grad():
        logp = gf.token_logprobs(hidden.requires_grad_(), weight, targets, backend=backend)
    assert logp.grad_fn is None


@pytest.mark.parametrize("transform", TRANSFORMS)
def test_gradcheck_float64_torch_backend(transform):
    hidden, weight, targets, bias = inputs(dtype=torch.float64, shape=(2, 3), hidden_size=4, vocab=7, bias=True)
    hidden, weight, bias = (t.requires_grad_() for t in (hidden, weight, bias))

    def logp_and_entropy(h, w, b):
        return gf.token_logprobs(h, w, targets, bias=b, return_entropy=True, backend="torch", chunk_bytes=200,
                                 **transform)

    assert torch.autograd.gradcheck(logp_and_entropy, (hidden, weight, bias))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_inputs_return_fp32_logps(dtype, backend):
    hidden, weight, targets, _ = inputs(dtype=dtype, vocab=300, hidden_size=32)
    logp, entropy = gf.token_logprobs(hidden, weight, targets, return_entropy=True, backend=backend)
    assert logp.dtype == entropy.dtype == torch.float32
    ref_logp, ref_entropy = reference.token_logprobs(hidden.double(), weight.double(), targets,
                                                     return_entropy=True)
    assert_close(logp, ref_logp, 2e-2, name="logp")
    assert_close(entropy, ref_entropy, 2e-2, name="entropy")
