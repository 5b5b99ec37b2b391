"""Every tensor argument of the public entries as a strided, transposed or expanded view, on both backends: the
results equal those of contiguous copies against the float64 reference (kernels may not assume a layout)."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import DEVICE, assert_close, flat, grouped

N, H = 40, 32
CHUNK = 4 * 300 * 4          # ~4 rows per chunk at V = 300: several chunks, a ragged last one


def column(values, width=3, index=1):
    """values as column `index` of a wider tensor: the same numbers with stride `width`."""
    wide = torch.zeros(*values.shape, width, dtype=values.dtype, device=values.device)
    wide[..., index] = values
    return wide[..., index]


def transposed(matrix):
    """The same (R, C) values held column-major: matrix.t().contiguous().t()."""
    return matrix.t().contiguous().t()


def check_grads(grads, ref_grads, rtol=1e-5):
    for name, g, r in zip(("hidden", "weight"), grads, ref_grads):
        assert_close(g, r, rtol, atol=1e-7, name=f"d{name}")


@pytest.mark.parametrize("vocab", [300, 256])                 # padded rows (300 % 16 != 0) and unpadded
def test_token_logprobs_with_strided_targets_hidden_and_weight(backend, vocab):
    gen = torch.Generator().manual_seed(vocab)
    hidden = torch.randn(N, H, generator=gen).to(DEVICE)
    weight = (torch.randn(vocab, H, generator=gen) * 0.3).to(DEVICE)
    ids = torch.randint(0, vocab, (N, 4), generator=gen).to(DEVICE)
    targets = ids[:, 0]                                         # a column: stride 4
    assert targets.stride() == (4,)
    views = [transposed(hidden).requires_grad_(), transposed(weight).requires_grad_()]
    assert not views[0].is_contiguous() and not views[1].is_contiguous()
    logp, entropy = gf.token_logprobs(*views, targets, return_entropy=True, **grouped(chunk_bytes=CHUNK,
                                                                                      backend=backend))
    exact = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    ref_logp, ref_entropy = reference.token_logprobs(*exact, targets.contiguous(), return_entropy=True)
    assert_close(logp, ref_logp, 1e-5, atol=1e-6, name="logp")
    assert_close(entropy, ref_entropy, 1e-5, atol=1e-6, name="entropy")
    w = torch.randn(N, generator=gen).to(DEVICE)
    grads = torch.autograd.grad((logp * w).sum() + (entropy * w.flip(0)).sum(), views)
    ref_grads = torch.autograd.grad((ref_logp * w).sum() + (ref_entropy * w.flip(0)).sum(), exact)
    check_grads(grads, ref_grads)


def test_token_logprobs_with_batched_strided_targets(backend):
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 7, H, generator=gen).to(DEVICE)
    weight = (torch.randn(300, H, generator=gen) * 0.3).to(DEVICE)
    targets = torch.randint(0, 300, (7, 3), generator=gen).to(DEVICE).t()     # (B, T) transposed view
    hidden_view = hidden.transpose(0, 1).contiguous().transpose(0, 1)          # (B, T, H), not contiguous
    logp = gf.token_logprobs(hidden_view, weight, targets, **grouped(chunk_bytes=CHUNK, backend=backend))
    ref = reference.token_logprobs(hidden.double(), weight.double(), targets.contiguous())
    assert_close(logp, ref, 1e-5, atol=1e-6, name="logp")


@pytest.mark.parametrize("options", [dict(beta=0.04, epsilon_high=0.28),
                                     dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
                                     dict(loss_type="cispo", epsilon_high=4.0, entropy_coef=0.01)])
def test_grpo_loss_with_every_vector_a_view(backend, options):
    gen = torch.Generator().manual_seed(2)
    B, T, V = 4, 10, 300
    hidden = torch.randn(B, T, H, generator=gen).to(DEVICE)
    weight = (torch.randn(V, H, generator=gen) * 0.3).to(DEVICE)
    targets = torch.randint(0, V, (B, T), generator=gen).to(DEVICE)
    mask = (torch.rand(B, T, generator=gen) > 0.2).to(DEVICE)
    old = (-torch.rand(B, T, generator=gen) * 3 - 3).to(DEVICE)
    ref_logps = (-torch.rand(B, T, generator=gen) * 3 - 3).to(DEVICE)
    is_ratio = (0.5 + torch.rand(B, T, generator=gen)).to(DEVICE)
    advantages = torch.randn(B, 1, generator=gen).to(DEVICE)
    contiguous = dict(targets=targets, mask=mask, old_logps=old, ref_logps=ref_logps, is_ratio=is_ratio,
                      advantages=advantages.expand(B, T).contiguous())
    views = dict(
        targets=column(targets), mask=transposed_bt(mask), old_logps=column(old, 2, 0),
        ref_logps=transposed_bt(ref_logps), is_ratio=column(is_ratio, 5, 4),
        advantages=advantages.expand(B, T),                      # stride 0 along T
    )
    assert all(not v.is_contiguous() for v in views.values())
    hidden_view = hidden.transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
    weight_view = transposed(weight).requires_grad_()
    loss, _ = gf.grpo_loss(hidden_view, weight_view, **grouped(**views, chunk_bytes=CHUNK, backend=backend, **options))
    exact = [hidden.double().requires_grad_(), weight.double().requires_grad_()]
    ref_loss, _ = flat(reference.grpo_loss)(*exact, **contiguous, **options)
    assert_close(loss, ref_loss, 1e-5, atol=1e-7, name="loss")
    check_grads(torch.autograd.grad(loss, [hidden_view, weight_view]), torch.autograd.grad(ref_loss, exact))


def transposed_bt(values):
    """(B, T) values held T-major."""
    return values.t().contiguous().t()
