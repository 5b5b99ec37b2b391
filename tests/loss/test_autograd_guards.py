"""What the chunked gradients cannot do raises instead of returning a wrong number: double backward, and in-place
changes of hidden / weight / bias between the forward and the backward. And what they can do beyond hidden, weight
and bias: gradients to advantages, old_logps, ref_logps and is_ratio, as the full-logits reference gives them."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.variants import LOSS_TYPES
from tests.helpers import as_float64, assert_close, flat, forward_grouped, grouped, make_batch

LEVELS = ["token", "sequence"]       # fused (gradient in the forward) and two-phase (through token_logprobs)


def loss_inputs(seed=0):
    """make_batch's loss inputs with a bias; hidden, weight and bias require grad."""
    inputs = make_batch(seed=seed, bias=True)
    del inputs["is_ratio"], inputs["ref_logps"]
    for key in ("hidden", "weight", "bias"):
        inputs[key] = inputs[key].clone().requires_grad_()
    return inputs


def call_loss(fn, inputs, level, backend=None):
    options = dict(importance_sampling_level=level, loss_type="grpo", entropy_coef=0.01)
    if backend is not None:
        options["backend"] = backend
    return flat(fn)(**inputs, **options)[0]


def penalized_step(fn, inputs, level, backend=None):
    """loss + a gradient penalty on d(loss)/d(hidden), backpropagated: needs the gradient's own graph."""
    loss = call_loss(fn, inputs, level, backend)
    (grad,) = torch.autograd.grad(loss, inputs["hidden"], create_graph=True)
    (loss + (grad**2).sum()).backward()


@pytest.mark.parametrize("level", LEVELS)
def test_grpo_loss_double_backward_raises(level, backend):
    inputs = loss_inputs()
    with pytest.raises(RuntimeError, match=r"grpo_loss does not support double backward \(create_graph=True\).*"
                                           r"use grpo_fast\.reference\.grpo_loss for higher-order gradients"):
        penalized_step(gf.grpo_loss, inputs, level, backend)
    # The reference the message points to does take the penalty into account.
    ref_inputs = loss_inputs()
    penalized_step(reference.grpo_loss, ref_inputs, level)
    plain = loss_inputs()
    call_loss(reference.grpo_loss, plain, level).backward()
    assert not torch.allclose(ref_inputs["hidden"].grad, plain["hidden"].grad)


def test_token_logprobs_double_backward_raises(backend):
    inputs = loss_inputs()
    hidden, mask = inputs["hidden"], inputs["mask"]
    logp = gf.token_logprobs(hidden[mask], inputs["weight"], inputs["targets"][mask], bias=inputs["bias"],
                             **grouped(backend=backend))
    with pytest.raises(RuntimeError, match=r"token_logprobs does not support double backward .*"
                                           r"grpo_fast\.reference\.token_logprobs"):
        (grad,) = torch.autograd.grad(logp.sum(), hidden, create_graph=True)
        (grad**2).sum().backward()


def test_fused_token_loss_double_backward_names_itself_and_what_to_use(backend):
    """It named grpo_loss and a grpo_fast.reference.fused_token_loss that does not exist."""
    inputs = loss_inputs()
    loss = gf.fused_token_loss(inputs["hidden"], inputs["weight"], inputs["targets"],
                               gf.autograd_token_loss(lambda logp, entropy, index: logp.sum()), mask=inputs["mask"],
                               bias=inputs["bias"], **grouped(backend=backend))
    with pytest.raises(RuntimeError, match=r"^fused_token_loss does not support double backward .* use "
                                           r"grpo_fast\.reference\.token_logprobs and your loss in torch for "
                                           r"higher-order gradients$"):
        (grad,) = torch.autograd.grad(loss, inputs["hidden"], create_graph=True)
        (grad**2).sum().backward()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("name", ["hidden", "weight", "bias"])
def test_grpo_loss_inplace_change_before_backward_raises(name, level, backend):
    inputs = loss_inputs()
    loss = call_loss(gf.grpo_loss, inputs, level, backend)
    with torch.no_grad():
        inputs[name].mul_(2.0)
    with pytest.raises(RuntimeError, match=f"{name} was modified in place between grpo_loss's forward and "
                                           r"backward \(version 0 -> 1\): its gradient was computed from the old"):
        loss.backward()
    if name == "bias":      # the reference's addition saves no bias: its gradient stays that of the old values
        return
    # The full-logits reference refuses the same sequence of calls.
    ref_inputs = loss_inputs()
    ref_loss = call_loss(reference.grpo_loss, ref_inputs, level)
    with torch.no_grad():
        ref_inputs[name].mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        ref_loss.backward()


@pytest.mark.parametrize("level", LEVELS)
def test_grpo_loss_inplace_change_of_hidden_base_or_frozen_weight_raises(level, backend):
    """hidden as a view of the model's output (the change reaches it through the base), and a frozen weight
    (d(hidden) is computed from it)."""
    inputs = loss_inputs()
    full = torch.randn(*inputs["hidden"].shape[:2], inputs["hidden"].shape[2] + 1).requires_grad_()
    base = full * 1.0
    inputs["hidden"] = base[..., 1:]
    loss = call_loss(gf.grpo_loss, inputs, level, backend)
    with torch.no_grad():
        base.add_(1.0)
    with pytest.raises(RuntimeError, match="hidden was modified in place between grpo_loss's forward and backward"):
        loss.backward()

    inputs = loss_inputs()
    inputs["weight"].requires_grad_(False)
    loss = call_loss(gf.grpo_loss, inputs, level, backend)
    with torch.no_grad():
        inputs["weight"].add_(1.0)
    with pytest.raises(RuntimeError, match="weight was modified in place between grpo_loss's forward and backward"):
        loss.backward()


@pytest.mark.parametrize("contiguous", [True, False])
@pytest.mark.parametrize("name", ["hidden", "weight", "bias"])
def test_token_logprobs_inplace_change_before_backward_raises(name, contiguous, backend):
    """A non-contiguous hidden reaches the autograd function as a copy: torch's saved-tensor check cannot see it."""
    inputs = loss_inputs()
    if not contiguous:
        inputs["hidden"] = inputs["hidden"].detach().transpose(0, 1).contiguous().transpose(0, 1).requires_grad_()
        assert not inputs["hidden"].is_contiguous()
    targets = inputs["targets"].clamp(min=0)
    logp = gf.token_logprobs(inputs["hidden"], inputs["weight"], targets, bias=inputs["bias"],
                             **grouped(backend=backend))
    with torch.no_grad():
        inputs[name].mul_(2.0)
    with pytest.raises(RuntimeError, match=f"{name} was modified in place between token_logprobs's forward and "
                                           r"backward \(version 0 -> 1\)"):
        logp.sum().backward()


@pytest.mark.parametrize("level", LEVELS)
def test_training_steps_and_repeated_backward_still_work(level, backend):
    """forward, backward, optimizer.step() in a loop; the forward leaves its inputs' versions alone; a retained
    graph can be backpropagated twice (with a scale); evaluation under no_grad ignores later changes."""
    torch.manual_seed(0)
    inputs = loss_inputs()
    layer = torch.nn.Linear(inputs["hidden"].shape[-1], inputs["hidden"].shape[-1])
    params = [layer.weight, layer.bias, inputs["weight"], inputs["bias"]]
    optimizer = torch.optim.SGD(params, lr=0.1)
    source = inputs.pop("hidden").detach()
    for _ in range(3):
        hidden = layer(source)
        versions = [t._version for t in (hidden, inputs["weight"], inputs["bias"])]
        loss = call_loss(gf.grpo_loss, dict(inputs, hidden=hidden), level, backend)
        assert [t._version for t in (hidden, inputs["weight"], inputs["bias"])] == versions
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()

    loss = call_loss(gf.grpo_loss, dict(inputs, hidden=layer(source)), level, backend)
    (once,) = torch.autograd.grad(loss, inputs["weight"], retain_graph=True)
    (twice,) = torch.autograd.grad(-2.0 * loss, inputs["weight"])
    torch.testing.assert_close(twice, -2.0 * once)

    with torch.no_grad():
        loss = call_loss(gf.grpo_loss, dict(inputs, hidden=layer(source)), level, backend)
        inputs["weight"].add_(1.0)
    assert torch.isfinite(loss) and not loss.requires_grad


# ------------------------------------------------- gradients to the per-token inputs (a learned baseline, say)
SIDE_INPUTS = ("advantages", "old_logps", "ref_logps", "is_ratio")
SIDE_OPTIONS = {"dr_grpo": dict(max_completion_length=8), "cispo": dict(epsilon_high=1.1)}


def side_inputs(seed=0, per_token_adv=False):
    """Small loss inputs (hidden, weight, bias require grad) whose old log-probs lie near the policy's (ratios
    around 1, some clipped), so that no variant's weights vanish."""
    inputs = make_batch(batch=3, seq=6, vocab=19, seed=seed, bias=True, per_token_adv=per_token_adv)
    gen = torch.Generator().manual_seed(seed + 1)
    logp = reference.token_logprobs(inputs["hidden"], inputs["weight"], inputs["targets"], bias=inputs["bias"])
    noise = 0.3 * torch.randn(logp.shape, generator=gen)
    inputs["old_logps"] = torch.where(inputs["mask"], logp + noise, inputs["old_logps"])
    for key in ("hidden", "weight", "bias"):
        inputs[key] = inputs[key].clone().requires_grad_()
    return inputs


def side_grads(fn, inputs, options, names=SIDE_INPUTS + ("hidden",)):
    """(loss, {name: d(loss)/d(name)}) with fresh leaves for `names`; zeros where the loss does not depend on one
    (cispo's and vespo's detached weights)."""
    inputs = {k: (v.detach().clone().requires_grad_() if k in names else v) for k, v in inputs.items()}
    loss, _ = flat(fn)(**inputs, **options)
    grads = torch.autograd.grad(loss, [inputs[k] for k in names], allow_unused=True, materialize_grads=True)
    return loss, dict(zip(names, grads))


def assert_side_grads_match(inputs, options, backend, names=SIDE_INPUTS + ("hidden",)):
    loss, grads = side_grads(gf.grpo_loss, inputs, dict(options, backend=backend), names)
    ref_loss, ref_grads = side_grads(reference.grpo_loss, as_float64(inputs), options, names)
    assert ref_grads["advantages"].abs().max() > 0
    assert_close(loss, ref_loss, 1e-5, atol=1e-7, name="loss")
    for name in names:
        assert grads[name].dtype == inputs[name].dtype
        assert_close(grads[name], ref_grads[name], 1e-5, atol=1e-7, name=f"d{name}")
    return loss


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("loss_type", sorted(LOSS_TYPES))
def test_grpo_loss_gradients_to_advantages_and_log_probs_match_reference(loss_type, level, backend):
    """Every registered variant: d(loss)/d(advantages, old_logps, ref_logps, is_ratio) as the float64 reference's,
    and the loss unchanged by asking for them."""
    inputs = side_inputs()
    options = dict(loss_type=loss_type, importance_sampling_level=level, beta=0.04, use_bias_correction_kl=True,
                   entropy_coef=0.01, **SIDE_OPTIONS.get(loss_type, {}))
    loss = assert_side_grads_match(inputs, options, backend)
    plain, _ = gf.grpo_loss(**grouped(**inputs, **options, backend=backend))
    assert torch.equal(loss, plain)


@pytest.mark.parametrize("frozen_head", [False, True])
def test_grpo_loss_module_learned_baseline_gradient(frozen_head, backend):
    """Per-token advantages A = returns - baseline with a trainable baseline, through GRPOLoss; with a frozen LM
    head and constant hidden states too (the loss then depends on the baseline alone)."""
    inputs = side_inputs(seed=1, per_token_adv=True)
    if frozen_head:
        for key in ("hidden", "weight", "bias"):
            inputs[key] = inputs[key].detach()
    module = gf.GRPOLoss(**grouped(loss_type="grpo", epsilon_high=0.28, delta=1.5, backend=backend))
    returns = inputs.pop("advantages")
    del inputs["ref_logps"]
    baseline = torch.zeros_like(returns).requires_grad_()
    loss, _ = module(**forward_grouped(advantages=returns - baseline, **inputs))
    (grad,) = torch.autograd.grad(loss, baseline)
    ref_baseline = torch.zeros_like(returns, dtype=torch.float64).requires_grad_()
    ref_inputs = as_float64(inputs)
    ref_loss, _ = flat(reference.grpo_loss)(advantages=returns.double() - ref_baseline, **ref_inputs, loss_type="grpo",
                                      epsilon_high=0.28, delta=1.5)
    (ref_grad,) = torch.autograd.grad(ref_loss, ref_baseline)
    assert ref_grad.abs().max() > 0
    assert_close(grad, ref_grad, 1e-5, atol=1e-7, name="d(baseline)")

    with torch.no_grad():
        loss, _ = module(**forward_grouped(advantages=returns - baseline, **inputs))
    assert not loss.requires_grad
