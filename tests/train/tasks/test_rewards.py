"""Each reward on fixed strings, including an <answer> that holds a bare number with no LaTeX."""

import importlib
import math
import re
import sys
import threading

import numpy as np
import pytest
import torch

from grpo_fast.train.tasks import rewards as R

pytest.importorskip("math_verify")

GOOD = "<think>\nStep 1: add.\nStep 2: check.\n</think>\n<answer>\n18\n</answer>"


def test_accuracy_bare_number_latex_boxed_and_wrong():
    completions = [GOOD, "<answer>\n$18$\n</answer>", "so \\boxed{18}", "<answer>\n17\n</answer>",
                   [{"role": "assistant", "content": "<answer>\n18\n</answer>"}]]
    assert R.accuracy_reward(completions, solution=["18"] * 5) == [1.0, 1.0, 1.0, 0.0, 1.0]


def test_accuracy_skips_unparseable_gold():
    assert R.accuracy_reward(["<answer>\n1\n</answer>"], solution=["no number here"]) == [None]


def test_accuracy_off_the_main_thread():
    out = {}
    thread = threading.Thread(target=lambda: out.update(r=R.accuracy_reward([GOOD], solution=["$18$"])))
    thread.start()
    thread.join()
    assert out["r"] == [1.0]


def test_exact_match():
    completions = ["8", " 8\n", "8\ufffd9", "08", "", [{"role": "assistant", "content": "8"}]]
    assert R.exact_match_reward(completions, solution=["8"] * 6) == [1.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert R.accuracy_reward(completions[2:3], solution=["8"]) == [1.0]      # what exact_match is for


def test_format_and_tag_count():
    assert R.format_reward([GOOD, "<answer>\n18\n</answer>", GOOD + " trailing"]) == [1.0, 0.0, 0.0]
    assert R.tag_count_reward([GOOD, "<think>\nx\n</think>\n", "nothing"]) == [1.0, 0.5, 0.0]


def test_reasoning_steps():
    assert R.reasoning_steps_reward(["Step 1: a\nStep 2: b\nStep 3: c", "First, x. Finally, y.", "none"]) == \
        [1.0, pytest.approx(2 / 3), 0.0]


def test_length_reward():
    completions = ["<answer>\n18\n</answer>", "<answer>\n18\n</answer> with more words", "<answer>\n17\n</answer>"]
    assert R.length_reward(completions, solution=["18"] * 3) == [0.5, -0.5, 0.0]
    assert R.length_reward(["a", "b"], solution=["1", "1"]) == [0.0, 0.0]


def test_cosine_scaled_reward():
    reward = R.cosine_scaled_reward(max_len=100)
    short_right, short_wrong = "<answer>\n18\n</answer>", "<answer>\n17\n</answer>"
    right, wrong = reward([short_right, short_wrong], solution=["18", "18"])
    cosine = math.cos(len(short_right) / 100 * math.pi)
    assert right == pytest.approx(0.5 + 0.25 * (1 + cosine))
    assert wrong == pytest.approx(-0.5 + 0.5 * (-1.0 + 0.5) * (1 + cosine))
    assert reward(["x"], solution=["no gold"]) == [1.0]


def test_repetition_penalty():
    reward = R.repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)
    assert reward(["a b a b a b", "a b c d", "a"]) == [pytest.approx(-(1 - 2 / 5)), 0.0, 0.0]
    with pytest.raises(ValueError, match="max_penalty must be <= 0"):
        R.repetition_penalty_reward(max_penalty=0.5)


def test_weighted_sum_and_skips():
    def half(completions, **_):
        return [0.5] * len(completions)

    def skipper(completions, **_):
        return [None, 1.0]

    assert R.weighted_rewards([half, skipper], [2.0, 1.0], ["a", "b"]) == [1.0, 2.0]
    assert math.isnan(R.weighted_rewards([skipper], None, ["a", "b"])[0])
    with pytest.raises(ValueError, match="weights must match"):
        R.weighted_rewards([half], [1.0, 2.0], ["a"])


def test_failing_reward_names_itself():
    def broken(completions, **_):
        raise KeyError("solution")

    with pytest.raises(RuntimeError, match="reward broken failed on a batch of 2 completions"):
        R.weighted_rewards([broken], None, ["a", "b"])


def test_load_reward():
    assert R.load_reward("format") is R.format_reward
    assert R.load_reward("grpo_fast.train.tasks.rewards:tag_count_reward") is R.tag_count_reward
    assert R.load_reward("repetition_penalty", ngram_size=2)(["a b a b"]) == [pytest.approx(-1 / 3)]
    with pytest.raises(ValueError, match="reward must be one of"):
        R.load_reward("nope")
    with pytest.raises(ValueError, match="cannot load reward"):
        R.load_reward("grpo_fast.train.tasks.rewards:nope")


def my_reward_returning(value):
    def my_reward(completions, **_):
        return value() if callable(value) else value
    return my_reward


@pytest.mark.parametrize("returned, got", [
    (lambda: (1.0 for _ in range(2)), "got a generator"),
    (lambda: map(float, [1, 2]), "got a map"),
    ("ab", "got a str"),
    ({0: 1.0, 1: 0.0}, "got a dict"),
    (None, "got None"),
    (1.0, "got a float"),
    ([1.0, "0.5"], "got a str at index 1: '0.5'"),
    ([object(), 1.0], "got an object at index 0"),
])
def test_a_reward_returning_no_list_of_scores_names_itself(returned, got):
    expected = "reward my_reward must return a list of floats (or None to skip a sample), one per completion; "
    with pytest.raises(TypeError, match=re.escape(expected + got)):
        R.weighted_rewards([my_reward_returning(returned)], None, ["a", "b"])


def test_scores_as_a_tuple_or_an_array_are_accepted():
    assert R.weighted_rewards([my_reward_returning((0.5, None)), my_reward_returning(np.array([1.0, 2.0]))],
                              None, ["a", "b"]) == [1.5, 2.0]


def test_non_finite_scores_are_skipped_with_one_warning():
    broken = my_reward_returning([float("inf"), float("-inf"), float("nan"), 1.0])
    with pytest.warns(UserWarning) as record:
        alone = R.weighted_rewards([broken], None, ["a", "b", "c", "d"])
    assert [str(w.message) for w in record] == [
        "reward my_reward returned 3 non-finite score(s) (inf, -inf or NaN) for 4 completions: those samples are "
        "skipped for it"]
    assert all(math.isnan(x) for x in alone[:3]) and alone[3] == 1.0
    with pytest.warns(UserWarning, match="returned 3 non-finite"):
        both = R.weighted_rewards([broken, my_reward_returning([0.5] * 4)], [1.0, 2.0], ["a", "b", "c", "d"])
    assert both == [1.0, 1.0, 1.0, 2.0]


@pytest.mark.parametrize("scores, weights, message", [
    ([0.5, 1e39], None, "reward my_reward returned 1e+39 at index 1, beyond float32's range"),
    ([-1e308], None, "reward my_reward returned -1e+308 at index 0, beyond float32's range"),
    ([0.0, 10**400], None, "reward my_reward returned 1e+400 at index 1, beyond float32's range"),
    ([3e38, 1.0], [10.0], "the weighted reward of completion 0 is 3e+39, beyond float32's range"),
])
def test_a_finite_score_beyond_float32_is_refused_naming_it(scores, weights, message):
    """Rewards are trained in fp32, where 1e39 is inf (then a NaN loss and skipped steps, with no word of why): a
    score, or a weighted sum, beyond float32's range is one line naming the reward and the value."""
    with pytest.raises(ValueError, match="^" + re.escape(message) + r" \(\|x\| <= 3\.403e\+38\)[^\n]*$"):
        R.weighted_rewards([my_reward_returning(scores)], weights, ["a"] * len(scores))
    largest = R.weighted_rewards([my_reward_returning([R.FP32_MAX, -R.FP32_MAX])], None, ["a", "b"])
    assert torch.isfinite(torch.tensor(largest, dtype=torch.float32)).all()       # the edge itself is kept


def test_a_run_whose_reward_overflows_float32_stops_in_one_line(tmp_path, capsys):
    """A user's reward file returning 1e39: `grpo-fast train` stops at step 1 with one line naming the reward and
    the value, before anything trains on inf."""
    from grpo_fast.cli import main as cli

    (tmp_path / "huge.py").write_text("def huge_reward(completions, **_):\n    return [1e39] * len(completions)\n")
    code = cli(["train", "--output-dir", str(tmp_path / "run"), "--sft-steps", "0", "--eval-every", "0",
                "--group-size", "2", "--prompts-per-step", "2", "--max-steps", "1",
                "--rewards", f"{tmp_path / 'huge.py'}:huge_reward"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err[-1] == ("grpo-fast train: step 1: reward huge_reward returned 1e+39 at index 0, beyond "
                                     "float32's range (|x| <= 3.403e+38) that rewards are trained in: scale it down")


def test_no_reward_functions():
    with pytest.raises(ValueError, match=r"^at least one reward function is needed, got none$"):
        R.weighted_rewards([], None, ["a"])


def test_user_rewards_from_the_working_directory_or_a_file(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])  # as a console script
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cwd_reward_ok.py").write_text("def ones(completions, **_):\n    return [1.0] * len(completions)\n")
    (tmp_path / "cwd_reward_bad.py").write_text("def broken(completions, **_):\n    return [\n\ndef other(:\n")
    importlib.invalidate_caches()
    assert R.load_reward("cwd_reward_ok:ones")(["a", "b"]) == [1.0, 1.0]
    assert R.load_reward("cwd_reward_ok.py:ones")(["a"]) == [1.0]
    assert R.load_reward(f"{tmp_path / 'cwd_reward_ok.py'}:ones") is R.load_reward("cwd_reward_ok.py:ones")
    for spec in ("cwd_reward_bad:broken", "cwd_reward_bad.py:broken"):      # one line: the file and the line
        with pytest.raises(ValueError, match=rf"^cannot load reward '{spec}': .*cwd_reward_bad\.py:[24]: .+$"):
            R.load_reward(spec)
    with pytest.raises(ValueError, match=r"no module 'no_such_reward' on the Python path or in the working "
                                         r"directory .*; name its file instead \(path/to/file\.py:fn\)"):
        R.load_reward("no_such_reward:fn")
    with pytest.raises(ValueError, match=r"no such file .*missing\.py"):
        R.load_reward("missing.py:fn")
    with pytest.raises(ValueError, match=r"cwd_reward_ok\.py has no 'nope'"):
        R.load_reward("cwd_reward_ok.py:nope")
