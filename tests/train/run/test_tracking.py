"""The experiment trackers (grpo_fast.train.run.tracking): TensorBoard's events read back, wandb's offline run,
Trackio's database, and the config-time checks of `report_to`."""
import glob
import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from grpo_fast.train.run import tracking
from tests.helpers import ROOT

ROWS = [{"step": 3, "prompt": "What is 2+2?", "completion": "It is 4 | four\nDone.", "reward": 1.0},
        {"step": 3, "prompt": "What is 3*3?", "completion": "8", "reward": 0.0}]


def _train_record(step: int) -> dict:
    """A metrics.jsonl line as the loop logs it, with values every tracker must leave out."""
    return {"step": step, "loss": 0.5 * step, "reward": step / 10, "skipped_updates": 0, "entropy": float("nan"),
            "grad_norm": float("inf"), "note": "not a number", "stages": {"update": 1.0}}


def _events(output_dir: str):
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(os.path.join(output_dir, "tensorboard"))
    accumulator.Reload()
    return accumulator


def _scalars(accumulator, tag: str) -> list:
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def test_check_report_to_accepts_the_default_and_installed_trackers(monkeypatch):
    monkeypatch.setattr(tracking, "find_spec", lambda name: object())
    tracking.check_report_to([])
    tracking.check_report_to(list(tracking.TRACKERS))


@pytest.mark.parametrize("names, message", [
    (["tensorboard", "mlflow"], "report_to: unknown tracker 'mlflow'; the known ones are tensorboard, wandb, trackio"),
    (["wandb", "tensorboard", "wandb"], "report_to names 'wandb' twice"),
])
def test_check_report_to_refuses_unknown_and_repeated_names(monkeypatch, names, message):
    monkeypatch.setattr(tracking, "find_spec", lambda name: object())
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        tracking.check_report_to(names)


def test_check_report_to_names_the_package_that_is_missing(monkeypatch):
    looked_up = []
    monkeypatch.setattr(tracking, "find_spec", lambda name: looked_up.append(name) or None)
    with pytest.raises(ValueError) as error:
        tracking.check_report_to(["wandb"])
    assert looked_up == ["wandb"]
    assert "report_to" in str(error.value) and "`pip install wandb`" in str(error.value)
    assert "grpo-fast[wandb]" in str(error.value)


def test_tensorboard_gets_the_finite_scalars_and_the_completions(tmp_path):
    pytest.importorskip("tensorboard")
    output_dir = str(tmp_path / "run")
    trackers = tracking.Trackers(["tensorboard"], output_dir, {"lr": 1e-6})
    for step in (1, 2, 3):
        trackers.log(_train_record(step), step, prefix="train/")
    trackers.log({"step": 3, "accuracy": 0.25, "pass@4": 0.5, "problems": 8}, 3, prefix="eval/")
    trackers.log_completions(3, ROWS)
    trackers.close()
    trackers.log(_train_record(4), 4, prefix="train/")     # after close: ignored, not an error

    events = _events(output_dir)
    assert sorted(events.Tags()["scalars"]) == ["eval/accuracy", "eval/pass@4", "eval/problems", "train/loss",
                                                "train/reward", "train/skipped_updates"]
    assert _scalars(events, "train/loss") == [(1, 0.5), (2, 1.0), (3, 1.5)]
    assert _scalars(events, "train/reward") == [(s, pytest.approx(s / 10)) for s in (1, 2, 3)]
    assert _scalars(events, "eval/accuracy") == [(3, 0.25)]
    (text,) = events.Tensors("completions/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert text.step == 3
    assert "| reward | prompt | completion |" in table
    assert "| 1 | What is 2+2? | It is 4 \\| four<br>Done. |" in table and "| 0 | What is 3*3? | 8 |" in table


def test_a_resumed_tensorboard_run_drops_the_steps_after_the_checkpoint(tmp_path):
    """Steps 1..5 and an evaluation at 5, then a resume from the checkpoint of step 3 that redoes steps 4 and 5
    with other values: each step is read back once, with the new value, and the old evaluation at 5 is gone (its
    tag stays listed, with no events). Without purge_step EventAccumulator reads steps 1..5, 4, 5 and keeps the
    evaluation: the writer's "restart at step 4" event is what makes it drop the old steps."""
    pytest.importorskip("tensorboard")
    output_dir = str(tmp_path / "run")
    first = tracking.Trackers(["tensorboard"], output_dir, {})
    for step in range(1, 6):
        first.log({"loss": step}, step, prefix="train/")
    first.log({"accuracy": 0.5}, 5, prefix="eval/")
    first.close()
    resumed = tracking.Trackers(["tensorboard"], output_dir, {}, resumed_step=3)
    resumed.log({"loss": 40}, 4, prefix="train/")
    resumed.log({"loss": 50}, 5, prefix="train/")
    resumed.close()

    events = _events(output_dir)
    assert len(glob.glob(os.path.join(output_dir, "tensorboard", "events.out.tfevents.*"))) == 2
    assert _scalars(events, "train/loss") == [(1, 1), (2, 2), (3, 3), (4, 40), (5, 50)]
    assert _scalars(events, "eval/accuracy") == []


def test_nothing_is_written_off_the_main_process_or_without_trackers(tmp_path):
    for names, is_main in ((["tensorboard", "wandb", "trackio"], False), ([], True)):
        trackers = tracking.Trackers(names, str(tmp_path / "run"), {}, is_main=is_main, resumed_step=2)
        trackers.log(_train_record(3), 3, prefix="train/")
        trackers.log_completions(3, ROWS)
        trackers.close()
    assert not os.path.exists(tmp_path / "run")


def _wandb_history(run_file: str) -> list:
    """The history rows of a wandb run file (its LevelDB-style log of protobuf records: 32 KiB blocks, each
    chunk a 7-byte header of checksum, length and kind), as {key: value} with the step under "_step"."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B"
    block, position, pending, rows = 32768, 7, b"", []
    while position + 7 <= len(data):
        if block - position % block < 7:                 # too short for a header: the block's padding
            position += block - position % block
            continue
        length, kind = int.from_bytes(data[position + 4:position + 6], "little"), data[position + 6]
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):                                # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def _wandb_runs(output_dir: str, run_id: str, steps: set) -> list:
    """The history of each offline session of wandb run `run_id` in output_dir, once their steps are `steps`:
    finish() can return before wandb's service has written the run file out, so this waits up to 20 s for it."""
    # A session that starts within the same second as the one before it gets the folder name with "-1" appended
    pattern = os.path.join(output_dir, "wandb", "offline-run-*", f"run-{run_id}.wandb")
    deadline = time.monotonic() + 20
    while True:
        sessions = [_wandb_history(path) for path in sorted(glob.glob(pattern))]
        if {row["_step"] for rows in sessions for row in rows} == steps or time.monotonic() > deadline:
            return sessions
        time.sleep(0.1)


def test_wandb_keeps_an_offline_run_that_a_resume_continues(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_MODE", raising=False)
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):   # keep wandb out of the home folder
        monkeypatch.setenv(variable, str(tmp_path / variable.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    output_dir = str(tmp_path / "run")
    trackers = tracking.Trackers(["wandb"], output_dir, {"learning_rate": 1e-6})
    for step in (1, 2, 3):
        trackers.log(_train_record(step), step, prefix="train/")
    trackers.log({"accuracy": 0.25}, 3, prefix="eval/")
    trackers.log_completions(3, ROWS)
    trackers.close()
    run_id = open(os.path.join(output_dir, tracking.WANDB_ID_FILE)).read().strip()
    (history,) = _wandb_runs(output_dir, run_id, {1, 2, 3})
    assert [row["_step"] for row in history] == [1, 2, 3]
    assert [row["train/loss"] for row in history] == [0.5, 1.0, 1.5]
    assert history[-1]["eval/accuracy"] == 0.25 and history[-1]["completions/nrows"] == 2
    assert not any(key.endswith(("entropy", "grad_norm", "note", "step")) for row in history for key in row
                   if not key.startswith("_"))
    (table,) = glob.glob(os.path.join(output_dir, "wandb", "offline-run-*", "files", "media", "table",
                                      "completions_*.json"))
    assert json.load(open(table))["data"][0] == ["What is 2+2?", "It is 4 | four\nDone.", 1.0]

    resumed = tracking.Trackers(["wandb"], output_dir, {"learning_rate": 1e-6}, resumed_step=3)
    resumed.log(_train_record(4), 4, prefix="train/")
    resumed.close()
    assert open(os.path.join(output_dir, tracking.WANDB_ID_FILE)).read().strip() == run_id   # the same run
    sessions = _wandb_runs(output_dir, run_id, {1, 2, 3, 4})
    assert sorted([row["_step"] for row in rows] for rows in sessions) == [[1, 2, 3], [4]]


def test_trackio_records_the_scalars_and_the_completions(tmp_path):
    """In a child process: Trackio fixes its folder (TRACKIO_DIR) when imported."""
    pytest.importorskip("trackio")
    script = textwrap.dedent(f"""
        import json
        from grpo_fast.train.run import tracking
        from trackio.sqlite_storage import SQLiteStorage
        trackers = tracking.Trackers(["trackio"], {str(tmp_path / "run")!r}, {{"learning_rate": 1e-6}})
        trackers.log({{"step": 1, "loss": 0.5, "entropy": float("nan"), "note": "x"}}, 1, prefix="train/")
        trackers.log({{"accuracy": 0.25}}, 1, prefix="eval/")
        trackers.log_completions(1, {ROWS!r})
        trackers.close()
        print(json.dumps(SQLiteStorage.get_logs("grpo-fast", "run")))
    """)
    environment = dict(os.environ, TRACKIO_DIR=str(tmp_path / "trackio"))
    result = subprocess.run([sys.executable, "-c", script], env=environment, capture_output=True, text=True,
                            timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    logs = json.loads(result.stdout.strip().splitlines()[-1])
    values = {key: value for log in logs if log["step"] == 1 for key, value in log.items()
              if key not in ("step", "timestamp")}
    assert values["train/loss"] == 0.5 and values["eval/accuracy"] == 0.25
    assert not any(key.startswith("train/") and key != "train/loss" for key in values)
    assert [row["completion"] for row in values["completions"]["_value"]] == [row["completion"] for row in ROWS]


def test_a_training_run_reports_its_metrics_and_evaluations_to_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from grpo_fast.train.loop import train
    from tests.helpers import flat_config

    output_dir = str(tmp_path / "run")
    history = train(flat_config(sft_steps=5, max_steps=3, save_every=3, group_size=2, prompts_per_step=2,
                                eval_every=2, eval_prompts=3, eval_samples=2, log_completions=1,
                                report_to=["tensorboard"], output_dir=output_dir), log=lambda *_: None)
    accumulator = _events(output_dir)
    assert _scalars(accumulator, "train/reward") == [(r["step"], pytest.approx(r["reward"])) for r in history]
    evals = [json.loads(line) for line in open(os.path.join(output_dir, "eval.jsonl"))]
    assert _scalars(accumulator, "eval/accuracy") == [(r["step"], pytest.approx(r["accuracy"])) for r in evals]
    assert [r["step"] for r in evals] == [0, 2, 3]
    assert accumulator.Tags()["tensors"]          # the completions table at the checkpoint
