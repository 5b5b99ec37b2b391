"""Kept sets (top-k / top-p): log-probs, entropies, the loss and every gradient over each token's kept set equal
the float64 reference built from masked full logits, on both backends, on strided layouts, over several chunks;
the GEMM passes stay 3 (2 with a frozen head); bad kept sets raise one-line errors naming the argument."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.benchmarks.profiling import GemmCounter
from grpo_fast.kept import kept_set_from_mask
from tests.helpers import DEVICE, as_float64, assert_close, flat, grouped, make_batch
from tests.loss.test_strides import column, transposed


def kept_sets(targets, vocab, mask=None, share=0.3, seed=0, top_k=None):
    """Random kept sets holding each target (a random share of the vocabulary, or the top_k ids of a random
    score); empty where mask is 0, where the loss reads nothing."""
    gen = torch.Generator().manual_seed(seed)
    flat = targets.reshape(-1).cpu().clamp(min=0)
    if top_k is None:
        keep = torch.rand(flat.numel(), vocab, generator=gen) < share
    else:
        keep = torch.zeros(flat.numel(), vocab, dtype=torch.bool)
        keep.scatter_(1, torch.rand(flat.numel(), vocab, generator=gen).topk(top_k - 1, dim=1).indices, True)
    keep[torch.arange(flat.numel()), flat] = True
    if mask is not None:
        keep &= mask.reshape(-1, 1).cpu()
    ids, offsets = kept_set_from_mask(keep)
    return ids.to(DEVICE), offsets.to(DEVICE)


TRANSFORMS = [dict(), dict(temperature=0.7, logit_softcap=3.0), dict(logit_scale=0.5, temperature=1.3)]


@pytest.mark.parametrize("vocab", [300, 256])                 # padded rows and unpadded
@pytest.mark.parametrize("transform", TRANSFORMS, ids=["plain", "softcap", "scale"])
def test_token_logprobs_over_kept_sets(backend, vocab, transform):
    gen = torch.Generator().manual_seed(vocab)
    n, h = 40, 32
    hidden = torch.randn(n, h, generator=gen).to(DEVICE)
    weight = (torch.randn(vocab, h, generator=gen) * 0.3).to(DEVICE)
    bias = (torch.randn(vocab, generator=gen) * 0.5).to(DEVICE)
    targets = torch.randint(0, vocab, (n,), generator=gen).to(DEVICE)
    ids, offsets = kept_sets(targets, vocab, seed=vocab)
    views = [transposed(hidden).requires_grad_(), transposed(weight).requires_grad_(), bias.clone().requires_grad_()]
    # strided kept sets too: ids as a column of a wider tensor
    logp, entropy = gf.token_logprobs(views[0], views[1], column(targets), bias=views[2], return_entropy=True,
                                      **grouped(kept_ids=column(ids), kept_offsets=column(offsets),
                                                chunk_bytes=4 * 300 * 4, backend=backend, **transform))
    exact = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    ref_logp, ref_entropy = reference.token_logprobs(exact[0], exact[1], targets, bias=exact[2], return_entropy=True,
                                                     kept_ids=ids, kept_offsets=offsets, **transform)
    full_logp = reference.token_logprobs(hidden.double(), weight.double(), targets, bias=bias.double(), **transform)
    assert (ref_logp - full_logp).abs().min() > 1e-3                  # the kept set changes every log-prob
    assert_close(logp, ref_logp, 1e-5, atol=1e-6, name="logp")
    assert_close(entropy, ref_entropy, 1e-5, atol=1e-6, name="entropy")
    w = torch.randn(n, generator=gen).to(DEVICE)
    grads = torch.autograd.grad((logp * w).sum() + (entropy * w.flip(0)).sum(), views)
    ref_grads = torch.autograd.grad((ref_logp * w).sum() + (ref_entropy * w.flip(0)).sum(), exact)
    for name, g, r in zip(("hidden", "weight", "bias"), grads, ref_grads):
        assert_close(g, r, 1e-5, atol=1e-7, name=f"d{name}")
    off_set = ~torch.zeros(n, vocab, dtype=torch.bool).index_put_(
        (torch.repeat_interleave(torch.arange(n), offsets.diff().cpu()), ids.cpu()), torch.tensor(True)).any(0)
    assert bool((grads[1][off_set.to(DEVICE)] == 0).all())          # ids no token kept get no gradient


def test_whole_vocabulary_kept_set_equals_plain_pass(backend):
    inputs = make_batch(vocab=40, seed=3)
    mask = inputs["mask"]
    keep = torch.ones(mask.numel(), 40, dtype=torch.bool)
    ids, offsets = kept_set_from_mask(keep)
    kw = dict(old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], beta=0.1, entropy_coef=0.01,
              backend=backend)
    plain, plain_metrics = gf.grpo_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"],
                                        mask, **grouped(**kw))
    kept, kept_metrics = gf.grpo_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"],
                                      mask, **grouped(kept_ids=ids.to(DEVICE), kept_offsets=offsets.to(DEVICE), **kw))
    assert_close(kept, plain, 1e-6, name="loss")
    assert_close(kept_metrics["entropy"], plain_metrics["entropy"], 1e-6, name="entropy")


CASES = [dict(loss_type="dapo", beta=0.1, entropy_coef=0.02),
         dict(loss_type="grpo", delta=1.5),
         dict(loss_type="cispo", epsilon_high=5.0),
         dict(loss_type="sapo"),
         dict(loss_type="dapo", importance_sampling_level="sequence"),        # two phases
         dict(loss_type="vespo")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["loss_type"] + "/" + c.get("importance_sampling_level", "t"))
def test_grpo_loss_over_kept_sets(backend, case):
    inputs = make_batch(batch=3, seq=9, vocab=37, seed=5, bias=True)
    mask = inputs["mask"]
    ids, offsets = kept_sets(inputs["targets"], 37, mask, seed=7)
    kw = dict(old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], is_ratio=inputs["is_ratio"],
              temperature=0.9, logit_softcap=4.0, **case)
    leaves = {k: inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    # (B, T) layouts of the strides tests: hidden with T outermost in memory, targets a transposed view
    hidden_view = leaves["hidden"].transpose(0, 1).contiguous().transpose(0, 1)
    targets_view = inputs["targets"].t().contiguous().t()
    loss, metrics = gf.grpo_loss(hidden_view, transposed(leaves["weight"]), targets_view, inputs["advantages"], mask,
                                 bias=leaves["bias"], **grouped(kept_ids=ids, kept_offsets=offsets,
                                                                chunk_bytes=37 * 4 * 5, backend=backend, **kw))
    exact = as_float64(inputs)
    exact_leaves = {k: exact[k].clone().requires_grad_() for k in ("hidden", "weight", "bias")}
    ref_loss, ref_metrics = flat(reference.grpo_loss)(
        exact_leaves["hidden"], exact_leaves["weight"], inputs["targets"], exact["advantages"], mask,
        bias=exact_leaves["bias"], kept_ids=ids, kept_offsets=offsets,
        **{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    assert_close(loss, ref_loss, 1e-5, atol=1e-7, name="loss")
    for name in ref_metrics:
        assert_close(metrics[name], ref_metrics[name], 1e-5, atol=1e-7, name=name)
    loss.backward()
    ref_loss.backward()
    # 3e-5 for the gradients: on a GPU the soft-cap's tanh is good to 1.5e-6 relative (approximate exp2 and
    # division), which the cap over the temperature (4 / 0.9) makes up to 7e-6 absolute in each logit.
    for name in leaves:
        assert_close(leaves[name].grad, exact_leaves[name].grad, 3e-5, atol=1e-7, name=f"d{name}")


def test_kept_sets_keep_the_gemm_passes():
    n, h, v = 96, 32, 200
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, n // 2, h, generator=gen, requires_grad=True)
    targets = torch.randint(0, v, (2, n // 2), generator=gen)
    mask = torch.ones(2, n // 2, dtype=torch.bool)
    ids, offsets = kept_sets(targets, v, top_k=20)
    ids, offsets = ids.cpu(), offsets.cpu()
    for weight_grad, expected in ((True, 3), (False, 2)):
        weight = torch.randn(v, h, generator=gen, requires_grad=weight_grad)
        with GemmCounter() as counter:
            gf.grpo_loss(hidden, weight, targets, torch.randn(2), mask, **grouped(kept_ids=ids, kept_offsets=offsets,
                                                                                  backend="torch",
                                                                                  chunk_bytes=20_000))[0].backward()
        assert counter.flops / (2 * n * h * v) == expected


def test_peaked_kept_set_keeps_relative_accuracy(backend):
    """One id far above the rest of its kept set: the entropy (about 1e-9) keeps its relative accuracy."""
    vocab, n = 64, 4
    logits = torch.zeros(n, vocab, dtype=torch.float64)
    logits[:, 5] = 24.0
    hidden = torch.eye(n, vocab, dtype=torch.float64)[:, :16] * 0 + torch.eye(n, 16, dtype=torch.float64)
    weight = torch.zeros(vocab, 16, dtype=torch.float64)
    weight[5, :n] = 24.0
    targets = torch.full((n,), 5)
    ids, offsets = kept_sets(targets, vocab, share=0.1, seed=1)
    ref_logp, ref_entropy = reference.token_logprobs(hidden, weight, targets, return_entropy=True,
                                                     kept_ids=ids.cpu(), kept_offsets=offsets.cpu())
    dtype = torch.float64 if backend == "torch" else torch.float32
    logp, entropy = gf.token_logprobs(hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE), targets.to(DEVICE),
                                      return_entropy=True, **grouped(kept_ids=ids, kept_offsets=offsets,
                                                                     backend=backend))
    assert float(ref_entropy.max()) < 1e-7
    assert_close(entropy, ref_entropy, 1e-4, name="entropy")
    assert_close(logp, ref_logp, 1e-4, name="logp")


def bad(**changes):
    inputs = make_batch(batch=2, seq=4, vocab=11, seed=2, masked_fraction=0.0)
    ids, offsets = kept_sets(inputs["targets"], 11, share=0.5)
    args = dict(kept_ids=ids, kept_offsets=offsets)
    args.update({k: (v(args) if callable(v) else v) for k, v in changes.items()})
    return lambda: gf.grpo_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"],
                                inputs["mask"], **grouped(backend="torch", **args))


@pytest.mark.parametrize("changes, message", [
    (dict(kept_offsets=None), r"kept_ids needs kept_offsets .* got kept_offsets=None"),
    (dict(kept_ids=lambda a: a["kept_ids"].float()), r"kept_ids must be an integer tensor, got dtype torch.float32"),
    (dict(kept_offsets=lambda a: a["kept_offsets"][:-1]), r"kept_offsets must have shape \(N \+ 1,\) = \(9,\)"),
    (dict(kept_offsets=lambda a: a["kept_offsets"] + 1), r"kept_offsets must run from 0 to kept_ids.numel\(\)"),
    (dict(kept_offsets=lambda a: torch.cat([a["kept_offsets"][:2], a["kept_offsets"][1:2] - 1,
                                            a["kept_offsets"][3:]])), r"kept_offsets must not decrease"),
    (dict(kept_offsets=lambda a: torch.cat([a["kept_offsets"][:1], a["kept_offsets"][:-1].clamp(max=10**6)])
          .clone().index_fill_(0, torch.tensor([1]).to(DEVICE), 0)),
     r"kept_offsets must run from 0 to kept_ids.numel\(\)"),
    (dict(kept_ids=lambda a: a["kept_ids"] + 11), r"kept_ids must lie in \[0, V\) = \[0, 11\)"),
])
def test_bad_kept_sets_raise(changes, message):
    with pytest.raises((ValueError, TypeError), match=message):
        bad(**changes)()


def test_empty_or_targetless_or_repeated_kept_sets_raise():
    inputs = make_batch(batch=2, seq=4, vocab=11, seed=2, masked_fraction=0.0)
    targets, mask = inputs["targets"].clamp(min=0), torch.ones_like(inputs["mask"])
    call = lambda ids, offsets: gf.grpo_loss(inputs["hidden"], inputs["weight"], targets,  # noqa: E731
                                             inputs["advantages"], mask, **grouped(kept_ids=ids, kept_offsets=offsets))
    flat = targets.reshape(-1)
    keep = torch.zeros(8, 11, dtype=torch.bool)
    keep[torch.arange(8), flat.cpu()] = True
    ids, offsets = kept_set_from_mask(keep)
    empty = keep.clone()
    empty[3] = False
    with pytest.raises(ValueError, match=r"needs K >= 1 ids .* got K = 0 for token 3"):
        call(*[t.to(DEVICE) for t in kept_set_from_mask(empty)])
    other = keep.clone()
    other[5] = False
    other[5, (int(flat[5]) + 1) % 11] = True
    with pytest.raises(ValueError, match=r"must hold its target .* token 5 with target"):
        call(*[t.to(DEVICE) for t in kept_set_from_mask(other)])
    repeated_ids = torch.cat([ids[:1], ids])
    repeated_offsets = torch.cat([offsets[:1], offsets[1:] + 1])
    with pytest.raises(ValueError, match=r"each id once per token, got id .* twice for token 0"):
        call(repeated_ids.to(DEVICE), repeated_offsets.to(DEVICE))
    # where mask is 0 a kept set may be empty, or miss its target: the loss reads nothing there
    masked = mask.clone()
    masked.view(-1)[3] = False
    gf.grpo_loss(inputs["hidden"], inputs["weight"], targets, inputs["advantages"], masked,
                 **grouped(kept_ids=kept_set_from_mask(empty)[0].to(DEVICE),
                           kept_offsets=kept_set_from_mask(empty)[1].to(DEVICE)))
    with pytest.raises(ValueError, match=r"got K = 0 for token 3"):               # token_logprobs has no mask
        gf.token_logprobs(inputs["hidden"], inputs["weight"], targets,
                          **grouped(kept_ids=kept_set_from_mask(empty)[0].to(DEVICE),
                                    kept_offsets=kept_set_from_mask(empty)[1].to(DEVICE)))


def test_chunk_passes_read_only_the_kept_logits(backend):
    """The logits off the kept sets are poisoned (NaN, +inf) in a padded buffer: the statistics and the gradient,
    which the passes write over the whole row (zeros off the kept sets, padding included), do not see them."""
    from grpo_fast import backends
    from grpo_fast.chunked import padded_width
    from grpo_fast.kept import KeptChunk
    from grpo_fast.numerics import LogitTransform

    gen = torch.Generator().manual_seed(11)
    rows, vocab = 6, 300
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    ids, offsets = kept_sets(targets, vocab, share=0.1, seed=4)
    keep = torch.zeros(rows, vocab, dtype=torch.bool)
    keep[torch.repeat_interleave(torch.arange(rows), offsets.diff().cpu()), ids.cpu()] = True
    transform = LogitTransform(scale=0.8, softcap=5.0, temperature=0.9)
    z = transform.softcap * torch.tanh(logits * transform.scale / transform.softcap) / transform.temperature
    z_kept = z.masked_fill(~keep, float("-inf"))
    lse = z_kept.logsumexp(-1)
    probs = (z_kept - lse[:, None]).exp()
    entropy = -(probs * (z_kept - lse[:, None]).masked_fill(~keep, 0)).sum(-1)
    g_logp, g_entropy = torch.randn(2, rows, generator=gen, dtype=torch.float64)
    dz = g_logp[:, None] * (torch.nn.functional.one_hot(targets, vocab) - probs) \
        - g_entropy[:, None] * probs * (z_kept - lse[:, None] + entropy[:, None]).masked_fill(~keep, 0)
    dy = dz * (1 - torch.tanh(logits * transform.scale / transform.softcap) ** 2) * transform.scale \
        / transform.temperature

    dtype = torch.float64 if backend == "torch" else torch.float32
    buffer = torch.full((rows, padded_width(vocab)), float("nan"), dtype=dtype, device=DEVICE)[:, :vocab]
    buffer.copy_(logits.masked_fill(~keep, float("nan")).to(dtype))
    buffer[0, (~keep[0]).nonzero()[0]] = float("inf")
    ops = backends.resolve(backend, torch.device(DEVICE))
    state = ops.stats_(buffer, targets.to(DEVICE), transform, True, kept=KeptChunk(ids, offsets))
    assert_close(state.logp, z_kept.gather(1, targets[:, None])[:, 0] - lse, 1e-5, name="logp")
    assert_close(state.entropy, entropy, 1e-5, name="entropy")
    grads = [g.to(DEVICE, torch.float64 if dtype == torch.float64 else torch.float32) for g in (g_logp, g_entropy)]
    ops.dlogits_(buffer, state, targets.to(DEVICE), *grads, transform)
    assert_close(buffer, dy, 1e-5, name="dlogits")
    assert bool((buffer.cpu()[~keep] == 0).all())
