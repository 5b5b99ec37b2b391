"""The config section `rollout`: group_size completions for each of prompts_per_step prompts, sampled by the
`engine`, in turn with the update or (max_staleness k >= 1) k steps ahead of it in a process of its own."""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Optional

from grpo_fast.fields import (
    AT_LEAST_ONE,
    FRACTION,
    LENGTH,
    LOGIT_FACTOR_MAX,
    NON_NEGATIVE,
    POSITIVE,
    Rule,
    bounded,
    check_keys,
    is_number,
    key,
    plain,
)

ENGINES = ("hf", "vllm")
VLLM_DTYPES = ("auto", "float32", "bfloat16")
# vLLM raises a temperature below 0.01 to 0.01 (NaN otherwise), so the engine would sample at another temperature
# than the trainer's log-probs take; near it every sampled token has probability ~1 and the loss no gradient
TEMPERATURE_MIN = 0.01
SAMPLING_TEMPERATURE = bounded(POSITIVE, TEMPERATURE_MIN, LOGIT_FACTOR_MAX)
SAMPLING_ROUNDS = 3                     # max_sampling_rounds' default: any other value needs dynamic_sampling
SHORT_STEPS = ("train", "error")
# the batch multiplier: a round generates at most this many times the prompts a step wants
SAMPLING_MULTIPLIER = bounded(AT_LEAST_ONE, 1.0, 1024.0)


def check_sampling(engine: str, top_k: int, top_p: float, training: bool = True) -> None:
    """Raises ValueError for sampling settings a job cannot run: vLLM with top_p and no top_k bound, and for
    training (`training`) top_k 1. The one check of the trainer's config and the planner's Job."""
    if training and top_k == 1:
        # the kept set is the sampled token alone: its log-prob over the set is 0 under any weights
        raise ValueError("top_k=1 samples the most likely token: over its kept set of one token every log-prob "
                         "is 0, so the loss's gradient is exactly zero; set top_k >= 2 (or 0: every token)")
    if engine == "vllm" and top_p < 1 and top_k == 0:
        # vLLM hands over kept sets only under a top_k bound; without them the trainer's log-probs would be over
        # the whole vocabulary and the engine's over the nucleus, off by the kept mass on every token
        raise ValueError(f"top_p={top_p} with engine 'vllm' needs top_k > 0, got top_k=0: vLLM returns the "
                         "kept set of each token (which the trainer's log-probs must be over, so that the rollout "
                         "correction compares like with like) only with a top_k bound; set top_k (e.g. 512)")


def check_vllm_sleep(vllm_sleep: bool, engine: str, max_staleness: int) -> None:
    """Raises ValueError, naming the keys, when vllm_sleep is asked of a job in which nothing sleeps during the
    update: another engine, or vLLM in a rollout process that generates through it (max_staleness > 0). Whether
    the platform can sleep is the engine's check (engines.check_sleep_mode), where vLLM is imported."""
    if vllm_sleep and engine != "vllm":
        raise ValueError(f"vllm_sleep puts vLLM to sleep during the update, but engine is {engine!r}: set engine: "
                         "vllm, or vllm_sleep: false")
    if vllm_sleep and max_staleness:
        raise ValueError(f"vllm_sleep needs max_staleness 0 (generate, then update), got max_staleness="
                         f"{max_staleness}: the rollout process generates during the update; set one of them back")


def _whole(value) -> int:
    """A step or a length of a schedule: a whole number (text of one, or a number equal to one), never a bool
    (YAML's true) or 4.7, which int() would read as 1 and 4."""
    value = plain(value)
    if isinstance(value, str) or isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if is_number(value) and float(value).is_integer():
        return int(value)
    raise ValueError


def length_stages(value):
    """[(from step, length)] of a length schedule: "0:8192,200:16384", {0: 8192, 200: 16384} or [[0, 8192], ...],
    sorted by step; None for a single length (an int, or text without ":"). Raises ValueError naming the key."""
    try:
        if isinstance(value, dict):
            pairs = [(_whole(step), _whole(length)) for step, length in value.items()]
        elif isinstance(value, (list, tuple)):
            pairs = [(_whole(step), _whole(length)) for step, length in value]
        elif isinstance(value, str) and ":" in value:
            pairs = [tuple(_whole(part) for part in item.split(":")) for item in value.split(",") if item.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError
        else:
            return None
    except (TypeError, ValueError, OverflowError):
        raise ValueError(f"max_completion_length / completion_length_stages: a schedule is FROM_STEP:LENGTH,... "
                         f"of whole numbers (e.g. 0:8192,200:16384), got {value!r}") from None
    if not pairs:
        raise ValueError(f"completion_length_stages: no stage in {value!r}")
    return sorted(pairs)


class LengthStages(tuple):
    """The completion budget by step, parsed once: ((from step, length), ...) sorted by step, the first from step
    0 (0-based steps: the log's step n is step n - 1 here). One stage is a run without a schedule."""

    def __new__(cls, pairs):
        pairs = tuple((int(start), int(length)) for start, length in pairs)
        if not pairs or pairs[0][0] != 0 or any(later[0] <= earlier[0] for earlier, later in zip(pairs, pairs[1:])) \
                or any(length <= 0 for _, length in pairs):
            raise ValueError(f"completion_length_stages must start at step 0, with later steps after and positive "
                             f"lengths, got {[f'{start}:{length}' for start, length in pairs]}")
        return super().__new__(cls, pairs)

    @property
    def largest(self) -> int:
        """The longest stage's length: what sizes the context, vLLM and the planner."""
        return max(length for _, length in self)

    @property
    def shortest(self) -> int:
        return min(length for _, length in self)

    def at(self, step: int) -> int:
        """The completion budget of the (0-based) `step`: its stage's length."""
        return [length for start, length in self if start <= step][-1]

    def starting_at(self, step: int):
        """The 1-based number of the stage that begins at `step`, or None (none begins there, or one stage)."""
        starts = [start for start, _ in self]
        return starts.index(step) + 1 if len(self) > 1 and step in starts else None

    def unreached(self, max_steps: int) -> list:
        """The stages (from step, length) that start at or after max_steps: a run of max_steps never samples
        them, though they size its context and vLLM (a --resume with more steps reaches them)."""
        return [(start, length) for start, length in self if start >= max_steps]

    def texts(self) -> list:
        """["FROM_STEP:LENGTH", ...]: the key completion_length_stages as it is written."""
        return [f"{start}:{length}" for start, length in self]


@dataclass
class RolloutConfig:
    """The config section `rollout`. vLLM samples with its own numerics: the `correction` section weighs each
    token by exp(trainer log-prob - engine log-prob), as it weighs the samples of an older policy (max_staleness)."""

    engine: str = key("hf", '"hf" (model.generate) or "vllm" (offline vLLM in this process, weights pushed after '
                            "every step)", choices=ENGINES)
    max_staleness: int = key(0, "0: generate, then update, in turn. k >= 1: the engine runs in its own process and "
                                "generates the next k steps' rollouts while the trainer updates, from a policy at "
                                "most k optimizer steps old", NON_NEGATIVE)
    group_size: int = key(8, "completions per prompt (>= 2: advantages compare them)",
                          Rule(">= 2 (advantages compare completions)", lambda v: v >= 2))
    prompts_per_step: int = key(16, "prompts per step, split across processes", POSITIVE)
    max_completion_length: int = key(6, "tokens sampled per completion at most (and the dr_grpo normalizer unless "
                                        "loss.max_completion_length is set); a schedule FROM_STEP:LENGTH,... (YAML: "
                                        "{0: 8192, 200: 16384}; FROM_STEP counts from 0, the log from 1) sets "
                                        "completion_length_stages and the largest length here", LENGTH)
    completion_length_stages: list[str] = key([], "the completion budget grown in stages, FROM_STEP:LENGTH each "
                                                  "(0:8192,200:16384: the first from step 0, then later steps, the "
                                                  "last length max_completion_length). FROM_STEP counts from 0, the "
                                                  "log from 1: 200:16384 starts at the log's step 201. Each step "
                                                  "samples up to its stage's length; the context, vLLM and the "
                                                  "planner are sized by the largest (a stage from max_steps on never "
                                                  "runs: one line of the log says so)")
    temperature: float = key(1.0, f"sampling temperature, at least {TEMPERATURE_MIN} (vLLM samples at "
                                  f"{TEMPERATURE_MIN} below it)", SAMPLING_TEMPERATURE)
    top_p: float = key(1.0, "nucleus sampling probability mass, in (0, 1]", FRACTION)
    top_k: int = key(0, "sample among the top_k most likely tokens (0: every token), before top_p. With top_k > 0 "
                        "or top_p < 1 the engines return each token's kept set and the trainer's log-probs (old, "
                        "reference, training) are over it; engine 'vllm' needs top_k > 0 then (it bounds the kept "
                        "sets vLLM returns)", NON_NEGATIVE)
    ignore_eos: bool = key(False, "sample all max_completion_length tokens of every completion (length tests)")
    dynamic_sampling: bool = key(False, "DAPO's dynamic sampling: a group whose rewards are all equal (zero advantage, "
                                        "no gradient) is dropped and more training prompts are sampled until the step "
                                        "has prompts_per_step informative groups, or max_sampling_rounds rounds")
    max_sampling_rounds: int = key(SAMPLING_ROUNDS, "with dynamic_sampling, the step's rounds of generation at most "
                                                    "(the first included); a step still short then does as "
                                                    "short_step says. Another value without dynamic_sampling is "
                                                    "refused", AT_LEAST_ONE)
    dynamic_sampling_metric: Optional[str] = key(None, "with dynamic_sampling, what a group must differ in to be "
                                                       "kept: a reward's name from scoring.rewards (its own score, "
                                                       "unweighted), or 'reward' (the weighted sum); None: the "
                                                       "first reward that is not 'overlong', the task's correctness "
                                                       "(DAPO and verl filter on accuracy)")
    sampling_batch_multiplier: float = key(1.0, "with dynamic_sampling, each round generates this many times the "
                                                "prompts a step wants (verl's gen_batch_size / train_batch_size), "
                                                "the first round included", SAMPLING_MULTIPLIER)
    short_step: str = key("train", "with dynamic_sampling, a step that has fewer informative groups than "
                                   "prompts_per_step after max_sampling_rounds: 'train' on those it has (normalized "
                                   "over their tokens, as a step of those groups alone), or stop the run with an "
                                   "'error' (verl's)", choices=SHORT_STEPS)
    vllm_gpu_memory_utilization: float = key(0.3, "vLLM's share of the GPU memory, in (0, 1]", FRACTION)
    vllm_sleep: bool = key(False, "engine 'vllm' in turn with the update (max_staleness 0) on a GPU: vLLM sleeps "
                                  "through each update (its sleep mode, level 1: weights to host memory, KV cache "
                                  "dropped) and wakes for the next push and generation, so its pool is free for "
                                  "the update; refused where vLLM cannot sleep (its CPU build)")
    vllm_dtype: str = key("auto", '"auto" (bfloat16 on a GPU, and on a CPU that computes bf16 natively: AMX or '
                                  'AVX512-BF16; else float32), "float32" or "bfloat16": the vLLM engine\'s weights '
                                  "and compute; the rollout correction covers its gap to the trainer's log-probs",
                          choices=VLLM_DTYPES)

    def __post_init__(self):
        stages = length_stages(self.max_completion_length)
        if stages is not None:                          # max_completion_length given as a schedule
            if self.completion_length_stages:
                raise ValueError(f"max_completion_length is a schedule ({self.max_completion_length!r}) and "
                                 f"completion_length_stages is given too ({self.completion_length_stages}): give "
                                 "the stages once, in one of them")
            self.completion_length_stages = LengthStages(stages).texts()
            self.max_completion_length = max(length for _, length in stages)
        check_keys(self)
        check_sampling(self.engine, self.top_k, self.top_p, training=False)
        if self.completion_length_stages:
            self._stages = LengthStages(length_stages(",".join(self.completion_length_stages)))
            if self._stages.largest != self.max_completion_length:
                raise ValueError(f"completion_length_stages' largest length ({self._stages.largest}) must be "
                                 f"max_completion_length ({self.max_completion_length})")
        else:
            self._stages = LengthStages([(0, self.max_completion_length)])

    @property
    def stages(self) -> LengthStages:
        """The completion budget by step (completion_length_stages, or one stage of max_completion_length)."""
        return self._stages

    def check_for_training(self) -> None:
        """The sampling a training job may use (`check_sampling`): `grpo-fast train` and `grpo-fast plan` call it;
        an evaluation may sample greedily (top_k 1), and the export or evaluation of a run saved by an earlier
        version, which took max_sampling_rounds without dynamic_sampling, is not refused for it."""
        check_sampling(self.engine, self.top_k, self.top_p)
        check_vllm_sleep(self.vllm_sleep, self.engine, self.max_staleness)
        if self.max_sampling_rounds != SAMPLING_ROUNDS and not self.dynamic_sampling:
            raise ValueError(f"max_sampling_rounds ({self.max_sampling_rounds}) bounds the rounds of dynamic "
                             "sampling, which is off: set dynamic_sampling: true, or leave max_sampling_rounds "
                             f"at {SAMPLING_ROUNDS}")
        unused = {"dynamic_sampling_metric": (self.dynamic_sampling_metric, None),
                  "sampling_batch_multiplier": (self.sampling_batch_multiplier, 1.0),
                  "short_step": (self.short_step, "train")}
        for name, (value, default) in unused.items():
            if value != default and not self.dynamic_sampling:
                raise ValueError(f"{name} ({value!r}) is a setting of dynamic sampling, which is off: set "
                                 f"dynamic_sampling: true, or leave {name} at {default!r}")

    @property
    def truncates_sampling(self) -> bool:
        """Whether the engines sample from a truncated distribution (top_k > 0 or top_p < 1): they then return
        each token's kept set, and every log-prob of the trainer is over it."""
        return self.top_k > 0 or self.top_p < 1
