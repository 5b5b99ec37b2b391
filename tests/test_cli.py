"""What `grpo-fast` prints around its results: no lines of its dependencies' imports, the project's own warnings as
one line, the config file's place on the command line, and the thread count on a small CPU host."""

import os
import re
import subprocess
import sys

import pytest

from grpo_fast.cli import main as cli
from tests.helpers import ROOT

# the lines torchao, torch's pytree and DeepSpeed log on import (transformers imports torchao, accelerate DeepSpeed
# when a model is saved): the command's own process must print none of them
NOISE = ("Failed to load", "_C_mxfp8", "_C_cutlass", "is an Enum subclass", "Setting accelerator to CPU")


def grpo_fast(*arguments, env=None, **options):
    """`grpo-fast ARGUMENTS` in a process of its own, from the repository (tests.helpers' rewards import)."""
    return subprocess.run([sys.executable, "-m", "grpo_fast.cli", *arguments], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})}, **options)


def test_a_run_prints_no_dependency_noise_and_its_own_warnings_as_one_line(tmp_path):
    """A one-step run that imports transformers, saves a model and meets a reward's inf, its rollouts in a rollout
    process (which loads the model again): its output has none of NOISE, and the trainer's warning is one line, not
    Python's file:line and source line."""
    done = grpo_fast("train", "--output-dir", str(tmp_path / "run"), "--max-steps", "1", "--sft-steps", "0",
                     "--eval-every", "0", "--group-size", "2", "--prompts-per-step", "1", "--max-completion-length",
                     "4", "--rewards", "tests.helpers:inf_once_reward", "--max-staleness", "1",
                     env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert not [line for line in output.splitlines() if any(noise in line for noise in NOISE)], output
    assert "warning: reward inf_once_reward returned 1 non-finite score(s) (inf, -inf or NaN) for 2 completions: " \
           "those samples are skipped for it\n" in done.stderr, done.stderr
    assert "UserWarning" not in done.stderr and "loop.py" not in done.stderr, done.stderr
    assert "note: torch runs" not in done.stdout               # one thread: nothing to say about threads


def test_the_thread_count_is_named_on_a_small_host(tmp_path):
    """On at most 2 cores (this process's affinity) with 2 threads the log's first line names OMP_NUM_THREADS=1,
    before the run refuses its arguments (a --resume without a checkpoint): cheap, and the note comes first."""
    cores = sorted(os.sched_getaffinity(0))[:2] if hasattr(os, "sched_getaffinity") else []
    if not cores:
        pytest.skip("no CPU affinity to set on this platform")
    done = grpo_fast("train", "--output-dir", str(tmp_path / "run"), "--resume", "--device", "cpu",
                     env={"OMP_NUM_THREADS": "2"}, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    assert done.returncode == 2, done.stderr
    assert done.stdout.startswith(f"note: torch runs 2 threads on {len(cores)} cores; if other processes share "
                                  "them, set OMP_NUM_THREADS=1"), done.stdout
    assert "--resume: no checkpoint in" in done.stderr


def test_a_config_file_after_the_options_is_one_line_saying_it_comes_first(tmp_path, capsys):
    (tmp_path / "job.yaml").write_text("run:\n  max_steps: 1\n")
    assert cli(["train", "--output-dir", str(tmp_path / "run"), str(tmp_path / "job.yaml"), "--resume"]) == 2
    err = capsys.readouterr().err
    assert err == (f"grpo-fast train: the config file comes first, got '{tmp_path / 'job.yaml'}' after --key value "
                   f"pairs: grpo-fast train {tmp_path / 'job.yaml'} --output-dir {tmp_path / 'run'} --resume\n")
    assert not (tmp_path / "run").exists()


def test_the_help_names_the_default_task(capsys):
    with pytest.raises(SystemExit):
        cli(["--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert re.search(r"a tiny model on the max task, the largest of four numbers, on CPU", help_text), help_text
