"""benchmarks/run_summary.py: a run's records as a results page, kept unless --overwrite."""

import json

import pytest

from grpo_fast.benchmarks import run_summary


def write_run(folder, rows):
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


def test_each_step_is_a_row_with_its_values(tmp_path):
    rows = [{"step": 1, "reward": 0.125, "clip_ratio/region_mean": 0.0, "loss": 0.95, "seconds": 77.4},
            {"step": 2, "reward": 0.5, "clip_ratio/region_mean": 0.0312, "loss": float("nan"), "seconds": 80.0,
             "frac_filtered_groups": 0.5, "sampling_rounds": 2}]
    run = write_run(tmp_path / "run", rows)
    out = tmp_path / "out"
    assert run_summary.main([str(run), "--name", "r", "--command", "grpo-fast train x.yaml", "--out", str(out)]) == 0
    page = (out / "r.md").read_text()
    assert "`grpo-fast train x.yaml`" in page
    lines = [line for line in page.splitlines() if line.startswith("| ")]
    header = [title.strip() for title in lines[0].strip("|").split("|")]
    assert header == ["step", "reward", "groups dropped", "rounds", "clip region", "loss", "seconds"]
    assert lines[1].split("|")[1:-1] == [" 1 ", " 0.125 ", " - ", " - ", " 0.0000 ", " 0.9500 ", " 77 "]
    assert lines[2].split("|")[1:-1] == [" 2 ", " 0.500 ", " 0.50 ", " 2 ", " 0.0312 ", " - ", " 80 "]
    assert [json.loads(line) for line in (out / "r_metrics.jsonl").read_text().splitlines()][1]["step"] == 2


def test_results_are_kept_and_a_folder_without_records_is_named(tmp_path, capsys):
    run = write_run(tmp_path / "run", [{"step": 1, "reward": 0.0}])
    out = tmp_path / "out"
    args = [str(run), "--name", "r", "--command", "c", "--out", str(out)]
    run_summary.main(args)
    (out / "r.md").write_text("kept")
    with pytest.raises(SystemExit):
        run_summary.main(args)
    assert (out / "r.md").read_text() == "kept" and "--overwrite" in capsys.readouterr().err
    run_summary.main(args + ["--overwrite"])
    assert "| 1 | 0.000 |" in (out / "r.md").read_text()
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        run_summary.main([str(tmp_path), "--name", "r", "--command", "c", "--out", str(out)])
