"""The config sections of the update stage: `correction` (the rollout correction), `scoring` (rewards and how they
become advantages), `optimization` (AdamW, the schedule, updates per rollout), `batching` (micro-batches) and
`warm_start` (supervised steps before GRPO). The loss options are the section `loss`, a grpo_fast.LossConfig
(LossSection: its max_completion_length may stay unset, each step's completion budget).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

from grpo_fast.fields import (
    COEFFICIENT,
    COEFFICIENT_MAX,
    NON_NEGATIVE,
    NON_NEGATIVE_COEFFICIENT,
    NON_NEGATIVE_FP32,
    POSITIVE,
    POSITIVE_FP32,
    bounded,
    check_keys,
    is_number,
    key,
    one_of,
    plain,
)
from grpo_fast.train.update.advantages import ESTIMATORS, SCALES
from grpo_fast.train.update.correction import IS_MODES
from grpo_fast.train.update.optimizer import OPTIMIZERS
from grpo_fast.variants import LossConfig

# a learning rate: the optimizers take lr and lr * weight_decay as float32 scalars (torch refuses one beyond
# float32's range, at the first step), and both within 1e18 keep that product below 1e36
LEARNING_RATE = bounded(POSITIVE, 0.0, COEFFICIENT_MAX, open_low=True)


@dataclass(frozen=True)
class LossSection(LossConfig):
    """The config section `loss`: a grpo_fast.LossConfig whose max_completion_length (dr_grpo's normalizer) may
    stay None, meaning each step's completion budget (its stage's max_completion_length); a value given is kept,
    whatever it equals. `at_length(n)` is the LossConfig of a step whose budget is n."""

    def __post_init__(self):
        given = self.max_completion_length
        object.__setattr__(self, "max_completion_length", 1 if given is None else given)   # the other checks
        try:
            super().__post_init__()
        finally:
            object.__setattr__(self, "max_completion_length", given)

    @classmethod
    def of(cls, loss: LossConfig) -> "LossSection":
        """The section of a LossConfig built in code (its max_completion_length as given)."""
        return loss if isinstance(loss, cls) else cls(**_loss_values(loss))

    def at_length(self, length: int) -> LossConfig:
        """The LossConfig of a step whose completion budget is `length`: max_completion_length as given, else
        `length`."""
        values = _loss_values(self)
        if values["max_completion_length"] is None:
            values["max_completion_length"] = length
        return LossConfig(**values)


def _loss_values(loss: LossConfig) -> dict:
    return {item.name: getattr(loss, item.name) for item in dataclasses.fields(LossConfig)}


@dataclass
class CorrectionConfig:
    """The config section `correction`: each token's loss is weighted by exp(trainer log-prob - engine log-prob),
    bounded by importance_sampling_min and importance_sampling_cap, when the engine's log-probs reach the update
    (engine vllm, or max_staleness > 0). With num_iterations 1 the trainer's log-probs are the update forward's own
    (no separate forward)."""

    importance_sampling: str = key("sequence_mask", f"rollout correction: {one_of(IS_MODES)}", choices=IS_MODES)
    importance_sampling_cap: float = key(3.0, "cap of the rollout correction's ratio", POSITIVE_FP32)
    importance_sampling_min: float = key(0.0, "lower bound of the rollout correction's ratio: truncated up to it, "
                                              "or masked below it (0: none)", NON_NEGATIVE_FP32)

    def __post_init__(self):
        check_keys(self)
        if self.importance_sampling_min >= self.importance_sampling_cap:
            raise ValueError(f"importance_sampling_min ({self.importance_sampling_min}) must be below "
                             f"importance_sampling_cap ({self.importance_sampling_cap})")


@dataclass
class ScoringConfig:
    """The config section `scoring`: reward functions, their weights, and how rewards become advantages."""

    rewards: list[str] = key(["exact_match"], 'names from grpo_fast.train.tasks.rewards.REWARDS, "module:function" '
                                              '(also from the working directory) or "path/to/file.py:function" '
                                              "(comma-separated)")
    reward_weights: Optional[list[float]] = key(None, "one weight per reward (comma-separated); None: all 1")
    scale_rewards: str = key("group", f"advantages divided by the reward std of: {one_of(SCALES)}", choices=SCALES)
    advantage_estimator: str = key("grpo", f"advantage baseline: {one_of(ESTIMATORS)}", choices=ESTIMATORS)
    mask_truncated_completions: bool = key(False, "completions cut at max_completion_length get no loss")
    overlong_buffer: int = key(0, "the reward 'overlong' (DAPO's soft overlong penalty): over the last overlong_buffer "
                                  "tokens before max_completion_length it falls linearly from 0 to -overlong_penalty; "
                                  "0: off", NON_NEGATIVE)
    overlong_penalty: float = key(1.0, "the reward 'overlong' at max_completion_length: -overlong_penalty",
                                  NON_NEGATIVE_COEFFICIENT)

    def __post_init__(self):
        check_keys(self)
        if not self.rewards or not all(isinstance(name, str) and name.strip() for name in self.rewards):
            raise ValueError(f"rewards must name at least one reward function, got {self.rewards!r}")
        twice = next((name for i, name in enumerate(self.rewards) if name in self.rewards[:i]), None)
        if twice is not None:              # it would count twice: a weight says how much a reward counts
            raise ValueError(f"rewards names {twice!r} twice ({self.rewards}): list each reward once and give it "
                             "a weight in reward_weights instead")
        if self.reward_weights is not None:
            self.reward_weights = [plain(w) for w in self.reward_weights]     # numpy's numbers as Python's
            if not all(is_number(w) and math.isfinite(w) for w in self.reward_weights):
                raise ValueError(f"reward_weights must be finite numbers, got {self.reward_weights!r}")
            if not all(COEFFICIENT.bound.test(w) for w in self.reward_weights):     # weighted rewards are float32
                raise ValueError(f"reward_weights must be numbers {COEFFICIENT.bound.text}, got "
                                 f"{self.reward_weights!r}")
            if len(self.reward_weights) != len(self.rewards):
                raise ValueError(f"reward_weights must have one weight per reward ({len(self.rewards)}), "
                                 f"got {self.reward_weights}")
        if self.rewards == ["overlong"]:
            raise ValueError("rewards ['overlong'] has no reward for the answers: the length penalty is added to "
                             "one (DAPO: accuracy), e.g. rewards: [accuracy, overlong]")
        if ("overlong" in self.rewards) != (self.overlong_buffer > 0):
            raise ValueError("the reward 'overlong' and overlong_buffer > 0 go together (overlong_buffer is the "
                             f"length its penalty ramps over): rewards {self.rewards}, overlong_buffer "
                             f"{self.overlong_buffer}")


@dataclass
class OptimizationConfig:
    """The config section `optimization`: AdamW (or a low-bit one), warm-up then decay, grad-norm clipping, and
    the updates per rollout: num_iterations passes over it, each steps_per_generation optimizer steps on
    mini-batches of it (more than one update in all takes old log-probs before the first).

    updates_per_step: num_iterations x steps_per_generation, the optimizer steps of a training step."""

    # 5e-4: at 1e-3 AdamW's early steps on the built-in task drove whole answer digits to probability ~0 where they
    # were sampled wrong, before the policy had learned when they are right; a digit never sampled earns no reward
    # to come back from (a group of wrong answers has zero advantage), and 4 of 5 seeds stalled at held-out accuracy
    # 0.73-0.85, the machine's rounding deciding which digit died. At 5e-4 entropy falls about half as fast and
    # every seed, thread count and vector width measured ended at 0.89-0.97; with batched rollouts and shared
    # prompts (another order of sums) seeds 0-4 ended at 0.85-0.97, with each completion's attention as one causal
    # sequence at 0.78-0.97 (seed 2 the lowest both times; README, Quick start)
    learning_rate: float = key(5e-4, "AdamW learning rate of the GRPO steps", LEARNING_RATE)
    weight_decay: float = key(0.0, "AdamW weight decay", NON_NEGATIVE_COEFFICIENT)
    warmup_steps: int = key(5, "training steps of linear learning-rate warm-up (the rate moves at each of their "
                               "optimizer steps)", NON_NEGATIVE)
    lr_schedule: str = key("cosine", "decay to 0 at max_steps after the warm-up: cosine, linear, constant",
                           choices=("cosine", "linear", "constant"))
    max_grad_norm: float = key(1.0, "gradients are clipped to this norm", POSITIVE_FP32)
    optimizer: str = key("adamw", "adamw (fp32 master weights under bf16), adamw8bit (8-bit states), adamw-bf16 "
                                  "(bf16 states, dtype bf16); the last two need torchao", choices=OPTIMIZERS)
    grad_accum_dtype: str = key("fp32", "what gradients of bf16 weights add up in over a step's micro-batches: fp32 "
                                        "(an fp32 copy of them while the step runs; one process) or bf16 (no copy; "
                                        "rounded at every micro-batch)", choices=("fp32", "bf16"))
    num_iterations: int = key(1, "passes over a step's rollouts (> 1 reuses them with old log-probs)", POSITIVE)
    steps_per_generation: int = key(1, "optimizer steps per pass over a step's rollouts: they are cut into this "
                                       "many mini-batches of whole groups (DAPO: 16; TRL's name; verl: "
                                       "train_batch_size / ppo_mini_batch_size), one step each, the loss normalized "
                                       "over each; > 1 takes old log-probs once before the first, so the ratio "
                                       "moves and clipping acts. The learning-rate schedule counts optimizer steps",
                                  POSITIVE)
    loss_implementation: str = key("grpo_fast", '"grpo_fast" or "naive" (the same loss from the full logits, for '
                                                "comparisons)", choices=("grpo_fast", "naive"))

    def __post_init__(self):
        check_keys(self)

    @property
    def updates_per_step(self) -> int:
        return self.num_iterations * self.steps_per_generation


@dataclass
class BatchingConfig:
    """The config section `batching`: micro-batches hold at most micro_batch_size sequences and micro_batch_tokens
    real tokens; their gradients add up to the whole step's, whatever the cut."""

    micro_batch_size: int = key(32, "sequences per micro-batch at most", POSITIVE)
    micro_batch_tokens: Optional[int] = key(None, "real tokens per micro-batch at most (None: no limit; a longer "
                                                  "sequence goes alone)", POSITIVE)
    packing: bool = key(True, "lay a micro-batch's sequences end to end without padding (else pad to the longest)")
    share_prompts: bool = key(True, "packed micro-batches hold a group's prompt once, each completion attending to "
                                    "it (exact; only with grpo_fast's own attention, so off under flash-attention "
                                    "and padded micro-batches)")

    def __post_init__(self):
        check_keys(self)


@dataclass
class WarmStartConfig:
    """The config section `warm_start`: sft_steps of supervised training on the task's solutions before GRPO."""

    sft_steps: int = key(10, "supervised steps on the task's solutions before GRPO (0 to skip); the whole model, "
                             "before any LoRA adapters are added", NON_NEGATIVE)
    sft_learning_rate: float = key(3e-3, "learning rate of the supervised steps", LEARNING_RATE)

    def __post_init__(self):
        check_keys(self)
