"""What the trainer guarantees when things go wrong: non-finite rewards, losses and gradients never reach the
weights or a checkpoint; a folder holding a run is never overwritten by accident; resume tolerates a torn metrics
line, refuses a changed model or data and applies other changed keys; errors are one line from the CLI."""

import json
import os

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.cli import main as cli  # noqa: E402
from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.config import KEYS  # noqa: E402
from grpo_fast.train.saved import checkpoint
from grpo_fast.train.update import step as update  # noqa: E402
from grpo_fast.train.update.optimizer import lr_factor  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

FAST = dict(sft_steps=10, max_steps=3, save_every=1, group_size=4, prompts_per_step=4, log_completions=0,
            rewards=["tests.helpers:counting_reward"], eval_every=0)      # the evaluation would count calls too
QUIET = dict(log=lambda *_: None)


def run(tmp_path, name="run", resume=False, **options):
    helpers.CALLS.update(n=0, interrupt_at=None)
    return T.train(flat_config(**{**FAST, **options}, output_dir=str(tmp_path / name)), resume=resume, **QUIET)


def saved_weights(folder):
    return torch.load(os.path.join(folder, "state.pt"), weights_only=False)["model"]


def all_finite(state):
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())


def test_a_non_finite_reward_skips_the_sample_not_the_run(tmp_path):
    helpers.INF_AT.update(call=2, n=0)
    history = run(tmp_path, rewards=["tests.helpers:inf_once_reward"])
    assert [r["skipped_samples"] for r in history] == [0.0, 1.0, 0.0]
    assert all(r["skipped_updates"] == 0 and torch.isfinite(torch.tensor(r["loss"])) for r in history)
    assert all_finite(saved_weights(tmp_path / "run" / "checkpoint-3"))


def nan_gradients_at(monkeypatch, calls):
    """accumulate_gradients whose gradients are NaN on the given (1-based) calls."""
    original, count = update.accumulate_gradients, {"n": 0}

    def poisoned(policy, *args, **kwargs):
        summed = original(policy, *args, **kwargs)
        count["n"] += 1
        if count["n"] in calls:
            for parameter in policy.trunk.parameters():
                parameter.grad.fill_(float("nan"))
        return summed

    monkeypatch.setattr(update, "accumulate_gradients", poisoned)


def test_a_non_finite_gradient_skips_the_update(tmp_path, monkeypatch):
    nan_gradients_at(monkeypatch, {2})
    history = run(tmp_path)
    assert [r["skipped_updates"] for r in history] == [0.0, 1.0, 0.0]
    assert all_finite(saved_weights(tmp_path / "run" / "checkpoint-3"))


def test_max_bad_steps_in_a_row_stop_the_run_and_keep_the_good_checkpoint(tmp_path, monkeypatch):
    nan_gradients_at(monkeypatch, {2, 3, 4, 5})
    with pytest.raises(T.RunError, match=r"step 4: 3 steps in a row had a non-finite loss or gradient norm"):
        run(tmp_path, max_steps=6)
    # skipped steps leave the weights as step 1 made them: every checkpoint written since holds them, finite
    latest = checkpoint.latest_checkpoint(str(tmp_path / "run"))
    assert latest.endswith("checkpoint-3") and all_finite(saved_weights(latest))


def test_a_checkpoint_is_never_written_from_non_finite_weights(tmp_path):
    good = checkpoint.save_checkpoint(str(tmp_path), 1, {"model": {"w": torch.ones(2)}})
    with pytest.raises(RuntimeError, match="not saving checkpoint-2: 1 weight tensors are not finite"):
        checkpoint.save_checkpoint(str(tmp_path), 2, {"model": {"w": torch.tensor([1.0, float("inf")])}})
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-1"] and os.path.exists(os.path.join(good, "state.pt"))


def test_a_folder_holding_a_run_is_refused_then_overwritten_on_request(tmp_path, capsys):
    run(tmp_path, max_steps=1)
    folder = tmp_path / "run"
    before = {name: (folder / name).read_bytes() for name in ("metrics.jsonl", "checkpoint-1/state.pt")}
    with pytest.raises(ValueError, match=r"already holds a run \(checkpoint-1, curves.png, metrics.jsonl, model\)"):
        run(tmp_path, max_steps=1)
    assert cli(["train", "--max-steps", "1", "--sft-steps", "0", "--output-dir", str(folder)]) == 2
    assert "grpo-fast train: output_dir" in capsys.readouterr().err
    assert {name: (folder / name).read_bytes() for name in before} == before       # nothing touched
    history = run(tmp_path, max_steps=2, overwrite_output_dir=True)
    assert [r["step"] for r in history] == [1, 2]
    assert sorted(os.listdir(folder)) == ["checkpoint-2", "curves.png", "metrics.jsonl", "model"]
    assert [json.loads(line)["step"] for line in open(folder / "metrics.jsonl")] == [1, 2]


def test_a_run_that_fails_before_its_first_checkpoint_leaves_the_folder_to_the_same_command(tmp_path, monkeypatch):
    """A failure in step 1 (after the first evaluation and metrics.jsonl were written): the same call again trains
    into the folder, replacing those files, and says so; --resume still finds nothing to resume there."""
    def failing(*args, **kwargs):
        raise RuntimeError("value cannot be converted to type float without overflow")

    options = dict(sft_steps=0, max_steps=1, eval_every=1, eval_prompts=2, eval_samples=1)
    with monkeypatch.context() as patch:
        patch.setattr(T, "policy_updates", failing)
        with pytest.raises(RuntimeError, match="without overflow"):
            run(tmp_path, **options)
    folder = tmp_path / "run"
    assert sorted(os.listdir(folder)) == ["eval.jsonl", "metrics.jsonl"]
    with pytest.raises(ValueError, match="--resume: no checkpoint in"):
        run(tmp_path, resume=True, **options)
    logged = []
    helpers.CALLS.update(n=0, interrupt_at=None)
    history = T.train(flat_config(**{**FAST, **options}, output_dir=str(folder)), log=logged.append)
    assert [r["step"] for r in history] == [1]
    assert f"{folder} holds no checkpoint, only the files of a run that stopped before its first one (eval.jsonl, " \
           "metrics.jsonl): nothing to resume, this run replaces them" in logged
    assert [json.loads(line)["step"] for line in open(folder / "eval.jsonl")] == [0, 1]     # this run's alone
    assert [json.loads(line)["step"] for line in open(folder / "metrics.jsonl")] == [1]


@pytest.mark.parametrize("names, holds_run", [
    (["metrics.jsonl", "eval.jsonl", "completions.jsonl", "tensorboard", "checkpoint-2.tmp"], False),
    (["metrics.jsonl", "checkpoint-2"], True), (["metrics.jsonl", "checkpoint-2.old"], True),
    (["metrics.jsonl", "model"], True), (["curves.png"], True)])
def test_only_what_a_saved_run_leaves_holds_the_folder(tmp_path, names, holds_run):
    """A checkpoint, the export or the final curves (all written after a save) keep a folder from a new run; the
    files a run writes before its first checkpoint do not, and are what the new run replaces."""
    from grpo_fast.train.run.record import check_output_dir

    for name in names:
        (tmp_path / name).mkdir() if "." not in name or name.startswith("checkpoint-") else (tmp_path / name).touch()
    if holds_run:
        with pytest.raises(ValueError, match="already holds a run"):
            check_output_dir(str(tmp_path), resume=False, overwrite=False)
        assert check_output_dir(str(tmp_path), resume=True, overwrite=False) == []
    else:
        assert check_output_dir(str(tmp_path), resume=False, overwrite=False) == sorted(names)


def test_output_dir_that_is_a_file_or_read_only_is_refused_before_anything(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        run(tmp_path, name="file")
    locked = tmp_path / "locked"
    locked.mkdir()
    real_access = os.access

    def access(path, mode):        # a read-only folder as any user sees it (root writes through chmod 500)
        return False if str(path) == str(locked) else real_access(path, mode)

    monkeypatch.setattr(os, "access", access)
    with pytest.raises(ValueError, match="cannot be written .*locked' is read-only"):
        run(tmp_path, name="locked/run")
    assert os.listdir(locked) == []


def test_resume_without_a_checkpoint_is_refused(tmp_path):
    with pytest.raises(ValueError, match="--resume: no checkpoint in"):
        run(tmp_path, resume=True)


def test_resume_tolerates_a_torn_metrics_line_and_trims_completions(tmp_path):
    run(tmp_path, max_steps=2, save_every=2, log_completions=1)
    folder = tmp_path / "run"
    with open(folder / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "reward": 0.')                    # a write cut short by a full disk
    with open(folder / "completions.jsonl", "a") as f:
        f.write(json.dumps({"step": 3, "prompt": "p", "completion": "c", "reward": 0.0}) + "\n")
    history = run(tmp_path, max_steps=3, save_every=2, log_completions=1, resume=True)
    assert [r["step"] for r in history] == [3]
    assert [json.loads(line)["step"] for line in open(folder / "metrics.jsonl")] == [1, 2, 3]
    assert [json.loads(line)["step"] for line in open(folder / "completions.jsonl")] == [1, 2, 3]


def test_resume_refuses_a_changed_model_or_data_and_applies_other_keys(tmp_path, monkeypatch):
    run(tmp_path, max_steps=2, save_every=2)
    for key, value in (("seed", 1), ("num_prompts", 1000), ("task", "gsm8k")):
        with pytest.raises(ValueError, match=f"--resume cannot change .*{key} "):
            run(tmp_path, max_steps=3, resume=True, **{key: value})
    seen = {}
    original = update.policy_update

    def spy(policy, optimizer, *args, **kwargs):
        seen["lr"], seen["weight_decay"] = optimizer.param_groups[0]["initial_lr"], optimizer.param_groups[0][
            "weight_decay"]
        return original(policy, optimizer, *args, **kwargs)

    monkeypatch.setattr(update, "policy_update", spy)
    logged = []
    helpers.CALLS.update(n=0, interrupt_at=None)
    T.train(flat_config(**{**FAST, "max_steps": 3, "learning_rate": 2.5e-4, "weight_decay": 0.1},
                        output_dir=str(tmp_path / "run")), resume=True, log=logged.append)
    assert seen == {"lr": 2.5e-4, "weight_decay": 0.1}
    assert any("learning_rate 0.0005 -> 0.00025" in line for line in logged), logged


def test_the_checkpoint_keeps_the_tokenizer_the_weights_were_trained_with(tmp_path):
    run(tmp_path, max_steps=1)
    saved = checkpoint.load_tokenizer(str(tmp_path / "run" / "checkpoint-1"))
    assert saved is not None and saved.encode("7+8=15") and len(saved) > 259


def test_the_logged_learning_rate_is_the_one_the_step_used(tmp_path):
    history = run(tmp_path, max_steps=2, warmup_steps=5, learning_rate=1e-3)
    assert history[0]["lr"] == pytest.approx(1e-3 * lr_factor(0, flat_config(warmup_steps=5).optimization, 10))


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert cli(["train", "--model", str(tmp_path / "missing"), "--output-dir", str(tmp_path / "a")]) == 2
    assert ("model must be 'tiny', 'smollm2-135m-instruct' or a local Hugging Face model folder"
            in capsys.readouterr().err)
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": "1+1=", "solution": "2"}\n{"prompt": "\xff", "solution": "1"}\n')
    assert cli(["train", "--task", str(bad), "--output-dir", str(tmp_path / "b")]) == 2
    assert "bad.jsonl: not UTF-8 text (invalid start byte at byte 48, line 2)" in capsys.readouterr().err
    bad.write_text('{"prompt": ["1+1="], "solution": "2"}\n')
    assert cli(["train", "--task", str(bad), "--output-dir", str(tmp_path / "c")]) == 2
    assert "bad.jsonl: row 0 (line 1), column 'prompt' (prompt_column): message 0 is not a" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "abc")            # nothing written


def test_an_interrupt_before_the_first_step_says_nothing_was_saved(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "supervised_warm_start", interrupted)
    assert cli(["train", "--output-dir", str(tmp_path / "run")]) == 130
    assert "nothing was saved" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
def test_cuda_without_cuda_is_one_line_before_anything(tmp_path, capsys):
    assert cli(["train", "--device", "cuda", "--output-dir", str(tmp_path / "run")]) == 2
    assert "grpo-fast train: device 'cuda' was asked for but torch sees no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def test_train_help_lists_every_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli(["train", "--help"])
    out = capsys.readouterr().out
    for field in KEYS.values():
        assert f"  {field.name}: " in out, field.name
    assert "max_grad_norm: float = 1.0" in out


@pytest.mark.parametrize("damage", ["empty", "truncated", "missing"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, damage):
    run(tmp_path, max_steps=2, save_every=2)
    path = tmp_path / "run" / "checkpoint-2" / "state.pt"
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(b"" if damage == "empty" else data[:len(data) // 2])
    capsys.readouterr()                                         # the first run's output
    assert cli(["train", "--output-dir", str(tmp_path / "run"), "--resume"]) == 2
    err = capsys.readouterr().err
    expected = f"checkpoint {path.parent} has no state.pt" if damage == "missing" else \
        f"checkpoint {path} cannot be read"
    assert expected in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("change", ["shuffled", "row added"])
def test_resume_refuses_a_dataset_file_that_changed(tmp_path, change):
    rows = [json.dumps({"prompt": f"{a}+{b}=", "solution": str(a + b)}) for a in range(6) for b in range(6)]
    data = tmp_path / "sums.jsonl"
    data.write_text("\n".join(rows) + "\n")
    run(tmp_path, task=str(data), max_steps=1, save_every=1, sft_steps=0)
    changed = rows[::-1] if change == "shuffled" else rows + [json.dumps({"prompt": "9+9=", "solution": "18"})]
    data.write_text("\n".join(changed) + "\n")
    with pytest.raises(ValueError, match=f"--resume: the data of '{data}' is not what the checkpoint trained on"):
        run(tmp_path, task=str(data), max_steps=2, save_every=1, sft_steps=0, resume=True)
    data.write_text("\n".join(rows) + "\n")                                 # the file as it was: resumes
    assert [r["step"] for r in run(tmp_path, task=str(data), max_steps=2, save_every=1, sft_steps=0,
                                   resume=True)] == [2]


def test_an_interrupt_while_the_engine_starts_leaves_the_folder_free(tmp_path, monkeypatch, capsys):
    from grpo_fast.train.run.record import run_contents

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(T, "start_rollouts", interrupted)
    assert cli(["train", "--output-dir", str(tmp_path / "run"), "--sft-steps", "0"]) == 130
    assert "nothing was saved" in capsys.readouterr().err
    assert run_contents(str(tmp_path / "run")) == []           # a new run may use the folder


def test_a_resumed_runs_summary_counts_the_whole_run(tmp_path, capsys):
    arguments = ["train", "--output-dir", str(tmp_path / "run"), "--sft-steps", "0", "--eval-every", "0",
                 "--group-size", "2", "--prompts-per-step", "2"]
    assert cli([*arguments, "--max-steps", "2"]) == 0
    capsys.readouterr()
    assert cli([*arguments, "--max-steps", "3", "--resume"]) == 0
    out = capsys.readouterr().out
    assert "done: 3 steps" in out
    # --eval-every 0 writes no eval.jsonl: the line lists what is there
    assert out.strip().endswith(f"{tmp_path / 'run'}/metrics.jsonl, curves.png, model/"), out


def test_non_finite_metrics_are_null_in_metrics_jsonl_and_read_back(tmp_path, capsys):
    """A step no reward could score has a NaN mean reward: metrics.jsonl holds null there, as JSON has no NaN
    (json.dumps wrote NaN, which strict readers such as jq and JavaScript refuse), and the summary line, curves.png
    and --resume read it back."""
    helpers.INF_AT.update(call=2, n=0)
    arguments = ["train", "--output-dir", str(tmp_path / "run"), "--sft-steps", "0", "--eval-every", "0",
                 "--group-size", "2", "--prompts-per-step", "2", "--rewards", "tests.helpers:unscorable_once_reward"]
    assert cli([*arguments, "--max-steps", "2"]) == 0
    assert "mean reward 0.000 (first tenth) -> nan (last tenth)" in capsys.readouterr().out

    def strict(constant):
        raise ValueError(f"{constant} is not JSON")

    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert rows[0]["reward"] == 0.0 and rows[1]["reward"] is None and rows[1]["skipped_samples"] == 4
    assert cli([*arguments, "--max-steps", "3", "--resume"]) == 0
    assert "done: 3 steps" in capsys.readouterr().out
    rows = [json.loads(line, parse_constant=strict) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [row["step"] for row in rows] == [1, 2, 3] and rows[1]["reward"] is None
    assert os.path.getsize(tmp_path / "run" / "curves.png") > 0


def test_a_deliberate_data_change_resumes_with_accept_changed_data_and_is_named(tmp_path):
    """A label fix is refused by --resume, names the key that accepts it, and with accept_changed_data resumes,
    saying what changed; other held-out problems stay refused with the key."""
    rows = [{"prompt": f"{a}+{b}=", "solution": str(a + b)} for a in range(6) for b in range(6)]
    data = tmp_path / "sums.jsonl"
    write = lambda rows: data.write_text("".join(json.dumps(row) + "\n" for row in rows))  # noqa: E731
    write(rows)
    run(tmp_path, task=str(data), max_steps=1, save_every=1, sft_steps=0)
    write([{**row, "solution": str(int(row["solution"]) + 1)} if row["prompt"] == "5+5=" else row for row in rows])
    with pytest.raises(ValueError, match="--accept-changed-data true"):
        run(tmp_path, task=str(data), max_steps=2, save_every=1, sft_steps=0, resume=True)
    logged = []
    history = T.train(flat_config(**{**FAST, "task": str(data), "max_steps": 2, "save_every": 1, "sft_steps": 0,
                                     "accept_changed_data": True}, output_dir=str(tmp_path / "run")),
                      resume=True, log=logged.append)
    assert [r["step"] for r in history] == [2]
    assert [line for line in logged if "changed since the checkpoint" in line and "accepted" in line], logged
    write(rows[:-6])                                       # fewer problems: other held-out ones
    with pytest.raises(ValueError, match="the held-out problems changed"):
        run(tmp_path, task=str(data), max_steps=3, save_every=1, sft_steps=0, resume=True, accept_changed_data=True)


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_last_good_one(tmp_path, monkeypatch, capsys):
    """state.pt written to /dev/full (every write: no space left on device) from step 2's checkpoint on: the CLI
    says so on one line, naming the step, the free space and the checkpoint kept, which resumes."""
    import builtins

    saves = []

    def open_on_a_full_disk(path, mode="r", *args, **kwargs):
        if str(path).endswith("state.pt") and "w" in mode:
            saves.append(path)
            if len(saves) >= 2:
                return builtins.open("/dev/full", mode)
        return builtins.open(path, mode, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "open", open_on_a_full_disk, raising=False)
    folder = tmp_path / "run"
    assert cli(["train", "--output-dir", str(folder), "--sft-steps", "0", "--eval-every", "0", "--max-steps", "3",
                "--save-every", "1", "--group-size", "2", "--prompts-per-step", "2"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "checkpoint-2 could not be written" in err and "No space left on device" in err and "GiB free" in err
    assert f"the last good checkpoint, {folder / 'checkpoint-1'}, is kept" in err, err
    monkeypatch.undo()
    assert sorted(name for name in os.listdir(folder) if name.startswith("checkpoint")) == ["checkpoint-1"]
    assert [r["step"] for r in run(tmp_path, max_steps=2, sft_steps=0, resume=True, group_size=2,
                                   prompts_per_step=2)] == [2]


def test_a_lora_run_refuses_to_resume_on_a_changed_base(tmp_path):
    """A LoRA run's checkpoint holds its adapters alone: resumed on a base whose weights were since multiplied by
    1.5, they would be another policy (and the KL reference, the base, would move). The base's fingerprint is
    kept and compared: refused with the accept key named; accepted (and logged) with accept_changed_data; the
    base restored, it resumes."""
    from safetensors.torch import load_file, save_file

    run(tmp_path, name="base", max_steps=1, save_every=1, sft_steps=10)           # a model folder to start from
    base = tmp_path / "base" / "model"
    lora_run = dict(model=str(base), lora_rank=4, sft_steps=0, beta=0.04, save_every=1)
    run(tmp_path, name="lora", max_steps=1, **lora_run)
    weights = base / "model.safetensors"
    original = weights.read_bytes()
    save_file({name: tensor * 1.5 for name, tensor in load_file(weights).items()}, weights, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=rf"--resume: the base weights of '{base}' are not the ones the checkpoint's "
                                         r"LoRA adapters were trained on \(fingerprint \w+ -> \w+\); .* "
                                         r"--accept-changed-data true"):
        run(tmp_path, name="lora", resume=True, max_steps=2, **lora_run)
    logged = []
    history = T.train(flat_config(**{**FAST, **lora_run, "max_steps": 2, "accept_changed_data": True},
                                  output_dir=str(tmp_path / "lora")), resume=True, log=logged.append)
    assert [r["step"] for r in history] == [2]
    assert [line for line in logged if "base weights" in line and "accepted (accept_changed_data)" in line], logged
    weights.write_bytes(original)                           # the base as it was: the fingerprint matches again
    with pytest.raises(ValueError, match="are not the ones the checkpoint's LoRA adapters were trained on"):
        run(tmp_path, name="lora", resume=True, max_steps=3, **lora_run)      # checkpoint-2 was on the 1.5x base


def test_a_top_p_that_keeps_only_the_sampled_token_is_named_at_the_first_step(tmp_path):
    """top_p 1e-6 keeps the most likely token alone: the loss and its gradient are exactly 0 every step (as with
    top_k 1, which the config refuses); the first step says so. top_p 0.9 on the untrained model keeps more."""
    warnings = {}
    for top_p in (1e-6, 0.9):
        logged = []
        history = T.train(flat_config(**{**FAST, "max_steps": 1, "sft_steps": 0, "top_p": top_p},
                                      output_dir=str(tmp_path / str(top_p))), log=logged.append)
        warnings[top_p] = [line for line in logged if "kept set is that token alone" in line]
        if top_p == 1e-6:
            assert history[0]["loss"] == 0.0 and history[0]["grad_norm"] == 0.0
    assert len(warnings[1e-6]) == 1 and "top_p 1e-06, top_k 0" in warnings[1e-6][0] and not warnings[0.9], warnings


def test_a_resume_with_nothing_left_to_train_says_so(tmp_path):
    """--resume on a finished run, or with a max_steps below the checkpoint's step: no step runs, and the log says
    why (it was silent, rc 0); the checkpoint stays the one it was."""
    run(tmp_path, max_steps=2, save_every=2)
    for max_steps in (2, 1):
        logged = []
        history = T.train(flat_config(**{**FAST, "max_steps": max_steps, "save_every": 2},
                                      output_dir=str(tmp_path / "run")), resume=True, log=logged.append)
        assert history == []
        assert [line for line in logged if line.startswith(
            f"nothing left to train: {tmp_path / 'run' / 'checkpoint-2'} is at step 2 and max_steps is {max_steps} "
            "(raise --max-steps to train further)")], logged
        assert not [line for line in logged if line.startswith("resumed from")], logged   # not both stories
        assert checkpoint.latest_checkpoint(str(tmp_path / "run")) == str(tmp_path / "run" / "checkpoint-2")


def test_without_a_terminal_each_tenth_of_the_run_is_one_plain_line(tmp_path, monkeypatch):
    """Under nohup, a batch scheduler or CI the bar disables itself; a plain line with its fields comes every tenth
    of the run (20 steps: every 2), or every 60 s when a tenth takes longer (a clock that jumps 61 s a step: every
    step), and at the last step."""
    from grpo_fast.train.run.progress import StepLines

    logged = []
    T.train(flat_config(**{**FAST, "max_steps": 20, "save_every": 20, "beta": 0.04, "sft_steps": 0, "group_size": 2,
                           "prompts_per_step": 2}, output_dir=str(tmp_path / "a")), log=logged.append)
    lines = [line for line in logged if line.startswith("step ") and "/20: reward " in line]
    assert [line.split(":")[0] for line in lines] == [f"step {n}/20" for n in range(2, 21, 2)], lines
    assert all(", loss " in line and ", tok_s " in line and ", kl " in line for line in lines), lines
    clock = iter(range(0, 10_000, 61))
    monkeypatch.setattr("grpo_fast.train.run.progress.time.monotonic", lambda: next(clock))
    slow, printed = StepLines(range(0, 20), 20, [].append), []
    slow.log = printed.append
    for _ in slow:
        slow.set_postfix({"reward": "0.5"})
    assert printed == [f"step {n}/20: reward 0.5" for n in range(1, 21)]
