"""The trainer's configuration: one dataclass, loaded from YAML with `--key value` overrides, checked once."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Optional

from grpo_fast.train.advantages import ESTIMATORS, SCALES
from grpo_fast.train.engines import IS_MODES
from grpo_fast.variants import LossConfig


@dataclass
class TrainConfig:
    """Every option of `grpo-fast train`, grouped by what it controls.

    Model and data
        model: "tiny" (a Qwen2-style model and tokenizer built in code) or a Hugging Face model directory.
        task: "arithmetic" (generated, operands 0..max_operand), "gsm8k" (vendored subset) or a .jsonl file
            with prompt / solution.
        prompt_format: "plain" (the prompt text) or "chat" (the tokenizer's chat template, as a user turn);
            system_prompt, if set, is the system turn (chat) or a line before the prompt (plain).
        device: "auto" (CUDA when available), "cpu" or "cuda[:i]". bf16 autocast on GPU, fp32 on CPU.
    Rollouts: group_size completions per prompt, prompts_per_step prompts per step, sampled at temperature /
        top_p up to max_completion_length tokens (every one of them with ignore_eos, for length tests) by the
        `engine`: "hf" (model.generate) or "vllm" (an offline vLLM engine in this process, weights pushed after
        every step; vllm_gpu_memory_utilization is its share of the GPU). vLLM samples with its own numerics,
        so each token's loss is weighted by the rollout correction `importance_sampling` (none, token_truncate,
        token_mask, sequence_truncate, sequence_mask) of exp(trainer log-prob - engine log-prob), capped at
        importance_sampling_cap.
    Rewards: names from grpo_fast.train.rewards.REWARDS or "module:function", weighted by reward_weights.
    Loss: as grpo_fast.grpo_loss; num_iterations > 1 reuses each rollout with old log-probs.
        loss_implementation "naive" computes the same loss from the full logits (for comparisons).
    Optimization: AdamW, warm-up then cosine or linear decay, grad-norm clipping, gradient checkpointing.
        Micro-batches hold at most micro_batch_size sequences and micro_batch_tokens real tokens (None: no
        token limit; a longer sequence goes alone); packing lays a micro-batch's sequences end to end without
        padding (position_ids restart per sequence), otherwise they are padded to the micro-batch's longest.
        Their gradients add up to the whole step's, whatever the cut. offload_activations keeps the tensors
        saved for backward in CPU memory (GPU runs).
    Warm start: sft_steps of supervised training on the task's solutions before GRPO (0 to skip).
    Processes: under torchrun, `distributed` is "ddp" (PyTorch DistributedDataParallel) or "fsdp2"
        (fully_shard per decoder layer); each rank takes prompts_per_step / world_size prompts per step.
    Run: output_dir gets metrics.jsonl, curves.png, completions.jsonl and checkpoints every save_every steps.
        A folder that already holds a run is refused unless resuming or overwrite_output_dir is set. A step
        whose loss or gradient norm is not finite is skipped (the weights stay as they were); max_bad_steps
        such steps in a row stop the run.
    """

    model: str = "tiny"
    task: str = "arithmetic"
    prompt_format: str = "plain"
    system_prompt: Optional[str] = None
    device: str = "auto"
    num_prompts: int = 2000
    max_operand: int = 9
    engine: str = "hf"
    group_size: int = 8
    prompts_per_step: int = 8
    max_completion_length: int = 6
    temperature: float = 1.0
    top_p: float = 1.0
    ignore_eos: bool = False
    vllm_gpu_memory_utilization: float = 0.3
    importance_sampling: str = "sequence_mask"
    importance_sampling_cap: float = 3.0
    rewards: list = field(default_factory=lambda: ["accuracy"])
    reward_weights: Optional[list] = None
    scale_rewards: str = "group"
    advantage_estimator: str = "grpo"
    mask_truncated_completions: bool = False
    loss_type: str = "dapo"
    loss_implementation: str = "grpo_fast"
    beta: float = 0.0
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    num_iterations: int = 1
    entropy_coef: float = 0.0
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 5
    lr_schedule: str = "cosine"
    max_grad_norm: float = 1.0
    micro_batch_size: int = 32
    micro_batch_tokens: Optional[int] = None
    packing: bool = True
    offload_activations: bool = False
    gradient_checkpointing: bool = True
    max_steps: int = 300
    sft_steps: int = 300
    sft_learning_rate: float = 3e-3
    seed: int = 0
    distributed: str = "ddp"
    output_dir: str = "runs/default"
    overwrite_output_dir: bool = False
    save_every: int = 20
    log_completions: int = 4
    max_bad_steps: int = 3

    def __post_init__(self):
        positive = ("num_prompts", "group_size", "prompts_per_step", "max_completion_length", "num_iterations",
                    "micro_batch_size", "max_steps", "save_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)!r}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages compare completions), got {self.group_size}")
        choices = {"prompt_format": ("plain", "chat"), "engine": ("hf", "vllm"), "importance_sampling": IS_MODES,
                   "loss_implementation": ("grpo_fast", "naive"), "distributed": ("ddp", "fsdp2"),
                   "scale_rewards": SCALES, "advantage_estimator": ESTIMATORS,
                   "lr_schedule": ("cosine", "linear", "constant")}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.temperature <= 0 or not 0 < self.top_p <= 1:
            raise ValueError(f"temperature must be > 0 and top_p in (0, 1], got {self.temperature}, {self.top_p}")
        if self.micro_batch_tokens is not None and self.micro_batch_tokens <= 0:
            raise ValueError(f"micro_batch_tokens must be > 0 or None, got {self.micro_batch_tokens}")
        if self.importance_sampling_cap <= 0 or not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ValueError(f"importance_sampling_cap must be > 0 and vllm_gpu_memory_utilization in (0, 1], got "
                             f"{self.importance_sampling_cap}, {self.vllm_gpu_memory_utilization}")
        if self.sft_steps < 0 or self.warmup_steps < 0:
            raise ValueError("sft_steps and warmup_steps must be >= 0")
        if self.reward_weights is not None and len(self.reward_weights) != len(self.rewards):
            raise ValueError(f"reward_weights must have one weight per reward ({len(self.rewards)}), "
                             f"got {self.reward_weights}")
        self.loss_config()                     # loss options are checked where the loss defines them

    def check_world(self, world_size: int) -> None:
        """The checks that need the number of processes, run once before anything is loaded."""
        if self.prompts_per_step % world_size:
            raise ValueError(f"prompts_per_step must be a multiple of the number of processes ({world_size}) so "
                             f"that each rank scores whole groups, got {self.prompts_per_step}")
        if self.scale_rewards == "batch" and world_size > 1:
            raise ValueError("scale_rewards='batch' needs the rewards of all ranks; use 'group' or 'none'")

    def loss_config(self) -> LossConfig:
        return LossConfig(loss_type=self.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                          beta=self.beta, entropy_coef=self.entropy_coef,
                          max_completion_length=self.max_completion_length)


def _convert(name: str, text, kind):
    """A command-line or YAML value as the field's type, with an error naming the key."""
    origin = typing.get_origin(kind)
    if origin is typing.Union:                                    # Optional[X]
        if text is None or (isinstance(text, str) and text.lower() in ("none", "null")):
            return None
        kind = next(arg for arg in typing.get_args(kind) if arg is not type(None))
        origin = typing.get_origin(kind)
    if kind is list or origin is list:
        if isinstance(text, list):
            return text
        items = [item.strip() for item in str(text).split(",") if item.strip()]
        return [float(item) if name == "reward_weights" else item for item in items]
    if isinstance(text, kind) and not (kind is int and isinstance(text, bool)):
        return text
    try:
        if kind is bool:
            lowered = str(text).lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        return kind(text)
    except (TypeError, ValueError):
        raise ValueError(f"config key {name!r} expects {kind.__name__}, got {text!r}") from None


def load_config(path: Optional[str] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """TrainConfig from a YAML file (optional) and overrides {key: value}; unknown keys are errors."""
    values = {}
    if path:
        import yaml

        with open(path) as f:
            loaded = yaml.safe_load(f) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file is a mapping of keys to values")
        values.update(loaded)
    values.update(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = typing.get_type_hints(TrainConfig)
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(fields)}")
    return TrainConfig(**{name: _convert(name, value, hints[name]) for name, value in values.items()})


def parse_overrides(items: list) -> dict:
    """['--key', 'value', '--other', 'v'] -> {'key': 'value', 'other': 'v'} (dashes in keys become _)."""
    overrides, index = {}, 0
    while index < len(items):
        item = items[index]
        if not item.startswith("--"):
            raise ValueError(f"expected --key value, got {item!r}")
        key = item[2:].replace("-", "_")
        if "=" in key:
            key, value = key.split("=", 1)
            index += 1
        else:
            if index + 1 >= len(items):
                raise ValueError(f"--{key} needs a value")
            value = items[index + 1]
            index += 2
        overrides[key] = value
    return overrides
