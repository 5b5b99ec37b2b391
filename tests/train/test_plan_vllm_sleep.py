"""rollout.vllm_sleep in the planner: vLLM's pool counted at generation beside what the trainer holds between
updates, and the update's peak beside what vLLM keeps asleep, instead of the pool beside the update's peak."""

import subprocess
import sys

import pytest

from grpo_fast.train.plan.memory import CARDS, GIB, HELD_BETWEEN_UPDATES, PRESETS, VLLM_ASLEEP, Job, fits, plan

QWEN3_8B = PRESETS["qwen3-8b"]
CARD = CARDS["H100 80GB"]


def job(**keys) -> Job:
    return Job(**{"prompt_length": 512, "completion_length": 16384, "group_size": 8, "prompts_per_step": 1,
                  "micro_batch_size": 1, "dtype": "bf16", "lora_rank": 64, "engine": "vllm",
                  "gpu_memory_utilization": 0.3, **keys})


def test_the_pool_is_counted_at_generation_and_the_update_beside_a_sleeping_vllm():
    awake, asleep = job(), job(vllm_sleep=True)
    estimate = plan(QWEN3_8B, asleep, CARD)
    assert estimate == plan(QWEN3_8B, awake, CARD)                # the trainer's own components do not change
    pool = 0.3 * CARD
    held = estimate["weights"] + estimate["optimizer"] + estimate["kept_sets"] + estimate["runtime"]
    assert held == sum(estimate.get(name, 0) for name in HELD_BETWEEN_UPDATES)
    assert held < estimate["total"] - estimate["activations"]     # gradients and the step's batch are not held
    fits_awake, needed_awake, _ = fits(QWEN3_8B, awake)["H100 80GB"]
    fits_asleep, needed_asleep, _ = fits(QWEN3_8B, asleep)["H100 80GB"]
    assert needed_awake == estimate["total"] + pool
    assert needed_asleep == max(estimate["total"] + VLLM_ASLEEP, held + pool)
    assert needed_asleep == held + pool          # at 16k generation's peak is the higher: the pool's share is free
    assert needed_awake - needed_asleep > 10 * GIB
    longer = plan(QWEN3_8B, job(vllm_sleep=True, completion_length=65536), CARD)
    assert fits(QWEN3_8B, job(vllm_sleep=True, completion_length=65536))["H100 80GB"][1] == \
        longer["total"] + VLLM_ASLEEP          # at 64k the update's peak is
    # a pool as large as the card leaves the trainer between updates: generation's peak is then the higher
    big = job(vllm_sleep=True, gpu_memory_utilization=0.9)
    assert fits(QWEN3_8B, big)["H100 80GB"][1] == held + 0.9 * CARD > CARD
    assert not fits(QWEN3_8B, big)["H100 80GB"][0]


@pytest.mark.parametrize("keys, words", [
    ({"engine": "hf"}, "vllm_sleep puts vLLM to sleep during the update, but engine is 'hf'"),
    ({"max_staleness": 1}, "vllm_sleep needs max_staleness 0 (generate, then update), got max_staleness=1")])
def test_the_planner_refuses_a_sleep_the_trainer_refuses(keys, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        job(vllm_sleep=True, **keys)


def test_the_command_line_and_a_config_plan_the_sleep():
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.plan.fit import training_job

    assert training_job(TrainConfig.from_keys(engine="vllm", vllm_sleep=True), 64, "cuda").vllm_sleep
    command = [sys.executable, "-m", "grpo_fast.cli", "plan", "qwen3-8b", "--prompt-length", "512",
               "--completion-length", "16384", "--group-size", "8", "--micro-batch-size", "1", "--prompts-per-step",
               "1", "--lora-rank", "64", "--dtype", "bf16", "--engine", "vllm"]
    asleep = subprocess.run(command + ["--vllm-sleep"], capture_output=True, text=True, check=True).stdout
    awake = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert "vllm_sleep: vLLM sleeps through each update" in asleep and "vllm_sleep" not in awake

    def needed(output: str) -> float:
        line = next(line for line in output.splitlines() if line.startswith("H100 80GB"))
        return float(line.split("(")[1].split()[0])

    assert needed(asleep) == pytest.approx(fits(QWEN3_8B, job(vllm_sleep=True))["H100 80GB"][1] / GIB, abs=0.051)
    assert needed(awake) == pytest.approx(fits(QWEN3_8B, job())["H100 80GB"][1] / GIB, abs=0.051)
    refused = subprocess.run(command + ["--vllm-sleep", "--engine", "hf"], capture_output=True, text=True)
    assert refused.returncode == 2 and "vllm_sleep puts vLLM to sleep during the update" in refused.stderr
