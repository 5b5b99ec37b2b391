"""A run folder whose checkpoint is not what the trainer wrote (replaced, emptied, poisoned, beside a stray entry
of a newer step) is refused in one line that names the file, what is wrong and the complete checkpoint to use
instead; never a traceback, never a silent resume from an older checkpoint (the next save would remove the newer
entry). Each case is a real file on disk, resumed through the CLI, then evaluated."""

import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.cli import main as cli  # noqa: E402
from grpo_fast.train.saved import checkpoint  # noqa: E402

ARGUMENTS = ["--sft-steps", "0", "--eval-every", "0", "--group-size", "2", "--prompts-per-step", "2",
             "--save-every", "1"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A 2-step run with its checkpoint-2 (and no exported model: eval must read the checkpoint)."""
    folder = tmp_path_factory.mktemp("finished") / "run"
    assert cli(["train", "--output-dir", str(folder), "--max-steps", "2", *ARGUMENTS]) == 0
    shutil.rmtree(folder / "model")
    return folder


@pytest.fixture
def run_copy(finished_run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(finished_run, copy)
    return copy


def rewrite_state(folder, change):
    path = folder / "checkpoint-2" / "state.pt"
    state = torch.load(path, weights_only=False)
    torch.save(change(state), path)
    return path


def poisoned(state):
    """Every weight NaN (tied embedding and head alike), as a run that diverged and was saved by other code."""
    for tensor in state["model"].values():
        tensor.fill_(float("nan"))
    return state


def reshaped(state):
    name = next(iter(state["model"]))
    state["model"][name] = torch.zeros(3, 3)
    return state


STATES = {
    "a list": (lambda state: [1, 2, 3], "it holds a list, not a checkpoint's dict"),
    "no model key": (lambda state: {k: v for k, v in state.items() if k != "model"}, "it has no 'model'"),
    "a string step": (lambda state: {**state, "step": "2"}, "its 'step' is str"),
    "non-finite weights": (poisoned, "its model weight 'model.embed_tokens.weight' is not finite"),
}


def one_line_error(capsys, arguments):
    capsys.readouterr()
    assert cli(arguments) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def resume_and_eval(capsys, folder):
    resumed = one_line_error(capsys, ["train", "--output-dir", str(folder), "--max-steps", "3", "--resume",
                                      *ARGUMENTS])
    evaluated = one_line_error(capsys, ["eval", str(folder), "--num-samples", "1"])
    return resumed, evaluated


@pytest.mark.parametrize("case", sorted(STATES))
def test_a_state_that_is_not_a_checkpoints_is_one_line_naming_the_file(run_copy, capsys, case):
    change, reason = STATES[case]
    path = rewrite_state(run_copy, change)
    for err in resume_and_eval(capsys, run_copy):
        assert f"checkpoint {path} is not a checkpoint's state: {reason}" in err, err
        assert "restore it from a copy" in err, err


def test_weights_of_another_shape_are_one_line_naming_the_checkpoint(run_copy, capsys):
    rewrite_state(run_copy, reshaped)
    for err in resume_and_eval(capsys, run_copy):
        assert f"checkpoint {run_copy / 'checkpoint-2'}: its weights do not fit this model" in err, err
        assert "size mismatch for model.embed_tokens.weight" in err, err


@pytest.mark.parametrize("stray", ["an empty folder", "a file"])
def test_a_stray_newer_entry_names_the_complete_checkpoint_and_is_not_skipped(run_copy, capsys, stray):
    newer = run_copy / "checkpoint-9"
    newer.mkdir() if stray == "an empty folder" else newer.write_text("not a checkpoint")
    problem = "has no state.pt (it holds nothing)" if stray == "an empty folder" else "is not a folder"
    for err in resume_and_eval(capsys, run_copy):
        assert f"checkpoint {newer} {problem}; {run_copy / 'checkpoint-2'} is complete: move {newer} out of " \
               f"{run_copy} to resume from it" in err, err
    assert os.path.lexists(newer) and os.path.exists(run_copy / "checkpoint-2" / "state.pt")   # nothing removed
    assert checkpoint.latest_checkpoint(str(run_copy)) == str(run_copy / "checkpoint-2")
    shutil.rmtree(newer) if newer.is_dir() else newer.unlink()               # moved aside: resumes
    assert cli(["train", "--output-dir", str(run_copy), "--max-steps", "3", "--resume", *ARGUMENTS]) == 0


def test_a_checkpoint_without_its_tokenizer_file_is_named(run_copy, capsys):
    (run_copy / "checkpoint-2" / "tokenizer.json").unlink()
    err = one_line_error(capsys, ["train", "--output-dir", str(run_copy), "--max-steps", "3", "--resume",
                                  *ARGUMENTS])
    assert f"checkpoint {run_copy / 'checkpoint-2'}: the tokenizer saved with it cannot be loaded " \
           "(tokenizer.json missing)" in err, err


def test_weights_that_turn_non_finite_in_a_run_are_one_line_at_the_save(run_copy, capsys, monkeypatch):
    """A save refused for non-finite weights stops the run with one line (a RunError), keeping the last one."""
    from grpo_fast.train import loop

    original = loop.checkpoint.training_state

    def diverged(*args, **kwargs):
        return poisoned(original(*args, **kwargs))

    monkeypatch.setattr(loop.checkpoint, "training_state", diverged)
    err = one_line_error(capsys, ["train", "--output-dir", str(run_copy), "--max-steps", "3", "--resume",
                                  *ARGUMENTS])
    assert "not saving checkpoint-3: " in err and f"the last good checkpoint in {run_copy} is kept" in err, err
    assert checkpoint.latest_checkpoint(str(run_copy)) == str(run_copy / "checkpoint-2")
