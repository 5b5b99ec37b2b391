"""Bad input gets a clear error naming the argument, before any work is done."""

import re

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import as_float64, assert_close, flat, grouped, make_batch


def call(**changes):
    inputs = make_batch()
    del inputs["is_ratio"], inputs["bias"]
    inputs.update(changes)
    return gf.grpo_loss(**grouped(**inputs))


@pytest.mark.parametrize("changes,error,words", [
    (dict(hidden=torch.randn(16)), ValueError, "hidden must be (N, H) or (B, T, H)"),
    (dict(weight=torch.randn(37, 15)), ValueError, "weight must be (V, H) with H"),
    (dict(weight=torch.randn(37, 16, dtype=torch.float64)), TypeError, "hidden and weight must share a dtype"),
    (dict(hidden=torch.randint(0, 3, (3, 9, 16))), TypeError,
     "hidden must have dtype float16, bfloat16, float32 or float64, got torch.int64"),
    (dict(targets=torch.zeros(3, 9)), TypeError, "targets must be an integer tensor"),
    (dict(targets=torch.zeros(3, 8, dtype=torch.long)), ValueError, "targets must have shape"),
    (dict(mask=torch.ones(3, 8, dtype=torch.bool)), ValueError, "mask must have shape (3, 9)"),
    (dict(mask=torch.full((3, 9), 2)), ValueError, "mask must hold only 0 and 1"),
    (dict(advantages=torch.randn(4)), ValueError, "advantages must be (B,) = (3,) or (B, T)"),
    (dict(old_logps=torch.randn(3, 8)), ValueError, "old_logps must have shape (3, 9)"),
    (dict(ref_logps=torch.randn(9, 3), beta=0.1), ValueError, "ref_logps must have shape (3, 9)"),
    (dict(loss_type="ppo2"), ValueError, "loss_type must be one of"),
    (dict(importance_sampling_level="batch"), ValueError, "importance_sampling_level must be one of"),
    (dict(beta=0.1, ref_logps=None), ValueError, "beta = 0.1 > 0 needs ref_logps"),
    (dict(loss_type="dr_grpo"), ValueError, "loss_type='dr_grpo' requires max_completion_length"),
    (dict(temperature=0.0), ValueError, "temperature must be > 0"),
    (dict(logit_softcap=-1.0), ValueError, "logit_softcap must be a finite float > 0"),
    (dict(epsilon_low=-0.1), ValueError, "epsilon_low must be a finite number >= 0 (LossConfig.epsilon_low), got -0.1"),
    (dict(loss_type="vespo", vespo_k_pos=-1.0), ValueError,
     "vespo_k_pos must be a finite number >= 0 (LossConfig.vespo_k_pos), got -1.0"),
    (dict(vespo_k_neg=float("nan")), ValueError,
     "vespo_k_neg must be a finite number >= 0 (LossConfig.vespo_k_neg), got nan"),
    (dict(vespo_lambda_pos=0.0), ValueError,
     "vespo_lambda_pos must be a finite number > 0 (LossConfig.vespo_lambda_pos), got 0.0"),
    (dict(loss_type="vespo", vespo_lambda_neg=-2.0), ValueError,
     "vespo_lambda_neg must be a finite number > 0 (LossConfig.vespo_lambda_neg), got -2.0"),
    (dict(chunk_bytes=0), ValueError, "chunk_bytes must be a positive int"),
    (dict(backend="cuda"), ValueError, "backend must be one of"),
    (dict(num_items_in_batch=-1), ValueError,
     "num_items_in_batch must be a finite number >= 0 or None (TokenWeights.num_items_in_batch), got -1"),
])
def test_bad_arguments(changes, error, words):
    with pytest.raises(error) as info:
        call(**changes)
    assert words in str(info.value)


def test_targets_out_of_range_where_mask_is_one():
    inputs = make_batch()
    inputs["targets"][0, 0] = 37
    inputs["mask"][0, 0] = True
    with pytest.raises(ValueError, match=r"targets must lie in \[0, V\) = \[0, 37\) where mask is 1"):
        call(targets=inputs["targets"], mask=inputs["mask"])


def test_targets_anything_where_mask_is_zero():
    inputs = make_batch()
    assert (inputs["targets"][~inputs["mask"]] == -100).all()
    loss, _ = call()
    assert torch.isfinite(loss)


def test_token_logprobs_errors():
    hidden, weight = torch.randn(4, 8), torch.randn(10, 8)
    with pytest.raises(ValueError, match=r"targets must lie in \[0, V\) = \[0, 10\), got values in \[-1, 3\]"):
        gf.token_logprobs(hidden, weight, torch.tensor([0, 1, 3, -1]))
    with pytest.raises(ValueError, match="bias must have shape"):
        gf.token_logprobs(hidden, weight, torch.zeros(4, dtype=torch.long), bias=torch.zeros(9))
    with pytest.raises(TypeError, match="weight must be a torch.Tensor"):
        gf.token_logprobs(hidden, [[0.0]], torch.zeros(4, dtype=torch.long))


def test_triton_backend_without_gpu_or_interpreter(monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="backend='triton' needs CUDA tensors"):
        gf.token_logprobs(torch.randn(4, 8), torch.randn(10, 8), torch.zeros(4, dtype=torch.long),
                          **grouped(backend="triton"))


def test_module_rejects_bad_config_at_construction():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        gf.GRPOLoss(**grouped(loss_type="nope"))
    with pytest.raises(ValueError, match="backend must be one of"):
        gf.GRPOLoss(**grouped(backend="jax"))


def test_tensors_on_different_devices():
    hidden, targets = torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="hidden and weight must be on one device, got cpu and meta"):
        gf.token_logprobs(hidden, torch.randn(10, 8, device="meta"), targets)
    with pytest.raises(ValueError, match="targets must be on cpu like hidden, got meta"):
        gf.token_logprobs(hidden, torch.randn(10, 8), targets.to("meta"))
    inputs = make_batch()
    with pytest.raises(ValueError, match="old_logps must be on .* like hidden, got meta"):
        call(old_logps=inputs["old_logps"].to("meta"))


def test_the_reference_takes_grpo_loss_s_signature():
    """reference.grpo_loss is called as grpo_fast.grpo_loss is: the same parameters, kinds and defaults; the
    same one-line error for a flat keyword that moved into an option group; equal results (float64)."""
    import inspect

    def parameters(fn):
        return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]

    assert parameters(reference.grpo_loss) == parameters(gf.grpo_loss)
    inputs = as_float64(make_batch())
    del inputs["is_ratio"]
    with pytest.raises(TypeError, match=r"^grpo_loss\(\) got temperature=0.9: it moved to "
                                        r"transform=LogitTransform\(temperature=...\)$"):
        reference.grpo_loss(**inputs, temperature=0.9)
    with pytest.raises(TypeError, match=r"^grpo_loss\(\) got loss_type='grpo': it moved to "
                                        r"config=LossConfig\(loss_type=...\)$"):
        reference.grpo_loss(**inputs, loss_type="grpo")
    with pytest.raises(TypeError, match="config must be a grpo_fast.LossConfig, a loss type name .* got dict"):
        reference.grpo_loss(**inputs, config={"loss_type": "grpo"})
    options = dict(config="grpo", transform=gf.LogitTransform(temperature=0.9), execution=gf.Execution(backend="torch"))
    expected, _ = reference.grpo_loss(**inputs, **options)
    assert_close(gf.grpo_loss(**inputs, **options)[0], expected, 1e-10, name="loss")


def test_grpo_loss_takes_one_config_or_a_loss_type_name():
    """The fused entries take the loss options as one `config`: a LossConfig or a loss-type name; a loss option
    as a keyword is a one-line TypeError naming its new home."""
    inputs = make_batch()
    del inputs["is_ratio"], inputs["bias"]
    by_name, _ = gf.grpo_loss(**inputs, config="grpo", transform=gf.LogitTransform(temperature=0.9))
    by_config, _ = gf.grpo_loss(**inputs, config=gf.LossConfig(loss_type="grpo"),
                                transform=gf.LogitTransform(temperature=0.9))
    assert torch.equal(by_name, by_config)
    with pytest.raises(TypeError, match=r"^grpo_loss\(\) got loss_type='grpo': it moved to "
                                        r"config=LossConfig\(loss_type=\.\.\.\)$"):
        gf.grpo_loss(**inputs, config=gf.LossConfig(), loss_type="grpo")
    with pytest.raises(TypeError, match="config must be a grpo_fast.LossConfig, a loss type name .* got dict"):
        gf.grpo_loss(**inputs, config={"loss_type": "grpo"})
    with pytest.raises(ValueError, match="loss_type must be one of"):
        gf.grpo_loss(**inputs, config="ppo2")


def test_module_takes_one_config_or_a_loss_type_name():
    config = gf.LossConfig(loss_type="cispo", epsilon_high=5.0)
    with pytest.raises(TypeError, match=r"^GRPOLoss\(\) got beta=0.04: it moved to config=LossConfig\(beta=\.\.\.\)$"):
        gf.GRPOLoss(config, beta=0.04)
    assert gf.GRPOLoss(config).config is config
    assert gf.GRPOLoss("cispo").config == gf.LossConfig(loss_type="cispo")


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.complex64, torch.int32])
def test_unsupported_float_dtypes_name_the_accepted_ones(dtype):
    """float8 is floating point but not a dtype the loss computes in: every entry point and every floating argument
    names the dtypes it takes and the one it got (with a hint to upcast a narrow float)."""
    inputs = make_batch(bias=True)
    del inputs["is_ratio"]
    hint = " (upcast it first, e.g. .to(torch.bfloat16))" if dtype.is_floating_point else ""

    def expect(name):
        return re.escape(f"{name} must have dtype float16, bfloat16, float32 or float64, got {dtype}{hint}") + "$"

    entry_points = {
        "grpo_loss": lambda **kw: gf.grpo_loss(**grouped(**kw)),
        "reference": lambda **kw: flat(reference.grpo_loss)(**kw),
        "GRPOLoss": lambda **kw: gf.GRPOLoss()(**kw),
        "token_logprobs": lambda hidden, weight, targets, bias, **_: gf.token_logprobs(hidden, weight, targets,
                                                                                       bias=bias),
        "fused_token_loss": lambda hidden, weight, targets, bias, mask, **_: gf.fused_token_loss(
            hidden, weight, targets, gf.autograd_token_loss(lambda logp, entropy, index: logp.sum()), mask=mask,
            bias=bias),
    }
    for entry, fn in entry_points.items():
        for name in ("hidden", "weight", "bias"):
            with pytest.raises(TypeError, match=expect(name)):
                fn(**{**inputs, name: inputs[name].to(dtype)})
        if entry in ("grpo_loss", "reference", "GRPOLoss"):
            for name in ("advantages", "old_logps"):
                with pytest.raises(TypeError, match=expect(name)):
                    fn(**{**inputs, name: inputs[name].to(dtype)})
