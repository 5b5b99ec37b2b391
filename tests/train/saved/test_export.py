"""Export: the trained policy as a Hugging Face folder that transformers loads with the trainer's log-probs."""

import os

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.cli import main as cli  # noqa: E402
from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.policy import load_model  # noqa: E402
from grpo_fast.train.run.model_folder import exported_step  # noqa: E402
from grpo_fast.train.saved.export import export_run  # noqa: E402
from grpo_fast.train.update.step import Policy, completion_logprobs  # noqa: E402
from tests.helpers import flat_config, logprob_sections  # noqa: E402
from tests.train.update.test_batching import rollout  # noqa: E402

FAST = dict(sft_steps=20, max_steps=2, save_every=2, group_size=4, prompts_per_step=4, log_completions=0,
            rewards=["tests.helpers:length_reward"])   # varies within a group: every step updates


def logprobs_of(model, config, vocab):
    batch = rollout(vocab=vocab)
    batch.old_logps = batch.ref_logps = None
    return completion_logprobs(Policy.of(model), batch, *logprob_sections(config))


@pytest.mark.parametrize("memory", [{}, {"lora_rank": 4, "learning_rate": 0.05, "sft_steps": 0}],
                         ids=["full", "lora"])
def test_a_run_exports_a_model_transformers_loads_with_the_same_logprobs(tmp_path, memory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = flat_config(**{**FAST, **memory}, output_dir=str(tmp_path / "run"))
    T.train(config, log=lambda *_: None)
    exported = tmp_path / "run" / "model"                  # written at the end of the run
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= set(
        os.listdir(exported))
    model = AutoModelForCausalLM.from_pretrained(exported)
    tokenizer = AutoTokenizer.from_pretrained(exported)
    assert not any(".lora_" in name or "base_layer" in name for name in model.state_dict())   # merged, plain
    # the same weights through `grpo-fast export` from the checkpoint, which rebuilds the model from its config
    assert cli(["export", str(tmp_path / "run"), str(tmp_path / "again")]) == 0
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again")
    assert exported_step(str(tmp_path / "again")) == 2                    # the step its weights are from
    vocab = len(tokenizer)
    expected = logprobs_of(model, config, vocab)
    torch.testing.assert_close(logprobs_of(again, config, vocab), expected, rtol=0, atol=1e-6)
    # and they are the trained policy's: a LoRA run's adapters really are in the exported weights
    base = load_model(config.policy, [], tokenizer, seed=config.run.seed)[0]
    assert (logprobs_of(base, config, vocab) - expected).abs().max() > 1e-3


def test_export_refuses_what_it_cannot_do(tmp_path, capsys):
    (tmp_path / "taken").mkdir()
    assert cli(["export", str(tmp_path), str(tmp_path / "taken")]) == 2
    assert "grpo-fast export: export target" in capsys.readouterr().err        # one line, exit code 2
    with pytest.raises(ValueError, match=r"export target '.*taken' already exists \(a folder\)"):
        export_run(str(tmp_path), str(tmp_path / "taken"))
    with pytest.raises(ValueError, match=r"export: no checkpoint in .* \(a run writes one every save_every steps"):
        export_run(str(tmp_path), str(tmp_path / "out"))
    with pytest.raises(ValueError, match=r"run folder '.*missing' does not exist"):
        export_run(str(tmp_path / "missing"), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()    # nothing half-written


def test_a_lora_run_exports_its_adapters_for_peft(tmp_path, capsys):
    """--peft-adapter: PEFT loads out/adapter on the base the run started from and gives the merged export's
    log-probs; a full-training run and a run whose warm start changed the base are refused."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = flat_config(**{**FAST, "lora_rank": 4, "learning_rate": 0.05, "sft_steps": 0},
                         output_dir=str(tmp_path / "run"))
    T.train(config, log=lambda *_: None)
    assert cli(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--peft-adapter"]) == 0
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(tmp_path / "out" / "adapter"))
    assert (tmp_path / "out" / "adapter" / "grpo_fast_base.json").read_text() == "{}"    # no rope_scaling: no keys
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    base = load_model(config.policy, [], tokenizer, seed=config.run.seed)[0]  # the tiny base the run started from
    adapted = PeftModel.from_pretrained(base, tmp_path / "out" / "adapter")
    vocab = merged.config.vocab_size
    torch.testing.assert_close(logprobs_of(adapted, config, vocab), logprobs_of(merged, config, vocab),
                               rtol=0, atol=1e-5)

    T.train(flat_config(**FAST, output_dir=str(tmp_path / "full")), log=lambda *_: None)
    assert cli(["export", str(tmp_path / "full"), str(tmp_path / "out2"), "--peft-adapter"]) == 2
    assert "trained the whole model (lora_rank 0)" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "out2")
    T.train(flat_config(**{**FAST, "lora_rank": 4, "max_steps": 1, "save_every": 1}, output_dir=str(tmp_path / "ws")),
            log=lambda *_: None)
    with pytest.raises(ValueError, match=r"the warm start \(sft_steps 20\) trained the base before the adapters"):
        export_run(str(tmp_path / "ws"), str(tmp_path / "out3"), adapter=True)


def test_the_adapters_of_a_rope_scaled_run_come_with_the_scaling_their_base_needs(tmp_path, capsys):
    """A LoRA run with YaRN x2 on a model folder: --peft-adapter warns in one line that the base needs the scaling
    and records it beside the adapters; the base loaded with that record (docs/trainer.md's way) and the adapters
    give the merged export's log-probs, the base as its folder has it does not."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo_fast.train import tasks
    from grpo_fast.train.policy import tiny_qwen2, train_tokenizer

    samples = tasks.arithmetic_task(64, seed=0, max_operand=9)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=300)
    tiny_qwen2(len(tokenizer), hidden_size=64, num_heads=2, num_kv_heads=1, eos_token_id=tokenizer.eos_token_id,
               pad_token_id=tokenizer.pad_token_id).save_pretrained(tmp_path / "base")
    tokenizer.save_pretrained(tmp_path / "base")
    yarn = {"rope_type": "yarn", "factor": 2.0}
    config = flat_config(**{**FAST, "lora_rank": 4, "learning_rate": 0.05, "sft_steps": 0, "max_steps": 1,
                            "save_every": 1}, model=str(tmp_path / "base"), rope_scaling=yarn,
                         output_dir=str(tmp_path / "run"))
    T.train(config, log=lambda *_: None)
    assert cli(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--peft-adapter"]) == 0
    warning = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and 'policy.rope_scaling {"rope_type": "yarn", "factor": 2.0}' in warning[0], warning
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    vocab = merged.config.vocab_size
    expected = logprobs_of(merged, config, vocab)
    adapter = tmp_path / "out" / "adapter"
    with open(adapter / "grpo_fast_base.json") as f:                       # docs/trainer.md: loading the adapters
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base", **json.load(f))
    adapted = PeftModel.from_pretrained(base, adapter)
    torch.testing.assert_close(logprobs_of(adapted, config, vocab), expected, rtol=0, atol=1e-5)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), adapter)
    assert (logprobs_of(plain, config, vocab) - expected).abs().max() > 1e-4     # the scaling matters (5e-4 here)
