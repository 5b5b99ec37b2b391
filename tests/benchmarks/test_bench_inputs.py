"""`grpo-fast bench` and `grpo-fast demo` on bad input: refused before anything is measured, with exit status 2;
and bench's exit status when a measured row failed. Nothing here times a real workload."""

import pytest
import torch

from grpo_fast.benchmarks import demo, harness
from grpo_fast.benchmarks.implementations import IMPLEMENTATIONS, Implementation
from grpo_fast.cli import main


@pytest.fixture
def nothing_runs(monkeypatch):
    def refuse(*args, **kwargs):
        pytest.fail("bad input must be refused before anything runs")

    monkeypatch.setattr(demo, "run", refuse)
    monkeypatch.setattr(harness, "run", refuse)


def usage_error(capsys, argv) -> str:
    """The last stderr line of an argparse refusal (exit status 2)."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("option, value", [("--repeats", "0"), ("--repeats", "-1"), ("--tokens", "0"),
                                           ("--hidden", "-4"), ("--vocab", "0"), ("--vocab", "ten")])
def test_demo_refuses_non_positive_sizes_and_repeats(capsys, nothing_runs, option, value):
    assert usage_error(capsys, ["demo", "--tokens", "8", "--hidden", "4", "--vocab", "10", option, value]) == (
        f"grpo-fast demo: error: argument {option}: expected an integer >= 1, got {value!r}")


@pytest.mark.parametrize("text", ["0x0x0", "8x4x0", "8x-4x10", "8x4", "8x4x10x2", "axbxc", ""])
def test_bench_refuses_malformed_shapes(capsys, nothing_runs, text):
    assert usage_error(capsys, ["bench", "--device", "cpu", "--shapes", "8x4x10", text]) == (
        "grpo-fast bench: error: argument --shapes: a shape is NxHxV of positive integers (e.g. 4096x896x151936), "
        f"got {text!r}")
    with pytest.raises(ValueError, match="a shape is NxHxV of positive integers"):
        harness.Shape.parse(text)


@pytest.mark.parametrize("option, value, expected", [
    ("--repeats", "0", "expected an integer >= 1, got '0'"),
    ("--time-budget", "-1", "expected a number of seconds >= 0, got '-1'"),
    ("--time-budget", "nan", "expected a number of seconds >= 0, got 'nan'"),
])
def test_bench_refuses_bad_repeats_and_budget(capsys, nothing_runs, option, value, expected):
    assert usage_error(capsys, ["bench", "--device", "cpu", "--shapes", "8x4x10", option, value]) == (
        f"grpo-fast bench: error: argument {option}: {expected}")


def test_bench_refuses_an_output_folder_it_cannot_write(tmp_path, capsys, nothing_runs):
    taken = tmp_path / "results.txt"
    taken.write_text("not a folder")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "bench.json").mkdir()                 # a folder where the results file goes
    for out, problem in ((taken, f"File exists: {taken}"), (taken / "sub", f"Not a directory: {taken / 'sub'}"),
                         (tmp_path / "out", f"{tmp_path / 'out' / 'bench.json'} exists and is not a file")):
        assert main(["bench", "--device", "cpu", "--shapes", "8x4x10", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.err == (f"grpo-fast bench: --out must be a folder that can be created and written, got "
                                f"{str(out)!r}: {problem}\n"), captured.err
    assert harness.unwritable(str(tmp_path / "new" / "folder")) is None and (tmp_path / "new" / "folder").is_dir()


def test_bench_keeps_results_already_there_unless_told(tmp_path, capsys, nothing_runs):
    """Committed results are never replaced by default: a bench.json in --out stops the run before it measures,
    naming --overwrite."""
    (tmp_path / "bench.json").write_text("{}")
    assert main(["bench", "--device", "cpu", "--shapes", "8x4x10", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"grpo-fast bench: {tmp_path / 'bench.json'} exists: pass --overwrite to "
                                       "replace it, or another --out\n")
    assert (tmp_path / "bench.json").read_text() == "{}"


@pytest.fixture
def in_process(monkeypatch):
    # Rows measured in this process, at tiny shapes: no subprocess, well under a second each.
    monkeypatch.setattr(harness, "measure_in_subprocess",
                        lambda name, shape, *a, **k: harness.measure(name, shape, torch.float32, "cpu", 1))
    monkeypatch.setattr(harness, "plot", lambda *a, **k: [])


def test_bench_exits_non_zero_when_a_measured_row_failed(tmp_path, capsys, monkeypatch, in_process):
    def broken(batch):
        raise RuntimeError("shape mismatch")

    monkeypatch.setitem(IMPLEMENTATIONS, "broken", Implementation("broken", broken))
    argv = ["bench", "--device", "cpu", "--shapes", "32x8x50", "--repeats", "1", "--out", str(tmp_path), "--overwrite"]
    assert main([*argv, "--impls", "broken"]) == 1
    assert capsys.readouterr().err.splitlines()[-1] == (
        "grpo-fast bench: 1 of 2 rows failed: 32x8x50 broken: RuntimeError: shape mismatch")
    assert (tmp_path / "bench.json").exists()                  # the results are still written
    # a peer not installed here, or rows the time budget skipped, are not failures
    monkeypatch.setitem(IMPLEMENTATIONS, "absent", Implementation("absent", broken, requires=("no_such_module_xyz",)))
    assert main([*argv, "--impls", "absent"]) == 0
    assert main([*argv, "--impls", "broken", "--time-budget", "0"]) == 0
