"""What the chunked gradients cannot do raises instead of returning a wrong number: double backward, and in-place
changes of hidden / weight / bias between the forward and the backward."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import make_batch

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
    return fn(**inputs, **options)[0]


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
                             backend=backend)
    with pytest.raises(RuntimeError, match=r"token_logprobs does not support double backward .*"
                                           r"grpo_fast\.reference\.token_logprobs"):
        (grad,) = torch.autograd.grad(logp.sum(), hidden, create_graph=True)
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
    logp = gf.token_logprobs(inputs["hidden"], inputs["weight"], targets, bias=inputs["bias"], backend=backend)
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
