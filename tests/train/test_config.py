"""The trainer's configuration: every key's range and type, nulls, paths, bad files, task names, the keys' help."""

import dataclasses
import math
import os
import re

import pytest

pytest.importorskip("transformers")

from grpo_fast.cli import main as cli  # noqa: E402
from grpo_fast.train.config import KEYS, RULES, load_config, parse_overrides, saved_config  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

NUMERIC = [key.name for key in KEYS.values() if key.type in ("int", "float", "Optional[int]", "Optional[float]")]

BAD = [("max_grad_norm", "-1", "max_grad_norm must be a finite number > 0, got -1.0"),
       ("max_grad_norm", "0", "max_grad_norm must be a finite number > 0, got 0.0"),
       ("max_grad_norm", "inf", "max_grad_norm must be a finite number > 0, got inf"),
       ("learning_rate", "0", "learning_rate must be a finite number > 0, got 0.0"),
       ("sft_learning_rate", "-3e-3", "sft_learning_rate must be a finite number > 0, got -0.003"),
       ("weight_decay", "-0.1", "weight_decay must be a finite number >= 0, got -0.1"),
       ("temperature", "inf", "temperature must be a finite number > 0, got inf"),
       ("top_p", "0", "top_p must be a finite number in (0, 1], got 0.0"),
       ("top_p", "1.5", "top_p must be a finite number in (0, 1], got 1.5"),
       ("epsilon_low", "-0.2", "epsilon_low must be a finite number >= 0 (LossConfig.epsilon_low), got -0.2"),
       ("epsilon_high", "inf", "epsilon_high must be a finite number >= 0 (LossConfig.epsilon_high), got inf"),
       ("beta", "inf", "beta must be a finite number >= 0 (LossConfig.beta), got inf"),
       ("entropy_coef", "-inf", "entropy_coef must be a finite number (LossConfig.entropy_coef), got -inf"),
       ("importance_sampling_cap", "0", "importance_sampling_cap must be a finite number > 0, got 0.0"),
       ("vllm_gpu_memory_utilization", "1.2", "vllm_gpu_memory_utilization must be a finite number in (0, 1], got 1.2"),
       ("max_operand", "0", "max_operand must be > 0, got 0"),
       ("num_prompts", "-5", "num_prompts must be > 0, got -5"),
       ("num_iterations", "0", "num_iterations must be > 0, got 0"),
       ("micro_batch_tokens", "0", "micro_batch_tokens must be > 0, got 0"),
       ("sft_steps", "-1", "sft_steps must be >= 0, got -1"),
       ("warmup_steps", "-1", "warmup_steps must be >= 0, got -1"),
       ("log_completions", "-1", "log_completions must be >= 0, got -1"),
       ("max_bad_steps", "0", "max_bad_steps must be >= 1, got 0"),
       ("seed", "-1", "seed must be in [0, 2**32), got -1"),
       ("reward_weights", "a,b", "config key 'reward_weights' expects list[float], got 'a,b'"),
       ("reward_weights", "1,nan", "reward_weights must be finite numbers, got [1.0, nan]"),
       ("rewards", "", "rewards must name at least one reward function, got []"),
       ("rewards", " , ", "rewards must name at least one reward function, got []"),
       # numbers the float32 math takes: beyond them a run died at its first step (torch: "value cannot be
       # converted to type float without overflow") or sampled at another temperature than it trained at
       ("learning_rate", "1e39", "learning_rate must be a finite number in (0, 1e+18], got 1e+39"),
       ("sft_learning_rate", "1e19", "sft_learning_rate must be a finite number in (0, 1e+18], got 1e+19"),
       ("weight_decay", "1e19", "weight_decay must be a finite number in [0, 1e+18], got 1e+19"),
       ("max_grad_norm", "1e39", "max_grad_norm must be a finite number in (0, 3.4028234663852886e+38], got 1e+39"),
       ("importance_sampling_cap", "1e39",
        "importance_sampling_cap must be a finite number in (0, 3.4028234663852886e+38], got 1e+39"),
       ("importance_sampling_min", "1e39",
        "importance_sampling_min must be a finite number in [0, 3.4028234663852886e+38], got 1e+39"),
       ("overlong_penalty", "1e19", "overlong_penalty must be a finite number in [0, 1e+18], got 1e+19"),
       ("reward_weights", "1,-1e19", "reward_weights must be numbers in [-1e+18, 1e+18], got [1.0, -1e+19]"),
       ("temperature", "0.001", "temperature must be a finite number in [0.01, 1e+09], got 0.001"),
       ("temperature", "1e-40", "temperature must be a finite number in [0.01, 1e+09], got 1e-40"),
       ("max_completion_length", "2147483648", "max_completion_length must be in [1, 2147483647], got 2147483648")]


@pytest.mark.parametrize("key, value, message", BAD, ids=[f"{key}={value}" for key, value, _ in BAD])
def test_out_of_range_values_name_the_key(key, value, message):
    with pytest.raises(ValueError) as error:
        load_config(None, {key: value})
    assert str(error.value) == message


def test_max_sampling_rounds_without_dynamic_sampling_is_refused_for_training_only():
    """A training job refuses it (it would be ignored); an export or evaluation reads the config a run saved, as
    an earlier version took it."""
    config = load_config(None, {"max_sampling_rounds": "5"})
    with pytest.raises(ValueError) as error:
        config.check_world(1)
    assert str(error.value) == ("max_sampling_rounds (5) bounds the rounds of dynamic sampling, which is off: set "
                                "dynamic_sampling: true, or leave max_sampling_rounds at 3")
    load_config(None, {"max_sampling_rounds": "5", "dynamic_sampling": "true"}).check_world(1)
    assert saved_config(dataclasses.asdict(config)).rollout.max_sampling_rounds == 5


def test_every_numeric_key_has_a_rule_and_nan_fails_it():
    assert set(NUMERIC) == set(RULES)
    for key in NUMERIC:
        field = key.rpartition(".")[2]      # loss.max_completion_length: the loss section's own error names its field
        with pytest.raises(ValueError, match=field):
            flat_config(**{key: math.nan})
        with pytest.raises(ValueError, match=field):
            load_config(None, {key: "nan"})


def test_boundary_values_are_accepted():
    config = load_config(None, {"top_p": "1", "weight_decay": "0", "sft_steps": "0", "warmup_steps": "0",
                                "log_completions": "0", "entropy_coef": "-0.01", "epsilon_low": "0", "beta": "0",
                                "micro_batch_tokens": "None", "max_bad_steps": "1", "vllm_gpu_memory_utilization": "1",
                                "rewards": "accuracy,format", "reward_weights": "1,-0.5"})
    assert (config.rollout.top_p, config.batching.micro_batch_tokens,
            config.scoring.reward_weights) == (1.0, None, [1.0, -0.5])


def test_the_cli_reports_a_bad_value_on_one_line(capsys, tmp_path):
    assert cli(["train", "--temperature", "inf"]) == 2
    assert capsys.readouterr().err == "grpo-fast train: temperature must be a finite number > 0, got inf\n"
    # accepted, it warmed up and died at step 1 in AdamW, leaving a folder that refused the same command
    assert cli(["train", "--learning-rate", "1e39", "--output-dir", str(tmp_path / "run")]) == 2
    assert capsys.readouterr().err == "grpo-fast train: learning_rate must be a finite number in (0, 1e+18], got " \
                                      "1e+39\n"
    assert not (tmp_path / "run").exists()
    assert cli(["train", "--reward-weights", "a,b"]) == 2
    assert capsys.readouterr().err == "grpo-fast train: config key 'reward_weights' expects list[float], got 'a,b'\n"


@pytest.mark.parametrize("text, message", [
    ("output_dir: ~\n", "config key 'output_dir' expects str and cannot be null, got None"),
    ("output_dir:\n", "config key 'output_dir' expects str and cannot be null, got None"),
    ("model: null\n", "config key 'model' expects str and cannot be null, got None"),
    ("packing: ~\n", "config key 'packing' expects bool and cannot be null, got None"),
    ("max_steps: ~\n", "config key 'max_steps' expects int and cannot be null, got None"),
    ("rewards: ~\n", "config key 'rewards' expects list[str] and cannot be null, got None"),
    ("max_steps: true\n", "config key 'max_steps' expects int, got True"),
    ("max_steps: 2.5\n", "config key 'max_steps' expects int, got 2.5"),
    ("beta: yes\n", "config key 'beta' expects float, got True"),
])
def test_null_and_mistyped_yaml_values_are_errors(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_config(str(path))
    assert str(error.value) == message


def test_the_bounds_are_what_the_float32_math_takes():
    """At the learning rates' and weight decay's bound AdamW steps (it takes lr and lr * weight_decay as float32
    scalars), and the correction's clamp takes float32's largest number; one step past float32's range torch
    refuses both, the error a run hit at its first step before the bounds."""
    import torch

    from grpo_fast.fields import COEFFICIENT_MAX, FP32_MAX

    def adamw_step(**options):
        weight = torch.nn.Parameter(torch.ones(3))
        weight.grad = torch.ones(3)
        torch.optim.AdamW([weight], **options).step()

    adamw_step(lr=COEFFICIENT_MAX, weight_decay=COEFFICIENT_MAX)
    flat_config(learning_rate=COEFFICIENT_MAX, weight_decay=COEFFICIENT_MAX, importance_sampling_cap=FP32_MAX)
    torch.ones(3).clamp(max=FP32_MAX)
    with pytest.raises(RuntimeError, match="overflow"):
        adamw_step(lr=1e39)
    with pytest.raises(RuntimeError, match="overflow"):
        torch.ones(3).clamp(max=1e39)


def test_numpy_numbers_are_stored_as_python_numbers():
    """Keys computed with numpy (a sweep's np.float32 weights, np.int64 steps): accepted where a Python number is,
    and stored as one (a checkpoint's config and the trackers' hold plain numbers)."""
    import numpy as np

    config = flat_config(learning_rate=np.float32(1e-3), max_steps=np.int64(3), reward_weights=[np.float32(0.5)],
                         max_completion_length={np.int64(0): np.int64(4), np.int64(2): np.float64(8.0)})
    assert config.scoring.reward_weights == [0.5] and type(config.scoring.reward_weights[0]) is float
    assert type(config.optimization.learning_rate) is float and type(config.run.max_steps) is int
    assert config.rollout.completion_length_stages == ["0:4", "2:8"]


def test_none_strings_and_nulls_in_code():
    for value in ("None", "null"):
        with pytest.raises(ValueError, match=f"config key 'output_dir' expects str and cannot be null, got '{value}'"):
            load_config(None, {"output_dir": value})
    with pytest.raises(ValueError, match="config key 'gradient_checkpointing' expects bool and cannot be null"):
        load_config(None, {"gradient_checkpointing": "None"})
    with pytest.raises(ValueError, match="config key 'output_dir' expects str, got None"):
        flat_config(output_dir=None)
    config = load_config(None, {"system_prompt": "None", "micro_batch_tokens": "null", "max_steps": 4.0})
    assert (config.data.system_prompt, config.batching.micro_batch_tokens, config.run.max_steps) == (None, None, 4)
    # where "none" is one of the key's choices it is that choice, from the command line and from YAML
    config = load_config(None, {"importance_sampling": "none", "scale_rewards": "None"})
    assert (config.correction.importance_sampling, config.scoring.scale_rewards) == ("none", "none")


def test_home_is_expanded_in_paths(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.jsonl").write_text('{"prompt": "1+1=", "solution": "2"}\n')
    path = tmp_path / "c.yaml"
    path.write_text("output_dir: ~/runs/a\ntask: ~/data.jsonl\nmodel: ~/models/m\n")
    config = load_config("~/c.yaml")
    assert config.run.output_dir == str(tmp_path / "runs" / "a")
    assert (config.data.task, config.policy.model) == (str(tmp_path / "data.jsonl"), str(tmp_path / "models" / "m"))
    assert load_config(None, {"model": "Qwen/Qwen2.5-0.5B-Instruct"}).policy.model == "Qwen/Qwen2.5-0.5B-Instruct"


@pytest.mark.parametrize("text, message", [
    ("group_size: 4\nrewards: [accuracy\nmax_steps: 3\n",
     "c.yaml:3: not valid YAML (expected ',' or ']', but got ':'; while parsing a flow sequence on line 2)"),
    ("group_size: 4\nmax_steps: 3\n  beta: 0.1\n", "c.yaml:3: not valid YAML (mapping values are not allowed here)"),
    ("group_size: 4\n\tbeta: 0.1\n", "c.yaml:2: not valid YAML (found character '\\t' that cannot start any token)"),
])
def test_bad_yaml_names_the_file_and_line(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ValueError) as error:
        load_config(str(path))
    assert str(error.value) == f"{tmp_path}{os.sep}{message}"


def test_unreadable_config_files_are_one_line_errors(tmp_path, capsys):
    path = tmp_path / "latin1.yaml"
    path.write_bytes(b"model: tiny\noutput_dir: caf\xe9\n")
    with pytest.raises(ValueError, match=r"latin1\.yaml:2: not UTF-8 text \(byte 0xe9: invalid continuation byte\)"):
        load_config(str(path))
    (tmp_path / "bom.yaml").write_bytes(b"\xef\xbb\xbfmax_steps: 3\n")
    assert load_config(str(tmp_path / "bom.yaml")).run.max_steps == 3
    for name in ("latin1.yaml", "missing.yaml"):
        assert cli(["train", str(tmp_path / name)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("grpo-fast train: ") and name in err and err.count("\n") == 1, err
    with pytest.raises(FileNotFoundError, match="missing.yaml"):
        load_config(str(tmp_path / "missing.yaml"))


def test_task_is_a_known_name_or_an_existing_file(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(None, {"task": "gms8k"})
    assert str(error.value) == ("task='gms8k': no such file or folder (task is one of max, arithmetic, gsm8k or a "
                                "dataset on disk)")
    with pytest.raises(ValueError, match=r"is a folder but not one written by datasets' save_to_disk"):
        flat_config(task=str(tmp_path))
    with pytest.raises(ValueError, match=r"eval_task='nope.txt': no such file or folder"):
        flat_config(eval_task="nope.txt")
    path = tmp_path / "mine.jsonl"
    path.write_text('{"prompt": "1+1=", "solution": "2"}\n')
    assert flat_config(task=str(path)).data.task == str(path)
    assert load_config(None, {"task": "gsm8k"}).data.task == "gsm8k"


def test_device_names():
    """cuda is accepted without a GPU (the examples load on CPU; the trainer checks the device when it starts)."""
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert flat_config(device=device).policy.device == device
    with pytest.raises(ValueError, match=r"device must be 'auto', 'cpu' or 'cuda\[:i\]', got 'cdua'"):
        load_config(None, {"device": "cdua"})


def test_keys_help_lists_every_key_with_its_type_default_and_help():
    from grpo_fast.train.config import GROUPS, keys_help

    text = keys_help()
    lines = text.splitlines()
    for item in KEYS.values():
        help_text = item.help
        assert help_text.strip() and "\n" not in help_text, item.name
        assert item.section in GROUPS
        default = item.default
        [line] = [line for line in lines if line.startswith(f"  {item.name}: ")]
        assert f" = {default!r} " in line and line.endswith(help_text), line
    assert [line for line in lines if not line.startswith(" ")] == [f"{group}:" for group in GROUPS]
    assert "  max_grad_norm: float = 1.0 " in text and "  reward_weights: list[float] or None = None " in text


def test_top_p_with_vllm_needs_a_top_k_bound():
    with pytest.raises(ValueError, match=r"top_p=0.9 with engine 'vllm' needs top_k > 0, got top_k=0: vLLM returns the "
                                         r"kept set .* only with a top_k bound"):
        flat_config(engine="vllm", top_p=0.9)
    assert flat_config(engine="vllm", top_p=0.9, top_k=64).rollout.truncates_sampling
    assert flat_config(engine="hf", top_p=0.9).rollout.truncates_sampling            # the HF engine needs no bound
    assert not flat_config().rollout.truncates_sampling
    with pytest.raises(ValueError, match="top_k must be >= 0, got -1"):
        load_config(None, {"top_k": "-1"})


def test_top_k_1_is_refused_for_training_and_planning_not_for_evaluation(tmp_path, capsys):
    """top_k 1: each kept set is the sampled token alone, whose log-prob over it is 0 under any weights: train and
    plan (a YAML config or flags) refuse it with the same words; an evaluation may sample greedily."""
    message = r"top_k=1 samples the most likely token: .* gradient is exactly zero; set top_k >= 2 \(or 0: every " \
              r"token\)"
    config = load_config(None, {"top_k": "1"})                 # a config an evaluation may use
    with pytest.raises(ValueError, match=message):
        config.check_world(1)                                   # what train() checks first
    (tmp_path / "greedy.yaml").write_text("rollout:\n  top_k: 1\n")
    for arguments in (["train", "--top-k", "1", "--output-dir", str(tmp_path / "run")], ["plan", "qwen2.5-0.5b",
                      "--top-k", "1"], ["plan", str(tmp_path / "greedy.yaml")]):
        assert cli(arguments) == 2, arguments
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and re.search(message, err), (arguments, err)
    assert not (tmp_path / "run").exists()
    assert cli(["plan", "qwen2.5-0.5b", "--top-p", "0.9", "--engine", "vllm"]) == 2    # train's vLLM check too
    assert "top_p=0.9 with engine 'vllm' needs top_k > 0" in capsys.readouterr().err
    assert flat_config(top_k=2).rollout.truncates_sampling


def test_the_rollout_correction_bounds():
    assert flat_config(importance_sampling_min=0.5).correction.importance_sampling_min == 0.5
    with pytest.raises(ValueError, match=r"importance_sampling_min \(3.0\) must be below importance_sampling_cap"):
        flat_config(importance_sampling_min=3.0)
    with pytest.raises(ValueError, match="importance_sampling_min must be a finite number >= 0, got -0.1"):
        flat_config(importance_sampling_min=-0.1)


def test_vespo_takes_the_rollout_correction_per_token():
    for corrected in ({"engine": "vllm"}, {"max_staleness": 1}):
        with pytest.raises(ValueError, match=r"loss_type 'vespo' takes the rollout correction per token .* "
                                             r"importance_sampling='sequence_mask' is per sequence"):
            flat_config(loss_type="vespo", **corrected)
        assert flat_config(loss_type="vespo", importance_sampling="token_mask", **corrected).loss.loss_type == "vespo"
    assert flat_config(loss_type="vespo").loss.loss_type == "vespo"   # HF in process: no correction


def test_override_values_are_kept_exactly():
    overrides = parse_overrides(["--output-dir=runs/my-run", "--system-prompt", "be brief - no steps",
                                 "--task=data/my-file.jsonl"])
    assert overrides == {"output_dir": "runs/my-run", "system_prompt": "be brief - no steps",
                         "task": "data/my-file.jsonl"}


def test_a_key_given_twice_is_an_error(tmp_path, capsys):
    with pytest.raises(ValueError, match=r"^--max-steps is given twice \('3' and '4'\); give each key once$"):
        parse_overrides(["--max-steps", "3", "--max_steps=4"])
    path = tmp_path / "c.yaml"
    path.write_text("max_steps: 3\nseed: 1\nmax_steps: 4\n")
    with pytest.raises(ValueError) as error:
        load_config(str(path))
    assert str(error.value) == (f"{path}:3: not valid YAML (the key 'max_steps' is given twice, here and on line 1; "
                                "give it once)")
    path.write_text("max_steps: 3\n")
    assert load_config(str(path), {"max_steps": "5"}).run.max_steps == 5        # the command line overrides the file
    assert cli(["eval", str(tmp_path), "--num-samples", "2", "--eval-samples", "3"]) == 2
    assert "--num-samples and --eval-samples are the same key" in capsys.readouterr().err


NESTED = """\
rollout:
  group_size: 4
  temperature: 0.7
loss:
  loss_type: grpo
  importance_sampling_level: sequence
  epsilon_low: 3.0e-4
  epsilon_high: 4.0e-4
optimization:
  num_iterations: 2
run:
  max_steps: 3
"""


def test_a_file_nests_by_section_and_keys_are_given_flat_or_with_their_section(tmp_path):
    from grpo_fast.variants import LossConfig

    path = tmp_path / "c.yaml"
    path.write_text(NESTED)
    config = load_config(str(path), parse_overrides(["--rollout.top-k", "8", "--beta", "0.1", "--run.seed=3"]))
    assert config.loss.at_length(6) == LossConfig(loss_type="grpo", importance_sampling_level="sequence",
                                                  epsilon_low=3e-4, epsilon_high=4e-4, beta=0.1,
                                                  max_completion_length=6)
    assert (config.rollout.group_size, config.rollout.temperature, config.rollout.top_k) == (4, 0.7, 8)
    assert (config.optimization.num_iterations, config.run.max_steps, config.run.seed) == (2, 3, 3)
    with pytest.raises(ValueError, match=r"^temperature and rollout\.temperature are the same key"):
        load_config(str(path), {"temperature": "1", "rollout.temperature": "2"})
    path.write_text("loss: grpo\n")
    with pytest.raises(ValueError, match=r"c\.yaml: loss is a section, a mapping of its keys, got 'grpo'"):
        load_config(str(path))


def test_a_flat_file_is_read_and_its_nested_form_shown_on_one_line(tmp_path):
    path = tmp_path / "flat.yaml"
    path.write_text("group_size: 4\ntemperature: 0.7\nloss_type: grpo\nimportance_sampling_level: sequence\n"
                    "epsilon_low: 3.0e-4\nepsilon_high: 4.0e-4\nnum_iterations: 2\nmax_steps: 3\n")
    with pytest.warns(FutureWarning) as caught:
        flat = load_config(str(path))
    [line] = [str(warning.message) for warning in caught]
    assert "\n" not in line and line.endswith(
        "nested, the file is {rollout: {group_size: 4, temperature: 0.7}, loss: {loss_type: grpo, "
        "importance_sampling_level: sequence, epsilon_low: 0.0003, epsilon_high: 0.0004}, optimization: "
        "{num_iterations: 2}, run: {max_steps: 3}}"), line
    (tmp_path / "nested.yaml").write_text(NESTED)
    assert flat == load_config(str(tmp_path / "nested.yaml"))


def test_unknown_keys_name_the_keys_they_were_probably_meant_to_be():
    with pytest.raises(ValueError, match=r"unknown config key\(s\) \['temprature'\]; 'temprature': did you mean "
                                         r"temperature"):
        load_config(None, {"temprature": "0.7"})
    with pytest.raises(ValueError, match=r"'rollout\.beta': did you mean loss\.beta\?"):
        load_config(None, {"rollout.beta": "0.1"})


def test_the_loss_section_is_a_loss_config_with_the_trainers_defaults():
    """epsilon_high 0.28 (the library's default is epsilon_low); dr_grpo's normalizer is each step's completion
    budget unless loss.max_completion_length is given (None in the section: at_length fills it), and a value given
    stays, through replace() too, whatever it equals."""
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.variants import LossConfig

    assert TrainConfig().loss.at_length(6) == LossConfig(epsilon_high=0.28, max_completion_length=6)
    assert TrainConfig().loss.max_completion_length is None
    config = load_config(None, {"loss_type": "dr_grpo", "max_completion_length": "9"})
    assert (config.rollout.max_completion_length, config.loss.max_completion_length) == (9, None)
    assert config.replace(max_completion_length=20).loss.at_length(20).max_completion_length == 20
    config = load_config(None, {"loss_type": "dr_grpo", "loss.max_completion_length": "12"})
    assert (config.rollout.max_completion_length, config.loss.max_completion_length) == (6, 12)
    assert config.replace(max_completion_length=20).loss.at_length(20).max_completion_length == 12
    config = load_config(None, {"loss_type": "dr_grpo", "loss.max_completion_length": "6"})    # equal: kept
    assert config.replace(max_completion_length=20).loss.at_length(20).max_completion_length == 6
    with pytest.raises(ValueError, match="loss_type must be one of"):
        load_config(None, {"loss_type": "ppo"})


def test_every_key_has_one_section_and_the_config_few_top_level_fields():
    import dataclasses

    from grpo_fast.train.config import GROUPS, TrainConfig

    assert [item.name for item in dataclasses.fields(TrainConfig)] == list(GROUPS) and len(GROUPS) <= 15
    assert len({(key.section, key.field) for key in KEYS.values()}) == len(KEYS)
    assert KEYS["max_completion_length"].section == "rollout" and "loss.max_completion_length" in KEYS
    assert {key.field for key in KEYS.values() if key.section == "loss"} == {
        item.name for item in dataclasses.fields(__import__("grpo_fast").LossConfig)}


def test_a_checkpoint_of_an_earlier_flat_config_is_read_and_compared():
    """Checkpoints of earlier versions saved the config flat: a resume compares it key by key, export and eval
    read it."""
    import dataclasses

    from grpo_fast.train.config import flat_values, saved_config
    from grpo_fast.train.saved.checkpoint import resume_changes

    config = flat_config(group_size=4, learning_rate=2.5e-4)
    flat = {name: value for name, value in flat_config(group_size=4).flat().items() if "." not in name}
    assert resume_changes(flat, config) == {"learning_rate": (5e-4, 2.5e-4)}
    assert resume_changes(dataclasses.asdict(config), config) == {}
    assert saved_config(flat, {"learning_rate": "2.5e-4"}) == config
    assert saved_config(dataclasses.asdict(config)) == config
    assert flat_values(dataclasses.asdict(config)) == config.flat()
    with pytest.raises(ValueError, match=r"--resume cannot change .*group_size 4 -> 8"):
        resume_changes(flat, flat_config(group_size=8))


def test_code_and_yaml_give_the_loss_section_the_same_defaults(tmp_path):
    """TrainConfig(loss=gf.LossConfig(...)) in code and the same keys in a YAML file are one config (the trainer
    has no defaults of its own for the loss: epsilon_high was 0.2 one way and 0.28 the other)."""
    import yaml

    from grpo_fast.train.config import TrainConfig
    from grpo_fast.variants import LossConfig

    for given in ({}, {"loss_type": "grpo"}, {"loss_type": "cispo", "epsilon_low": 0.1}, {"beta": 0.04},
                  {"epsilon_high": None}):
        path = tmp_path / "loss.yaml"
        path.write_text(yaml.safe_dump({"loss": given}))
        assert TrainConfig(loss=LossConfig(**given)).loss == load_config(str(path)).loss, given
        assert TrainConfig.from_keys(**given).loss == load_config(str(path)).loss, given


NUMERIC_LOSS_FIELDS = [name for name, key in KEYS.items() if key.section == "loss" and key.name in NUMERIC]


@pytest.mark.parametrize("field", [KEYS[name].field for name in NUMERIC_LOSS_FIELDS])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, "0.2"], ids=["nan", "inf", "-inf", "text"])
def test_the_library_and_the_trainer_refuse_a_loss_value_with_the_same_words(field, value):
    """Every numeric LossConfig field: NaN, +-inf and text are refused by the library's LossConfig and by the
    trainer's loss section (built in code) with one error, word for word, naming the field."""
    import grpo_fast as gf
    from grpo_fast.train.config import NAMES, TrainConfig

    with pytest.raises(ValueError) as library:
        gf.LossConfig(**{field: value})
    with pytest.raises(ValueError) as trainer:
        TrainConfig.from_keys(**{NAMES["loss", field]: value})
    assert f"LossConfig.{field}" in str(library.value) and str(trainer.value) == str(library.value)
    assert isinstance(library.value, TypeError) or not isinstance(value, str)      # a wrong type: a TypeError too
