"""The engine-facing options of the loss: caller-given per-token weights of the loss terms and of the entropy
bonus (any normalizer linear in the loss matrix), and verl's clamps of the log-ratios and of the KL. Float64
reference on both backends, token level (fused) and sequence level (two phases); GEMM passes unchanged."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.benchmarks.profiling import GemmCounter
from grpo_fast.variants import LossConfig, token_weights
from tests.helpers import DEVICE, as_float64, assert_close, flat, grouped, make_batch


def weights_for(mask, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.rand(mask.shape, generator=gen, dtype=torch.float64) / mask.sum().item()).to(DEVICE)


CASES = [dict(loss_type="dapo", beta=0.1),
         dict(loss_type="cispo", epsilon_high=4.0, beta=0.05, use_bias_correction_kl=True),
         dict(loss_type="sapo"),
         dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.05)]       # two phases


@pytest.mark.parametrize("case", CASES, ids=lambda c: c["loss_type"] + "/" + c.get("importance_sampling_level", "t"))
@pytest.mark.parametrize("clamps", [False, True])
def test_weights_and_clamps_equal_the_reference(backend, case, clamps):
    inputs = make_batch(batch=3, seq=9, vocab=37, seed=4, logit_std=3.0)
    mask = inputs["mask"]
    # log-ratios spread wide, so that tight clamps bind on part of the tokens
    exact_logp = reference.token_logprobs(inputs["hidden"].double(), inputs["weight"].double(), inputs["targets"])
    gen = torch.Generator().manual_seed(1)
    old = (exact_logp + torch.randn(mask.shape, generator=gen, dtype=torch.float64).to(DEVICE)).float()
    ref = (exact_logp + 2 * torch.randn(mask.shape, generator=gen, dtype=torch.float64).to(DEVICE)).float()
    options = dict(case, **(dict(log_ratio_clamp=0.5, kl_clamp=1.0) if clamps else {}))
    kw = dict(old_logps=old, ref_logps=ref, loss_weights=weights_for(mask, 1).float(),
              entropy_weights=weights_for(mask, 2).float() * 0.1, **options)
    leaves = [inputs[k].clone().requires_grad_() for k in ("hidden", "weight")]
    loss, metrics = gf.grpo_loss(*leaves, inputs["targets"], inputs["advantages"], mask,
                                 **grouped(backend=backend, chunk_bytes=37 * 4 * 5, **kw))
    exact = as_float64(inputs)
    exact_leaves = [exact[k].clone().requires_grad_() for k in ("hidden", "weight")]
    ref_loss, ref_metrics = flat(reference.grpo_loss)(
        *exact_leaves, inputs["targets"], exact["advantages"], mask,
        **{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
    assert_close(loss, ref_loss, 1e-5, atol=1e-8, name="loss")
    for name, value in ref_metrics.items():
        assert_close(metrics[name], value, 1e-5, atol=1e-8, name=name)
    for name, g, r in zip(("hidden", "weight"), torch.autograd.grad(loss, leaves),
                          torch.autograd.grad(ref_loss, exact_leaves)):
        assert_close(g, r, 1e-5, atol=1e-9, name=f"d{name}")
    if clamps:                      # the clamps bind: the same loss without them differs
        unclamped, _ = flat(reference.grpo_loss)(
            exact["hidden"], exact["weight"], inputs["targets"], exact["advantages"], mask,
            **{k: (v.double() if isinstance(v, torch.Tensor) else v) for k, v in {**kw, **case}.items()
               if k not in ("log_ratio_clamp", "kl_clamp")})
        assert abs(float(unclamped.detach()) - float(ref_loss.detach())) > 1e-4


def test_reduction_weights_reproduce_the_loss_types():
    """loss_weights = token_weights(mask) (the loss type's own reduction) gives the loss type's loss, and the
    entropy bonus as weights gives entropy_coef's masked mean."""
    inputs = make_batch(batch=3, seq=9, vocab=37, seed=6)
    mask = inputs["mask"]
    for loss_type in ("grpo", "bnpo", "dapo", "luspo"):
        config = LossConfig(loss_type=loss_type, entropy_coef=0.03)
        plain, _ = gf.grpo_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"], mask,
                                old_logps=inputs["old_logps"], config=config)
        weighted, _ = gf.grpo_loss(
            inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"], mask,
            old_logps=inputs["old_logps"], **grouped(loss_type=loss_type,
                                                     loss_weights=token_weights(mask.float(), config),
                                                     entropy_weights=0.03 * mask.float() / mask.sum()))
        assert_close(weighted, plain, 1e-6, name=loss_type)


def test_weights_keep_three_passes_and_bad_options_raise():
    inputs = make_batch(batch=2, seq=48, vocab=200, seed=1, masked_fraction=0.0)
    inputs["mask"][:] = True
    hidden = inputs["hidden"].clone().requires_grad_()
    weight = inputs["weight"].clone().requires_grad_()
    targets = inputs["targets"].clamp(min=0)
    with GemmCounter() as counter:
        gf.grpo_loss(hidden, weight, targets, inputs["advantages"], inputs["mask"], ref_logps=inputs["old_logps"],
                     **grouped(loss_weights=weights_for(inputs["mask"]).float(), log_ratio_clamp=20.0, kl_clamp=10.0,
                               beta=0.1, backend="torch", chunk_bytes=20_000))[0].backward()
    assert counter.flops / (2 * 96 * hidden.shape[-1] * 200) == 3
    call = lambda **kw: gf.grpo_loss(inputs["hidden"], inputs["weight"], targets, inputs["advantages"],  # noqa
                                     inputs["mask"], **grouped(**kw))
    with pytest.raises(ValueError, match=r"pass entropy_coef=0.0 with them, got entropy_coef=0.01"):
        call(entropy_weights=inputs["mask"].float(), entropy_coef=0.01)
    with pytest.raises(ValueError, match=r"loss_weights must have shape \(2, 48\) \(like targets\), got \(2, 3\)"):
        call(loss_weights=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"kl_clamp must be a finite number > 0 \(LossConfig.kl_clamp\), got -1.0"):
        call(kl_clamp=-1.0)


def test_packed_rows_with_per_token_advantages_and_weights_equal_the_padded_batch(backend):
    """verl's remove-padding layout: the sequences' tokens one after another in a single (N, H) row. With per-token
    advantages and loss_weights carrying each sequence's normalizer (grpo: 1 / (its length x B)), the loss and
    the gradients equal the padded (B, T) batch's."""
    inputs = make_batch(batch=3, seq=9, vocab=37, seed=9)
    mask = inputs["mask"]
    kw = dict(loss_type="grpo", backend=backend, chunk_bytes=37 * 4 * 5)
    leaves = [inputs[k].clone().requires_grad_() for k in ("hidden", "weight")]
    padded, _ = gf.grpo_loss(*leaves, inputs["targets"], inputs["advantages"], mask, old_logps=inputs["old_logps"],
                             **grouped(**kw))
    padded_grads = torch.autograd.grad(padded, leaves)

    rows = mask.nonzero()                                   # (N, 2) packed order: sequence by sequence
    lengths = mask.sum(1)
    packed_leaves = [inputs["hidden"][mask].clone().requires_grad_(), inputs["weight"].clone().requires_grad_()]
    packed, _ = gf.grpo_loss(
        *packed_leaves, inputs["targets"][mask], inputs["advantages"][rows[:, 0]],
        torch.ones(rows.shape[0], dtype=torch.bool, device=DEVICE), old_logps=inputs["old_logps"][mask],
        **grouped(loss_weights=1.0 / (lengths[rows[:, 0]].float() * mask.shape[0]), **kw))
    assert_close(packed, padded, 1e-6, name="loss")
    d_hidden, d_weight = torch.autograd.grad(packed, packed_leaves)
    assert_close(d_hidden, padded_grads[0][mask], 1e-6, atol=1e-9, name="dhidden")
    assert_close(d_weight, padded_grads[1], 1e-6, atol=1e-9, name="dweight")
