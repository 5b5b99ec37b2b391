"""fused_token_loss: a caller's own token-separable loss inside the sweep equals the same expression over the
float64 reference's log-probs and entropies, value and gradients, on both backends, masked and over kept sets;
3 GEMM passes (2 frozen, 1 without gradients); a malformed token_loss is a one-line error."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.benchmarks.profiling import GemmCounter
from tests.helpers import DEVICE, assert_close, grouped, make_batch
from tests.loss.test_kept import kept_sets


def expression(advantages, old, weights, coef):
    """A clipped-ratio term with per-token weights (any engine's normalizer) plus an entropy bonus: a sum over
    tokens, each term a function of that token's log-prob and entropy."""
    def fn(logp, entropy, index):
        ratio = (logp - old.reshape(-1)[index]).exp()
        adv = advantages.reshape(-1)[index]
        policy = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        value = (policy * weights.reshape(-1)[index]).sum()
        return value if entropy is None else value - coef * (entropy * weights.reshape(-1)[index]).sum()
    return fn


@pytest.mark.parametrize("with_entropy", [False, True])
@pytest.mark.parametrize("kept", [False, True])
def test_own_loss_equals_the_reference(backend, with_entropy, kept):
    inputs = make_batch(batch=3, seq=9, vocab=37, seed=8, bias=True)
    mask, targets = inputs["mask"], inputs["targets"]
    gen = torch.Generator().manual_seed(2)
    advantages = torch.randn(3, 9, generator=gen, dtype=torch.float64).to(DEVICE)
    old = (-torch.rand(3, 9, generator=gen, dtype=torch.float64) * 3).to(DEVICE)
    weights = torch.rand(3, 9, generator=gen, dtype=torch.float64).to(DEVICE) / mask.sum()
    fn = expression(advantages, old, weights, 0.05)
    keep = dict(zip(("kept_ids", "kept_offsets"), kept_sets(targets, 37, mask, seed=3))) if kept else {}
    leaves = [inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    loss = gf.fused_token_loss(leaves[0], leaves[1], targets, gf.autograd_token_loss(fn), mask=mask, bias=leaves[2],
                               with_entropy=with_entropy, **grouped(temperature=0.8, logit_softcap=4.0,
                                                                    chunk_bytes=37 * 4 * 5, backend=backend, **keep))
    exact = [inputs[k].double().requires_grad_() for k in ("hidden", "weight", "bias")]
    logp, entropy = reference.token_logprobs(exact[0], exact[1], targets, bias=exact[2], temperature=0.8,
                                             logit_softcap=4.0, return_entropy=True, **keep)
    index = mask.reshape(-1).nonzero().squeeze(1)
    expected = fn(logp.reshape(-1)[index], entropy.reshape(-1)[index] if with_entropy else None, index)
    assert_close(loss, expected, 1e-5, atol=1e-8, name="loss")
    grads = torch.autograd.grad(loss, leaves)
    expected_grads = torch.autograd.grad(expected, exact)
    for name, g, e in zip(("hidden", "weight", "bias"), grads, expected_grads):
        assert_close(g, e, 1e-5, atol=1e-8, name=f"d{name}")


def test_hand_written_gradients_and_gemm_passes():
    n, h, v = 96, 32, 200
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=gen)
    scale = torch.randn(n, generator=gen)

    def token_loss(chunk):                    # sum of scale * logp: its gradient is scale itself
        return (scale[chunk.index] * chunk.logp).sum(), scale[chunk.index], None

    for weight_grad, expected in ((True, 3), (False, 2)):
        weight = torch.randn(v, h, generator=gen, requires_grad=weight_grad)
        with GemmCounter() as counter:
            loss = gf.fused_token_loss(hidden, weight, targets, token_loss, **grouped(chunk_bytes=20_000,
                                                                                      backend="torch"))
            loss.backward()
        assert counter.flops / (2 * n * h * v) == expected
        expected_loss = (scale * gf.token_logprobs(hidden.detach(), weight.detach(), targets)).sum()
        assert_close(loss, expected_loss, 1e-5, name="loss")
    with torch.no_grad(), GemmCounter() as counter:
        value = gf.fused_token_loss(hidden, weight, targets, token_loss, **grouped(chunk_bytes=20_000, backend="torch"))
    assert counter.flops / (2 * n * h * v) == 1
    assert_close(value, expected_loss, 1e-5, name="no-grad value")


def test_malformed_token_loss_raises():
    inputs = make_batch(batch=2, seq=4, vocab=11, seed=2)
    call = lambda fn, **kw: gf.fused_token_loss(inputs["hidden"], inputs["weight"], inputs["targets"], fn,  # noqa
                                                **grouped(**{"mask": inputs["mask"], **kw}))
    with pytest.raises(TypeError, match="token_loss must be callable"):
        call(None)
    with pytest.raises(TypeError, match=r"token_loss must return \(value, g_logp, g_entropy\), got Tensor"):
        call(lambda chunk: chunk.logp.sum())
    with pytest.raises(ValueError, match=r"token_loss's g_logp must have shape \(\d+,\) like chunk.logp, got \(1,\)"):
        call(lambda chunk: (chunk.logp.sum(), chunk.logp[:1], None))
    with pytest.raises(ValueError, match="called with with_entropy=False: pass with_entropy=True"):
        call(lambda chunk: (chunk.logp.sum(), chunk.logp, chunk.logp))
    with pytest.raises(ValueError, match=r"mask must have shape \(2, 4\)"):
        call(lambda chunk: (chunk.logp.sum(), chunk.logp, None), mask=inputs["mask"][:, :2])


@pytest.mark.parametrize("with_entropy", [False, True])
def test_batch_token_loss_takes_a_whole_batch_loss(backend, with_entropy):
    """batch_token_loss: a loss written over the whole (B, T) batch (per-sequence token means of a clipped ratio,
    an entropy bonus), evaluated per chunk with the chunk's entries as variables, gives the float64 reference's
    gradients; after the sweep its tensors hold the sweep's log-probs and entropies, and the loss on them is the
    value. Several chunks, masked tokens."""
    from grpo_fast.token_loss import batch_token_loss

    inputs = make_batch(batch=3, seq=9, vocab=37, seed=4, bias=True)
    mask, targets = inputs["mask"], inputs["targets"]
    gen = torch.Generator().manual_seed(5)
    advantages = torch.randn(3, 1, generator=gen, dtype=torch.float64).to(DEVICE)
    old = (-torch.rand(3, 9, generator=gen, dtype=torch.float64) * 3).to(DEVICE)
    weights = mask.double() / mask.sum(-1, keepdim=True).clamp(min=1) / 3

    def batch_loss(logp, entropy):
        ratio = (logp - old).exp()
        policy = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.28) * advantages)
        value = (policy * weights).sum()
        return value if entropy is None else value - 0.05 * (entropy * weights).sum()

    logp = old.clone()
    entropy = torch.zeros_like(old) if with_entropy else None
    leaves = [inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
    carrier = gf.fused_token_loss(leaves[0], leaves[1], targets, batch_token_loss(batch_loss, logp, entropy), mask=mask,
                                  bias=leaves[2], with_entropy=with_entropy, **grouped(temperature=0.8,
                                                                                       chunk_bytes=37 * 4 * 5,
                                                                                       backend=backend))
    grads = torch.autograd.grad(carrier, leaves)
    exact = [inputs[k].double().requires_grad_() for k in ("hidden", "weight", "bias")]
    ref_logp, ref_entropy = reference.token_logprobs(exact[0], exact[1], targets, bias=exact[2], temperature=0.8,
                                                     return_entropy=True)
    ref_logp, ref_entropy = torch.where(mask, ref_logp, old), torch.where(mask, ref_entropy, 0.0)
    expected = batch_loss(ref_logp, ref_entropy if with_entropy else None)
    assert float(carrier) == 0.0                                 # the chunks carry gradients only
    assert_close(batch_loss(logp, entropy), expected, 1e-5, atol=1e-8, name="loss after the sweep")
    assert_close(torch.where(mask, logp, 0.0), torch.where(mask, ref_logp, 0.0), 1e-5, atol=1e-8, name="logp")
    for name, g, e in zip(("hidden", "weight", "bias"), grads, torch.autograd.grad(expected, exact)):
        assert_close(g, e, 1e-5, atol=1e-8, name=f"d{name}")


def _sequence_batch(dtype):
    """Inputs of a (3, 9) batch with several chunks, and float64 old log-probs, advantages and token weights."""
    inputs = make_batch(batch=3, seq=9, vocab=37, seed=6, bias=True)
    gen = torch.Generator().manual_seed(7)
    advantages = torch.randn(3, 1, generator=gen, dtype=torch.float64).to(DEVICE)
    old = (-torch.rand(3, 9, generator=gen, dtype=torch.float64) * 3).to(DEVICE)
    return inputs, advantages.to(dtype), old.to(dtype), inputs["mask"].to(dtype)


def _reference_grads(inputs, batch_loss, old):
    """d(hidden), d(weight), d(bias) of batch_loss at the float64 reference's log-probs (old where masked)."""
    exact = [inputs[k].double().requires_grad_() for k in ("hidden", "weight", "bias")]
    logp = reference.token_logprobs(exact[0], exact[1], inputs["targets"], bias=exact[2])
    logp = torch.where(inputs["mask"], logp, old.double())
    return torch.autograd.grad(batch_loss(logp, None), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batch_token_loss_refuses_a_loss_that_is_not_token_separable(dtype):
    """A whole-batch loss that mixes tokens nonlinearly gets each chunk's gradient at the other chunks' starting
    values: with several chunks that is not the final gradient, and the sweep raises instead of returning wrong
    gradients. With one chunk every gradient is the final one: the result matches the float64 reference. A
    separable loss passes the check in either dtype."""
    from grpo_fast.token_loss import batch_token_loss

    inputs, advantages, old, mask_f = _sequence_batch(dtype)
    lengths = mask_f.sum(-1, keepdim=True).clamp(min=1)

    def squared_sum(logp, entropy):
        return (((logp - old) * mask_f).sum() - 1.0) ** 2

    def sequence_ratio(logp, entropy):       # GSPO: the ratio of a sequence's mean log-ratio
        ratio = (((logp - old) * mask_f).sum(-1, keepdim=True) / lengths).exp()
        return -(ratio * advantages).mean()

    def separable(logp, entropy):
        return -((logp - old).exp() * advantages * mask_f / lengths).sum()

    def run(batch_loss, chunk_bytes):
        leaves = [inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")]
        carrier = gf.fused_token_loss(leaves[0], leaves[1], inputs["targets"],
                                      batch_token_loss(batch_loss, old.clone()), mask=inputs["mask"], bias=leaves[2],
                                      **grouped(chunk_bytes=chunk_bytes, backend="torch"))
        return torch.autograd.grad(carrier, leaves)

    several = 37 * 4 * 5
    for batch_loss in (squared_sum, sequence_ratio):
        with pytest.raises(ValueError, match=r"^batch_token_loss's loss is not token-separable: the d loss / d logp "
                                             r"its chunks returned .* differs from the one at the sweep's final "
                                             r"values .* or compute token_logprobs and take the loss's gradient "
                                             r"by autograd$"):
            run(batch_loss, several)
        for name, g, e in zip(("hidden", "weight", "bias"), run(batch_loss, None),
                              _reference_grads(inputs, batch_loss, old)):
            assert_close(g, e, 1e-4 if dtype == torch.float32 else 1e-5, atol=1e-7, name=f"one chunk: d{name}")
    for name, g, e in zip(("hidden", "weight", "bias"), run(separable, several),
                          _reference_grads(inputs, separable, old)):
        assert_close(g, e, 1e-4 if dtype == torch.float32 else 1e-5, atol=1e-7, name=f"separable: d{name}")
    with torch.no_grad():                    # no gradient is used: nothing to refuse, the values are the sweep's
        logp = old.clone()
        gf.fused_token_loss(inputs["hidden"], inputs["weight"], inputs["targets"], batch_token_loss(squared_sum, logp),
                            mask=inputs["mask"], bias=inputs["bias"], **grouped(chunk_bytes=several, backend="torch"))
    expected = reference.token_logprobs(inputs["hidden"].double(), inputs["weight"].double(), inputs["targets"],
                                        bias=inputs["bias"].double())
    assert_close(logp[inputs["mask"]], expected[inputs["mask"]], 1e-5, name="no-grad logp")


def test_a_loss_of_neither_logp_nor_entropy_is_a_clear_error():
    """A chunk loss that does not depend on logp (or entropy) would give a zero gradient or torch's own autograd
    error: a one-line ValueError says so. A loss of the entropy alone is legitimate: zero logp gradient, the
    float64 reference's gradients."""
    from grpo_fast.token_loss import batch_token_loss

    inputs = make_batch(batch=2, seq=6, vocab=11, seed=3)
    hidden = inputs["hidden"].clone().requires_grad_()

    def call(token_loss, **kw):
        loss = gf.fused_token_loss(hidden, inputs["weight"], inputs["targets"], token_loss, mask=inputs["mask"],
                                   **grouped(chunk_bytes=64, backend="torch", **kw))
        return torch.autograd.grad(loss, hidden)[0]

    neither = r"does not depend on {}: return a differentiable torch expression of {} \(no \.item\(\), " \
              r"\.detach\(\) or torch\.no_grad\(\) on the way; logp\.sum\(\) \* 0 for a zero loss\)$"
    autograd_fn = r"^autograd_token_loss's fn\(logp, entropy, index\) "
    batch_fn = r"^batch_token_loss's loss\(logp, entropy\) "
    for fn in (lambda logp, entropy, index: torch.tensor(1.0),
               lambda logp, entropy, index: logp.detach().sum(),
               lambda logp, entropy, index: torch.zeros((), requires_grad=True) * 2):
        with pytest.raises(ValueError, match=autograd_fn + neither.format("logp", "logp")):
            call(gf.autograd_token_loss(fn))
    with pytest.raises(ValueError, match=autograd_fn + neither.format("logp or entropy", "logp and entropy")):
        call(gf.autograd_token_loss(lambda logp, entropy, index: torch.tensor(0.0)), with_entropy=True)
    with pytest.raises(TypeError, match=autograd_fn + r"must return a 1-element tensor, got float$"):
        call(gf.autograd_token_loss(lambda logp, entropy, index: 1.0))
    with pytest.raises(ValueError, match=batch_fn + neither.format("logp", "logp")):
        call(batch_token_loss(lambda logp, entropy: logp.detach().sum(), torch.zeros(2, 6)))
    with pytest.raises(ValueError, match=batch_fn + neither.format("logp or entropy", "logp and entropy")):
        call(batch_token_loss(lambda logp, entropy: torch.tensor(2.0), torch.zeros(2, 6), torch.zeros(2, 6)),
             with_entropy=True)
    with pytest.raises(ValueError, match=r"^batch_token_loss was given entropy, but the chunks carry none: call "
                                         r"fused_token_loss with with_entropy=True$"):
        call(batch_token_loss(lambda logp, entropy: entropy.sum(), torch.zeros(2, 6), torch.zeros(2, 6)))

    exact = inputs["hidden"].double().requires_grad_()
    _, entropy = reference.token_logprobs(exact, inputs["weight"].double(), inputs["targets"], return_entropy=True)
    expected = torch.autograd.grad(-entropy[inputs["mask"]].sum(), exact)[0]
    got = call(gf.autograd_token_loss(lambda logp, entropy, index: -entropy.sum()), with_entropy=True)
    assert_close(got, expected, 1e-5, atol=1e-8, name="entropy only: dhidden")
    got = call(batch_token_loss(lambda logp, entropy: -(entropy * inputs["mask"]).sum(), torch.zeros(2, 6),
                                torch.zeros(2, 6)), with_entropy=True)
    assert_close(got, expected, 1e-5, atol=1e-8, name="entropy only, batch: dhidden")


def test_the_separability_check_is_per_token_so_a_long_sequence_cannot_hide_in_it():
    """GSPO's sequence ratio over one 8-token and one 4000-token sequence, from the old log-probs (the policy has
    moved since: each token's log-prob 0.1 nats up): the long sequence's gradients, each ~1/500 of the short one's,
    are up to 9% wrong (its ratio taken with the later chunks at their old values). Compared with the largest
    gradient in the batch that hid below the tolerance and d(hidden) came back wrong; each token against its own
    final gradient, the sweep refuses. The same loss in one chunk, and a separable loss in many, pass and equal
    the float64 reference."""
    from grpo_fast.token_loss import batch_token_loss

    gen = torch.Generator().manual_seed(11)
    vocab, width, length = 32, 16, 4000
    hidden = torch.randn(2, length, width, generator=gen)
    weight = torch.randn(vocab, width, generator=gen) * 0.3
    targets = torch.randint(0, vocab, (2, length), generator=gen)
    mask = torch.zeros(2, length, dtype=torch.bool)
    mask[0, :8], mask[1, :] = True, True
    logp_now = reference.token_logprobs(hidden.double(), weight.double(), targets)
    old = (logp_now - 0.1 + 0.05 * torch.randn(2, length, generator=gen, dtype=torch.float64)).float()
    mask_f, lengths, advantages = mask.float(), mask.sum(-1, keepdim=True).float(), torch.tensor([[1.0], [-1.0]])

    def sequence_ratio(logp, entropy):
        ratio = (((logp - old) * mask_f).sum(-1, keepdim=True) / lengths).exp()
        return -(ratio * advantages).mean()

    def separable(logp, entropy):
        return -((logp - old).exp() * advantages * mask_f / lengths).sum()

    def grads(batch_loss, chunk_bytes):
        leaf = hidden.clone().requires_grad_()
        carrier = gf.fused_token_loss(leaf, weight, targets, batch_token_loss(batch_loss, old.clone()), mask=mask,
                                      **grouped(chunk_bytes=chunk_bytes, backend="torch"))
        return torch.autograd.grad(carrier, leaf)[0]

    def exact(batch_loss):
        leaf = hidden.double().requires_grad_()
        logp = torch.where(mask, reference.token_logprobs(leaf, weight.double(), targets), old.double())
        return torch.autograd.grad(batch_loss(logp, None), leaf)[0]

    several = vocab * 4 * 700                        # 700 tokens a chunk: the long sequence spans 6
    with pytest.raises(ValueError, match=r"not token-separable: .* at \d+ of 4008 tokens \(worst: "):
        grads(sequence_ratio, several)
    assert_close(grads(sequence_ratio, None), exact(sequence_ratio).float(), 1e-4, atol=1e-9, name="one chunk")
    assert_close(grads(separable, several), exact(separable).float(), 1e-4, atol=1e-9, name="separable")
