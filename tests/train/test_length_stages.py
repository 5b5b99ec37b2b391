"""Staged completion lengths (rollout.max_completion_length as a schedule, or completion_length_stages): each step
samples up to its stage's length, in both kinds of rollouts; the dr_grpo normalizer and the overlong penalty follow
the stage; the context, vLLM and the planner are sized by the largest (a line per stage in the run's plan); a run
resumed at or across a stage boundary is the uninterrupted one."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.config import load_config, parse_overrides  # noqa: E402
from grpo_fast.train.tasks.rewards import soft_overlong_penalty  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import flat_config  # noqa: E402


@pytest.mark.parametrize("given", [{0: 4, 2: 8}, [[2, 8], [0, 4]], "0:4,2:8"])
def test_a_schedule_in_yaml_or_on_the_command_line(given):
    config = flat_config(max_completion_length=given)
    assert config.rollout.max_completion_length == 8 and config.rollout.completion_length_stages == ["0:4", "2:8"]
    assert [config.rollout.stages.at(step) for step in range(4)] == [4, 4, 8, 8]
    assert config.loss.max_completion_length is None        # each stage's (stage_loss)
    cli = load_config(None, parse_overrides(["--max-completion-length", "0:4,2:8"]))
    assert list(cli.rollout.stages) == [(0, 4), (2, 8)]
    same = load_config(None, parse_overrides(["--completion-length-stages", "0:4,2:8", "--max-completion-length", "8"]))
    assert same.rollout == cli.rollout


@pytest.mark.parametrize("keys, message", [
    (dict(max_completion_length="1:4,3:8"), "start at step 0"),
    (dict(max_completion_length="0:4,0:8"), "later steps after"),
    (dict(max_completion_length="0:4,2:x"), "FROM_STEP:LENGTH"),
    (dict(completion_length_stages=["0:4", "2:8"], max_completion_length=16), "largest length"),
    (dict(max_completion_length="0:4,2:8", rewards=["exact_match", "overlong"], overlong_buffer=6),
     "shortest stage"),
    (dict(max_completion_length={0: 4.7, 2: 8}), r"of whole numbers .*, got \{0: 4.7, 2: 8\}"),    # not 4
    (dict(max_completion_length=[[0, True], [2, 8]]), "of whole numbers"),                          # not 1
    (dict(max_completion_length={0: 4, 2: 8}, completion_length_stages=["0:4", "2:16"]),
     r"max_completion_length is a schedule \(\{0: 4, 2: 8\}\) and completion_length_stages is given too"),
])
def test_a_schedule_that_cannot_run_is_refused_naming_the_keys(keys, message):
    with pytest.raises(ValueError, match=message):
        flat_config(**keys)


def test_yaml_keeps_a_base_60_looking_value_as_text(tmp_path):
    """YAML 1.1 reads 1:30 as 90 (base 60): a 90-token run nobody asked for. It stays the text "1:30", a schedule
    (refused: no stage from step 0), and 5:16 in a list of stages stays the stage it reads as."""
    path = tmp_path / "c.yaml"
    path.write_text("rollout:\n  max_completion_length: 1:30\n")
    with pytest.raises(ValueError, match=r"must start at step 0.*got \['1:30'\]"):
        load_config(str(path))
    path.write_text("rollout:\n  completion_length_stages: [0:4, 5:16]\n  max_completion_length: 16\n")
    assert list(load_config(str(path)).rollout.stages) == [(0, 4), (5, 16)]


def test_a_stage_from_max_steps_on_is_named_in_one_line():
    """It never runs, yet sizes the context and vLLM: the run says so (and keeps it for a longer --resume)."""
    lines = []
    T.start_processes(flat_config(max_completion_length="0:4,2:6,5:8", max_steps=5), lines.append)
    assert lines == ["warning: the stage 5:8 of completion_length_stages starts at step 6, after max_steps (5): this "
                     "run never samples it, yet sizes the context and vLLM for 8 tokens"]
    T.start_processes(flat_config(max_completion_length="0:4,2:6,5:8", max_steps=6), lines.append)
    assert len(lines) == 1


def test_the_dr_grpo_normalizer_and_the_overlong_penalty_follow_the_stage():
    config = flat_config(max_completion_length="0:4,2:8", loss_type="dr_grpo")
    lines = []
    assert T.stage_loss(config.loss, config.rollout, 0, lines.append).max_completion_length == 4
    assert T.stage_loss(config.loss, config.rollout, 1, lines.append).max_completion_length == 4
    assert T.stage_loss(config.loss, config.rollout, 2, lines.append).max_completion_length == 8
    assert lines == ["step 1: completions of up to 4 tokens from here (stage 1 of 2)",
                     "step 3: completions of up to 8 tokens from here (stage 2 of 2)"]
    fixed = flat_config(max_completion_length="0:4,2:8", loss_type="dr_grpo", **{"loss.max_completion_length": 6})
    assert T.stage_loss(fixed.loss, fixed.rollout, 0, print).max_completion_length == 6
    # a value given stays whatever it equals: the rollout's largest length too (it was taken for "not given")
    equal = flat_config(max_completion_length="0:4,2:8", loss_type="dr_grpo", **{"loss.max_completion_length": 8})
    assert [T.stage_loss(equal.loss, equal.rollout, step, print).max_completion_length for step in (0, 2)] == [8, 8]
    assert equal.replace(seed=1).loss.max_completion_length == 8 and config.replace(seed=1).loss.max_completion_length \
        is None
    assert [T.stage_loss(config.loss, config.rollout, step, print).max_completion_length for step in (0, 2)] == [4, 8]
    assert [config.loss_at(step).max_completion_length for step in (0, 2)] == [4, 8]
    reward = soft_overlong_penalty(8, 2)
    ids = [[1] * 3, [1] * 4, [1] * 7]
    assert reward(["", "", ""], completion_ids=ids) == [0.0, 0.0, -0.5]                  # the largest stage
    assert reward(["", "", ""], completion_ids=ids, max_completion_length=[4] * 3) == [-0.5, -1.0, -1.0]


# two mini-batches a step (one group each): the staged budget, the rollout process and the resume under them
RUN = dict(sft_steps=10, max_steps=4, save_every=2, group_size=2, prompts_per_step=2, log_completions=0,
           eval_every=0, ignore_eos=True, max_completion_length="0:4,2:8", steps_per_generation=2,
           rewards=["tests.helpers:counting_reward"])


def test_the_plan_command_sizes_the_largest_stage_and_gives_a_line_per_stage(capsys, tmp_path):
    """The long-reasoning recipe with staged lengths (8k, then 16k from step 101), planned before its dataset is
    downloaded: one line says so, and the plan is the config's job with --prompt-length's prompts."""
    from grpo_fast.cli import main as cli

    with open(os.path.join(helpers.ROOT, "examples", "long_reasoning_16k.yaml")) as recipe:
        text = recipe.read()
    assert "  max_completion_length: 20480\n" in text
    staged = tmp_path / "staged.yaml"
    staged.write_text(text.replace("  max_completion_length: 20480\n",
                                   "  max_completion_length: {0: 8192, 100: 16384}\n"))
    assert cli(["plan", str(staged)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == ("data: data/dapo-math-17k/data/dapo-math-17k.parquet is not here yet; planned "
                                   "with prompts of --prompt-length 512 tokens")
    assert "prompt 512 + completion 16384 tokens" in out
    lines = [line for line in out.splitlines() if line.startswith("stage from step")]
    assert [line.split(", training peak")[0] for line in lines] == [
        "stage from step 1: completions of up to 8192 tokens", "stage from step 101: completions of up to 16384 tokens"]
    peaks = [float(line.split("peak ")[1].split(" GiB")[0]) for line in lines]
    assert peaks[0] < peaks[1] and f"peak {peaks[1]:.2f}" in " ".join(out.split())


def test_the_plan_command_takes_a_schedule_as_train_does(capsys):
    """`plan MODEL --completion-length 0:8192,200:16384`: the plan of its largest stage, as
    `--completion-length 16384` gives it, and a line per stage; a schedule train refuses is one line."""
    from grpo_fast.cli import main as cli

    assert cli(["plan", "qwen2.5-7b", "--completion-length", "16384"]) == 0
    largest = capsys.readouterr().out
    assert cli(["plan", "qwen2.5-7b", "--completion-length", "0:8192,200:16384"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(largest)
    assert [line.split(", training peak")[0] for line in out[len(largest):].splitlines()] == [
        "stage from step 1: completions of up to 8192 tokens", "stage from step 201: completions of up to 16384 tokens"]
    with pytest.raises(SystemExit):
        cli(["plan", "qwen2.5-7b", "--completion-length", "1:8192"])
    assert capsys.readouterr().err.splitlines()[-1] == (
        "grpo-fast plan: error: argument --completion-length: a length or a schedule FROM_STEP:LENGTH,... (e.g. "
        "0:8192,200:16384), got '1:8192': completion_length_stages must start at step 0, with later steps after and "
        "positive lengths, got ['1:8192']")


@pytest.mark.parametrize("staleness", [0, 1])
def test_each_step_samples_up_to_its_stages_length(tmp_path, staleness):
    extra = dict(max_staleness=1, importance_sampling="token_truncate") if staleness else {}
    lines = []
    history = T.train(flat_config(**RUN, **extra, output_dir=str(tmp_path / "run")), log=lines.append)
    assert [r["completion_len"] for r in history] == [4.0, 4.0, 8.0, 8.0]          # ignore_eos: the whole budget
    assert [r["truncated"] for r in history] == [1.0] * 4
    assert "  stage from step 3: completions of up to 8 tokens, peak" in "\n".join(lines)
    assert "step 3: completions of up to 8 tokens from here (stage 2 of 2)" in lines


@pytest.mark.parametrize("interrupt_at", [2, 3], ids=["across", "at"])
def test_a_resume_at_or_across_a_stage_boundary_is_the_uninterrupted_run(tmp_path, monkeypatch, interrupt_at):
    """Ctrl-C while scoring step 2 (resumed from step 1: it crosses the boundary) or step 3 (resumed from
    checkpoint-2: it starts at the boundary); weights and metrics equal the uninterrupted run's."""
    captured = helpers.saved_models(monkeypatch)
    options = {**RUN, "ignore_eos": False}
    helpers.CALLS.update(n=0, interrupt_at=None)
    straight = T.train(flat_config(**options, output_dir=str(tmp_path / "straight")), log=lambda *_: None)
    helpers.CALLS.update(n=0, interrupt_at=interrupt_at)
    with pytest.raises(KeyboardInterrupt):
        T.train(flat_config(**options, output_dir=str(tmp_path / "resumed")), log=lambda *_: None)
    helpers.CALLS.update(interrupt_at=None)
    T.train(flat_config(**options, output_dir=str(tmp_path / "resumed")), resume=True, log=lambda *_: None)
    a, b = captured[str(tmp_path / "straight")], captured[str(tmp_path / "resumed")]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    lines = [json.loads(line) for line in open(os.path.join(tmp_path, "resumed", "metrics.jsonl"))]
    assert [(r["step"], r["reward"], r["completion_len"]) for r in lines] == \
        [(r["step"], r["reward"], r["completion_len"]) for r in straight]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_vllm_engine_samples_up_to_each_stages_length(tmp_path):
    code = f"""
import json
from grpo_fast.train.loop import train
from tests.helpers import flat_config
history = train(flat_config(**{{**{RUN!r}, "max_steps": 3}}, engine="vllm", output_dir={str(tmp_path / "run")!r}),
                log=lambda *_: None)
print("RESULT " + json.dumps([r["completion_len"] for r in history]))
"""
    env = {**os.environ, "PYTHONPATH": helpers.ROOT}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env,
                          cwd=helpers.ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(done.stdout.split("RESULT ")[-1]) == [4.0, 4.0, 8.0]
