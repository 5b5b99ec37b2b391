"""How the loss entries take their options: one LossConfig (or a loss-type name), a LogitTransform, an Execution
and TokenWeights, the same loss and gradients as the full-logits reference's flat keywords; a keyword that moved
into a group is a one-line TypeError naming its new home, and the groups' checks name the field."""

import re

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import as_float64, assert_close, flat, grouped, make_batch

OPTIONS = dict(loss_type="grpo", epsilon_low=0.15, epsilon_high=0.28, delta=1.5, beta=0.04,
               use_bias_correction_kl=True, entropy_coef=0.01)
TRANSFORM = dict(temperature=0.9, logit_scale=1.2, logit_softcap=4.0)
TENSORS = ("hidden", "weight", "targets", "advantages", "mask")


def one_line_type_error(make) -> str:
    with pytest.raises(TypeError) as info:
        make()
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("keyword,value,home", [
    ("temperature", 0.7, "transform=LogitTransform(temperature=...)"),
    ("logit_scale", 1.2, "transform=LogitTransform(scale=...)"),
    ("logit_softcap", 4.0, "transform=LogitTransform(softcap=...)"),
    ("kept_ids", torch.arange(3), "transform=LogitTransform(kept=KeptSet(ids, offsets))"),
    ("chunk_bytes", 4096, "execution=Execution(chunk_bytes=...)"),
    ("backend", "torch", "execution=Execution(backend=...)"),
    ("process_group", None, "execution=Execution(process_group=...)"),
    ("num_items_in_batch", 20, "weights=TokenWeights(num_items_in_batch=...)"),
    ("is_ratio", torch.ones(3, 9), "weights=TokenWeights(is_ratio=...)"),
    ("beta", 0.04, "config=LossConfig(beta=...)"),
    ("loss_type", "grpo", "config=LossConfig(loss_type=...)"),
])
def test_moved_keyword_names_its_new_home(keyword, value, home):
    inputs = make_batch()
    tensors = [inputs[k] for k in TENSORS]
    shown = "<tensor (3,) torch.int64>" if keyword == "kept_ids" else \
        "<tensor (3, 9) torch.float32>" if keyword == "is_ratio" else repr(value)
    message = one_line_type_error(lambda: gf.grpo_loss(*tensors, **{keyword: value}))
    assert message == f"grpo_loss() got {keyword}={shown}: it moved to {home}"
    if home.startswith(("transform=", "execution=")):
        for entry, call in (("token_logprobs", lambda: gf.token_logprobs(*tensors[:3], **{keyword: value})),
                            ("fused_token_loss", lambda: gf.fused_token_loss(*tensors[:3], None, **{keyword: value})),
                            ("GRPOLoss", lambda: gf.GRPOLoss(**{keyword: value}))):
            if keyword == "kept_ids" and entry == "GRPOLoss":
                continue
            message = one_line_type_error(call)
            assert message == f"{entry}() got {keyword}={shown}: it moved to {home}"


def test_module_forward_names_the_new_homes():
    inputs = make_batch()
    tensors = [inputs[k] for k in TENSORS]
    module = gf.GRPOLoss()
    for keyword, value, home in (("kept_offsets", torch.arange(3), "kept=KeptSet(ids, offsets)"),
                                 ("num_items_in_batch", 20, "weights=TokenWeights(num_items_in_batch=...)"),
                                 ("temperature", 0.7, "GRPOLoss(transform=LogitTransform(temperature=...))"),
                                 ("backend", "torch", "GRPOLoss(execution=Execution(backend=...))"),
                                 ("beta", 0.1, "GRPOLoss(config=LossConfig(beta=...))")):
        message = one_line_type_error(lambda: module(*tensors, **{keyword: value}))
        assert message.startswith(f"GRPOLoss.forward() got {keyword}=") and message.endswith(f"it moved to {home}")


@pytest.mark.parametrize("config", ["grpo", gf.LossConfig(loss_type="grpo")], ids=["name", "config"])
def test_unknown_keyword_names_it(config):
    inputs = make_batch()
    tensors = [inputs[k] for k in TENSORS]
    for make in (lambda: gf.GRPOLoss(config, epsilon=0.2),
                 lambda: gf.grpo_loss(*tensors, config=config, epsilon=0.2)):
        message = one_line_type_error(make)
        assert "unknown keyword argument epsilon=0.2: expected one of " in message
        assert "epsilon_low, epsilon_high" in message          # what was expected


def test_unknown_keyword_of_each_entry_lists_its_keywords():
    """An unknown keyword of any entry fails with one line: the entry, the keyword and value, the entry's own
    keywords and the close names (its own, or a moved one's with its new home)."""
    hidden, weight, targets = torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long)
    message = one_line_type_error(lambda: gf.token_logprobs(hidden, weight, targets, retrun_entropy=True))
    assert message == ("token_logprobs() got an unknown keyword argument retrun_entropy=True: expected one of "
                       "hidden, weight, targets, bias, transform, execution, return_entropy, return_sum_pi_squared; "
                       "close: return_entropy")
    message = one_line_type_error(lambda: gf.fused_token_loss(hidden, weight, targets, lambda *a: None, temprature=1))
    assert message.endswith("close: temperature in transform=LogitTransform(...)"), message
    inputs = make_batch()
    message = one_line_type_error(lambda: gf.GRPOLoss("grpo")(*[inputs[k] for k in TENSORS], old_logp=None))
    assert message.startswith("GRPOLoss.forward() got an unknown keyword argument old_logp=None: expected one of ")
    assert message.endswith("close: old_logps"), message


def test_loss_keywords_config_and_function_agree_in_float64():
    """GRPOLoss(LossConfig(**options), transform=, execution=) = grpo_loss(..., config=LossConfig(**options), ...),
    loss and d(hidden, weight, bias), in float64 on the torch backend; and both equal the full-logits reference
    called with the same option groups."""
    inputs = as_float64(make_batch(seed=12, bias=True))
    module_keywords = gf.GRPOLoss(**grouped(**OPTIONS, **TRANSFORM, backend="torch"))
    module_config = gf.GRPOLoss(gf.LossConfig(**OPTIONS), **grouped(**TRANSFORM, backend="torch"))
    assert module_keywords.config == module_config.config == gf.LossConfig(**OPTIONS)

    def run(fn, regroup=True):
        hidden, weight, bias = (inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss, _ = (flat(fn) if regroup else fn)(hidden, weight, inputs["targets"], inputs["advantages"], inputs["mask"],
                           old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], bias=bias,
                           is_ratio=inputs["is_ratio"], num_items_in_batch=20)
        return [loss, *torch.autograd.grad(loss, (hidden, weight, bias))]

    results = [
        run(module_keywords),
        run(module_config),
        run(lambda *args, **kwargs: gf.grpo_loss(*args, **grouped(**kwargs, **OPTIONS, **TRANSFORM,
                                                                  backend="torch")), regroup=False),
    ]
    assert results[0][0].dtype == torch.float64
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
    expected = run(lambda *args, **kwargs: flat(reference.grpo_loss)(*args, **kwargs, **OPTIONS, **TRANSFORM),
                   regroup=False)
    for name, actual, wanted in zip(("loss", "hidden", "weight", "bias"), results[0], expected):
        assert_close(actual, wanted, 1e-10, atol=1e-12, name=name)


def test_module_keeps_its_own_options_explicit():
    module = gf.GRPOLoss(**grouped(loss_type="cispo", epsilon_high=5.0, chunk_bytes=4096, backend="torch",
                                   temperature=0.7))
    assert (module.execution.chunk_bytes, module.execution.backend, module.transform.temperature) == (4096, "torch",
                                                                                                      0.7)
    assert module.config.loss_type == "cispo" and "cispo" in repr(module)
    assert gf.GRPOLoss("dapo").config == gf.LossConfig()           # the one positional argument is the config
    with pytest.raises(TypeError, match="config must be a grpo_fast.LossConfig, a loss type name .* got dict"):
        gf.GRPOLoss({"loss_type": "dapo"})
    with pytest.raises(TypeError, match="transform must be a grpo_fast.LogitTransform or None, got dict"):
        gf.GRPOLoss(transform={"temperature": 0.7})


@pytest.mark.parametrize("make,error,message", [
    (lambda: gf.LogitTransform(temperature=0.0), ValueError,
     "temperature must be > 0 (LogitTransform.temperature), got 0.0"),
    (lambda: gf.LogitTransform(temperature=float("inf")), TypeError,
     "temperature must be a finite float (LogitTransform.temperature), got inf"),
    (lambda: gf.LogitTransform(scale="2"), TypeError,
     "logit_scale must be a finite float (LogitTransform.scale), got '2'"),
    (lambda: gf.LogitTransform(softcap=-1.0), ValueError,
     "logit_softcap must be a finite float > 0 or None (LogitTransform.softcap), got -1.0"),
    (lambda: gf.LogitTransform(kept=(torch.arange(2), torch.arange(3))), TypeError,
     "kept must be a grpo_fast.KeptSet(ids, offsets) or None (LogitTransform.kept), got tuple"),
    (lambda: gf.Execution(chunk_bytes=0), ValueError,
     "chunk_bytes must be a positive int or None (Execution.chunk_bytes), got 0"),
    (lambda: gf.Execution(chunk_bytes=True), ValueError,
     "chunk_bytes must be a positive int or None (Execution.chunk_bytes), got True"),
    (lambda: gf.Execution(backend="cuda"), ValueError,
     "backend must be one of ('auto', 'torch', 'triton') (Execution.backend), got 'cuda'"),
    (lambda: gf.Execution(process_group="x"), TypeError,
     "process_group must be a torch.distributed.ProcessGroup or None (Execution.process_group), got 'x'"),
    (lambda: gf.LogitTransform(softcap=float("inf")), ValueError,
     "logit_softcap must be a finite float > 0 or None (LogitTransform.softcap), got inf"),
    (lambda: gf.TokenWeights(num_items_in_batch=float("nan")), ValueError,
     "num_items_in_batch must be a finite number >= 0 or None (TokenWeights.num_items_in_batch), got nan"),
    (lambda: gf.TokenWeights(num_items_in_batch=torch.tensor(float("inf"))), ValueError,
     "num_items_in_batch must be a finite number >= 0 (TokenWeights.num_items_in_batch), got inf"),
    (lambda: gf.TokenWeights(num_items_in_batch=torch.ones(2)), ValueError,
     "num_items_in_batch must be a number or a 1-element real tensor (TokenWeights.num_items_in_batch), got "
     "<tensor (2,) torch.float32>"),
    (lambda: gf.TokenWeights(loss_weights=[0.5, 0.5]), TypeError,
     "loss_weights must be a tensor like targets or None (TokenWeights.loss_weights), got [0.5, 0.5]"),
    (lambda: gf.LossConfig(epsilon_low="0.2"), TypeError, "LossConfig.epsilon_low expects float, got '0.2'"),
    (lambda: gf.LossConfig(epsilon_high=float("nan")), ValueError,
     "epsilon_high must be a finite number >= 0 (LossConfig.epsilon_high), got nan"),
    (lambda: gf.LossConfig(use_bias_correction_kl=1), TypeError,
     "LossConfig.use_bias_correction_kl expects bool, got 1"),
], ids=["temperature", "temperature_inf", "scale", "softcap", "kept", "chunk_bytes", "chunk_bytes_bool", "backend",
        "process_group", "softcap_inf", "num_items_nan", "num_items_tensor_inf", "num_items_shape", "loss_weights",
        "epsilon_low_text", "epsilon_high_nan", "bias_correction_int"])
def test_option_groups_name_the_field(make, error, message):
    with pytest.raises(error, match="^" + re.escape(message) + "$"):
        make()


def test_kept_set_is_built_from_ids_and_offsets():
    torch.manual_seed(0)
    ids, offsets = torch.tensor([2, 0, 1], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32)
    kept = gf.KeptSet(ids, offsets)
    assert torch.equal(kept.host_offsets, offsets) and kept.host_offsets.device.type == "cpu"
    transform = gf.LogitTransform(temperature=0.5, kept=kept)
    assert (transform.temperature, transform.scale, transform.softcap, transform.kept) == (0.5, 1.0, None, kept)
    assert "2 tokens, 3 ids" in repr(transform)
    hidden, weight, targets = torch.randn(2, 4), torch.randn(5, 4), torch.tensor([2, 1])
    logp = gf.token_logprobs(hidden, weight, targets, transform=transform)
    expected = reference.token_logprobs(hidden, weight, targets, temperature=0.5, kept_ids=ids, kept_offsets=offsets)
    assert_close(logp, expected, 1e-6)
