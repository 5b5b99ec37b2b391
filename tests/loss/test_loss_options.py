"""How the loss entries take the loss options: LossConfig's fields as keywords (GRPOLoss(**options),
grpo_loss(..., **options)) or one LossConfig, the same loss and gradients either way; an unknown keyword is a
one-line ValueError naming it."""

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import as_float64, assert_close, make_batch

OPTIONS = dict(loss_type="grpo", epsilon_low=0.15, epsilon_high=0.28, delta=1.5, beta=0.04,
               use_bias_correction_kl=True, entropy_coef=0.01)
TRANSFORM = dict(temperature=0.9, logit_scale=1.2, logit_softcap=4.0)
TENSORS = ("hidden", "weight", "targets", "advantages", "mask")


def unknown_keyword_error(make) -> str:
    with pytest.raises(ValueError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("config", [None, gf.LossConfig(loss_type="grpo")], ids=["keywords", "config"])
def test_unknown_keyword_names_it(config):
    inputs = make_batch()
    tensors = [inputs[k] for k in TENSORS]
    for make in (lambda: gf.GRPOLoss(config, epsilon=0.2),
                 lambda: gf.grpo_loss(*tensors, config=config, epsilon=0.2)):
        message = unknown_keyword_error(make)
        assert message.startswith("unknown keyword argument epsilon=0.2: expected a loss option")
        assert "epsilon_low, epsilon_high" in message          # what was expected


def test_loss_keywords_config_and_function_agree_in_float64():
    """GRPOLoss(**options) = GRPOLoss(LossConfig(**options)) = grpo_loss(..., **options), loss and d(hidden,
    weight, bias), in float64 on the torch backend; and all three equal the full-logits reference."""
    inputs = as_float64(make_batch(seed=12, bias=True))
    module_keywords = gf.GRPOLoss(**OPTIONS, **TRANSFORM, backend="torch")
    module_config = gf.GRPOLoss(gf.LossConfig(**OPTIONS), **TRANSFORM, backend="torch")
    assert module_keywords.config == module_config.config == gf.LossConfig(**OPTIONS)

    def run(fn):
        hidden, weight, bias = (inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss, _ = fn(hidden, weight, inputs["targets"], inputs["advantages"], inputs["mask"],
                     old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], bias=bias,
                     is_ratio=inputs["is_ratio"], num_items_in_batch=20)
        return [loss, *torch.autograd.grad(loss, (hidden, weight, bias))]

    results = [
        run(module_keywords),
        run(module_config),
        run(lambda *args, **kwargs: gf.grpo_loss(*args, **kwargs, **OPTIONS, **TRANSFORM, backend="torch")),
    ]
    assert results[0][0].dtype == torch.float64
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    expected = run(lambda *args, **kwargs: reference.grpo_loss(*args, **kwargs, **OPTIONS, **TRANSFORM))
    for name, actual, wanted in zip(("loss", "hidden", "weight", "bias"), results[0], expected):
        assert_close(actual, wanted, 1e-10, atol=1e-12, name=name)


def test_module_keeps_its_own_options_explicit():
    module = gf.GRPOLoss(loss_type="cispo", epsilon_high=5.0, chunk_bytes=4096, backend="torch", temperature=0.7)
    assert (module.chunk_bytes, module.backend, module.transform.temperature) == (4096, "torch", 0.7)
    assert module.config.loss_type == "cispo" and "cispo" in repr(module)
    with pytest.raises(TypeError, match="config must be a grpo_fast.LossConfig or None, got str"):
        gf.GRPOLoss("dapo")                         # the one positional argument is the config
