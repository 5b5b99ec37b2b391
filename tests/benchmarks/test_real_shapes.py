"""benchmarks/real_shapes.py end to end on its --small model: every run succeeds, its losses are finite and bf16's
stay near fp32's, LoRA trains a fraction of the parameters, and each row sets its peak next to the planner's."""

import importlib.util
import json
import math

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from grpo_fast.benchmarks import real_shapes  # noqa: E402

# Every token's log p is about -ln(1024) = -6.9 on the small model, and bf16 keeps 8 significant bits (a relative
# step of 2^-8): one bf16 rounding of a value that size is ~0.03. The surrogate is a signed mean of such values,
# so errors mostly cancel; twice one rounding is a loose bound that a wrong update or a wrong dtype still breaks
# (two steps at lr 1e-5 move fp32's surrogate by ~0.02, a different rollout or model moves it by whole units).
BF16_TOLERANCE = 0.05


def test_small_runs_succeed_and_agree_with_fp32(tmp_path):
    # torchao compiles its optimizer step on first use (~10-20 s on 2 cores): its run alone is dropped without it
    runs = ["fp32", "bf16-adamw8bit", "lora16"]
    if importlib.util.find_spec("torchao") is None:
        runs.remove("bf16-adamw8bit")
    code = real_shapes.main(["--small", "--completion-length", "32", "--steps", "2", "--runs", *runs,
                             "--timeout", "300", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "real_shapes.json").read_text())
    rows = {row["run"]: row for row in result["rows"]}
    assert code == 0 and list(rows) == runs, [row.get("error") for row in result["rows"]]
    assert all("error" not in row for row in rows.values())

    fp32 = rows["fp32"]
    values = fp32["losses"] + [fp32["surrogate_before"], fp32["surrogate_after"]]
    assert len(fp32["losses"]) == 2 and all(math.isfinite(value) for value in values)
    assert fp32["surrogate_after"] < fp32["surrogate_before"]            # the updates followed the advantages
    for name in runs[1:]:                                                # bf16 weights (LoRA: a bf16 base)
        row = rows[name]
        for got, expected in zip(row["losses"] + [row["surrogate_before"], row["surrogate_after"]], values):
            assert abs(got - expected) <= BF16_TOLERANCE, (name, row)
        assert row["surrogate_after_minus_fp32"] == pytest.approx(row["surrogate_after"] - fp32["surrogate_after"])

    assert rows["lora16"]["trained_parameters"] < fp32["trained_parameters"] / 4
    for row in rows.values():
        assert row["peak_bytes"] > 0 and row["planned_bytes"] > 0
        assert math.isfinite(row["measured_over_planned"]) and row["measured_over_planned"] > 0
    table = (tmp_path / "real_shapes.md").read_text()
    assert all(f"| {name} |" in table for name in runs) and "failed" not in table
    assert (tmp_path / real_shapes.CONFIG_FILE).is_file()


def test_a_failed_run_is_a_row_and_exit_status_1(tmp_path, monkeypatch):
    monkeypatch.setattr(real_shapes, "measure", lambda args, run, path: {"error": "RuntimeError: boom"})
    code = real_shapes.main(["--small", "--runs", "fp32", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "real_shapes.json").read_text())["rows"]
    assert code == 1 and rows[0]["error"] == "RuntimeError: boom" and rows[0]["planned_bytes"] > 0
    assert "| fp32 | fp32 | adamw | failed: RuntimeError: boom |" in (tmp_path / "real_shapes.md").read_text()


@pytest.mark.parametrize("argv, message", [(["--steps", "0"], "--steps must be >= 1, got 0"),
                                           (["--group-size", "1"], "--group-size must be >= 2, got 1"),
                                           (["--runs", "fp32", "fp32"], "--runs must not repeat a run")])
def test_bad_arguments_are_named(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit):
        real_shapes.main(argv + ["--out", str(tmp_path)])
    assert message in capsys.readouterr().err
