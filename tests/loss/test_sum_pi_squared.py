"""token_logprobs' sum_v p_v^2 (return_sum_pi_squared): equal to the float64 full-logits value on both backends,
over several chunks, every logit transform, kept sets, peaked and flat rows and banned (-inf) tokens; asking for
it changes neither the other outputs nor their gradients, and it carries no gradient of its own."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import DEVICE, assert_close, grouped
from tests.loss.test_kept import kept_sets
from tests.loss.test_logprobs import TRANSFORMS, inputs


@pytest.mark.parametrize("transform", TRANSFORMS)
@pytest.mark.parametrize("with_entropy", [True, False], ids=["with entropy", "alone"])
def test_sum_pi_squared_equals_float64(transform, with_entropy, backend):
    hidden, weight, targets, bias = inputs(shape=(4, 9), vocab=300, hidden_size=32, bias=True)
    hidden = hidden * torch.linspace(0.05, 3.0, 9, device=DEVICE)[:, None]     # rows from flat to peaked
    ours = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    out = gf.token_logprobs(ours[0], ours[1], targets, bias=ours[2], return_entropy=with_entropy,
                            return_sum_pi_squared=True, **grouped(chunk_bytes=5 * 300 * 4, backend=backend,
                                                                  **transform))
    assert len(out) == 2 + with_entropy
    logp, sum_pi_squared = out[0], out[-1]
    assert sum_pi_squared.shape == targets.shape and sum_pi_squared.dtype == torch.float32
    assert not sum_pi_squared.requires_grad
    ref_logp, ref_entropy, ref_sum = reference.token_logprobs(hidden.double(), weight.double(), targets,
                                                             bias=bias.double(), return_entropy=True,
                                                             return_sum_pi_squared=True, **transform)
    assert ref_sum.max() > 3 * ref_sum.min()
    assert_close(sum_pi_squared, ref_sum, 1e-5, name="sum_pi_squared")
    assert_close(logp, ref_logp, 1e-5, name="logp")
    if with_entropy:
        assert_close(out[1], ref_entropy, 1e-5, name="entropy")
    # the log-prob's gradient is the one without sum p^2
    grads = torch.autograd.grad(logp.sum() + (out[1].sum() if with_entropy else 0), ours)
    plain = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    plain_out = gf.token_logprobs(plain[0], plain[1], targets, bias=plain[2], return_entropy=with_entropy,
                                  **grouped(chunk_bytes=5 * 300 * 4, backend=backend, **transform))
    plain_logp = plain_out[0] if with_entropy else plain_out
    plain_grads = torch.autograd.grad(plain_logp.sum() + (plain_out[1].sum() if with_entropy else 0), plain)
    for g, p in zip(grads, plain_grads):
        torch.testing.assert_close(g, p, rtol=0, atol=0)


@pytest.mark.parametrize("vocab", [300, 256])
def test_sum_pi_squared_over_kept_sets(vocab, backend):
    """Over each token's kept set: the kept-set distribution's sum p^2, not the full vocabulary's."""
    hidden, weight, targets, bias = inputs(shape=(30,), vocab=vocab, hidden_size=32, bias=True, seed=5)
    ids, offsets = kept_sets(targets, vocab, seed=vocab)
    logp, sum_pi_squared = gf.token_logprobs(hidden, weight, targets, bias=bias, return_sum_pi_squared=True,
                                             **grouped(kept_ids=ids, kept_offsets=offsets, temperature=0.8,
                                                       chunk_bytes=7 * 300 * 4, backend=backend))
    _, ref_sum = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double(), kept_ids=ids,
                                          kept_offsets=offsets, return_sum_pi_squared=True, temperature=0.8)
    _, full_sum = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double(),
                                           return_sum_pi_squared=True, temperature=0.8)
    assert ((ref_sum - full_sum).abs() / full_sum).min() > 1e-3          # the kept set changes every value
    assert_close(sum_pi_squared, ref_sum, 1e-5, name="sum_pi_squared")


def test_sum_pi_squared_of_peaked_flat_and_banned_rows(backend):
    """A one-hot-like row (sum p^2 = 1 - 4e-7 in float64), a uniform row (exactly 1/V), a row of ties, and banned
    tokens in every row (a -inf bias: probability 0, never NaN)."""
    vocab = 200
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(6))
    logits[0] = -20.0
    logits[0, 4] = 0.0                                                   # peaked: one token holds nearly all
    logits[1] = 1.5                                                      # uniform over the allowed tokens
    logits[2, [1, 2, 4, 5]] = 9.0                                        # four tied peaks
    bias = torch.zeros(vocab)
    bias[::3] = float("-inf")                                            # banned tokens
    hidden = torch.eye(5).to(DEVICE)
    weight = logits.t().contiguous().to(DEVICE)
    targets = torch.tensor([4, 1, 2, 5, 7], device=DEVICE)
    _, sum_pi_squared = gf.token_logprobs(hidden, weight, targets, bias=bias.to(DEVICE), return_sum_pi_squared=True,
                                          **grouped(backend=backend))
    expected = torch.softmax((logits + bias).double(), -1).square().sum(-1)
    assert torch.isfinite(sum_pi_squared).all()
    assert abs(expected[1].item() - 1 / (vocab - len(range(0, vocab, 3)))) < 1e-15
    assert 0 < 1 - expected[0].item() < 1e-6
    assert_close(sum_pi_squared, expected, 1e-5, name="sum_pi_squared")
