"""Rule-based rewards in Open-R1's style, their weighted sum, and user rewards given as `module:function`.

Every reward is `fn(completions, **columns) -> list[float | None]`, like TRL's reward functions: completions are
strings or chat messages (the last message's content is scored); extra dataset columns come as keyword lists
(`solution` for accuracy). None means "skip this sample" (e.g. a gold answer that cannot be parsed): it becomes
NaN, which `grpo_fast.train.advantages` leaves out.
"""

from __future__ import annotations

import importlib
import math
import re
import threading
import warnings
from typing import Callable, Optional

ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
FORMAT_RE = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
STEP_RE = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)", re.MULTILINE)


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def _timeouts() -> tuple:
    """(parse kwargs, verify kwargs). math-verify times out with SIGALRM, which only the main thread may use:
    elsewhere run without a limit (use a process pool for a hard limit off the main thread)."""
    if threading.current_thread() is threading.main_thread():
        return {}, {}
    return {"parsing_timeout": None}, {"timeout_seconds": None}


def _parse_gold(solution: str):
    from math_verify import parse

    return parse(solution, extraction_mode="first_match", **_timeouts()[0])


def _parse_answer(text: str):
    """The model's answer: the <answer> block when there is one, as LaTeX ($...$, \\boxed{}) or a plain expression
    (a bare number such as `18` included, which LaTeX-only extraction misses)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    match = ANSWER_RE.search(text)
    answer = match.group(1).strip() if match else text
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(answer, extraction_config=config, extraction_mode="first_match", **_timeouts()[0])


def _is_correct(gold_parsed, text: str) -> bool:
    from math_verify import verify

    return bool(verify(gold_parsed, _parse_answer(text), **_timeouts()[1]))


def accuracy_reward(completions, solution, **kwargs) -> list:
    """1.0 when the answer equals the gold solution (math-verify), 0.0 when not, None when the gold cannot be
    parsed (the sample is skipped rather than scored 0)."""
    rewards = []
    for completion, gold in zip(completions, solution, strict=True):
        gold_parsed = _parse_gold(str(gold))
        rewards.append(None if not gold_parsed else float(_is_correct(gold_parsed, _text(completion))))
    return rewards


def format_reward(completions, **kwargs) -> list:
    """1.0 for `<think>\\n...\\n</think>\\n<answer>\\n...\\n</answer>`, else 0.0."""
    return [1.0 if FORMAT_RE.match(_text(c)) else 0.0 for c in completions]


def tag_count_reward(completions, **kwargs) -> list:
    """0.25 for each of the four tags appearing exactly once (a smooth version of format_reward)."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if _text(c).count(tag) == 1) for c in completions]


def reasoning_steps_reward(completions, **kwargs) -> list:
    """min(1, number of step markers / 3): "Step 1:", numbered lines, bullets, "First,", "Finally," ..."""
    return [min(1.0, len(STEP_RE.findall(_text(c))) / 3) for c in completions]


def length_reward(completions, solution, **kwargs) -> list:
    """Kimi 1.5's length reward: lambda = 0.5 - (len - min) / (max - min) over the batch; correct answers get
    lambda, wrong ones min(0, lambda); all 0 when every completion has the same length."""
    texts = [_text(c) for c in completions]
    lengths = [len(t) for t in texts]
    shortest, longest = min(lengths), max(lengths)
    if shortest == longest:
        return [0.0] * len(texts)
    rewards = []
    for text, length, gold in zip(texts, lengths, solution, strict=True):
        gold_parsed = _parse_gold(str(gold))
        correct = True if not gold_parsed else _is_correct(gold_parsed, text)
        lam = 0.5 - (length - shortest) / (longest - shortest)
        rewards.append(lam if correct else min(0.0, lam))
    return rewards


def cosine_scaled_reward(min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                         min_value_correct: float = 0.5, max_value_correct: float = 1.0,
                         max_len: int = 1000) -> Callable:
    """Correctness scaled by length on a cosine: short correct answers earn most, short wrong ones lose most."""
    def reward(completions, solution, **kwargs):
        rewards = []
        for completion, gold in zip(completions, solution, strict=True):
            text = _text(completion)
            gold_parsed = _parse_gold(str(gold))
            if not gold_parsed:
                rewards.append(1.0)
                continue
            if _is_correct(gold_parsed, text):
                low, high = min_value_correct, max_value_correct
            else:
                low, high = max_value_wrong, min_value_wrong
            cosine = math.cos(len(text) / max_len * math.pi)
            rewards.append(low + 0.5 * (high - low) * (1.0 + cosine))
        return rewards
    reward.__name__ = "cosine_scaled_reward"
    return reward


def repetition_penalty_reward(ngram_size: int = 3, max_penalty: float = -1.0) -> Callable:
    """(1 - unique n-grams / n-grams) * max_penalty over lower-cased words; 0 for texts shorter than n words."""
    if max_penalty > 0:
        raise ValueError(f"max_penalty must be <= 0 (it is a penalty), got {max_penalty!r}")

    def reward(completions, **kwargs):
        rewards = []
        for completion in completions:
            words = _text(completion).lower().split()
            if len(words) < ngram_size:
                rewards.append(0.0)
                continue
            ngrams = [tuple(words[i:i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
            rewards.append((1 - len(set(ngrams)) / len(ngrams)) * max_penalty)
        return rewards
    reward.__name__ = "repetition_penalty_reward"
    return reward


REWARDS = {
    "accuracy": lambda **_: accuracy_reward,
    "format": lambda **_: format_reward,
    "tag_count": lambda **_: tag_count_reward,
    "reasoning_steps": lambda **_: reasoning_steps_reward,
    "length": lambda **_: length_reward,
    "cosine": lambda **options: cosine_scaled_reward(**options),
    "repetition_penalty": lambda **options: repetition_penalty_reward(**options),
}


def load_reward(spec: str, **options) -> Callable:
    """A built-in reward by name (see REWARDS) or a user function as `package.module:function`."""
    if spec in REWARDS:
        return REWARDS[spec](**options)
    if ":" not in spec:
        raise ValueError(f"reward must be one of {sorted(REWARDS)} or 'module:function', got {spec!r}")
    module_name, _, attribute = spec.partition(":")
    try:
        function = getattr(importlib.import_module(module_name), attribute)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"cannot load reward {spec!r}: {error}") from error
    if not callable(function):
        raise ValueError(f"reward {spec!r} is not callable")
    return function


def weighted_rewards(functions, weights: Optional[list], completions, **columns) -> list:
    """sum_k weights[k] * functions[k](completions, **columns) per completion, skipping None (NaN where every
    function skipped the sample). A function that fails raises an error naming it and the sample count."""
    weights = [1.0] * len(functions) if weights is None else list(weights)
    if len(weights) != len(functions):
        raise ValueError(f"reward weights must match the {len(functions)} reward functions, got {len(weights)}")
    totals = [0.0] * len(completions)
    seen = [False] * len(completions)
    for function, weight in zip(functions, weights):
        name = getattr(function, "__name__", repr(function))
        try:
            scores = function(completions, **columns)
        except Exception as error:
            raise RuntimeError(f"reward {name} failed on a batch of {len(completions)} completions: {error}") \
                from error
        if len(scores) != len(completions):
            raise RuntimeError(f"reward {name} returned {len(scores)} scores for {len(completions)} completions")
        for i, score in enumerate(scores):
            if score is not None and not (isinstance(score, float) and math.isnan(score)):
                totals[i] += weight * float(score)
                seen[i] = True
    if not any(seen):
        warnings.warn("every reward skipped every sample of this batch", stacklevel=2)
    return [total if ok else float("nan") for total, ok in zip(totals, seen)]
