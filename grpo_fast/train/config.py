"""The trainer's configuration: one dataclass, loaded from YAML with `--key value` overrides, checked once."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
import os
import re
import typing
from dataclasses import dataclass, field
from typing import Optional

from grpo_fast.attention import CHOICES as ATTENTIONS
from grpo_fast.train.run import tracking
from grpo_fast.train.tasks import dataset_files
from grpo_fast.train.update.advantages import ESTIMATORS, SCALES
from grpo_fast.train.update.correction import IS_MODES
from grpo_fast.train.update.optimizer import check_optimizer
from grpo_fast.variants import LOSS_TYPES, LossConfig

GROUPS = ("Model and data", "Rollouts", "Rewards", "Loss", "Optimization", "Memory", "Warm start", "Evaluation",
          "Processes", "Run")
TASKS = ("max", "arithmetic", "gsm8k")


def _group(name: str):
    """The field maker of one group: each key carries its group and one line of help, the one source of keys_help()."""
    assert name in GROUPS

    def key(default, help: str):
        metadata = {"group": name, "help": help}
        if isinstance(default, list):
            return field(default_factory=lambda: list(default), metadata=metadata)
        return field(default=default, metadata=metadata)
    return key


(_data, _rollouts, _rewards, _loss, _optimization, _memory, _warm_start, _evaluation, _processes,
 _run) = map(_group, GROUPS)


def _one_of(values) -> str:
    return ", ".join(values)


@dataclass
class TrainConfig:
    """Every option of `grpo-fast train`, grouped by what it controls; `keys_help()` lists each key with its type,
    default and help (the fields' metadata).

    Model and data: the policy (the tiny model built in code or a Hugging Face model) and the prompts it answers.
    Rollouts: group_size completions for each of prompts_per_step prompts, sampled by the `engine`. vLLM samples
        with its own numerics, so each token's loss is weighted by the rollout correction `importance_sampling` of
        exp(trainer log-prob - engine log-prob), bounded by importance_sampling_min and importance_sampling_cap.
        With num_iterations 1 the trainer's log-probs are the update forward's own (no separate forward).
        With max_staleness k >= 1 the engine runs in its own process, k steps ahead of the update: the same
        correction weighs each sample by the current policy over the (older) one that sampled it.
    Rewards: reward functions, their weights, and how rewards become advantages.
    Loss: as grpo_fast.grpo_loss; num_iterations > 1 reuses each rollout with old log-probs.
    Optimization: AdamW, warm-up then decay, grad-norm clipping, gradient checkpointing. Micro-batches hold at most
        micro_batch_size sequences and micro_batch_tokens real tokens; their gradients add up to the whole step's,
        whatever the cut.
    Memory: the weights' dtype and the optimizer (grpo_fast.train.update.precision and .optimizer have the
        tables), and LoRA adapters (PEFT) in place of full training: the same names as `grpo-fast plan`, which
        predicts their peak.
    Warm start: sft_steps of supervised training on the task's solutions before GRPO (0 to skip).
    Evaluation: held-out problems (never trained on) answered eval_samples times each, before the first step,
        every eval_every steps and after the last: accuracy and pass@k in eval.jsonl (grpo_fast.train.run.evaluate).
    Processes: under torchrun each rank takes prompts_per_step / world_size prompts per step.
    Run: output_dir gets metrics.jsonl, eval.jsonl, curves.png, completions.jsonl, checkpoints, model/ (the
        export) and what the report_to trackers write. A step whose loss or
        gradient norm is not finite is skipped (the weights stay as they were); max_bad_steps such steps in a row
        stop the run.
    """

    model: str = _data("tiny", '"tiny" (a Qwen2-style model and tokenizer built in code), a Hugging Face model '
                               "directory or hub id")
    task: str = _data("max", '"max" (generated: the largest of four numbers), "arithmetic" (generated), "gsm8k" '
                             "(vendored 200-problem subset) or a dataset on disk: a .jsonl / .json / .parquet / .csv "
                             "file or a save_to_disk folder")
    prompt_column: str = _data("prompt", "the dataset's prompt column: text, or a list of chat messages "
                                         "({role, content}, rendered with the chat template)")
    solution_column: str = _data("solution", "the dataset's gold-answer column (text or a number)")
    train_split: str = _data("train", "the split trained on, for a save_to_disk folder of several splits")
    prompt_format: str = _data("plain", '"plain" (the prompt text) or "chat" (the chat template, as a user turn)')
    system_prompt: Optional[str] = _data(None, "the system turn (chat) or a line before the prompt (plain)")
    device: str = _data("auto", '"auto" (CUDA when available), "cpu" or "cuda[:i]"')
    num_prompts: int = _data(2000, "how many max / arithmetic problems are generated")
    max_operand: int = _data(9, "max / arithmetic numbers are 0..max_operand")
    engine: str = _rollouts("hf", '"hf" (model.generate) or "vllm" (offline vLLM in this process, weights pushed '
                                  "after every step)")
    max_staleness: int = _rollouts(0, "0: generate, then update, in turn. k >= 1: the engine runs in its own "
                                      "process and generates the next k steps' rollouts while the trainer "
                                      "updates, from a policy at most k optimizer steps old")
    group_size: int = _rollouts(8, "completions per prompt (>= 2: advantages compare them)")
    prompts_per_step: int = _rollouts(16, "prompts per step, split across processes")
    max_completion_length: int = _rollouts(6, "tokens sampled per completion at most")
    temperature: float = _rollouts(1.0, "sampling temperature")
    top_p: float = _rollouts(1.0, "nucleus sampling probability mass, in (0, 1]")
    top_k: int = _rollouts(0, "sample among the top_k most likely tokens (0: every token), before top_p. With "
                              "top_k > 0 or top_p < 1 the engines return each token's kept set and the trainer's "
                              "log-probs (old, reference, training) are over it; engine 'vllm' needs top_k > 0 "
                              "then (it bounds the kept sets vLLM returns)")
    ignore_eos: bool = _rollouts(False, "sample all max_completion_length tokens of every completion (length tests)")
    vllm_gpu_memory_utilization: float = _rollouts(0.3, "vLLM's share of the GPU memory, in (0, 1]")
    vllm_dtype: str = _rollouts("auto", '"auto" (bfloat16 on a GPU, and on a CPU that computes bf16 natively: AMX '
                                        'or AVX512-BF16; else float32), "float32" or "bfloat16": the vLLM '
                                        "engine's weights and compute; the rollout correction covers its gap to "
                                        "the trainer's log-probs")
    importance_sampling: str = _rollouts("sequence_mask", f"rollout correction: {_one_of(IS_MODES)}")
    importance_sampling_cap: float = _rollouts(3.0, "cap of the rollout correction's ratio")
    importance_sampling_min: float = _rollouts(0.0, "lower bound of the rollout correction's ratio: truncated up "
                                                    "to it, or masked below it (0: none)")
    rewards: list[str] = _rewards(["exact_match"], 'names from grpo_fast.train.tasks.rewards.REWARDS, '
                                                '"module:function" (also from the working directory) or '
                                                '"path/to/file.py:function" (comma-separated)')
    reward_weights: Optional[list[float]] = _rewards(None, "one weight per reward (comma-separated); None: all 1")
    scale_rewards: str = _rewards("group", f"advantages divided by the reward std of: {_one_of(SCALES)}")
    advantage_estimator: str = _rewards("grpo", f"advantage baseline: {_one_of(ESTIMATORS)}")
    mask_truncated_completions: bool = _rewards(False, "completions cut at max_completion_length get no loss")
    loss_type: str = _loss("dapo", f"one of {_one_of(sorted(LOSS_TYPES))}")
    loss_implementation: str = _loss("grpo_fast", '"grpo_fast" or "naive" (the same loss from the full logits, '
                                                  "for comparisons)")
    beta: float = _loss(0.0, "weight of the k3 KL to the reference policy (the policy as GRPO started)")
    epsilon_low: float = _loss(0.2, "clip range [1 - epsilon_low, 1 + epsilon_high]")
    epsilon_high: float = _loss(0.28, "clip range [1 - epsilon_low, 1 + epsilon_high]")
    num_iterations: int = _loss(1, "updates per rollout (> 1 reuses it with old log-probs)")
    entropy_coef: float = _loss(0.0, "subtracts entropy_coef * the mean entropy from the loss")
    # 5e-4: at 1e-3 AdamW's early steps on the built-in task drove whole answer digits to probability ~0 where they
    # were sampled wrong, before the policy had learned when they are right; a digit never sampled earns no reward
    # to come back from (a group of wrong answers has zero advantage), and 4 of 5 seeds stalled at held-out accuracy
    # 0.73-0.85, the machine's rounding deciding which digit died. At 5e-4 entropy falls about half as fast and
    # every seed, thread count and vector width measured ended at 0.89-0.97; with batched rollouts and shared
    # prompts (another order of sums) seeds 0-4 ended at 0.85-0.97, with each completion's attention as one causal
    # sequence at 0.78-0.97 (seed 2 the lowest both times; README, Quick start)
    learning_rate: float = _optimization(5e-4, "AdamW learning rate of the GRPO steps")
    weight_decay: float = _optimization(0.0, "AdamW weight decay")
    warmup_steps: int = _optimization(5, "steps of linear learning-rate warm-up")
    lr_schedule: str = _optimization("cosine", "decay to 0 at max_steps after the warm-up: cosine, linear, constant")
    max_grad_norm: float = _optimization(1.0, "gradients are clipped to this norm")
    micro_batch_size: int = _optimization(32, "sequences per micro-batch at most")
    micro_batch_tokens: Optional[int] = _optimization(None, "real tokens per micro-batch at most (None: no limit; "
                                                            "a longer sequence goes alone)")
    packing: bool = _optimization(True, "lay a micro-batch's sequences end to end without padding (else pad to "
                                        "the longest)")
    share_prompts: bool = _optimization(True, "packed micro-batches hold a group's prompt once, each completion "
                                              "attending to it (exact; only with grpo_fast's own attention, so off "
                                              "under flash-attention and padded micro-batches)")
    attention: str = _optimization("auto", '"auto": a variable-length attention for packed rows (flash-attention 2 '
                                           "on CUDA with flash_attn and bf16 / fp16 compute, else grpo_fast_varlen; "
                                           "soft-capping and attention sinks by the model's eager attention); "
                                           '"eager" or "sdpa": keep that transformers attention (needs packing: '
                                           "false)")
    offload_activations: bool = _optimization(False, "keep the tensors saved for backward in CPU memory (GPU runs)")
    gradient_checkpointing: bool = _optimization(True, "recompute activations in backward to save memory")
    dtype: str = _memory("auto", "weights and compute: fp32, bf16-autocast (fp32 weights, bf16 compute), bf16 "
                                 "(bf16 weights), auto (fp32 on CPU; on CUDA bf16-autocast, or bf16 with LoRA)")
    optimizer: str = _memory("adamw", "adamw (fp32 master weights under bf16), adamw8bit (8-bit states), adamw-bf16 "
                                      "(bf16 states, dtype bf16); the last two need torchao")
    grad_accum_dtype: str = _memory("fp32", "what gradients of bf16 weights add up in over a step's micro-batches: "
                                            "fp32 (an fp32 copy of them while the step runs; one process) or bf16 "
                                            "(no copy; rounded at every micro-batch)")
    lora_rank: int = _memory(0, "rank of LoRA adapters trained instead of the whole model (0: full training)")
    lora_alpha: Optional[float] = _memory(None, "LoRA scale numerator: updates are scaled by lora_alpha / lora_rank "
                                                "(None: 2 x lora_rank)")
    lora_dropout: float = _memory(0.0, "dropout on the LoRA adapters' input, in [0, 1)")
    lora_target_modules: list[str] = _memory(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                              "down_proj"], "names of the linear layers that get adapters "
                                                            "(comma-separated; never the LM head)")
    sft_steps: int = _warm_start(10, "supervised steps on the task's solutions before GRPO (0 to skip); the "
                                      "whole model, before any LoRA adapters are added")
    sft_learning_rate: float = _warm_start(3e-3, "learning rate of the supervised steps")
    eval_every: int = _evaluation(50, "steps between evaluations on the held-out problems (also before the first "
                                      "step and after the last; 0: none)")
    eval_prompts: int = _evaluation(100, "held-out problems per evaluation at most")
    eval_samples: int = _evaluation(4, "completions per held-out problem: accuracy is their mean, pass@k for k "
                                       "up to this")
    eval_reward: Optional[str] = _evaluation(None, "the reward that scores an evaluation, 1.0 or more counting as "
                                                   "correct (None: the first of rewards)")
    eval_task: Optional[str] = _evaluation(None, "where the held-out problems come from, as task (arithmetic, "
                                                 "gsm8k, a file or folder); None: eval_split or eval_fraction")
    eval_split: Optional[str] = _evaluation(None, "the held-out split of a save_to_disk folder (e.g. test)")
    eval_fraction: float = _evaluation(0.1, "share of the task's distinct problems held out (never trained on) "
                                            "when neither eval_task nor eval_split is set")
    distributed: str = _processes("ddp", 'under torchrun: "ddp" (DistributedDataParallel) or "fsdp2" '
                                         "(fully_shard per decoder layer)")
    max_steps: int = _run(300, "GRPO steps")
    seed: int = _run(0, "seed of the task, the model's initialization and the sampling")
    output_dir: str = _run("runs/default", "metrics.jsonl, curves.png, completions.jsonl and checkpoints go here")
    overwrite_output_dir: bool = _run(False, "train into a folder that already holds a run (else refused unless "
                                             "resuming)")
    save_every: int = _run(20, "steps between checkpoints")
    accept_changed_data: bool = _run(False, "--resume with training data that differs from the checkpoint's (a "
                                     "label fix, rows added): accepted and named in the log (else refused); the "
                                     "held-out problems must stay the same")
    log_completions: int = _run(4, "prompts per step whose first completion goes to completions.jsonl")
    report_to: list[str] = _run([], "experiment trackers for the metrics: tensorboard, wandb, trackio "
                                    "(comma-separated; none by default)")
    max_bad_steps: int = _run(3, "non-finite steps in a row (each skipped) that stop the run")

    def __post_init__(self):
        hints = _hints()
        for name in ("model", "task", "eval_task", "output_dir"):     # paths: "~" is the home folder, as in a shell
            if isinstance(getattr(self, name), str):
                setattr(self, name, os.path.expanduser(getattr(self, name)))
        for item in dataclasses.fields(self):
            _check_type(item.name, getattr(self, item.name), hints[item.name])
        for name, (rule, test) in RULES.items():
            value = getattr(self, name)
            if value is None:                                 # Optional keys (typed above)
                continue
            if not (math.isfinite(value) and test(value)):   # NaN fails every comparison, inf is not finite
                number = "a finite number " if _base(hints[name])[0] is float else ""
                raise ValueError(f"{name} must be {number}{rule}".rstrip() + f", got {value!r}")
        for name, allowed in CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        for name in ("model", "output_dir"):
            if not getattr(self, name).strip():
                raise ValueError(f"{name} must not be empty, got {getattr(self, name)!r}")
        for name in ("task", "eval_task"):
            if getattr(self, name) is not None and getattr(self, name) not in TASKS:
                try:
                    dataset_files.check_source(getattr(self, name), name)
                except ValueError as error:
                    raise ValueError(f"{error} ({name} is one of {', '.join(TASKS)} or a dataset on disk)") from None
        eval_source = self.task if self.eval_task is None else self.eval_task
        if self.eval_split is not None and (eval_source in TASKS or not os.path.isdir(eval_source)):
            key = "task" if self.eval_task is None else "eval_task"
            raise ValueError(f"eval_split={self.eval_split!r} names a split of a dataset folder, but {key} is "
                             f"{eval_source!r}: use eval_task or eval_fraction")
        for name, folder in (("train_split", self.task), ("eval_split", eval_source)):
            split = getattr(self, name)
            if split is not None and folder not in TASKS and os.path.isdir(folder):
                found = dataset_files.splits(folder)
                if len(found) > 1 and split not in found:
                    raise ValueError(f"{name}={split!r}: {folder!r} has the splits {found}")
        tracking.check_report_to(self.report_to)
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:i]', got {self.device!r}")
        if not self.rewards or not all(isinstance(name, str) and name.strip() for name in self.rewards):
            raise ValueError(f"rewards must name at least one reward function, got {self.rewards!r}")
        if self.reward_weights is not None:
            if not all(_is_number(w) and math.isfinite(w) for w in self.reward_weights):
                raise ValueError(f"reward_weights must be finite numbers, got {self.reward_weights!r}")
            if len(self.reward_weights) != len(self.rewards):
                raise ValueError(f"reward_weights must have one weight per reward ({len(self.rewards)}), "
                                 f"got {self.reward_weights}")
        if self.importance_sampling_min >= self.importance_sampling_cap:
            raise ValueError(f"importance_sampling_min ({self.importance_sampling_min}) must be below "
                             f"importance_sampling_cap ({self.importance_sampling_cap})")
        if self.max_staleness and self.importance_sampling == "none":
            # the rollout correction is what weighs a stale sample: exp(current policy - the policy that sampled)
            raise ValueError(f"max_staleness={self.max_staleness} needs a rollout correction to weigh samples from "
                             "older policies (exp(trainer log-prob - sampling log-prob)); importance_sampling is "
                             f"'none': set one of {_one_of(IS_MODES[1:])}, or max_staleness: 0")
        corrected = self.engine == "vllm" or self.max_staleness > 0       # the engine's log-probs reach the loss
        if self.loss_type == "vespo" and corrected and self.importance_sampling.startswith("sequence"):
            # vespo folds each token's correction into its sequence weight: a per-sequence ratio would count n times
            raise ValueError(f"loss_type 'vespo' takes the rollout correction per token into its sequence weight; "
                             f"importance_sampling={self.importance_sampling!r} is per sequence: use token_truncate, "
                             "token_mask or none")
        if self.top_k == 1:
            # the kept set is the sampled token alone: its log-prob over the set is 0 under any weights
            raise ValueError("top_k=1 samples the most likely token: over its kept set of one token every log-prob "
                             "is 0, so the loss's gradient is exactly zero; set top_k >= 2 (or 0: every token)")
        if self.engine == "vllm" and self.top_p < 1 and self.top_k == 0:
            # vLLM hands over kept sets only under a top_k bound; without them the trainer's log-probs would be over
            # the whole vocabulary and the engine's over the nucleus, off by the kept mass on every token
            raise ValueError(f"top_p={self.top_p} with engine 'vllm' needs top_k > 0, got top_k=0: vLLM returns the "
                             "kept set of each token (which the trainer's log-probs must be over, so that the rollout "
                             "correction compares like with like) only with a top_k bound; set top_k (e.g. 512)")
        if self.attention != "auto" and self.packing:
            # transformers' own masks keep a packed row's sequences apart only in models that pass their position
            # ids to the mask (Llama, Qwen2, Gemma 2 do; GPT-OSS does not and would attend across sequences)
            raise ValueError(f"packing=True needs attention 'auto' (transformers' {self.attention} does not keep a "
                             f"packed row's sequences apart in every model), got attention={self.attention!r}; set "
                             "packing: false to keep it")
        check_optimizer(self.dtype, self.optimizer, self.lora_rank)
        if self.lora_rank:
            if not self.lora_target_modules or not all(isinstance(n, str) and n.strip()
                                                       for n in self.lora_target_modules):
                raise ValueError(f"lora_target_modules must name at least one linear layer when lora_rank > 0, got "
                                 f"{self.lora_target_modules!r}")
            if importlib.util.find_spec("peft") is None:
                raise ValueError(f"lora_rank={self.lora_rank} needs peft, which is not installed: pip install peft "
                                 "(or 'grpo-fast[train]'), or set lora_rank: 0")
        self.loss_config()                     # loss options are checked where the loss defines them

    def check_world(self, world_size: int) -> None:
        """The checks that need the number of processes, run once before anything is loaded."""
        if self.prompts_per_step % world_size:
            raise ValueError(f"prompts_per_step must be a multiple of the number of processes ({world_size}) so "
                             f"that each rank scores whole groups, got {self.prompts_per_step}")
        if self.max_staleness and world_size > 1:
            raise ValueError(f"max_staleness={self.max_staleness} runs one rollout process for one trainer process; "
                             f"under torchrun ({world_size} processes) use max_staleness: 0")
        if self.scale_rewards == "batch" and world_size > 1:
            raise ValueError("scale_rewards='batch' needs the rewards of all ranks; use 'group' or 'none'")

    @property
    def truncates_sampling(self) -> bool:
        """Whether the engines sample from a truncated distribution (top_k > 0 or top_p < 1): they then return
        each token's kept set, and every log-prob of the trainer is over it."""
        return self.top_k > 0 or self.top_p < 1

    def loss_config(self) -> LossConfig:
        return LossConfig(loss_type=self.loss_type, epsilon_low=self.epsilon_low, epsilon_high=self.epsilon_high,
                          beta=self.beta, entropy_coef=self.entropy_coef,
                          max_completion_length=self.max_completion_length)


VLLM_DTYPES = ("auto", "float32", "bfloat16")
# every key with a fixed set of values
CHOICES = {"prompt_format": ("plain", "chat"), "engine": ("hf", "vllm"), "importance_sampling": IS_MODES,
           "vllm_dtype": VLLM_DTYPES, "loss_implementation": ("grpo_fast", "naive"), "distributed": ("ddp", "fsdp2"),
           "scale_rewards": SCALES, "advantage_estimator": ESTIMATORS, "lr_schedule": ("cosine", "linear", "constant"),
           "grad_accum_dtype": ("fp32", "bf16"), "attention": ATTENTIONS}


def _rule(text: str, test):
    return text, test


_POSITIVE, _NON_NEGATIVE = _rule("> 0", lambda v: v > 0), _rule(">= 0", lambda v: v >= 0)
_FRACTION, _ANY = _rule("in (0, 1]", lambda v: 0 < v <= 1), _rule("", lambda v: True)
# every numeric key: (rule, test), checked after "is finite"; an Optional key's None is not checked
RULES = {
    "num_prompts": _POSITIVE, "max_operand": _POSITIVE,
    "group_size": _rule(">= 2 (advantages compare completions)", lambda v: v >= 2),
    "prompts_per_step": _POSITIVE, "max_completion_length": _POSITIVE, "temperature": _POSITIVE,
    "top_p": _FRACTION, "top_k": _NON_NEGATIVE, "vllm_gpu_memory_utilization": _FRACTION,
    "importance_sampling_cap": _POSITIVE,
    "importance_sampling_min": _NON_NEGATIVE, "max_staleness": _NON_NEGATIVE,
    "beta": _NON_NEGATIVE, "epsilon_low": _NON_NEGATIVE, "epsilon_high": _NON_NEGATIVE, "num_iterations": _POSITIVE,
    "entropy_coef": _ANY, "learning_rate": _POSITIVE, "weight_decay": _NON_NEGATIVE, "warmup_steps": _NON_NEGATIVE,
    "max_grad_norm": _POSITIVE, "micro_batch_size": _POSITIVE, "micro_batch_tokens": _POSITIVE,
    "lora_rank": _NON_NEGATIVE, "lora_alpha": _POSITIVE,
    "lora_dropout": _rule("in [0, 1)", lambda v: 0 <= v < 1), "sft_steps": _NON_NEGATIVE,
    "sft_learning_rate": _POSITIVE, "max_steps": _POSITIVE,
    "seed": _rule("in [0, 2**32)", lambda v: 0 <= v < 2**32),     # the engines' and numpy's seed range
    "eval_every": _NON_NEGATIVE, "eval_prompts": _POSITIVE, "eval_samples": _POSITIVE,
    "eval_fraction": _rule("in [0, 1)", lambda v: 0 <= v < 1),
    "save_every": _POSITIVE, "log_completions": _NON_NEGATIVE, "max_bad_steps": _rule(">= 1", lambda v: v >= 1),
}


@functools.cache
def _hints() -> dict:
    return typing.get_type_hints(TrainConfig)


def _base(kind) -> tuple:
    """(X, optional) for X and Optional[X]."""
    if typing.get_origin(kind) is typing.Union:
        return next(arg for arg in typing.get_args(kind) if arg is not type(None)), True
    return kind, False


def _type_name(kind) -> str:
    kind, optional = _base(kind)
    name = str(kind).replace("typing.", "") if typing.get_origin(kind) else kind.__name__
    return f"{name} or None" if optional else name


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_type(name: str, value, kind) -> None:
    """For TrainConfig(...) built in code: the value has the field's type (a float key takes an int too)."""
    base, optional = _base(kind)
    if value is None and optional:
        return
    origin = typing.get_origin(base) or base
    fits = {bool: lambda: isinstance(value, bool), int: lambda: isinstance(value, int) and not isinstance(value, bool),
            float: lambda: _is_number(value)}.get(origin, lambda: isinstance(value, origin))()
    if not fits:
        raise ValueError(f"config key {name!r} expects {_type_name(kind)}, got {value!r}")


def _convert(name: str, text, kind):
    """A command-line or YAML value as the field's type, with an error naming the key."""
    kind, optional = _base(kind)
    if isinstance(text, str) and text.strip().lower() == "none" and "none" in CHOICES.get(name, ()):
        return "none"                   # one of the key's choices (importance_sampling, scale_rewards), not a null
    if text is None or (isinstance(text, str) and text.strip().lower() in ("none", "null")):
        if optional:
            return None
        # otherwise a str key would hold the text "None" (output_dir: ~ trained into ./None)
        raise ValueError(f"config key {name!r} expects {_type_name(kind)} and cannot be null, got {text!r}")
    if typing.get_origin(kind) is list:
        items = text if isinstance(text, list) else [item.strip() for item in str(text).split(",") if item.strip()]
        item_kind = typing.get_args(kind)[0]
        try:
            return [_convert(name, item, item_kind) for item in items]
        except ValueError:
            raise ValueError(f"config key {name!r} expects {_type_name(kind)}, got {text!r}") from None
    if isinstance(text, kind) and not (kind is not bool and isinstance(text, bool)):
        return text
    try:
        if isinstance(text, bool) or kind is bool and isinstance(text, (int, float)) and text not in (0, 1):
            raise ValueError                       # YAML's true is no number, and 2 is no bool
        if kind is bool:
            lowered = str(text).strip().lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError
            return lowered in ("true", "1", "yes")
        if kind is int and isinstance(text, float):
            if not text.is_integer():
                raise ValueError                   # int(2.5) would be 2
            return int(text)
        return kind(text)
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"config key {name!r} expects {kind.__name__}, got {text!r}") from None


def _one_line(text) -> str:
    return " ".join(str(text).split())


@functools.cache
def _unique_keys_loader():
    """yaml's SafeLoader, except that a key given twice in one mapping is an error (SafeLoader keeps the last)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            lines = {}                                            # key -> the line it was first given on
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":     # `<<: *base`: its keys may be overridden
                    continue
                key = self.construct_object(key_node, deep=deep)
                if isinstance(key, typing.Hashable) and key in lines:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"the key {key!r} is given twice, here and on line {lines[key]}; give it once",
                        key_node.start_mark)
                if isinstance(key, typing.Hashable):
                    lines[key] = key_node.start_mark.line + 1
            return super().construct_mapping(node, deep=deep)

    return UniqueKeyLoader


def _read_yaml(path: str):
    import yaml

    with open(path, "rb") as f:
        data = f.read().removeprefix(b"\xef\xbb\xbf")          # a UTF-8 byte order mark is no error
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[:error.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {data[error.start]:#04x}: {error.reason})") from None
    try:
        return yaml.load(text, Loader=_unique_keys_loader())
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{path}:{mark.line + 1}" if mark else path       # marks count lines from 0
        problem = error.problem or error.context
        if error.context and error.problem and error.context_mark:   # e.g. where an unclosed [ opened
            problem += f"; {error.context} on line {error.context_mark.line + 1}"
        raise ValueError(f"{where}: not valid YAML ({_one_line(problem)})") from None
    except yaml.YAMLError as error:
        raise ValueError(f"{path}: not valid YAML ({_one_line(error)})") from None


def load_config(path: Optional[str] = None, overrides: Optional[dict] = None) -> TrainConfig:
    """TrainConfig from a YAML file (optional) and overrides {key: value}; unknown keys are errors."""
    values = {}
    if path:
        loaded = _read_yaml(os.path.expanduser(path)) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{path}: a config file is a mapping of keys to values")
        values.update(loaded)
    values.update(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    hints = _hints()
    unknown = sorted(str(key) for key in set(values) - set(fields))
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; known keys: {sorted(fields)}")
    return TrainConfig(**{name: _convert(name, value, hints[name]) for name, value in values.items()})


def keys_help() -> str:
    """Every key of TrainConfig by group: `  key: type = default  help`, one line each (for `train --help`)."""
    hints, lines, last_group = _hints(), [], None
    rows = []
    for item in dataclasses.fields(TrainConfig):
        default = item.default_factory() if item.default is dataclasses.MISSING else item.default
        rows.append((item.metadata["group"], f"  {item.name}: {_type_name(hints[item.name])} = {default!r}",
                     item.metadata["help"]))
    # one column for the help, wide enough for the usual key and default; a longer default pushes its help along
    width = max(len(left) for _, left, _ in rows if len(left) <= 60) + 2
    for group, left, help in sorted(rows, key=lambda row: GROUPS.index(row[0])):
        if group != last_group:
            lines.append(f"{group}:")
            last_group = group
        lines.append(f"{left:<{width}}{help}" if len(left) < width else f"{left}  {help}")
    return "\n".join(lines)


def parse_overrides(items: list) -> dict:
    """['--key', 'value', '--other=v'] -> {'key': 'value', 'other': 'v'}: dashes in keys become _, values are kept
    exactly as given (`--output-dir=runs/my-run` is runs/my-run). A key given twice is an error."""
    overrides, index = {}, 0
    while index < len(items):
        item = items[index]
        if not item.startswith("--"):
            raise ValueError(f"expected --key value, got {item!r}")
        key, equals, value = item[2:].partition("=")
        if equals:
            index += 1
        else:
            if index + 1 >= len(items):
                raise ValueError(f"--{key} needs a value")
            value = items[index + 1]
            index += 2
        key = key.replace("-", "_")
        if key in overrides:
            raise ValueError(f"--{key.replace('_', '-')} is given twice ({overrides[key]!r} and {value!r}); give "
                             "each key once")
        overrides[key] = value
    return overrides
