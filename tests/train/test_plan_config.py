"""Plan what you run: `grpo-fast plan CONFIG.yaml` plans the job a training config runs, and `grpo-fast train`
says the plan (and on CUDA whether it fits) before loading the model."""

import dataclasses
import json
import re

import pytest

from grpo_fast.cli import main as cli
from grpo_fast.train.config import TrainConfig, load_config
from grpo_fast.train.plan import fit
from grpo_fast.train.plan import memory as P
from tests.helpers import flat_config

GIB = 2**30


def test_plan_of_a_training_config_is_that_job(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("max_completion_length: 64\ngroup_size: 4\nprompts_per_step: 4\nmicro_batch_size: 2\n"
                    "beta: 0.1\ngradient_checkpointing: false\nloss_implementation: naive\n")
    assert cli(["plan", str(path), "--prompt-length", "40", "--device", "cpu", "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    expected = P.Job(prompt_length=40, completion_length=64, group_size=4, prompts_per_step=4, micro_batch_size=2,
                     dtype="fp32", optimizer="adamw", gradient_checkpointing=False, loss="naive", beta=0.1,
                     engine="hf", gpu_memory_utilization=0.3, device="cpu")
    assert reported["job"] == dataclasses.asdict(expected)
    shape = fit.training_shape(load_config(str(path)).policy)
    assert reported["components"] == {k: int(v) for k, v in P.plan(shape, expected).items()}
    # on CUDA the trainer computes in bf16 autocast over fp32 weights: so does the plan
    assert fit.training_job(load_config(str(path)), 40, "cuda").dtype == "bf16-autocast"


def test_training_shape_of_tiny_folders_and_hub_ids(tmp_path):
    tiny = fit.training_shape(flat_config().policy)
    assert (tiny.hidden_size, tiny.num_layers, tiny.vocab_size, tiny.tie_word_embeddings) == (128, 2, 300, True)
    assert fit.training_shape(flat_config(model="Qwen/Qwen2.5-7B-Instruct").policy) == P.PRESETS["qwen2.5-7b"]
    with pytest.raises(ValueError, match="matches no preset"):
        fit.training_shape(flat_config(model="someone/unknown-model").policy)


def test_train_logs_the_plan_before_loading_the_model(tmp_path):
    from grpo_fast.train import loop

    logged = []
    config = flat_config(max_steps=1, sft_steps=0, group_size=2, prompts_per_step=2, log_completions=0,
                         output_dir=str(tmp_path / "run"))
    loop.train(config, log=logged.append)
    line = next(line for line in logged if line.startswith("memory plan"))
    assert re.search(r"[\d.]+ GiB at the peak, mostly \w+ [\d.]+ GiB", line), line


def test_fit_advice_names_a_change_that_makes_the_job_fit():
    assert fit.fit_advice(flat_config(), fit.training_shape(TrainConfig().policy), 64, 80 * GIB) is None  # tiny fits
    # 2 prompts a step: the HF engine's KV cache of the default 16 x 8 sequences would be a second wall
    config = flat_config(model="Qwen/Qwen2.5-1.5B", max_completion_length=16384, gradient_checkpointing=False,
                         micro_batch_size=4, prompts_per_step=2)
    shape = fit.training_shape(config.policy)
    advice = fit.fit_advice(config, shape, 512, 80 * GIB)
    named = re.search(r"^the plan needs [\d.]+ GiB on this 80.0 GiB card; (\w+): \S+ would make it fit", advice or "")
    assert named, advice                              # 1.5B at 16k without checkpointing does not fit 80 GiB
    key = named.group(1)
    fixed = config.replace(**{key: dict(fit.FIT_CHANGES)[key]})
    assert fit.fit_advice(fixed, shape, 512, 80 * GIB) is None
    # 7B at 16k on an 80 GB card: no exact change is enough, the memory options are named, every key of one. With
    # the card's 4.9 GiB chunk budget (all 16384 tokens' logits, 4.6 GiB) bf16 + adamw8bit needs 81.3 GiB: LoRA
    big = flat_config(model="Qwen/Qwen2.5-7B", max_completion_length=16384, micro_batch_size=1, engine="vllm")
    advice = fit.fit_advice(big, fit.training_shape(big.policy), 512, int(79.1 * GIB))
    assert "dtype: bf16, optimizer: adamw and lora_rank: 64 would make it fit" in advice, advice
    assert advice.endswith("; it changes the numerics or what is trained)")
    fixed = big.replace(dtype="bf16", optimizer="adamw", lora_rank=64)
    assert fit.fit_advice(fixed, fit.training_shape(big.policy), 512, int(79.1 * GIB)) is None


def test_plan_of_a_training_config_takes_its_rope_scaling_and_the_trainers_context_check(tmp_path, capsys):
    """A config whose prompt plus completion is beyond its model's context is refused in the trainer's words (the
    config's own keys); its policy.rope_scaling makes room as it would in training; --rope-scaling is the config's
    to give. A hub id has its preset's context when it is the Instruct checkpoint the preset is."""
    from types import SimpleNamespace

    from grpo_fast.train import tasks

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"hidden_size": 64, "intermediate_size": 160,
                                                    "num_hidden_layers": 2, "num_attention_heads": 4,
                                                    "vocab_size": 1000, "max_position_embeddings": 2048}))
    path = tmp_path / "job.yaml"
    path.write_text(f"policy:\n  model: {folder}\nrollout:\n  max_completion_length: 4096\n")
    assert cli(["plan", str(path), "--device", "cpu"]) == 2
    with pytest.raises(ValueError) as trainers:
        tasks.check_context(512, 4096, SimpleNamespace(max_position_embeddings=2048))
    assert capsys.readouterr().err == f"grpo-fast plan: {trainers.value}\n"
    assert str(trainers.value).endswith("set max_completion_length to at most 1536, or shorten the prompts, or set "
                                        'policy.rope_scaling to {"rope_type": "yarn", "factor": 3}')
    path.write_text(f"policy:\n  model: {folder}\n  rope_scaling: {{rope_type: yarn, factor: 3}}\nrollout:\n"
                    "  max_completion_length: 4096\n")
    assert cli(["plan", str(path), "--device", "cpu", "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["context"] == 6144 and reported["rope_scaling"] == {"rope_type": "yarn", "factor": 3}
    assert cli(["plan", str(path), "--rope-scaling", '{"rope_type": "yarn", "factor": 4}']) == 2
    assert capsys.readouterr().err == (f"grpo-fast plan: --rope-scaling plans a preset or config.json; {path} gives "
                                       "its own (policy.rope_scaling): set it there\n")
    for switch, key in (("--vllm-sleep", "rollout.vllm_sleep"), ("--load-in-4bit", "policy.load_in_4bit"),
                        ("--offload-activations", "policy.offload_activations")):   # not lost to the config's key
        assert cli(["plan", str(path), switch]) == 2
        assert capsys.readouterr().err == (f"grpo-fast plan: {switch} plans a preset or config.json; {path} gives "
                                           f"its own ({key}): set it there\n")
    path.write_text("policy:\n  model: Qwen/Qwen2.5-7B-Instruct\nrollout:\n  max_completion_length: 32768\n")
    assert cli(["plan", str(path)]) == 2
    assert "beyond the model's context of 32768 (max_position_embeddings; policy.rope_scaling extends it)" in \
        capsys.readouterr().err
    path.write_text("policy:\n  model: Qwen/Qwen2.5-7B\nrollout:\n  max_completion_length: 32768\n")   # the base
    assert cli(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] is None
