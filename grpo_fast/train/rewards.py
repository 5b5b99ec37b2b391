"""Rule-based rewards in Open-R1's style, their weighted sum, and user rewards given as `module:function`.

Every reward is `fn(completions, **columns) -> list[float | None]`, like TRL's reward functions: completions are
strings or chat messages (the last message's content is scored); extra dataset columns come as keyword lists
(`solution` for accuracy). None means "skip this sample" (e.g. a gold answer that cannot be parsed): it becomes
NaN, which `grpo_fast.train.advantages` leaves out.

The math-verify rewards (accuracy, length, cosine) run math-verify in a few worker processes with a hard time limit
per completion, MATH_VERIFY_TIME_LIMIT_S: some answers (`\\boxed{10^{10^{10}}}`) make sympy run for minutes, and
math-verify's own timeouts (SIGALRM) only work on the main thread. A completion over the limit scores as a wrong
answer, as when math-verify's own timeout fires, and its worker is killed and replaced.
"""

# Only the standard library at the top: the worker processes load this file on its own, without torch.
from __future__ import annotations

import atexit
import importlib
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from multiprocessing.connection import Connection, wait
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


_GOLD_CACHE = {}                                    # gold text -> parsed: a step repeats each gold group_size times


def _parse_gold(solution: str):
    from math_verify import parse

    if solution in _GOLD_CACHE:
        return _GOLD_CACHE[solution]
    parsed = parse(solution, extraction_mode="first_match")
    if parsed:                                      # not a failure or a timeout: those are retried, as before
        if len(_GOLD_CACHE) >= 4096:
            _GOLD_CACHE.clear()
        _GOLD_CACHE[solution] = parsed
    return parsed


def _parse_answer(text: str):
    """The model's answer: the <answer> block when there is one, as LaTeX ($...$, \\boxed{}) or a plain expression
    (a bare number such as `18` included, which LaTeX-only extraction misses)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    match = ANSWER_RE.search(text)
    answer = match.group(1).strip() if match else text
    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    return parse(answer, extraction_config=config, extraction_mode="first_match")


def _is_correct(gold_parsed, text: str) -> bool:
    from math_verify import verify

    return bool(verify(gold_parsed, _parse_answer(text)))


def _verdict(gold: str, text: str) -> Optional[bool]:
    """None when the gold cannot be parsed, else whether the answer in `text` equals it. Run in a worker, on its
    main thread, where math-verify's own timeouts (SIGALRM) work."""
    gold_parsed = _parse_gold(gold)
    return None if not gold_parsed else _is_correct(gold_parsed, text)


# ------------------------------------------------------------------ math-verify in worker processes
MATH_VERIFY_TIME_LIMIT_S = 10.0     # per completion; above math-verify's own 5 s limits, which keep the worker alive
MATH_VERIFY_WORKERS = 2             # per process (per torchrun rank): one stuck completion does not stall the batch
_STARTUP_LIMIT_S = 120.0            # importing math-verify and sympy in a fresh worker
_CHUNK_MAX = 32
# A worker runs `python -c _BOOT <this file> <request fd> <reply fd> <bell fd>`: it loads this file alone (not the
# package, which imports torch) and ignores Ctrl-C, which is the trainer's to handle; it exits when its request pipe
# closes. It replies per completion (so a killed worker's finished work is kept) but rings the bell, which is what
# the parent waits on, only per chunk: one wake-up per chunk keeps the parent's cost per call small.
_BOOT = ("import signal, sys\n"
         "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
         "import importlib.util\n"
         "spec = importlib.util.spec_from_file_location('_grpo_fast_math_worker', sys.argv[1])\n"
         "module = importlib.util.module_from_spec(spec)\n"
         "spec.loader.exec_module(module)\n"
         "module._serve(*map(int, sys.argv[2:5]))\n")


def _serve(request_fd: int, reply_fd: int, bell_fd: int) -> None:
    """A worker's loop: receives chunks of (index, gold, text), replies (index, verdict, math-verify timed out, time
    done) per completion and rings the bell after each chunk."""
    import logging

    requests, replies = Connection(request_fd, writable=False), Connection(reply_fd, readable=False)
    sys.path[:] = requests.recv()                   # the parent's, as multiprocessing's spawn does
    try:
        import math_verify  # noqa: F401
    except Exception as error:
        replies.send(("error", f"{type(error).__name__}: {error}"))
        os.write(bell_fd, b"!")
        return
    timeouts = []

    class _Timeouts(logging.Handler):
        # math-verify logs a timeout with the whole text: count it instead, the parent warns briefly
        def emit(self, record):
            if str(record.msg).startswith("Timeout during"):
                timeouts.append(record)

    logger = logging.getLogger("math_verify")
    logger.addHandler(_Timeouts())
    logger.propagate = False
    try:
        replies.send(("ready", time.monotonic()))
        os.write(bell_fd, b"!")
        while True:
            chunk = requests.recv()
            for index, gold, text in chunk:
                timeouts.clear()
                try:
                    value = _verdict(gold, text)
                except Exception as error:
                    replies.send(("failed", index, f"{type(error).__name__}: {error}"))
                    continue
                replies.send((index, value, bool(timeouts), time.monotonic()))
            os.write(bell_fd, b"!")
    except (EOFError, OSError):                     # the parent closed the pipes or exited: so does the worker
        return


class _Worker:
    def __init__(self):
        request_r, request_w = os.pipe()
        reply_r, reply_w = os.pipe()
        bell_r, bell_w = os.pipe()
        try:
            self.process = subprocess.Popen([sys.executable, "-c", _BOOT, os.path.abspath(__file__),
                                             str(request_r), str(reply_w), str(bell_w)],
                                            pass_fds=(request_r, reply_w, bell_w), stdin=subprocess.DEVNULL)
        except BaseException:
            for fd in (request_w, reply_r, bell_r):
                os.close(fd)
            raise
        finally:
            for fd in (request_r, reply_w, bell_w):
                os.close(fd)
        self.requests = Connection(request_w, readable=False)
        self.replies = Connection(reply_r, writable=False)
        self.bell = bell_r
        try:
            self.requests.send(list(sys.path))
        except OSError:
            pass                                    # it exited already: reading its replies says so
        self.ready = False
        self.since = time.monotonic()               # when the current completion (or the startup) began
        self.queue = deque()                        # indices sent and not answered yet, in order

    def deadline(self, limit: float) -> float:
        return self.since + (limit if self.ready else _STARTUP_LIMIT_S)

    def kill(self) -> None:
        if self.process.poll() is None:             # first: closing its pipes first could make it write an EPIPE
            self.process.kill()
        self.process.wait()
        if self.bell is not None:
            self.requests.close()
            self.replies.close()
            os.close(self.bell)
            self.bell = None


class _MathPool:
    """MATH_VERIFY_WORKERS worker processes; a completion over the time limit has its worker killed and replaced,
    and that worker's other completions go back to the queue."""

    def __init__(self, size: int):
        self.pid = os.getpid()
        self.closed = False
        self.workers = [_Worker() for _ in range(max(1, size))]

    def run(self, tasks: list, limit: float) -> tuple:
        """(verdicts, indices math-verify gave up on, indices whose worker died) for tasks [(gold, text)]."""
        self.verdicts, self.timed_out, self.crashed = [None] * len(tasks), [], []
        self.pending, self.left = deque(range(len(tasks))), len(tasks)
        chunk = max(1, min(_CHUNK_MAX, math.ceil(len(tasks) / (4 * len(self.workers)))))   # small: balanced
        try:
            for slot in range(len(self.workers)):
                if not self.workers[slot].ready:
                    self._drain(slot, rung=False)   # a replacement may have started since the last call
            while self.left:
                any_ready = any(w.ready for w in self.workers)
                for slot, worker in enumerate(self.workers):
                    if any_ready and not worker.ready:
                        continue                    # a replacement warms up for the next call, not this one
                    while self.pending and len(worker.queue) <= chunk:    # the next chunk waits in the pipe
                        batch = [self.pending.popleft() for _ in range(min(chunk, len(self.pending)))]
                        try:
                            worker.requests.send([(i, *tasks[i]) for i in batch])
                        except OSError:
                            self.pending.extendleft(reversed(batch))
                            self._died(slot)
                            break
                        if worker.ready and not worker.queue:
                            worker.since = time.monotonic()     # an idle worker's clock starts now
                        worker.queue.extend(batch)
                watched = [w for w in self.workers if w.queue or not w.ready]
                wait_s = max(0.0, min(w.deadline(limit) for w in watched) - time.monotonic())
                bells = wait([w.bell for w in watched], timeout=wait_s)
                rung = [w for w in watched if w.bell in bells]     # before a replacement reuses a bell's fd
                for slot, worker in enumerate(self.workers):
                    if worker in rung or worker.queue:
                        self._drain(slot, rung=worker in rung)
                now = time.monotonic()
                for slot, worker in enumerate(self.workers):
                    if (worker.queue or not worker.ready) and now >= worker.deadline(limit):
                        if not worker.ready:
                            raise RuntimeError(f"a math-verify worker did not start within {_STARTUP_LIMIT_S:g} s")
                        stuck = worker.queue.popleft()
                        self.verdicts[stuck] = False
                        self.timed_out.append(stuck)
                        self.left -= 1
                        self.pending.extendleft(reversed(worker.queue))
                        worker.kill()
                        self.workers[slot] = _Worker()
        except BaseException:
            self.close()                            # the workers may hold stale work: the next call starts afresh
            raise
        return self.verdicts, self.timed_out, self.crashed

    def _drain(self, slot: int, rung: bool) -> None:
        """Reads a worker's replies so far (and its bell when it rang); replaces it when it has died."""
        worker = self.workers[slot]
        alive = not rung or os.read(worker.bell, 4096) != b""      # a closed bell: the worker exited
        try:
            while worker.replies.poll():
                self._take(worker, worker.replies.recv())
        except (EOFError, OSError):
            alive = False
        if not alive:
            self._died(slot)

    def _take(self, worker: _Worker, message: tuple) -> None:
        if message[0] == "ready":
            worker.ready, worker.since = True, max(worker.since, message[1])
            return
        if message[0] == "error":
            raise RuntimeError(f"a math-verify worker could not start: {message[1]}")
        if message[0] == "failed":
            raise RuntimeError(f"math-verify failed on completion {message[1]}: {message[2]}")
        index, value, gave_up, done_at = message
        worker.queue.popleft()
        worker.since = max(worker.since, done_at)   # the next completion began when this one ended
        self.verdicts[index] = value
        self.left -= 1
        if gave_up:
            self.timed_out.append(index)

    def _died(self, slot: int) -> None:
        """A worker exited unasked: its current completion scores as wrong, the rest go back to the queue."""
        worker = self.workers[slot]
        worker.kill()
        if not worker.ready:
            raise RuntimeError(f"a math-verify worker exited while starting (exit code {worker.process.returncode})")
        if worker.queue:
            index = worker.queue.popleft()
            self.verdicts[index] = False
            self.crashed.append(index)
            self.left -= 1
        self.pending.extendleft(reversed(worker.queue))
        self.workers[slot] = _Worker()

    def close(self) -> None:
        if self.closed or os.getpid() != self.pid:  # a forked child leaves its parent's workers alone
            return
        self.closed = True
        for worker in self.workers:
            worker.kill()


_POOL: Optional[_MathPool] = None
_POOL_LOCK = threading.Lock()
_INHERITED = []                                     # pools a forked child got from its parent: never closed there


def _close_pool() -> None:
    if _POOL is not None:
        _POOL.close()


def _after_fork() -> None:
    global _POOL, _POOL_LOCK
    if _POOL is not None:
        _INHERITED.append(_POOL)
    _POOL, _POOL_LOCK = None, threading.Lock()


atexit.register(_close_pool)                        # kills the workers: a stuck one must not delay exit
os.register_at_fork(after_in_child=_after_fork)


def _verdicts(reward: str, texts: list, golds: list) -> list:
    """_verdict(gold, text) for each pair, run in the worker pool under the time limit."""
    global _POOL
    if not texts:
        return []
    tasks = [(str(gold), text) for gold, text in zip(golds, texts, strict=True)]
    limit = MATH_VERIFY_TIME_LIMIT_S
    with _POOL_LOCK:
        if _POOL is None or _POOL.closed:
            _POOL = _MathPool(MATH_VERIFY_WORKERS)
        verdicts, timed_out, crashed = _POOL.run(tasks, limit)
    if timed_out:
        first = texts[min(timed_out)]
        warnings.warn(f"{reward}: math-verify timed out on {len(timed_out)} of {len(texts)} completions (its own "
                      f"limits or the hard limit of {limit:g} s per completion), scored as wrong answers; the first "
                      f"begins {first[:80]!r}", stacklevel=3)
    if crashed:
        first = texts[min(crashed)]
        warnings.warn(f"{reward}: a math-verify worker died on {len(crashed)} of {len(texts)} completions, scored "
                      f"as wrong answers; the first begins {first[:80]!r}", stacklevel=3)
    return verdicts


def accuracy_reward(completions, solution, **kwargs) -> list:
    """1.0 when the answer equals the gold solution (math-verify), 0.0 when not, None when the gold cannot be
    parsed (the sample is skipped rather than scored 0)."""
    texts = [_text(c) for c in completions]
    return [None if v is None else float(v) for v in _verdicts("accuracy_reward", texts, solution)]


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
    for length, verdict in zip(lengths, _verdicts("length_reward", texts, solution)):
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
        for text, verdict in zip(texts, _verdicts("cosine_scaled_reward", texts, solution)):
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


REWARDS = {
    "accuracy": lambda **_: accuracy_reward,
    "exact_match": lambda **_: exact_match_reward,
    "format": lambda **_: format_reward,
    "tag_count": lambda **_: tag_count_reward,
    "reasoning_steps": lambda **_: reasoning_steps_reward,
    "length": lambda **_: length_reward,
    "cosine": lambda **options: cosine_scaled_reward(**options),
    "repetition_penalty": lambda **options: repetition_penalty_reward(**options),
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
    """(floats with None for skipped samples, number of non-finite scores) of what reward `name` returned."""
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
        except OverflowError:                       # an int beyond float range: infinite for this purpose
            value = math.inf
        except (TypeError, ValueError):
            raise TypeError(f"{expected} {_kind(score)} at index {i}: {str(score)[:80]!r}") from None
        if not math.isfinite(value):
            non_finite += 1
            value = None
        values.append(value)
    return values, non_finite


def _kind(value) -> str:
    name = type(value).__name__
    return "None" if value is None else f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def weighted_rewards(functions, weights: Optional[list], completions, **columns) -> list:
    """sum_k weights[k] * functions[k](completions, **columns) per completion, skipping None (NaN where every
    function skipped the sample). A non-finite score (inf, NaN) is skipped like None, with a warning. A function
    that fails, or returns something other than one number or None per completion, raises an error naming it."""
    functions = list(functions)
    if not functions:
        raise ValueError("at least one reward function is needed, got none")
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
        values, non_finite = _scores_of(name, scores, len(completions))
        if non_finite:
            warnings.warn(f"reward {name} returned {non_finite} non-finite score(s) (inf, -inf or NaN) for "
                          f"{len(completions)} completions: those samples are skipped for it", stacklevel=2)
        for i, value in enumerate(values):
            if value is not None:
                totals[i] += weight * value
                seen[i] = True
    overflowed = sum(ok and not math.isfinite(total) for total, ok in zip(totals, seen))
    if overflowed:                                  # huge finite scores times the weights: no inf advantages either
        warnings.warn(f"the weighted reward of {overflowed} of {len(completions)} completions overflowed to inf: "
                      "those samples are skipped", stacklevel=2)
    rewards = [total if ok and math.isfinite(total) else float("nan") for total, ok in zip(totals, seen)]
    if all(math.isnan(reward) for reward in rewards):
        warnings.warn("every reward skipped every sample of this batch", stacklevel=2)
    return rewards
