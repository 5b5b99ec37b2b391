"""The trainer built on the loss library: GRPO from rollouts to checkpoints, laid out by stage.

    from grpo_fast.train import TrainConfig, load_config, train
    history = train(load_config("examples/tiny_cpu.yaml", {"max_steps": 20}))

    loop.py          `train`: setup in named steps, then one line per stage of each step
    tasks/           the prompts of each step (generated tasks, GSM8K, dataset files) and the rewards
    rollout/         the completions: one Rollouts interface over HF / vLLM, in process or in a rollout process
    update/          advantages, micro-batches, the loss step, dtypes, the optimizer, the rollout correction
    run/             what every stage may use: atomic folders, stops between steps, RunError, metrics files,
                     trackers, evaluation, the model folder
    saved/           checkpoints and resume, `grpo-fast export`, `grpo-fast eval` and `grpo-fast generate`: what a
                     run saved
    policy.py        the policy: load_model, the tiny model built in code, the frozen KL reference
    config.py        `TrainConfig` (every option, checked once), `load_config`, `parse_overrides`
    plan/            the memory planner behind `grpo-fast plan`: the memory model, fit advice, the report
    lora.py          LoRA adapters (PEFT)
    distributed.py   DDP / FSDP2 under torchrun and the few collectives the trainer needs

Each folder's __init__ lists its modules. The import graph has no cycle, and no folder or module here imports one
that imports it back (tests/test_import_graph.py): each stands above all it imports.
"""

from grpo_fast.train.config import TrainConfig, load_config
from grpo_fast.train.loop import train

__all__ = ["train", "TrainConfig", "load_config"]
