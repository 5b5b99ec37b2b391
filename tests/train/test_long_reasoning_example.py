"""examples/long_reasoning_cpu.yaml, the long-reasoning recipe on this machine, run for a few steps as a policy
early in its training (a shorter warm start: its completions still run long): groups whose completions all score
alike are dropped and resampled, and long completions get the overlong penalty."""

import json
import os

import pytest

pytest.importorskip("transformers")

from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.config import load_config  # noqa: E402
from tests.helpers import ROOT  # noqa: E402


def test_the_cpu_recipe_filters_groups_and_penalizes_long_completions(tmp_path):
    config = load_config(os.path.join(ROOT, "examples", "long_reasoning_cpu.yaml"),
                         {"output_dir": str(tmp_path / "run"), "max_steps": "3", "eval_every": "0",
                          "sft_steps": "5", "log_completions": "64"})
    assert config.rollout.dynamic_sampling and "overlong" in config.scoring.rewards
    history = T.train(config, log=lambda *_: None)
    assert [r["step"] for r in history] == [1, 2, 3]
    assert any(r["frac_filtered_groups"] > 0 for r in history)              # groups were dropped
    assert any(r["sampling_rounds"] > 1 for r in history)                   # and more prompts sampled
    rows = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert list(config.rollout.stages) == [(0, 96), (75, 128)]
    penalized = [row for row in rows if row["reward"] < 0]
    assert penalized                                                        # long completions lost reward
    assert all(-1.0 <= row["reward"] <= 1.0 for row in rows)
