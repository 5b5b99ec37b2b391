"""math-verify's verdicts (does an answer equal its gold?) computed in worker processes under a hard time limit.

`verdicts` is the entry point, for the math-verify rewards of `grpo_fast.train.tasks.rewards`. Some answers
(`\\boxed{10^{10^{10}}}`) make sympy run for minutes, and math-verify's own timeouts (SIGALRM) only work on the
main thread: so math-verify runs in MATH_VERIFY_WORKERS worker processes with a limit of MATH_VERIFY_TIME_LIMIT_S per
completion. A completion over the limit scores as a wrong answer, as when math-verify's own timeout fires, and its
worker is killed and replaced. This module owns the workers, the pool (one per process, closed at exit, left alone
by a forked child) and the parsing of golds and answers that runs in the workers.
"""

# Only the standard library at the top: the worker processes load this file on its own, without torch.
from __future__ import annotations

import atexit
import math
import os
import re
import subprocess
import sys
import threading
import time
import warnings
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Optional

MATH_VERIFY_TIME_LIMIT_S = 10.0     # per completion; above math-verify's own 5 s limits, which keep the worker alive
MATH_VERIFY_WORKERS = 2             # per process (per torchrun rank): one stuck completion does not stall the batch

_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
# A line that opens with "Answer:" (any case, markdown bold or a heading mark allowed), the answer on the rest of it
# or on the next line: DAPO's prompts ask for "Answer: 34" as the last line, and DAPO's own rule reads the text
# after the last "Answer:".
_ANSWER_LINE_RE = re.compile(r"^[ \t*#>]*answer[ \t*]*:[ \t*]*(?:\n[ \t]*)?(\S.*)$", re.IGNORECASE | re.MULTILINE)
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
    """The model's answer, as LaTeX ($...$, \\boxed{}) or a plain expression (a bare number such as `18` included,
    which LaTeX-only extraction misses), read from the first of: the <answer> block; the last line that opens
    with "Answer:" (DAPO's form, `Answer: 34`; a `\\boxed{}` earlier in the reasoning does not override it), when
    math-verify finds an answer on it; the whole text (a `\\boxed{}` first)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
    match = _ANSWER_RE.search(text)
    if match:
        return parse(match.group(1).strip(), extraction_config=config, extraction_mode="first_match")
    lines = _ANSWER_LINE_RE.findall(text)
    if lines:
        # markdown bold around the answer (**34**) reads as the text "34**" to math-verify
        parsed = parse(lines[-1].strip().strip("*"), extraction_config=config, extraction_mode="first_match")
        if parsed:
            return parsed
    return parse(text, extraction_config=config, extraction_mode="first_match")


def _is_correct(gold_parsed, text: str) -> bool:
    from math_verify import verify

    return bool(verify(gold_parsed, _parse_answer(text)))


def _verdict(gold: str, text: str) -> Optional[bool]:
    """None when the gold cannot be parsed, else whether the answer in `text` equals it. Run in a worker, on its
    main thread, where math-verify's own timeouts (SIGALRM) work."""
    gold_parsed = _parse_gold(gold)
    return None if not gold_parsed else _is_correct(gold_parsed, text)


# ------------------------------------------------------------------ the worker processes and their pool
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


def verdicts(texts: list, golds: list, *, reward: str) -> list:
    """Whether the answer in each of `texts` equals its gold in `golds` under math-verify: True, False, or None
    when the gold cannot be parsed. Computed in the worker pool under the time limit; a completion over it, or whose
    worker died, is False, with a warning that names `reward` and points at the caller of the reward function."""
    global _POOL
    if not texts:
        return []
    tasks = [(str(gold), text) for gold, text in zip(golds, texts, strict=True)]
    limit = MATH_VERIFY_TIME_LIMIT_S
    with _POOL_LOCK:
        if _POOL is None or _POOL.closed:
            _POOL = _MathPool(MATH_VERIFY_WORKERS)
        found, timed_out, crashed = _POOL.run(tasks, limit)
    if timed_out:
        first = texts[min(timed_out)]
        warnings.warn(f"{reward}: math-verify timed out on {len(timed_out)} of {len(texts)} completions (its own "
                      f"limits or the hard limit of {limit:g} s per completion), scored as wrong answers; the first "
                      f"begins {first[:80]!r}", stacklevel=3)
    if crashed:
        first = texts[min(crashed)]
        warnings.warn(f"{reward}: a math-verify worker died on {len(crashed)} of {len(texts)} completions, scored "
                      f"as wrong answers; the first begins {first[:80]!r}", stacklevel=3)
    return found
