"""The run's JSONL files (grpo_fast.train.run.record): every line is JSON, a non-finite number written as null,
and what reads them back (curves.png, the progress bar after a resume) takes null as the missing number."""

import json
import math

import pytest

from grpo_fast.train.run.record import RunFiles, plot_curves

pytest.importorskip("matplotlib")


def strict_lines(path) -> list:
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in open(path)]


def test_non_finite_numbers_are_written_as_null_in_every_file_and_read_back_as_nan(tmp_path):
    files = RunFiles(str(tmp_path), is_main=True)
    files.start(resumed_step=None)
    for step, loss in ((1, 0.5), (2, float("nan")), (3, float("inf"))):
        files.append({"step": step, "reward": -math.inf if step == 3 else 0.25 * step, "loss": loss,
                      "entropy": 1.0, "completion_len": 3.0, "kl": 0.0, "generation_seconds": 0.1})
    files.add_eval({"step": 3, "accuracy": float("nan"), "pass@1": float("nan"), "problems": 0})
    rows = files.add_completions(3, ["1+1="], ["2", "x"], [float("nan"), 0.0], group_size=2, count=1)
    assert math.isnan(rows[0]["reward"])                    # the trackers still get the number

    metrics = strict_lines(tmp_path / "metrics.jsonl")
    assert [(row["reward"], row["loss"]) for row in metrics] == [(0.25, 0.5), (0.5, None), (None, None)]
    assert strict_lines(tmp_path / "eval.jsonl") == [{"step": 3, "accuracy": None, "pass@1": None, "problems": 0}]
    assert strict_lines(tmp_path / "completions.jsonl") == [{"step": 3, "prompt": "1+1=", "completion": "2",
                                                             "reward": None}]
    evaluation = files.evaluations()[-1]
    assert math.isnan(evaluation["accuracy"]) and evaluation["problems"] == 0 and files.evaluated_steps() == {3}
    plot_curves(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"), str(tmp_path / "eval.jsonl"))
    assert (tmp_path / "curves.png").stat().st_size > 0
