"""The one folder writer (grpo_fast.train.run.atomic): a folder is written whole or not at all."""

import os

import pytest

from grpo_fast.train.run.atomic import atomic_folder


def test_a_clean_block_replaces_the_folder_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "checkpoint-1"
    target.mkdir()
    (target / "old.txt").write_text("old")
    with atomic_folder(str(target), replace=True) as temporary:
        assert temporary == str(target) + ".tmp" and os.listdir(temporary) == []
        (tmp_path / "checkpoint-1.tmp" / "new.txt").write_text("new")
        assert (target / "old.txt").exists()            # untouched until the block ends
    assert sorted(os.listdir(target)) == ["new.txt"]
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"]


@pytest.mark.parametrize("failure", [OSError("No space left on device"), KeyboardInterrupt()])
def test_a_failed_block_keeps_the_old_folder_whole(tmp_path, failure):
    target = tmp_path / "model"
    target.mkdir()
    (target / "weights").write_text("good")
    with pytest.raises(type(failure)):
        with atomic_folder(str(target), replace=True) as temporary:
            (tmp_path / "model.tmp" / "weights").write_text("half")
            assert os.path.isdir(temporary)
            raise failure
    assert (target / "weights").read_text() == "good"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_without_replace_an_existing_folder_is_refused_before_anything_is_written(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        with atomic_folder(str(tmp_path / "out")):
            raise AssertionError("the block must not run")
    assert sorted(os.listdir(tmp_path)) == ["out"]
    with atomic_folder(str(tmp_path / "fresh/")) as temporary:      # a trailing slash names the same folder
        open(os.path.join(temporary, "a"), "w").close()
    assert os.listdir(tmp_path / "fresh") == ["a"]


# --- I3: no stop at any instant of a checkpoint write or re-write leaves the run without a complete checkpoint
import shutil  # noqa: E402
import signal  # noqa: E402

import torch  # noqa: E402

from grpo_fast.train.run import signals  # noqa: E402
from grpo_fast.train.saved import checkpoint  # noqa: E402

# the filesystem calls a checkpoint write is made of (shutil.rmtree unlinks and removes through os's own)
FILE_OPERATIONS = ("makedirs", "mkdir", "replace", "rename", "unlink", "rmdir", "open")


class FilesTokenizer:
    """Stands in for a tokenizer: three files, so that removing a checkpoint takes several steps."""

    def save_pretrained(self, folder):
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            with open(os.path.join(folder, name), "w") as f:
                f.write(name)


def state_of(version: float) -> dict:
    return {"model": {"w": torch.full((64,), version)}, "version": version}


def saved_run(folder, steps=(2,)) -> str:
    os.makedirs(folder)
    for step in steps:
        checkpoint.save_checkpoint(str(folder), step, state_of(float(step)), FilesTokenizer())
    return str(folder)


def at_every_file_operation(monkeypatch, action):
    """Calls action(index, name) before each filesystem operation of the checkpoint code (not of `action`
    itself); returns the list of operation names seen."""
    import builtins

    seen, busy = [], []
    for name in FILE_OPERATIONS:
        owner = builtins if name == "open" else os
        original = getattr(owner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            if not busy:
                busy.append(True)
                try:
                    action(len(seen), _name)
                finally:
                    busy.clear()
                seen.append(_name)
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)
    return seen


def resumable_step(folder) -> tuple:
    """(step, version) of the checkpoint --resume would load from `folder`: read the way it reads it."""
    found, state = checkpoint.require_latest(str(folder), "--resume")
    assert torch.equal(state["model"]["w"], torch.full((64,), state["version"])), found
    with open(os.path.join(found, "tokenizer.json")) as f:
        assert f.read() == "tokenizer.json"
    return state["step"], state["version"]


# the two writes of a run: a re-write of the step's existing checkpoint (the save after a Ctrl-C that follows a
# periodic save), and a new step's checkpoint, which then removes the older one
WRITES = {"re-write": ((2,), 2, 2.5), "new step": ((2,), 3, 3.0)}


@pytest.mark.parametrize("write", WRITES)
def test_a_kill_at_any_instant_of_a_checkpoint_write_leaves_one_that_resume_finds(tmp_path, monkeypatch, write):
    """SIGKILL leaves the disk as it is: a copy of the output folder taken before each filesystem operation of the
    write (each rename, each file of the removals, each file written) is what a kill at that instant leaves, and
    each must resume, from the old checkpoint or the new one, complete. (The code before this fix removed the
    old copy before renaming the new one in: a kill inside that removal left neither.)"""
    steps, step, version = WRITES[write]
    run = saved_run(tmp_path / "run", steps)
    snapshots = []
    seen = at_every_file_operation(monkeypatch, lambda index, name: snapshots.append(
        shutil.copytree(run, str(tmp_path / f"kill-{index}-{name}"))))
    checkpoint.save_checkpoint(run, step, state_of(version), FilesTokenizer())
    monkeypatch.undo()
    assert {"replace", "unlink", "rmdir", "open"} <= set(seen), seen
    found = {resumable_step(snapshot) for snapshot in snapshots}
    assert found == {(steps[-1], float(steps[-1])), (step, version)}, found
    assert resumable_step(run) == (step, version)
    assert sorted(os.listdir(run)) == [f"checkpoint-{step}"]


@pytest.mark.parametrize("write", WRITES)
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_at_any_instant_of_a_checkpoint_write_leaves_one_that_resume_finds(tmp_path, monkeypatch, write,
                                                                                     signum):
    """A Ctrl-C or a SIGTERM (the trainer's stops_as_interrupts) delivered before each filesystem operation of the
    write in turn: the write stops there (KeyboardInterrupt) or finishes first (the renames and removals hold the
    signal), and the folder then resumes, complete; a write that finishes leaves no leftovers, one cut inside
    the block leaves the old checkpoint and at most its temporary."""
    steps, step, version = WRITES[write]
    run = saved_run(tmp_path / "count", steps)
    count = at_every_file_operation(monkeypatch, lambda index, name: None)
    checkpoint.save_checkpoint(run, step, state_of(version), FilesTokenizer())
    monkeypatch.undo()
    outcomes = set()
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        for instant in range(len(count)):
            run = saved_run(tmp_path / f"signal-{instant}", steps)
            with monkeypatch.context() as patch:
                at_every_file_operation(patch, lambda index, name: index == instant and signal.raise_signal(signum))
                with signals.stops_as_interrupts(), pytest.raises(KeyboardInterrupt):
                    checkpoint.save_checkpoint(run, step, state_of(version), FilesTokenizer())
            outcome = resumable_step(run)
            outcomes.add(outcome)
            if outcome == (step, version):           # complete folders only (an older one goes at the next save)
                assert all(checkpoint.checkpoint_step(name) in (steps[-1], step) and not name.endswith(".old")
                           for name in os.listdir(run)), (instant, os.listdir(run))
            else:
                assert set(os.listdir(run)) <= {f"checkpoint-{steps[-1]}", f"checkpoint-{step}.tmp"}, instant
    finally:
        signal.signal(signal.SIGINT, previous)
    assert outcomes == {(steps[-1], float(steps[-1])), (step, version)}, outcomes


def test_a_replace_cut_between_its_renames_is_found_and_finished_by_the_next_write(tmp_path):
    """checkpoint-N.old with no checkpoint-N (a kill between the two renames) is step N's checkpoint for resume,
    eval and export, and the next write of any step clears it."""
    run = saved_run(tmp_path / "run", (4,))
    os.replace(os.path.join(run, "checkpoint-4"), os.path.join(run, "checkpoint-4.old"))
    assert checkpoint.latest_checkpoint(run) == os.path.join(run, "checkpoint-4.old")
    assert resumable_step(run) == (4, 4.0)
    checkpoint.save_checkpoint(run, 4, state_of(4.5), FilesTokenizer())
    assert sorted(os.listdir(run)) == ["checkpoint-4"] and resumable_step(run) == (4, 4.5)
