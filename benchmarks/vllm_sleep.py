"""vLLM's sleep mode on a GPU, as rollout.vllm_sleep uses it: the card's free memory with the engine awake,
asleep and woken by a weight push, and whether the woken engine samples what it sampled before the sleep (its
weights and cache came back whole).

python -m grpo_fast.benchmarks.vllm_sleep [--gpu-memory-utilization 0.3]

The trainer's VLLMEngine on the built-in tiny model (saved to a scratch folder): vLLM's pool is
--gpu-memory-utilization of the card whatever the model, its KV cache filling what the weights leave, so a tiny
model shows what a sleep frees. Prints one JSON line (free GiB before the engine, awake, asleep, woken; the GiB a
sleep freed; same_samples) and exits 0 when the sleep freed memory and the samples after it are the ones before;
1 when not; 2 where there is no CUDA device or no vLLM (saying which). benchmarks/gpu_window.sh runs it, then two
training steps with vllm_sleep, in its vllm_sleep phase: until that phase has run on a GPU, vllm_sleep has not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile

import torch

GIB = 2**30


def free_gib() -> float:
    """The card's free memory in GiB, after the work queued on it."""
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GIB


def measure(utilization: float) -> dict:
    """The JSON line's values (see the module docstring)."""
    from grpo_fast.train import tasks
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.policy import tiny_qwen2, train_tokenizer
    from grpo_fast.train.rollout.engines import VLLMEngine
    from grpo_fast.train.run.model_folder import save_model_folder

    samples = tasks.arithmetic_task(16, seed=0)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=300)
    model = tiny_qwen2(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id).cuda().eval()
    config = TrainConfig.from_keys(engine="vllm", vllm_sleep=True, vllm_gpu_memory_utilization=utilization,
                                   group_size=4, max_completion_length=16)
    prompts = tasks.prompt_ids([s["prompt"] for s in samples[:4]], tokenizer)
    with tempfile.TemporaryDirectory() as folder:
        save_model_folder(model, tokenizer, folder + "/model")
        before = free_gib()
        engine = VLLMEngine(folder + "/model", config.rollout, 0, max(map(len, prompts)) + 16, torch.device("cuda"))
        first = engine.generate(prompts, seed=11)
        awake = free_gib()
        engine.sleep()
        asleep = free_gib()
        engine.sync_weights(model)                      # the push after an update wakes it
        woken = free_gib()
        again = engine.generate(prompts, seed=11)
    total = torch.cuda.mem_get_info()[1] / GIB
    return {"gpu": torch.cuda.get_device_name(), "gpu_memory_utilization": utilization,
            "free_gib": {"before": round(before, 3), "awake": round(awake, 3), "asleep": round(asleep, 3),
                         "woken": round(woken, 3)},
            "freed_gib": round(asleep - awake, 3), "pool_gib": round(utilization * total, 3),
            "kept_asleep_gib": round(before - asleep, 3),      # the planner's VLLM_ASLEEP estimate, measured
            "same_samples": torch.equal(first.completion_ids, again.completion_ids)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    args = parser.parse_args(argv)
    missing = [why for why, absent in (("no CUDA device", not torch.cuda.is_available()),
                                       ("vllm is not installed", importlib.util.find_spec("vllm") is None)) if absent]
    if missing:
        print(f"vllm_sleep: not measured: {', '.join(missing)}")
        return 2
    result = measure(args.gpu_memory_utilization)
    print(json.dumps(result))
    return 0 if result["same_samples"] and result["freed_gib"] > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
