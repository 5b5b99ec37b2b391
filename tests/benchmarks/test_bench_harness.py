"""The benchmark harness's own logic, timing nothing: rows, errors, FLOP passes, accuracy, output files."""

import json

import pytest
import torch

from grpo_fast.benchmarks import harness
from grpo_fast.benchmarks.implementations import IMPLEMENTATIONS, Implementation

SHAPE = harness.Shape(64, 16, 300)


def test_shape_parsing():
    assert harness.Shape.parse("4096x896x151936") == harness.Shape(4096, 896, 151936)
    with pytest.raises(ValueError, match="a shape is NxHxV"):
        harness.Shape.parse("4096x896")


def test_rows_get_the_floor_ratio_and_keep_errors():
    shapes = [harness.Shape(8, 4, 10), harness.Shape(16, 4, 10)]
    measurements = {
        (shapes[0], "floor"): {"time_s": 2.0, "peak_bytes": 10},
        (shapes[0], "grpo_fast"): {"time_s": 3.0, "peak_bytes": 5},
        (shapes[1], "grpo_fast"): {"time_s": 1.0, "peak_bytes": 5},       # no floor measured at this shape
        (shapes[1], "floor"): {"error": "out of memory: test"},
    }
    checks = {"grpo_fast": {"gemm_passes": 3.0, "loss_error": 1e-7, "grad_error": 2e-7}}
    rows = harness.assemble_rows(shapes, ["floor", "grpo_fast", "naive"], measurements, checks)
    assert [(r["shape"], r["impl"]) for r in rows] == [
        ("8x4x10", "floor"), ("8x4x10", "grpo_fast"), ("8x4x10", "naive"),
        ("16x4x10", "floor"), ("16x4x10", "grpo_fast"), ("16x4x10", "naive")]
    assert rows[1]["floor_ratio"] == 1.5 and rows[1]["gemm_passes"] == 3.0
    assert rows[2]["error"] == "not run"
    assert "floor_ratio" not in rows[4] and rows[3]["error"].startswith("out of memory")
    table = harness.markdown_table(rows)
    assert "| 8x4x10 | grpo_fast | 3000.0 | 1.50 | 0 | 3.0 | 1.0e-07 | 2.0e-07 |" in table
    assert "| 16x4x10 | floor | out of memory: test |" in table


@pytest.fixture
def failing_impls(monkeypatch):
    def out_of_memory(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 40.00 GiB")

    def broken(batch):
        raise RuntimeError("shape mismatch\nsecond line")

    monkeypatch.setitem(IMPLEMENTATIONS, "oom", Implementation("oom", out_of_memory))
    monkeypatch.setitem(IMPLEMENTATIONS, "broken", Implementation("broken", broken))


def test_out_of_memory_and_failures_are_row_results(failing_impls):
    assert harness.measure("oom", SHAPE, torch.float32, "cpu", 1) == {
        "error": "out of memory: CUDA out of memory. Tried to allocate 40.00 GiB"}
    assert harness.measure("broken", SHAPE, torch.float32, "cpu", 1) == {"error": "RuntimeError: shape mismatch"}


def test_unavailable_peer_is_reported_not_raised(monkeypatch):
    monkeypatch.setitem(IMPLEMENTATIONS, "absent", Implementation("absent", lambda b: None,
                                                                  requires=("no_such_module_xyz",)))
    assert IMPLEMENTATIONS["absent"].unavailable("cpu") == "no_such_module_xyz not installed"
    assert IMPLEMENTATIONS["grpo_fast[triton]"].unavailable("cpu") == "not for cpu"


def test_check_counts_gemm_passes_and_errors():
    floor = harness.check("floor", torch.float32, "cpu")
    assert floor["gemm_passes"] == 3.0 and floor["loss_error"] is None
    for name, passes in [("grpo_fast", 3.0), ("grpo_fast_kept512", 3.0), ("grpo_fast_two_phase", 4.0), ("naive", 3.0)]:
        result = harness.check(name, torch.float32, "cpu")
        assert result["gemm_passes"] == passes, name
        assert result["loss_error"] < 1e-5 and result["grad_error"] < 1e-5, (name, result)


@pytest.mark.parametrize("name", ["trl", "liger"])
def test_peers_compute_the_same_loss(name):
    """TRL's and Liger's rows compute the loss the others do (so their times compare like with like)."""
    if IMPLEMENTATIONS[name].unavailable("cpu"):
        pytest.skip(IMPLEMENTATIONS[name].unavailable("cpu"))
    result = harness.check(name, torch.float32, "cpu")
    assert result["gemm_passes"] == 4.0
    assert result["loss_error"] < 1e-5 and result["grad_error"] < 1e-5, result


def test_run_writes_table_json_and_plots(tmp_path, failing_impls, monkeypatch):
    # Time nothing real: every implementation returns at once.
    monkeypatch.setattr(harness, "measure_in_subprocess",
                        lambda name, shape, *a, **k: harness.measure(name, shape, torch.float32, "cpu", 1))
    shapes = [harness.Shape(32, 8, 50), harness.Shape(64, 8, 50)]
    rows = harness.run(shapes, ["floor", "grpo_fast", "oom"], "float32", "cpu", 1, str(tmp_path),
                       log=lambda *_: None)
    assert len(rows) == 6 and rows[2]["error"].startswith("out of memory")
    saved = json.loads((tmp_path / "bench.json").read_text())
    assert saved["rows"] == json.loads(json.dumps(rows)) and saved["versions"]["torch"] == torch.__version__
    assert "| 64x8x50 | oom | out of memory" in (tmp_path / "bench.md").read_text()
    for name in ("time_vs_tokens.png", "memory_vs_tokens.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_time_budget_skips_remaining_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(harness, "measure_in_subprocess", lambda *a, **k: pytest.fail("should be skipped"))
    rows = harness.run([SHAPE], ["floor", "grpo_fast"], "float32", "cpu", 1, str(tmp_path), time_budget=0,
                       log=lambda *_: None)
    assert all(r["error"] == "skipped: time budget spent" for r in rows)


def test_kept_set_row_runs_over_its_kept_sets():
    """grpo_fast_kept512's batch holds kept sets (512 distinct ids per token, its target among them), and its loss
    is the kept-set loss: not the whole-vocabulary one of the same inputs."""
    from grpo_fast.benchmarks.implementations import kept_set

    shape = harness.Shape(64, 32, 2000)
    batch = harness.make_batch(shape, torch.float32, "cpu", kept=512)
    ids = batch.kept_ids.view(64, 512)
    assert torch.equal(ids[:, 0], batch.targets.reshape(-1))
    assert all(row.unique().numel() == 512 for row in ids)
    assert kept_set(batch.targets, 300, 512)[0].numel() == 64 * 300        # k capped at V
    kept_loss = IMPLEMENTATIONS["grpo_fast_kept512"].step(batch)[0]
    batch.kept_ids = batch.kept_offsets = None
    assert abs(float(kept_loss) - float(IMPLEMENTATIONS["grpo_fast"].step(batch)[0])) > 1e-3


def test_torch_linear_cross_entropy_row_computes_the_same_loss():
    """PyTorch's chunked linear_cross_entropy (torch >= 2.13) as a row: the same loss and gradients as the others,
    on its chunked path (a fallback to full logits would warn, which fails the row)."""
    impl = IMPLEMENTATIONS["torch_linear_ce"]
    if impl.unavailable("cpu"):
        pytest.skip(impl.unavailable("cpu"))
    result = harness.check("torch_linear_ce", torch.float32, "cpu")
    assert result["loss_error"] < 1e-5 and result["grad_error"] < 1e-5, result
    assert result["gemm_passes"] >= 3.0, result


def test_a_quick_run_writes_a_folder_of_its_own_beside_the_committed_results(tmp_path, monkeypatch):
    """`grpo-fast bench --quick` as the docs give it, in a clone whose benchmarks/results/cpu holds the committed
    results: it runs (no --overwrite needed) into a new folder under runs/ and leaves those results as they are; a
    sweep still refuses to replace them without --overwrite."""
    from grpo_fast import cli

    monkeypatch.chdir(tmp_path)
    committed = tmp_path / "benchmarks" / "results" / "cpu" / "bench.json"
    committed.parent.mkdir(parents=True)
    committed.write_text("committed")
    written = []

    def fake_run(shapes, names, dtype_name, device, repeats, out_dir, *args, **kwargs):
        written.append(out_dir)
        return [{"impl": "floor", "time_s": 1.0}]

    monkeypatch.setattr(harness, "run", fake_run)
    assert cli.main(["bench", "--quick", "--device", "cpu"]) == 0
    assert written[0].startswith("runs/bench-quick-") and (tmp_path / written[0]).is_dir(), written
    assert committed.read_text() == "committed"
    assert cli.main(["bench", "--device", "cpu"]) == 2 and len(written) == 1
    assert harness.default_out("cpu", quick=False) == "benchmarks/results/cpu"
    # a new folder per run: one made a second later is another
    assert harness.default_out("cpu", True, now=0.0) != harness.default_out("cpu", True, now=1.0)
