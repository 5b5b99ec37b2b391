"""The trainer built on the loss library: GRPO from rollouts to checkpoints, readable top to bottom.

    from grpo_fast.train import TrainConfig, load_config, train
    history = train(load_config("examples/tiny_cpu.yaml", {"max_steps": 20}))

    loop          `train`: setup, then one line per stage of each step
    config        `TrainConfig` (every option, checked once), `load_config`, `parse_overrides`
    engines       rollouts: Hugging Face generate or vLLM, and the rollout importance-sampling correction
    rewards       reward functions (math-verify accuracy, format, ...) and their weighted sum
    advantages    group-normalized advantages (GRPO, RLOO)
    tasks         prompt sources: generated arithmetic, the vendored GSM8K subset, JSONL files
    batching      micro-batches by sequences and tokens, packed or padded
    distributed   DDP / FSDP2 under torchrun and the few collectives the loop needs
    plan          the memory planner behind `grpo-fast plan`
    tiny          the tiny Qwen2-style model and byte-level tokenizer built in code (the offline default)
"""

from grpo_fast.train.config import TrainConfig, load_config
from grpo_fast.train.loop import train

__all__ = ["train", "TrainConfig", "load_config"]
