"""policy.rope_scaling: a checkpoint run past its context with RoPE scaling (YaRN, linear, dynamic), applied alike by
the trainer's model, the rollout process's copy (HF) and vLLM, so that a long completion's engine log-probs are the
trainer's (the step's ratio is 1); the context check counts the scaled context and names the key."""

import importlib.util
import json
import math
import os
from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from grpo_fast.train import tasks  # noqa: E402
from grpo_fast.train.policy import scaled_rope, tiny_qwen2  # noqa: E402
from tests.helpers import ROOT, flat_config, run_result_script  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 128}


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_long_completions_have_the_trainers_logprobs_with_the_scaling_on_both_sides(engine, tmp_path):
    """SmolLM2-135M-Instruct shrunk to a 128-position context, YaRN x2, 160-token completions: with the scaling
    given to the engine too, its log-probs of the sampled tokens are the trainer's to fp32 rounding; given to the
    trainer alone they are not (vLLM past its context: NaN)."""
    if engine == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed")
    result = run_result_script(os.path.join(ROOT, "tests", "train", "rope_scaling_check.py"), str(tmp_path), engine,
                               timeout=900)
    assert result["rope_parameters"] == {"rope_theta": 100000.0, **YARN}       # SmolLM2's theta kept
    assert result["gap_scaled"] < 1e-3, result
    assert not result["gap_unscaled"] < 0.1, result                            # NaN or far off


def test_scaling_keeps_the_models_own_rope_parameters_and_is_idempotent():
    model = tiny_qwen2(64, max_positions=128, rope_scaling=YARN)
    config = model.config
    assert config.rope_parameters == {"rope_theta": 10000.0, **YARN} and config.max_position_embeddings == 256
    scaled_rope(config, YARN)                                    # again (a saved folder loaded with the key)
    assert config.rope_parameters == {"rope_theta": 10000.0, **YARN} and config.max_position_embeddings == 256
    linear = tiny_qwen2(64, max_positions=128, rope_scaling={"type": "linear", "factor": 4.0}).config
    assert linear.rope_parameters["rope_type"] == "linear" and linear.max_position_embeddings == 128


def test_the_context_check_counts_the_scaled_context_and_names_the_key():
    plain = SimpleNamespace(max_position_embeddings=128, rope_parameters={"rope_type": "default"})
    with pytest.raises(ValueError, match=r"context of 128 \(max_position_embeddings; policy.rope_scaling extends "):
        tasks.check_context(16, 160, plain)
    yarn = tiny_qwen2(64, max_positions=128, rope_scaling=YARN).config
    tasks.check_context(16, 240, yarn)                                         # 256 positions
    with pytest.raises(ValueError, match=r"context of 256 \(max_position_embeddings x the factor of "
                                         r"policy.rope_scaling\)"):
        tasks.check_context(16, 241, yarn)
    linear = SimpleNamespace(max_position_embeddings=128, rope_parameters={"rope_type": "linear", "factor": 4.0})
    tasks.check_context(12, 500, linear)                                       # vLLM counts 128 x 4
    with pytest.raises(ValueError, match="context of 512"):
        tasks.check_context(13, 500, linear)


@pytest.mark.parametrize("value", [{"rope_type": "su", "factor": 2.0}, {"rope_type": "yarn"},
                                   {"rope_type": "yarn", "factor": 0.5}, {"rope_type": "linear", "factor": math.nan},
                                   {"rope_type": "linear", "factor": True}])
def test_a_scaling_the_trainer_cannot_apply_alike_is_refused_naming_the_key(value):
    with pytest.raises(ValueError, match=r"policy.rope_scaling"):
        flat_config(rope_scaling=value)


def test_the_key_reads_json_on_the_command_line_and_yaml_dicts(tmp_path):
    from grpo_fast.train.config import load_config, parse_overrides

    command_line = parse_overrides(["--policy.rope-scaling", json.dumps(YARN)])
    assert load_config(None, command_line).policy.rope_scaling == YARN
    with pytest.raises(ValueError, match="expects a dict"):
        load_config(None, parse_overrides(["--rope-scaling", "yarn x2"]))
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  rope_scaling: {rope_type: yarn, factor: 2.0, original_max_position_embeddings: 128}\n")
    assert load_config(str(path)).policy.rope_scaling == YARN
