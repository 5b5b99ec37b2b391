"""`grpo-fast plan`: parameter counts, the components' behaviour, the CLI, and the plan against measured peaks."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from grpo_fast.train.plan.memory import CARDS, GIB, PRESETS, Job, ModelShape, fits, load_shape, plan
from grpo_fast.train.plan.report import summary


def test_parameter_count_matches_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    for tied, bias_model in ((True, "qwen2"), (False, "llama")):
        if bias_model == "qwen2":
            config = transformers.Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=160,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=tied)
            model = transformers.Qwen2ForCausalLM(config)
        else:
            config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=160,
                                              num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                                              tie_word_embeddings=tied)
            model = transformers.LlamaForCausalLM(config)
        folder = tmp_path / bias_model
        config.save_pretrained(folder)
        assert load_shape(str(folder)).num_parameters() == model.num_parameters(), bias_model


def test_presets_have_the_published_sizes():
    billions = {name: shape.num_parameters() / 1e9 for name, shape in PRESETS.items()}
    assert round(billions["qwen2.5-0.5b"], 2) == 0.49 and round(billions["qwen2.5-1.5b"], 2) == 1.54
    assert round(billions["qwen2.5-7b"], 2) == 7.62 and round(billions["llama-3.1-8b"], 2) == 8.03


def test_components_behave():
    shape = PRESETS["qwen2.5-1.5b"]
    # past the card's chunk budget (1.4 GiB on a 24 GB card) grpo_fast's buffer is bounded by the budget, not by
    # the tokens: equal chunks, each between half the budget and the budget; only d(hidden) grows with the tokens
    from grpo_fast import chunked

    small_card = CARDS["24 GB (RTX 4090 / L4)"]
    short, long = (plan(shape, Job(completion_length=n, loss="grpo_fast"), small_card) for n in (8192, 32768))
    naive_short, naive_long = (plan(shape, Job(completion_length=n, loss="naive")) for n in (4096, 32768))
    budget = chunked.cuda_chunk_bytes(small_card)
    assert long["loss_buffers"] - short["loss_buffers"] < budget / 2 + 24576 * 1536 * 4 + 1
    assert naive_long["loss_buffers"] > 7 * naive_short["loss_buffers"]            # grows with tokens
    tokens_v = 32768 * shape.vocab_size
    assert naive_long["loss_buffers"] >= tokens_v * (2 + 12)                         # bf16 logits + fp32 copies
    no_ckpt = plan(shape, Job(completion_length=32768, gradient_checkpointing=False))
    assert no_ckpt["activations"] > 10 * long["activations"]
    lora = plan(shape, Job(lora_rank=16, dtype="bf16"))          # fp32 adapters on a bf16 base
    assert lora["optimizer"] < 0.02 * short["optimizer"] and lora["weights"] < 0.6 * short["weights"]
    assert lora["gradients"] == lora["optimizer"] // 2 and lora["autocast_weight_copies"] == 0
    lora_fp32_base = plan(shape, Job(lora_rank=16))                 # bf16-autocast keeps the weights in fp32
    assert lora_fp32_base["weights"] > short["weights"] and lora_fp32_base["autocast_weight_copies"] == 0
    assert plan(shape, Job(beta=0.04))["reference_model"] == short["weights"]
    # with LoRA the KL reference is the policy with its adapters off, as train builds it: no copy (it planned one)
    lora_kl = plan(shape, Job(lora_rank=16, dtype="bf16", beta=0.04))
    assert lora_kl["reference_model"] == 0 and lora_kl["total"] == lora["total"] + lora_kl["no_grad_pass"] - \
        lora["no_grad_pass"]
    # per trained parameter: AdamW 8 bytes (fp32 moments), 12 with bf16 weights (an fp32 master copy too),
    # 8-bit AdamW 2, bf16-state AdamW 4 (both round bf16 weights stochastically: no master)
    n = shape.num_parameters()
    assert short["optimizer"] == 8 * n and plan(shape, Job(dtype="bf16"))["optimizer"] == 12 * n
    assert plan(shape, Job(optimizer="adamw8bit"))["optimizer"] == 2 * n
    assert plan(shape, Job(dtype="bf16", optimizer="adamw8bit"))["optimizer"] == 2 * n
    assert plan(shape, Job(dtype="bf16", optimizer="adamw-bf16"))["optimizer"] == 4 * n
    for estimate in (short, long, naive_long, no_ckpt, lora):
        assert estimate["total"] == sum(v for k, v in estimate.items() if k != "total")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="loss must be one of"):
        Job(loss="liger")
    with pytest.raises(ValueError, match="completion_length must be > 0"):
        Job(completion_length=0)
    with pytest.raises(ValueError, match="model must be a preset"):
        load_shape("no-such-model")


def test_cli_json(tmp_path):
    from grpo_fast.cli import main

    done = subprocess.run([sys.executable, "-m", "grpo_fast.cli", "plan", "qwen2.5-7b", "--completion-length",
                           "16384", "--json"], capture_output=True, text=True, check=True)
    report = json.loads(done.stdout)
    assert report["parameters"] == PRESETS["qwen2.5-7b"].num_parameters()
    assert report["components"]["total"] == sum(v for k, v in report["components"].items() if k != "total")
    assert set(report["cards"]) >= {"H200 141GB", "A100 80GB", "A100 40GB"}
    small = json.loads(subprocess.run([sys.executable, "-m", "grpo_fast.cli", "plan", "qwen2.5-0.5b",
                                       "--completion-length", "1024", "--json"], capture_output=True, text=True,
                                      check=True).stdout)
    assert small["cards"]["H200 141GB"]["fits"] and not report["cards"]["24 GB (RTX 4090 / L4)"]["fits"]
    assert main(["plan", "nonexistent-model"]) == 2


def test_a_job_that_does_not_fit_says_which_budget_and_a_huge_batch_does_not_fit(capsys):
    """Below the card's memory a vLLM job can still miss its pool (the weights and one sequence's KV cache): the
    line says so, with the share it needs. The step's batch is counted, so group size 1e20 fits no card."""
    from grpo_fast.cli import main

    assert main(["plan", "qwen2.5-7b", "--lora-rank", "16", "--dtype", "bf16", "--engine", "vllm",
                 "--gpu-memory-utilization", "0.1"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("A100 80GB")]
    assert re.search(r"does not fit  \(\d+\.\d GiB needed of 79.1 GiB\); vLLM's pool, gpu_memory_utilization 0.1 of "
                     r"the card \(7.9 GiB\), is below its weights and one sequence's KV cache at full length "
                     r"\(\d+\.\d GiB, 0.\d\d of the card\)", line), line
    huge = plan(PRESETS["qwen2.5-0.5b"], Job(group_size=10**20))
    assert huge["step_batch"] > 10**20 and not any(ok for ok, _, _ in fits(PRESETS["qwen2.5-0.5b"],
                                                                           Job(group_size=10**20)).values())


def test_the_plan_of_the_defaults_is_the_trainers_default_job(capsys):
    """With no option but the lengths, the plan is the job `grpo-fast train` runs with its own defaults (its
    config sections'), and --help gives every option a text and every non-flag its default."""
    import argparse
    from dataclasses import asdict

    from grpo_fast.cli import main
    from grpo_fast.train.plan.command import add_arguments
    from grpo_fast.train.plan.fit import training_job
    from tests.helpers import flat_config

    assert main(["plan", "qwen2.5-0.5b", "--completion-length", "2048", "--prompt-length", "300", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["job"]
    assert planned == asdict(training_job(flat_config(max_completion_length=2048), 300, "cuda"))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for action in parser._actions:
        assert action.help, action.dest
    text = " ".join(parser.format_help().split())
    for action in parser._actions:
        if action.option_strings and action.nargs != 0:
            assert f"(default: {action.default})" in text, action.dest


def test_a_plan_that_does_not_fit_says_what_would_by_its_own_numbers(capsys):
    """The smallest and the largest card the job misses get a line: the change that makes it fit there, which the
    plan of the changed job confirms (these are the lines docs/long-context-and-planner.md shows)."""
    from grpo_fast.cli import main

    # 2 prompts a step: the HF engine's KV cache holds all of a step's sequences at once, 16 x 8 of them at the
    # default would be 115 GiB at these lengths, more than any change below saves
    job = ["plan", "qwen2.5-1.5b", "--completion-length", "16384", "--prompts-per-step", "2"]
    assert main(job) == 0
    advice = [line for line in capsys.readouterr().out.splitlines() if line.startswith("to fit ")]
    assert advice == [
        "to fit 24 GB (RTX 4090 / L4): --micro-batch-size 1, --dtype bf16 and --optimizer adamw8bit would make "
        "it fit (20.4 GiB; it changes the numerics or what is trained)",
        "to fit H200 141GB: --micro-batch-size 1 would make it fit (35.4 GiB)"]
    for line in advice:
        card, change = re.match(r"to fit (.+?): (.+) would make it fit", line).groups()
        assert main(job + re.sub(r",| and ", " ", change).split() + ["--json"]) == 0
        assert json.loads(capsys.readouterr().out)["cards"][card]["fits"], line
    # 8B with LoRA in bf16 at 64k, one prompt's group a step: no option but a shorter completion fits a 24 GB
    # card; the longest that does
    job = ["plan", "llama-3.1-8b", "--completion-length", "65536", "--micro-batch-size", "1", "--lora-rank", "16",
           "--dtype", "bf16", "--prompts-per-step", "1"]
    assert main(job) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("to fit 24 GB"))
    longest = int(re.search(r"makes it fit; --completion-length (\d+) would \(", line).group(1))
    for length, fitting in ((longest, True), (longest + 1, False)):
        assert main(job[:2] + ["--completion-length", str(length)] + job[4:] + ["--json"]) == 0
        assert json.loads(capsys.readouterr().out)["cards"]["24 GB (RTX 4090 / L4)"]["fits"] == fitting, line


@pytest.mark.parametrize("loss", ["grpo_fast", "naive"])
def test_cpu_plan_within_10_percent_of_live_memory(loss):
    """Two policy-update steps of a tiny model (vocabulary 32768, 2048-token completions) in a fresh process, with
    glibc's mmap threshold fixed so that freed tensors leave the RSS: the CPU plan (its tensors; no runtime term) is
    the peak once gradients and optimizer states exist, i.e. from the second step on, within 10%. (Under glibc's
    default threshold the RSS also holds the blocks the allocator keeps, which no plan counts.)"""
    pytest.importorskip("transformers")
    command = [sys.executable, "-m", "grpo_fast.benchmarks.long_context", "--worker-length", "2048",
               "--worker-loss", loss, "--device", "cpu", "--steps", "2"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert done.returncode == 0, done.stderr[-3000:]
    measured = json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"]
    from grpo_fast.benchmarks.long_context import PROMPT

    shape = ModelShape(256, 512, 2, 4, 2, 32768, tie_word_embeddings=True, attention_bias=True)
    planned = plan(shape, Job(prompt_length=PROMPT, completion_length=2048, group_size=2, micro_batch_size=1,
                              dtype="fp32", loss=loss, engine="hf", device="cpu"))
    assert planned["runtime"] == 0
    assert 0.9 < planned["total"] / measured < 1.1, (planned["total"] / GIB, measured / GIB)


def test_grpo_fast_chunk_is_the_loss_default_budget_of_each_card():
    """On CUDA the loss's default chunk budget is a share of the card's total memory (chunked.cuda_chunk_bytes):
    a job whose bf16 logits exceed 1 GiB counts up to 4.9 GiB on an 80 GB card and 1.4 GiB on a 24 GB one, not
    1 GiB (equal chunks as few as the budget allows: 9.3 GiB of logits in two of 4.6 GiB on an 80 GB card)."""
    import dataclasses

    from grpo_fast import chunked
    from grpo_fast.train.plan.memory import fits, fits_in

    shape = PRESETS["qwen2.5-1.5b"]
    # 32768 x 151936 bf16 logits: 9.3 GiB; one prompt's group a step, so that the update is the peak, not the HF
    # generation's KV cache of every sequence of the step
    job = Job(completion_length=32768, engine="hf", prompts_per_step=1)
    one_gib = plan(shape, dataclasses.replace(job, chunk_bytes=GIB))
    for card, budget in (("H100 80GB", 79.1 * GIB / 16), ("24 GB (RTX 4090 / L4)", 22.0 * GIB / 16),
                         ("H200 141GB", 8 * GIB)):
        capacity = CARDS[card]
        assert chunked.cuda_chunk_bytes(capacity) == int(budget), card
        estimate = plan(shape, job, capacity)
        # the buffer: equal chunks, as few as the budget allows (chunked.balanced_rows)
        row = shape.vocab_size * 2
        buffer = chunked.balanced_rows(32768, int(budget) // row) * row
        one_gib_buffer = chunked.balanced_rows(32768, GIB // row) * row
        assert estimate["loss_buffers"] - one_gib["loss_buffers"] == buffer - one_gib_buffer, card
        assert estimate["total"] - one_gib["total"] == buffer - one_gib_buffer, card
        assert int(budget) / 2 < buffer <= int(budget), card
        assert fits(shape, job)[card] == fits_in(shape, job, estimate, capacity) + (estimate["total"],)
    assert plan(shape, job) == plan(shape, job, CARDS["H200 141GB"])   # no card: the largest budget, 8 GiB
    # logits under the budget: the chunk holds them all, whatever the card; a given chunk_bytes overrides the card
    short = Job(completion_length=1024, engine="hf")
    assert len({plan(shape, short, capacity)["total"] for capacity in CARDS.values()}) == 1
    assert all(plan(shape, dataclasses.replace(job, chunk_bytes=GIB), capacity) == one_gib
               for capacity in CARDS.values())
    # CPU plans do not depend on a card: 256 MiB
    cpu = Job(completion_length=32768, engine="hf", device="cpu", dtype="fp32")
    assert plan(shape, cpu, CARDS["H200 141GB"]) == plan(shape, cpu, CARDS["24 GB (RTX 4090 / L4)"]) == plan(shape, cpu)
    assert plan(shape, cpu) == plan(shape, dataclasses.replace(cpu, chunk_bytes=chunked.DEFAULT_CHUNK_BYTES_CPU))


def test_attention_mask_is_counted_where_it_is_built():
    shape = PRESETS["qwen2.5-1.5b"]
    common = dict(prompt_length=512, completion_length=6000, micro_batch_size=20, dtype="bf16-autocast")
    tokens, length = 20 * 6512, 6512
    varlen = plan(shape, Job(**common, attention="grpo_fast_varlen"))
    flash = plan(shape, Job(**common, attention="flash_attention_2"))
    dense = plan(shape, Job(**common, attention="sdpa"))                  # sdpa over a packed row: (N, N)
    padded = plan(shape, Job(**common, attention="grpo_fast_varlen", packing=False))       # (b, 1, L, L)
    assert varlen["attention_mask"] == flash["attention_mask"] == 0
    assert plan(shape, Job(**common, attention="flash_attention_2", packing=False))["attention_mask"] == 0
    # a bool mask and sdpa's bf16 additive copy in the one checkpointed layer being recomputed
    assert dense["attention_mask"] == tokens * tokens * (1 + 2) == dense["total"] - varlen["total"]
    assert padded["attention_mask"] == 20 * length * length * (1 + 2)
    no_ckpt = plan(shape, Job(**common, attention="sdpa", packing=False, gradient_checkpointing=False))
    assert no_ckpt["attention_mask"] == 20 * length * length * (1 + 2 * shape.num_layers)
    one = dict(common, micro_batch_size=1)               # one sequence: nothing packed, no padding, no mask
    assert plan(shape, Job(**one, attention="sdpa"))["attention_mask"] == 0
    assert plan(shape, Job(**one, packing=False))["attention_mask"] == 0
    for estimate in (varlen, dense, padded, no_ckpt):
        assert estimate["total"] == sum(v for k, v in estimate.items() if k != "total")
    assert dense.attention == "sdpa" and summary(dense).endswith("; attention sdpa")
    assert "attention_mask" in summary(dense)
    assert plan(shape, Job(device="cpu", dtype="fp32")).attention == "grpo_fast_varlen"
    with pytest.raises(ValueError, match="attention must be one of"):
        Job(attention="eager")


def test_kept_sets_are_counted_bounded_by_top_k_or_the_vocabulary():
    """Top-k / top-p: every sampled position's kept set (int64 ids and an offset) is in both peaks, at most top_k
    ids a token, the whole vocabulary under top-p alone (and the run's log warns about that); nothing without."""
    from grpo_fast.train.plan.fit import log_run_plan
    from grpo_fast.train.plan.memory import Job, load_shape, plan
    from tests.helpers import flat_config

    shape = load_shape("qwen2.5-0.5b")
    base = dict(prompt_length=256, completion_length=1024, group_size=8, prompts_per_step=8, engine="hf")
    positions = 8 * 8 * 1024
    none = plan(shape, Job(**base))
    top_k = plan(shape, Job(**base, top_k=512, top_p=0.95))
    top_p = plan(shape, Job(**base, top_p=0.95))
    assert none["kept_sets"] == 0
    assert top_k["kept_sets"] == positions * 513 * 8
    assert top_p["kept_sets"] == positions * (shape.vocab_size + 1) * 8
    assert top_p["total"] - none["total"] >= top_p["kept_sets"]
    with pytest.raises(ValueError, match="top_k must be >= 0"):
        Job(**base, top_k=-1)
    lines = []
    log_run_plan(flat_config(top_p=0.95), [{"prompt": "1+1=", "solution": "2"}], torch.device("cpu"), lines.append)
    assert any("top_p=0.95 without top_k" in line and "set top_k" in line for line in lines), lines
    lines.clear()
    log_run_plan(flat_config(top_p=0.95, top_k=64), [{"prompt": "1+1=", "solution": "2"}], torch.device("cpu"),
                 lines.append)
    assert not any("without top_k" in line for line in lines), lines
