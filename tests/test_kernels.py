"""The Triton kernels on their own, against the torch backend's passes (CPU interpreter without a GPU)."""

import pytest
import torch

from conftest import DEVICE, assert_close

pytest.importorskip("triton")

from grpo_fast.backends import torch_ops  # noqa: E402
from grpo_fast.chunked import LogitTransform  # noqa: E402
from grpo_fast.kernels import dlogits_, logprob_forward  # noqa: E402


@pytest.mark.parametrize("dtype,rtol", [(torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("vocab", [5, 2048, 4096 + 77])
@pytest.mark.parametrize("transform", [LogitTransform(), LogitTransform(1.2, 3.0, 0.7)])
def test_kernels_match_torch_passes(dtype, rtol, vocab, transform):
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    logits = (torch.randn(rows, vocab, generator=gen) * 3).to(DEVICE, dtype)
    targets = torch.randint(0, vocab, (rows,), generator=gen).to(DEVICE)
    g_logp = torch.randn(rows, generator=gen).to(DEVICE)
    g_entropy = torch.randn(rows, generator=gen).to(DEVICE)

    expected_buffer = logits.double()          # the torch passes in float64: the oracle
    state = torch_ops.stats_(expected_buffer, targets, transform, need_entropy=True)
    lse, logp, entropy = logprob_forward(logits, targets, scale=transform.scale,
                                         temperature=transform.temperature, softcap=transform.softcap)
    assert_close(lse, state.lse, rtol, name="lse")
    assert_close(logp, state.logp, rtol, atol=rtol, name="logp")
    assert_close(entropy, state.entropy, rtol, atol=rtol, name="entropy")

    torch_ops.dlogits_(expected_buffer, state, targets, g_logp.double(), g_entropy.double(), transform)
    poisoned = logits.clone()
    dlogits_(poisoned, targets, lse, g_logp, entropy=entropy, g_entropy=g_entropy, scale=transform.scale,
             temperature=transform.temperature, softcap=transform.softcap)
    assert_close(poisoned, expected_buffer, rtol, name="dlogits")

    _, logp_only, none = logprob_forward(logits, targets, compute_entropy=False, scale=transform.scale,
                                         temperature=transform.temperature, softcap=transform.softcap)
    assert none is None
    assert torch.equal(logp_only, logp)


def test_dlogits_without_entropy_gradient():
    logits = torch.randn(3, 100).to(DEVICE)
    targets = torch.tensor([0, 50, 99]).to(DEVICE)
    g_logp = torch.tensor([1.0, -2.0, 0.5]).to(DEVICE)
    lse, _, _ = logprob_forward(logits, targets, compute_entropy=False)
    expected = g_logp[:, None] * (torch.nn.functional.one_hot(targets, 100) - logits.softmax(-1))
    dlogits_(logits, targets, lse, g_logp)
    assert_close(logits, expected, 1e-5)
