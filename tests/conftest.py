import os

import torch

# Without a GPU the Triton kernels run in Triton's CPU interpreter; the switch must be set before the kernels
# are decorated, i.e. before grpo_fast.kernels is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from grpo_fast.backends import triton_available  # noqa: E402

BACKENDS = ["torch"] + (["triton"] if triton_available() else [])
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def make_batch(batch=3, seq=9, hidden_size=16, vocab=37, dtype=torch.float32, seed=0, logit_std=2.0,
               masked_fraction=0.3, device=DEVICE, bias=False, per_token_adv=False):
    """Random inputs of the loss; masked positions hold poison (-100 targets, inf log-probs)."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, seq, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * (logit_std / hidden_size**0.5)
    mask = torch.rand(batch, seq, generator=gen) > masked_fraction
    mask[0, -2:] = False                        # ragged lengths
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    targets[~mask] = -100
    advantages = torch.randn(batch, seq, generator=gen) if per_token_adv else torch.randn(batch, generator=gen)
    old = -torch.rand(batch, seq, generator=gen) * 4
    ref = -torch.rand(batch, seq, generator=gen) * 4
    is_ratio = 0.5 + torch.rand(batch, seq, generator=gen)
    for t in (old, ref, is_ratio):
        t[~mask] = float("inf")
    out = dict(
        hidden=hidden.to(dtype), weight=weight.to(dtype), targets=targets, advantages=advantages, mask=mask,
        old_logps=old, ref_logps=ref, is_ratio=is_ratio,
        bias=(torch.randn(vocab, generator=gen) * 0.5).to(dtype) if bias else None,
    )
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in out.items()}


def as_float64(inputs):
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
            for k, v in inputs.items()}


def assert_close(actual, expected, rtol, atol=0.0, name=""):
    actual, expected = actual.double(), expected.double()
    scale = expected.abs().max().clamp(min=1e-12)
    err = (actual - expected).abs().max()
    assert torch.isfinite(actual).all(), f"{name}: non-finite values"
    assert err <= rtol * scale + atol, f"{name}: max error {err:.3e} > {rtol:.1e} x max |expected| {scale:.3e}"
