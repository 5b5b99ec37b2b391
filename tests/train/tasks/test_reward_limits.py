"""The math-verify rewards' hard time limit: math-verify runs in worker processes, so an answer that makes sympy
run for minutes is cut short on any thread, its worker replaced, and normal batches score as before."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_fast.train.tasks import math_verify_pool as pool
from grpo_fast.train.tasks import rewards as R
from tests.helpers import ROOT

pytest.importorskip("math_verify")

GOOD = "<think>\nStep 1: add.\nStep 2: check.\n</think>\n<answer>\n18\n</answer>"
EXPLOSIVE = "\\boxed{10^{10^{10}}}"            # sympy evaluates the power: minutes with no time limit


def in_process(completions, solution):
    """accuracy_reward's scores computed here, on the main thread, with math-verify's own timeouts."""
    verdicts = [pool._verdict(gold, R._text(completion)) for completion, gold in zip(completions, solution)]
    return [None if verdict is None else float(verdict) for verdict in verdicts]


def test_explosive_answer_off_the_main_thread_finishes_and_exit_does_not_hang():
    script = textwrap.dedent(f"""
        import threading, time
        from grpo_fast.train.tasks import rewards as R
        out = {{}}
        thread = threading.Thread(target=lambda: out.update(r=R.accuracy_reward([{EXPLOSIVE!r}, {GOOD!r}],
                                                                                 solution=["18", "18"])))
        start = time.monotonic()
        thread.start()
        thread.join()
        print(out["r"], round(time.monotonic() - start, 1), flush=True)
    """)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-2000:]
    scores, seconds = done.stdout.split("]")
    assert scores + "]" == "[0.0, 1.0]"
    assert float(seconds) < pool.MATH_VERIFY_TIME_LIMIT_S + 10, done.stdout
    assert time.monotonic() - start < float(seconds) + 30      # the import, and an exit that does not wait


def test_a_completion_over_the_limit_scores_0_and_its_worker_is_replaced(monkeypatch):
    R.accuracy_reward([GOOD], solution=["18"])                # the pool is up: startup is not timed
    pids = [w.process.pid for w in pool._POOL.workers]
    monkeypatch.setattr(pool, "MATH_VERIFY_TIME_LIMIT_S", 2.0)   # below math-verify's own 5 s: the hard limit fires
    long_text = EXPLOSIVE + " and some more words" * 50
    batch = [GOOD, long_text, "<answer>\n17\n</answer>", GOOD]
    start = time.monotonic()
    with pytest.warns(UserWarning) as record:
        scores = R.accuracy_reward(batch, solution=["18"] * 4)
    assert time.monotonic() - start < 4.5
    assert scores == [1.0, 0.0, 0.0, 1.0]
    assert [str(w.message) for w in record] == [
        "accuracy_reward: math-verify timed out on 1 of 4 completions (its own limits or the hard limit of 2 s per "
        f"completion), scored as wrong answers; the first begins {long_text[:80]!r}"]
    after = [w.process.pid for w in pool._POOL.workers]
    assert len(set(after) - set(pids)) == 1                   # the stuck worker alone was replaced ...
    for pid in set(pids) - set(after):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)                                   # ... killed and reaped
    assert R.accuracy_reward(batch[:1] + batch[2:], solution=["18"] * 3) == [1.0, 0.0, 1.0]


def test_normal_batches_score_as_in_process_and_reuse_the_pool():
    completions = [GOOD, "<answer>\n$\\frac{1}{2}$\n</answer>", "so \\boxed{0.5}", "<answer>\n17\n</answer>",
                   "no answer at all", [{"role": "assistant", "content": "<answer>\n$x^2$\n</answer>"}],
                   "<answer>\n1\n</answer>", "<answer>\n\\boxed{\\sqrt{2}}\n</answer>"]
    solution = ["18", "$\\frac{1}{2}$", "$\\frac{1}{2}$", "18", "3", "$x^2$", "no number here", "$\\sqrt{2}$"]
    expected = in_process(completions, solution)
    assert expected == [1.0, 1.0, 1.0, 0.0, 0.0, 1.0, None, 1.0]
    assert R.accuracy_reward(completions, solution=solution) == expected
    pids = [w.process.pid for w in pool._POOL.workers]
    for _ in range(3):
        assert R.accuracy_reward(completions, solution=solution) == expected
    assert [w.process.pid for w in pool._POOL.workers] == pids   # created once, reused
    # the values of the in-process implementation these rewards had before the worker pool
    assert R.length_reward(completions[:4], solution=solution[:4]) == [-0.5, pytest.approx(2 / 13), 0.5, 0.0]
    cosine = R.cosine_scaled_reward(max_len=100)
    assert cosine(completions[:4] + completions[6:7], solution=solution[:4] + solution[6:7]) == pytest.approx(
        [0.6295615814745712, 0.8839566987447491, 0.9762067631165049, -0.9475387530939225, 1.0])
