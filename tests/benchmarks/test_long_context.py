"""benchmarks/long_context.py on a pretrained model (SmolLM2-135M-Instruct with YaRN 2x), at lengths this machine
runs in seconds: each loss's row beside the planner's, the HF engine's rollout scored by the trainer's model, and
the refusals that come before any measurement."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

YARN = '{"rope_type": "yarn", "factor": 2.0}'


def run(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "grpo_fast.benchmarks.long_context", *args], capture_output=True,
                          text=True, timeout=900)


def test_smollm2_rows_plan_and_rollout(tmp_path):
    done = run("--model", "smollm2-135m-instruct", "--rope-scaling", YARN, "--lengths", "64", "--steps", "1",
               "--warmup-tokens", "8", "--malloc-mmap-threshold", "65536", "--rollout-tokens", "24", "--engines", "hf",
               "--out", str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.load(open(tmp_path / "long_context_smollm2.json"))
    rows = {row["loss"]: row for row in saved["rows"]}
    assert set(rows) == {"grpo_fast", "naive"}
    for row in rows.values():
        assert row["length"] == 64 and row["peak_bytes"] > 2 * 2**30       # weights, gradients, AdamW: 2 GiB
        assert row["planned_components"]["weights"] == 134515008 * 4      # SmolLM2-135M's parameters, fp32
        assert 0.9 < row["planned_bytes"] / row["peak_bytes"] < 1.1, row       # live memory: the threshold fixed
    [rollout] = saved["rollouts"]
    assert rollout["engine"] == "hf" and rollout["completions"] == 2 and rollout["completion_tokens"] == 24
    assert 0 < rollout["max_logprob_gap"] < 1e-3 and rollout["mean_logprob_gap"] <= rollout["max_logprob_gap"]
    assert '"yarn"' in saved["setting"] and "long_context_smollm2.json" not in saved["command"]
    table = (tmp_path / "long_context_smollm2.md").read_text()
    assert "| 64 | grpo_fast |" in table and "| hf | " in table
    assert os.path.getsize(tmp_path / "long_context_smollm2.png") > 0

    again = run("--model", "smollm2-135m-instruct", "--lengths", "64", "--out", str(tmp_path))
    assert again.returncode == 2 and "exists: pass --overwrite" in again.stderr     # results kept

    # --replan plans the job the recorded command ran (its YaRN scaling, group size, allocator setting), whatever
    # this command's defaults: the same plan and setting line, the measurements untouched
    stale = dict(saved, rows=[dict(row, planned_bytes=0) for row in saved["rows"]])
    (tmp_path / "long_context_smollm2.json").write_text(json.dumps(stale))
    replanned = run("--replan", "--model", "smollm2-135m-instruct", "--out", str(tmp_path))
    assert replanned.returncode == 0, replanned.stderr[-3000:]
    again = json.load(open(tmp_path / "long_context_smollm2.json"))
    assert again["rows"] == saved["rows"] and again["setting"] == saved["setting"]
    assert again["command"] == saved["command"] and "recomputed with `--replan`" in (
        tmp_path / "long_context_smollm2.md").read_text()


@pytest.mark.parametrize("args, message", [
    (["--lengths", "16384"], "beyond the model's context of 16384"),          # YaRN 2x of 8192, with the prompt
    (["--lengths", "64", "--rope-scaling", '{"rope_type": "yarm", "factor": 2}'], "policy.rope_scaling"),
    (["--lengths", "64", "--rope-scaling", "[2]"], "--rope-scaling must be a JSON object"),
])
def test_refused_before_measuring(tmp_path, args, message):
    rope = [] if "--rope-scaling" in args else ["--rope-scaling", YARN]
    done = run("--model", "smollm2-135m-instruct", *rope, *args, "--out", str(tmp_path))
    assert done.returncode == 2 and message in done.stderr.splitlines()[-1], done.stderr[-2000:]
    assert not os.listdir(tmp_path)


def test_replan_without_results_names_the_file(tmp_path):
    done = run("--replan", "--out", str(tmp_path))
    assert done.returncode == 2 and f"{tmp_path / 'long_context.json'} does not exist" in done.stderr


def test_rope_scaling_needs_a_pretrained_model(tmp_path):
    done = run("--rope-scaling", YARN, "--lengths", "64", "--out", str(tmp_path))
    assert done.returncode == 2 and "need a pretrained --model" in done.stderr
