"""Rule-based rewards in Open-R1's style, their weighted sum, and user rewards given as `module:function`.

Every reward is `fn(completions, **columns) -> list[float | None]`, like TRL's reward functions: completions are
strings or chat messages (the last message's content is scored); extra dataset columns come as keyword lists
(`solution` for accuracy). None means "skip this sample" (e.g. a gold answer that cannot be parsed): it becomes
NaN, which `grpo_fast.train.update.advantages` leaves out.

The math-verify rewards (accuracy, length, cosine) take their verdicts from
`grpo_fast.train.tasks.math_verify_pool`, which runs math-verify in worker processes with a hard time limit per
completion: a completion over it scores as a wrong answer.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import warnings
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from typing import Callable, Optional

from grpo_fast.fields import FP32_MAX
from grpo_fast.train.tasks.math_verify_pool import verdicts

FORMAT_RE = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)
STEP_RE = re.compile(r"(Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,)", re.MULTILINE)


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    raise TypeError(f"a completion must be a string or a list of chat messages, got {type(completion).__name__}")


def accuracy_reward(completions, solution, **kwargs) -> list:
    """1.0 when the answer equals the gold solution (math-verify), 0.0 when not, None when the gold cannot be
    parsed (the sample is skipped rather than scored 0)."""
    texts = [_text(c) for c in completions]
    return [None if v is None else float(v) for v in verdicts(texts, solution, reward="accuracy_reward")]


def exact_match_reward(completions, solution, **kwargs) -> list:
    """1.0 when the completion, without surrounding whitespace, is the gold solution's text, else 0.0: for
    short-answer tasks where anything but the answer scores nothing (the built-in max task). math-verify's
    accuracy reads the first number of "8<junk>9" as 8, and a tiny policy learns to stop ending its answers."""
    return [1.0 if _text(c).strip() == str(s).strip() else 0.0 for c, s in zip(completions, solution)]


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
    for length, verdict in zip(lengths, verdicts(texts, solution, reward="length_reward")):
        correct = True if verdict is None else verdict
        lam = 0.5 - (length - shortest) / (longest - shortest)
        rewards.append(lam if correct else min(0.0, lam))
    return rewards


def cosine_scaled_reward(min_value_wrong: float = -1.0, max_value_wrong: float = -0.5,
                         min_value_correct: float = 0.5, max_value_correct: float = 1.0,
                         max_len: int = 1000) -> Callable:
    """Correctness scaled by length on a cosine: short correct answers earn most, short wrong ones lose most."""
    def reward(completions, solution, **kwargs):
        rewards = []
        texts = [_text(c) for c in completions]
        for text, verdict in zip(texts, verdicts(texts, solution, reward="cosine_scaled_reward")):
            if verdict is None:
                rewards.append(1.0)
                continue
            if verdict:
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


def soft_overlong_penalty(max_completion_length: int, buffer: int, penalty: float = 1.0) -> Callable:
    """DAPO's soft overlong punishment (Yu et al., 2025, eq. 13) of each completion's token count n: 0 up to
    max_completion_length - buffer, then falling linearly to -penalty at max_completion_length (and -penalty past
    it), -penalty * clamp((n - (max_completion_length - buffer)) / buffer, 0, 1): long completions are discouraged
    before the length cut them, rather than only masked once cut. TRL's get_soft_overlong_punishment(max_len,
    buffer) with penalty 1, verl's reward_model.overlong_buffer (len = buffer, penalty_factor = penalty). Reads
    the completion_ids column (token ids, as TRL passes them; the trainer does); the trainer's keys are
    scoring.overlong_buffer and overlong_penalty."""
    if not 0 < buffer <= max_completion_length:
        raise ValueError(f"overlong_buffer must be in 1..max_completion_length ({max_completion_length}), got "
                         f"{buffer!r}")
    if not (math.isfinite(penalty) and penalty >= 0):
        raise ValueError(f"overlong_penalty must be a finite number >= 0, got {penalty!r}")
    start = max_completion_length - buffer

    def reward(completions, completion_ids=None, max_completion_length=None, **kwargs):
        if completion_ids is None:
            raise TypeError("overlong needs the completions' token ids (a completion_ids column)")
        # a staged run's step passes its own budget (a max_completion_length column): the ramp ends there
        starts = [start] * len(completion_ids) if max_completion_length is None else \
            [length - buffer for length in max_completion_length]
        return [-penalty * min(1.0, max(0.0, (len(ids) - first) / buffer))
                for ids, first in zip(completion_ids, starts)]
    reward.__name__ = "soft_overlong_penalty"
    return reward


REWARDS = {
    "accuracy": lambda **_: accuracy_reward,
    "exact_match": lambda **_: exact_match_reward,
    "format": lambda **_: format_reward,
    "tag_count": lambda **_: tag_count_reward,
    "reasoning_steps": lambda **_: reasoning_steps_reward,
    "length": lambda **_: length_reward,
    "cosine": lambda **options: cosine_scaled_reward(**options),
    "repetition_penalty": lambda **options: repetition_penalty_reward(**options),
    "overlong": lambda **options: soft_overlong_penalty(**options),
}


def load_reward(spec: str, **options) -> Callable:
    """A built-in reward by name (see REWARDS) or a user function: `package.module:function` (imported as usual,
    else from the working directory, as `python -m` would find it) or `path/to/file.py:function` (a file, relative
    to the working directory). Raises a one-line ValueError naming the spec and what is wrong: no such module or
    file, a syntax error (file and line), an error while importing it, no such function, not callable."""
    if spec in REWARDS:
        return REWARDS[spec](**options)
    target, _, attribute = spec.rpartition(":")
    if not target or not attribute:
        raise ValueError(f"reward must be one of {sorted(REWARDS)}, 'module:function' or 'path/to/file.py:function', "
                         f"got {spec!r}")
    try:
        module = _module_of_file(target) if target.endswith(".py") else _module_named(target, attribute)
    except SyntaxError as error:
        raise ValueError(f"cannot load reward {spec!r}: {error.filename}:{error.lineno}: {error.msg}") from None
    except _NotFound as error:
        raise ValueError(f"cannot load reward {spec!r}: {error}") from None
    except Exception as error:                      # the module's own code failed (a missing dependency, a bug)
        raise ValueError(f"cannot load reward {spec!r}: importing {target} raised {type(error).__name__}: "
                         f"{_first_line(error)}") from error
    function = getattr(module, attribute, None)
    if function is None:
        raise ValueError(f"cannot load reward {spec!r}: {target} has no {attribute!r}")
    if not callable(function):
        raise ValueError(f"reward {spec!r} is not callable")
    return function


class _NotFound(Exception):
    """No module or file of that name."""


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [""])[0]


def _module_named(name: str, attribute: str):
    """The module `name`, imported; a module only the working directory holds is imported from there (the
    `grpo-fast` console script, unlike `python -m`, does not put it on sys.path), with the working directory
    added at the end of sys.path so that installed packages keep precedence."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as error:
        top = name.partition(".")[0]
        if error.name not in (name, top):           # the module was found; something it imports was not
            raise
        here = os.getcwd()
        if here in map(os.path.abspath, sys.path) or not (os.path.isfile(os.path.join(here, top + ".py")) or
                                                          os.path.isdir(os.path.join(here, top))):
            raise _NotFound(f"no module {error.name!r} on the Python path or in the working directory {here}; "
                             f"name its file instead (path/to/file.py:{attribute}) or install it") from None
    sys.path.append(here)
    return importlib.import_module(name)


def _module_of_file(path: str):
    """The module of the Python file at `path` (relative to the working directory), loaded once."""
    import importlib.util

    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise _NotFound(f"no such file {path}")
    name = "_grpo_fast_reward_" + re.sub(r"\W", "_", path)
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module                      # before it runs: dataclasses and pickling look it up
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def _scores_of(name: str, scores, count: int) -> tuple:
    """(floats with None for skipped samples, number of non-finite scores) of what reward `name` returned; a finite
    score beyond float32's range is an error naming it."""
    expected = f"reward {name} must return a list of floats (or None to skip a sample), one per completion; got"
    # a str or dict has a length but no scores; a generator or map has no length to check against the batch
    if isinstance(scores, (str, bytes, Mapping, AbstractSet)) or not isinstance(scores, Iterable):
        raise TypeError(f"{expected} {_kind(scores)}")
    try:
        size = len(scores)
    except TypeError:
        raise TypeError(f"{expected} {_kind(scores)}") from None
    if size != count:
        raise RuntimeError(f"reward {name} returned {size} scores for {count} completions")
    values, non_finite = [], 0
    for i, score in enumerate(scores):
        if score is None:
            values.append(None)
            continue
        try:
            if isinstance(score, (str, bytes)):     # float("0.5") would pass
                raise TypeError
            value = float(score)
            beyond = math.isfinite(value) and abs(value) > FP32_MAX
        except OverflowError:                       # an int beyond even float64's range
            beyond = True
        except (TypeError, ValueError):
            raise TypeError(f"{expected} {_kind(score)} at index {i}: {str(score)[:80]!r}") from None
        if beyond:
            raise ValueError(f"reward {name} returned {_short(score)} at index {i}, beyond float32's range "
                             f"(|x| <= {FP32_MAX:.4g}) that rewards are trained in: scale it down")
        if not math.isfinite(value):
            non_finite += 1
            value = None
        values.append(value)
    return values, non_finite


def _short(score) -> str:
    """A score as a number to read: an int of 400 digits as 1e+400."""
    try:
        return f"{float(score):.6g}"
    except OverflowError:
        return f"{'-' if score < 0 else ''}1e+{len(str(abs(int(score)))) - 1}"


def _kind(value) -> str:
    name = type(value).__name__
    return "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def weighted_rewards(functions, weights: Optional[list], completions, scores: Optional[list] = None,
                     **columns) -> list:
    """sum_k weights[k] * functions[k](completions, **columns) per completion, skipping None (NaN where every
    function skipped the sample). A non-finite score (inf, NaN) is skipped like None, with a warning. A function
    that fails, returns something other than one number or None per completion, or a finite score beyond float32's
    range (which the trainer's fp32 rewards would hold as inf), raises an error naming it; so does a weighted sum
    beyond that range. scores: a list that gets each function's own scores, unweighted (floats, None where
    skipped), in the order of `functions` (dynamic sampling filters on one of them)."""
    functions = list(functions)
    if not functions:
        raise ValueError("at least one reward function is needed, got none")
    weights = [1.0] * len(functions) if weights is None else list(weights)
    if len(weights) != len(functions):
        raise ValueError(f"reward weights must match the {len(functions)} reward functions, got {len(weights)}")
    if not all(math.isfinite(weight) for weight in weights):
        raise ValueError(f"reward weights must be finite numbers, got {weights}")
    totals = [0.0] * len(completions)
    seen = [False] * len(completions)
    for function, weight in zip(functions, weights):
        name = getattr(function, "__name__", repr(function))
        try:
            returned = function(completions, **columns)
        except Exception as error:
            raise RuntimeError(f"reward {name} failed on a batch of {len(completions)} completions: {error}") \
                from error
        values, non_finite = _scores_of(name, returned, len(completions))
        if non_finite:
            warnings.warn(f"reward {name} returned {non_finite} non-finite score(s) (inf, -inf or NaN) for "
                          f"{len(completions)} completions: those samples are skipped for it", stacklevel=2)
        if scores is not None:
            scores.append(values)
        for i, value in enumerate(values):
            if value is not None:
                totals[i] += weight * value
                seen[i] = True
    for i, total in enumerate(totals):              # finite scores times the weights (inf past float64's range)
        if not abs(total) <= FP32_MAX:
            raise ValueError(f"the weighted reward of completion {i} is {total:.6g}, beyond float32's range "
                             f"(|x| <= {FP32_MAX:.4g}) that rewards are trained in (reward_weights {weights}): "
                             "scale the rewards or their weights down")
    rewards = [total if ok else float("nan") for total, ok in zip(totals, seen)]
    if all(math.isnan(reward) for reward in rewards):
        warnings.warn("every reward skipped every sample of this batch", stacklevel=2)
    return rewards
