"""A disk that fills part way through a write (a checkpoint's zip, the final export's safetensors) is one line that
names what could not be written, the free space and the checkpoint kept; never a traceback, never a half-written
folder. Each case runs `grpo-fast train` in a process on a real small filesystem: a tmpfs of a few MiB where this
machine lets the test mount one, and always under a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: a write past
the limit fails with EFBIG part way through the file, as a full disk fails it)."""

import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest

pytest.importorskip("transformers")

ARGUMENTS = ["--eval-every", "0", "--group-size", "4", "--prompts-per-step", "4"]


def train(output_dir, *arguments, file_size_limit=None, sft_steps=2):
    """`grpo-fast train` in its own process; file_size_limit: bytes, RLIMIT_FSIZE of that process."""
    def limited():
        if file_size_limit is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)     # EFBIG instead of a kill, as a full disk's ENOSPC
            resource.setrlimit(resource.RLIMIT_FSIZE, (file_size_limit, file_size_limit))

    done = subprocess.run([sys.executable, "-m", "grpo_fast.cli", "train", "--output-dir", str(output_dir),
                           *ARGUMENTS, "--sft-steps", str(sft_steps), *arguments], capture_output=True, text=True,
                          timeout=300, preexec_fn=limited)
    lines = [line for line in done.stderr.strip().splitlines() if line.startswith("grpo-fast train:")]
    return done.returncode, done.stderr, lines


def assert_one_line(rc, err, lines, *expected):
    assert rc == 2 and "Traceback" not in err and len(lines) == 1, err[-3000:]
    assert err.strip().splitlines()[-1] == lines[0], err[-3000:]          # the last line, and the only error
    for text in expected:
        assert text in lines[0], lines[0]


@pytest.fixture
def tmpfs(tmp_path):
    """mount(size_kib) -> a folder on a fresh tmpfs of that size (skips where this machine cannot mount one)."""
    mounted = []

    def mount(size_kib):
        folder = tmp_path / f"tmpfs-{len(mounted)}"
        folder.mkdir()
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kib}k", "tmpfs", str(folder)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:80]}); the file-size limit cases run")
        mounted.append(folder)
        return folder

    yield mount
    for folder in mounted:
        subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_a_disk_full_in_the_second_checkpoint_keeps_the_first_which_resumes(tmpfs, tmp_path):
    """6 MiB: checkpoint-1 (3.8 MiB) fits, checkpoint-2 does not while checkpoint-1 is still there."""
    disk = tmpfs(6 * 1024)
    rc, err, lines = train(disk / "a", "--max-steps", "3", "--save-every", "1")
    assert_one_line(rc, err, lines, "checkpoint-2 could not be written", "No space left on device", "GiB free",
                    f"the last good checkpoint, {disk / 'a' / 'checkpoint-1'}, is kept")
    assert sorted(name for name in os.listdir(disk / "a") if "checkpoint" in name) == ["checkpoint-1"]
    moved = shutil.copytree(disk / "a", tmp_path / "moved")              # more room: resumes and finishes
    rc, err, _ = train(moved, "--max-steps", "3", "--save-every", "1", "--resume")
    assert rc == 0, err[-3000:]
    assert [json.loads(line)["step"] for line in open(moved / "metrics.jsonl")] == [1, 2, 3]
    assert sorted(os.listdir(moved)) == ["checkpoint-3", "completions.jsonl", "curves.png", "metrics.jsonl", "model"]


def test_a_disk_full_in_the_final_export_keeps_the_checkpoint(tmpfs):
    """4.6 MiB: checkpoint-1 fits, the export's model.safetensors (1.3 MiB) does not."""
    disk = tmpfs(4700)
    rc, err, lines = train(disk / "a", "--max-steps", "1")
    assert_one_line(rc, err, lines, f"the final export to '{disk / 'a' / 'model'}' could not be written",
                    "No space left on device", f"the run's checkpoint, {disk / 'a' / 'checkpoint-1'}, is kept")
    assert not any(name.startswith("model") for name in os.listdir(disk / "a"))      # no half-written export


def test_a_checkpoint_past_the_file_size_limit_is_one_line(tmp_path):
    """state.pt (3.8 MiB) past a 2 MiB limit: torch's zip writer fails part way, then fails again closing."""
    rc, err, lines = train(tmp_path / "a", "--max-steps", "2", "--save-every", "1", file_size_limit=2 * 2**20)
    assert_one_line(rc, err, lines, "checkpoint-1 could not be written", "File too large", "no checkpoint was kept")
    assert not any("checkpoint" in name for name in os.listdir(tmp_path / "a"))      # no .tmp left behind


def test_an_export_past_the_file_size_limit_is_one_line_and_keeps_the_checkpoint(tmp_path):
    """LoRA without a warm start: the checkpoint holds the adapters alone (0.25 MiB), the export the merged model
    (1.3 MiB > 1 MiB)."""
    rc, err, lines = train(tmp_path / "a", "--max-steps", "1", "--lora-rank", "4", sft_steps=0,
                           file_size_limit=2**20)
    assert_one_line(rc, err, lines, f"the final export to '{tmp_path / 'a' / 'model'}' could not be written",
                    "File too large", f"the run's checkpoint, {tmp_path / 'a' / 'checkpoint-1'}, is kept")
    assert sorted(name for name in os.listdir(tmp_path / "a") if "model" in name or "checkpoint" in name) == \
        ["checkpoint-1"]


def test_a_disk_already_full_is_one_line_naming_the_metrics_file(tmpfs):
    """A filesystem another program filled: the run's first append (metrics.jsonl) fails."""
    disk = tmpfs(1024)
    with open(disk / "filler", "wb", buffering=0) as filler, pytest.raises(OSError):
        while True:
            filler.write(b"\0" * 4096)
    rc, err, lines = train(disk / "a", "--max-steps", "2")
    assert_one_line(rc, err, lines, f"{disk / 'a' / 'metrics.jsonl'} could not be written",
                    "No space left on device", "its checkpoints untouched")
