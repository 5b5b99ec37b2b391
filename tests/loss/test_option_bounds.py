"""The bounds of the numbers the loss math takes in float32 (grpo_fast.fields): a value past its bound is refused at
construction with one line naming the field, its range and the value; a value at the bound still gives a finite loss
and gradients equal to the float64 reference; numpy scalars are taken by every option group as Python numbers."""

import dataclasses
import re

import numpy as np
import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.fields import FP32_MAX, hints
from tests.helpers import as_float64, assert_close, flat, grouped, make_batch

# A large finite number passed to the loss used to die in torch.clamp ("value cannot be converted to type float
# without overflow"), or gave NaN (temperature 1e-40: logits / T overflow).
REFUSED = [
    (lambda: gf.LossConfig(epsilon_high=1e39),
     "epsilon_high must be a finite number in [0, 3.4028234663852886e+38] (LossConfig.epsilon_high), got 1e+39"),
    (lambda: gf.LossConfig(beta=1e38), "beta must be a finite number in [0, 1e+18] (LossConfig.beta), got 1e+38"),
    (lambda: gf.LossConfig(max_completion_length=10**30),
     f"max_completion_length must be in [1, 2147483647] (LossConfig.max_completion_length), got {10**30}"),
    (lambda: gf.LossConfig(loss_type="sapo", sapo_temperature_neg=1e-20),
     "sapo_temperature_neg must be a finite number in [1e-18, 1e+18] (LossConfig.sapo_temperature_neg), got 1e-20"),
    (lambda: gf.LossConfig(entropy_coef=-2e18),
     "entropy_coef must be a finite number in [-1e+18, 1e+18] (LossConfig.entropy_coef), got -2e+18"),
    (lambda: gf.LogitTransform(temperature=1e-40),
     "temperature must be in [1e-09, 1e+09] (LogitTransform.temperature), got 1e-40"),
    (lambda: gf.LogitTransform(scale=-1e20),
     "logit_scale must be in [-1e+09, 1e+09] (LogitTransform.scale), got -1e+20"),
    (lambda: gf.LogitTransform(softcap=1e-10),
     "logit_softcap must be in [1e-09, 1e+09] (LogitTransform.softcap), got 1e-10"),
    (lambda: gf.TokenWeights(num_items_in_batch=1e19),
     "num_items_in_batch must be a finite number in [0, 1e+18] or None (TokenWeights.num_items_in_batch), got 1e+19"),
    (lambda: gf.TokenWeights(num_items_in_batch=torch.tensor(1e19)),
     "num_items_in_batch must be in [0, 1e+18] (TokenWeights.num_items_in_batch), got 9.999999980506448e+18"),
]


@pytest.mark.parametrize("make,message", REFUSED, ids=[m.split()[0] + str(i) for i, (_, m) in enumerate(REFUSED)])
def test_a_number_past_its_bound_is_refused_at_construction(make, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        make()


def test_every_numeric_loss_option_has_a_bound_that_refuses_past_it():
    """Each int / float field of LossConfig has a bound, and the next value past its upper end is refused naming
    the field and the bound."""
    kinds = hints(gf.LossConfig)
    numeric = [item for item in dataclasses.fields(gf.LossConfig) if item.metadata["rule"] is not None]
    assert {item.name for item in numeric} == {name for name, kind in kinds.items()
                                               if re.search(r"\b(int|float)\b", str(kind))}
    for item in numeric:
        bound = item.metadata["rule"].bound
        assert bound is not None, item.name
        high = float(bound.text.rstrip("]").rpartition(", ")[2])
        past = int(high) + 1 if "int" in str(kinds[item.name]) else min(high * 2, 1e300)
        with pytest.raises(ValueError, match=rf"^{item.name} must be (a finite number )?{re.escape(bound.text)} "
                                             rf"\(LossConfig.{item.name}\), got "):
            gf.LossConfig(**{item.name: past})


# a value at (or just inside) each bound: the loss and its gradients stay finite and equal the float64 reference
AT_THE_BOUND = {
    "epsilon_fp32_max": dict(loss_type="dapo", epsilon_low=FP32_MAX, epsilon_high=FP32_MAX),
    "cispo_cap_fp32_max": dict(loss_type="cispo", epsilon_high=FP32_MAX),
    "delta_fp32_max": dict(loss_type="grpo", delta=FP32_MAX, beta=0.04),
    "beta_1e18": dict(loss_type="bnpo", beta=1e18, use_bias_correction_kl=True),
    "entropy_coef_-1e18": dict(entropy_coef=-1e18),
    "sapo_temperatures": dict(loss_type="sapo", sapo_temperature_pos=1e18, sapo_temperature_neg=1e-18),
    "vespo_fp32_max": dict(loss_type="vespo", vespo_k_pos=FP32_MAX, vespo_lambda_neg=FP32_MAX),
    "clamps_fp32_max": dict(beta=0.04, log_ratio_clamp=FP32_MAX, kl_clamp=FP32_MAX),
    "dr_grpo_length": dict(loss_type="dr_grpo", max_completion_length=2**31 - 1),
    # the transform's factors at their ends, paired so that the distribution stays one a float32 can resolve
    "temperature_and_scale_1e-9": dict(temperature=1e-9, logit_scale=1e-9),
    "transform_1e-9": dict(temperature=1e-9, logit_scale=1e-9, logit_softcap=1e-9),
    "transform_1e9": dict(temperature=1e9, logit_scale=-1e9, logit_softcap=1e9),
    "scale_1e9": dict(logit_scale=1e9),
    # alone: a near one-hot distribution, logits / T ~ 1e9, still finite
    "temperature_1e-9": dict(temperature=1e-9),
    "num_items_1e18": dict(num_items_in_batch=1e18),
}


@pytest.mark.parametrize("name", sorted(AT_THE_BOUND))
def test_a_value_at_its_bound_gives_the_float64_reference(name, backend):
    options = AT_THE_BOUND[name]
    inputs = make_batch(seed=3)
    inputs["advantages"] = inputs["advantages"].abs() + 0.5     # one sign: a loss of no cancellation, so rtol holds
    sides = {"old_logps": inputs["old_logps"], "ref_logps": inputs["ref_logps"]}
    leaves = [inputs[k].clone().requires_grad_() for k in ("hidden", "weight")]
    loss, _ = gf.grpo_loss(*leaves, inputs["targets"], inputs["advantages"], inputs["mask"], **sides,
                           **grouped(backend=backend, **{"entropy_coef": 0.01, **options}))
    exact = as_float64(inputs)
    exact_leaves = [exact[k].clone().requires_grad_() for k in ("hidden", "weight")]
    expected, _ = flat(reference.grpo_loss)(*exact_leaves, inputs["targets"], exact["advantages"], inputs["mask"],
                                            old_logps=exact["old_logps"], ref_logps=exact["ref_logps"],
                                            **{"entropy_coef": 0.01, **options})
    assert torch.isfinite(expected), "the float64 reference itself is not finite: the case shows nothing"
    assert_close(loss, expected, 1e-5, atol=1e-30, name="loss")
    for part, got, want in zip(("hidden", "weight"), torch.autograd.grad(loss, leaves),
                               torch.autograd.grad(expected, exact_leaves)):
        assert_close(got, want, 1e-5, atol=1e-30, name=f"d{part}")


def test_every_option_group_takes_numpy_scalars_as_python_numbers():
    """np.float32 / np.int64 / np.bool_ in LossConfig, LogitTransform, Execution and TokenWeights: stored as the
    Python numbers they hold, and the loss equals the one of those numbers."""
    config = gf.LossConfig(loss_type="dr_grpo", epsilon_low=np.float32(0.2), beta=np.float64(0.04),
                           max_completion_length=np.int64(12), use_bias_correction_kl=np.bool_(True))
    transform = gf.LogitTransform(temperature=np.float32(0.7), scale=np.int64(2), softcap=np.float32(5.0))
    execution = gf.Execution(chunk_bytes=np.int64(37 * 4 * 5), backend="torch")
    weights = gf.TokenWeights(num_items_in_batch=np.int64(20))
    stored = [config.epsilon_low, config.beta, config.max_completion_length, config.use_bias_correction_kl,
              transform.temperature, transform.scale, transform.softcap, execution.chunk_bytes,
              weights.num_items_in_batch]
    assert [type(value) for value in stored] == [float, float, int, bool, float, float, float, int, int]
    assert (config.epsilon_low, transform.temperature, execution.chunk_bytes) == (float(np.float32(0.2)),
                                                                                  float(np.float32(0.7)), 740)
    plain = dict(config=gf.LossConfig(loss_type="dr_grpo", epsilon_low=float(np.float32(0.2)), beta=0.04,
                                      max_completion_length=12, use_bias_correction_kl=True),
                 transform=gf.LogitTransform(temperature=float(np.float32(0.7)), scale=2.0, softcap=5.0),
                 execution=gf.Execution(chunk_bytes=740, backend="torch"),
                 weights=gf.TokenWeights(num_items_in_batch=20))
    inputs = make_batch(seed=5)
    tensors = [inputs[k] for k in ("hidden", "weight", "targets", "advantages", "mask")]
    sides = {"old_logps": inputs["old_logps"], "ref_logps": inputs["ref_logps"]}
    loss, _ = gf.grpo_loss(*tensors, **sides, config=config, transform=transform, execution=execution,
                           weights=weights)
    assert torch.equal(loss, gf.grpo_loss(*tensors, **sides, **plain)[0])
