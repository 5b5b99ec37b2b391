"""The memory planner behind `grpo-fast plan`: a GRPO job's peak memory per component, before it is launched.

    from grpo_fast.train.plan import Job, plan
    from grpo_fast.train.plan.memory import CARDS, PRESETS
    estimate = plan(PRESETS["qwen2.5-1.5b"], Job(completion_length=16384), CARDS["H100 80GB"])

    memory    the memory model: ModelShape, Job, the cards and presets, `plan` and whether it `fits`
    fit       a TrainConfig's shape and job, the context check, what makes a job fit a card, the plan the trainer logs
    report    the table (or JSON) of `grpo-fast plan` and the one-line summary
    command   `grpo-fast plan`: its arguments and main
"""

from grpo_fast.train.plan.memory import Job, ModelShape, plan

__all__ = ["plan", "Job", "ModelShape"]
