"""gpu_check can fail: its correctness rows pass on the real chunk passes and fail on injected bugs.

The bugs go in through the backend the loss resolves (`grpo_fast.backends.resolve`: one instance per backend), so
the rows see exactly what the loss computes. Tiny shapes; the Triton backend runs under TRITON_INTERPRET=1 on CPU.
"""

import dataclasses
import json

import pytest
import torch

from grpo_fast import backends
from grpo_fast.benchmarks import gpu_check
from tests.helpers import BACKENDS, DEVICE

SIZES = dict(vocabs=(700,), sequences=2, length=40, hidden_size=32)     # 72 tokens in 4 chunks, V not 16-aligned
ENTROPY_CASES = {"grpo+delta+entropy", "token_logprobs"}


def ops_module(backend):
    return backends.resolve(backend, torch.device(DEVICE))


def flip_entropy_gradient(real):
    def dlogits_(buffer, state, targets, g_logp, g_entropy, transform):
        real(buffer, state, targets, g_logp, None if g_entropy is None else -g_entropy, transform)
    return dlogits_


def scale_dlogits(real, factor=1.01):
    def dlogits_(buffer, state, targets, g_logp, g_entropy, transform):
        real(buffer, state, targets, g_logp, g_entropy, transform)
        buffer.mul_(factor)
    return dlogits_


def shift_logp(real, delta=1e-3):
    def stats_(buffer, targets, transform, need_entropy, kept=None):
        state = real(buffer, targets, transform, need_entropy, kept=kept)
        state.logp = state.logp + delta
        return state
    return stats_


def chunks_of(row) -> int:
    """The number of chunks of a correctness row's "chunks", e.g. 4 of "4 x 229 rows, last 226"."""
    return int(row["chunks"].split(" x ")[0])


def failing(rows):
    return {row["case"] for row in rows if not row["ok"]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_rows_pass_on_the_real_passes_and_fail_on_injected_bugs(backend, monkeypatch):
    ops = ops_module(backend)
    rows = gpu_check.correctness(DEVICE, backend, [torch.float32], **SIZES, log=lambda line: None)
    assert not failing(rows), [gpu_check.row_line(r) for r in rows]
    assert len(rows) == len(gpu_check.CONFIGS) and all(chunks_of(r) >= 4 for r in rows)

    with monkeypatch.context() as patch:          # the sign of the entropy term: only the cases that use it
        patch.setattr(ops, "dlogits_", flip_entropy_gradient(ops.dlogits_))
        rows = gpu_check.correctness(DEVICE, backend, [torch.float32], **SIZES, log=lambda line: None)
    assert failing(rows) == ENTROPY_CASES
    grpo = next(r for r in rows if r["case"] == "grpo+delta+entropy")["errors"]
    assert grpo["dhidden"]["error"] > 100 * gpu_check.FP32_TOL and grpo["loss"]["error"] < gpu_check.FP32_TOL

    with monkeypatch.context() as patch:          # every gradient 1% off
        patch.setattr(ops, "dlogits_", scale_dlogits(ops.dlogits_))
        rows = gpu_check.correctness(DEVICE, backend, [torch.float32], **SIZES, log=lambda line: None)
    assert failing(rows) == set(gpu_check.CONFIGS)

    with monkeypatch.context() as patch:          # log-probs 1e-3 off: the loss values (and logp) show it
        patch.setattr(ops, "stats_", shift_logp(ops.stats_))
        rows = gpu_check.correctness(DEVICE, backend, [torch.float32], **SIZES, log=lambda line: None)
    assert failing(rows) == set(gpu_check.CONFIGS)


def test_each_row_records_the_chunks_the_loop_ran_the_last_one_short(monkeypatch):
    """A correctness row's "chunks" is what the chunk loop ran (its balanced rows, seen here as the buffers the
    stats pass gets), and its last chunk is a partial one."""
    ops = ops_module("torch")
    buffers = []

    def recording_stats(real):
        def stats_(buffer, *args, **kwargs):
            buffers.append(buffer.shape[0])
            return real(buffer, *args, **kwargs)
        return stats_

    monkeypatch.setattr(ops, "stats_", recording_stats(ops.stats_))
    for case in ("dapo+kl", "token_logprobs"):
        buffers.clear()
        row, = gpu_check.correctness(DEVICE, "torch", [torch.float32], **SIZES, cases=(case,), log=lambda line: None)
        # one sweep: equal chunks up to the first short one (token_logprobs sweeps again in its backward)
        rows = buffers[0]
        sweep = buffers[:next((i + 1 for i, b in enumerate(buffers) if b < rows), len(buffers))]
        assert buffers == sweep * (len(buffers) // len(sweep)), buffers
        assert row["chunks"] == f"{len(sweep)} x {rows} rows, last {sweep[-1]}", (row["chunks"], buffers)
        assert len(sweep) >= 4 and 0 < sweep[-1] < rows, buffers
    # 913 tokens at a budget of 304 rows run as 4 x 229, the last 226; 72 as 4 x 18 would have no short chunk: 5 x 15
    assert gpu_check.ragged_rows(913) == 229 and gpu_check.ragged_rows(72) == 15


def test_bf16_rows_pass_on_the_real_passes_and_fail_on_injected_bugs(monkeypatch):
    """The torch backend rounds at the same points as the kernels: logits and dlogits in bf16, fp32 in between."""
    ops = ops_module("torch")
    sizes = {**SIZES, "vocabs": (5000,)}
    run = lambda: gpu_check.correctness(DEVICE, "torch", [torch.bfloat16], **sizes, log=lambda line: None)  # noqa
    rows = run()
    assert not failing(rows), [gpu_check.row_line(r) for r in rows]
    # a correct loss has the same-dtype full-logits loss's norm-wise error, to rounding flips of single elements
    assert all(e["error"] <= 1.05 * e["naive"] + 1e-6 for r in rows for e in r["errors"].values())
    with monkeypatch.context() as patch:
        patch.setattr(ops, "dlogits_", flip_entropy_gradient(ops.dlogits_))
        assert failing(run()) == ENTROPY_CASES
    with monkeypatch.context() as patch:
        patch.setattr(ops, "dlogits_", scale_dlogits(ops.dlogits_, 1.02))
        assert failing(run()) == set(gpu_check.CONFIGS)


def test_gpu_check_script_on_cpu(tmp_path):
    """The whole script in its CPU smoke mode: every section, the summary last, exit status 0."""
    status = gpu_check.main([str(tmp_path), "--device", "cpu", "--dtype", "float32", "--backend", "torch",
                             "--quick", "--shapes", "128x32x1000", "--repeats", "1"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 0 and all(row["ok"] for row in result["checks"])
    assert len(result["checks"]) == 2 * len(gpu_check.CONFIGS)
    env = result["environment"]
    assert env["copy_gbs"] > 0 and env["gemm_tflops"] > 0 and env["weight_grad_path"]
    assert [p["pass"] for p in result["passes"]][:2] == ["GEMM 1 (logits)", "stats"] and len(result["passes"]) == 6
    rows = {row["impl"]: row for row in result["end_to_end"]}
    assert rows["floor"]["x_floor"] == 1.0 and rows["grpo_fast"]["time_s"] > 0 and "x_floor" in rows["naive"]
    summary = (tmp_path / "SUMMARY.md").read_text().splitlines()
    assert summary == result["summary"] and len(summary) <= gpu_check.SUMMARY_LINES
    assert summary[0].startswith("SUMMARY: PASS") and summary[-1].endswith(gpu_check.KERNEL_TESTS)
    # every fused row says how it was chunked and which d(weight) path it took, the forced one in 4+ chunks
    forced = rows[gpu_check.forced_chunks_name("grpo_fast")]
    assert rows["grpo_fast"]["chunks"] == 1 and rows["grpo_fast"]["dweight_path"] == "direct"
    assert forced["chunks"] >= gpu_check.FORCED_CHUNKS and forced["dweight_path"] == "fp32" and forced["time_s"] > 0
    default_line = next(line for line in summary if line.startswith("  grpo_fast "))
    forced_line = next(line for line in summary if line.startswith("  grpo_fast 4+ chunks "))
    assert "1 x 128 rows, d(weight) direct" in default_line, summary
    assert f"{forced['chunks']} x {forced['chunk_rows']} rows, d(weight) fp32" in forced_line, summary
    assert result["finished"] and result["phases_done"][0] == "environment"


CPU_RUN = ["--device", "cpu", "--dtype", "float32", "--backend", "torch", "--quick", "--repeats", "1"]


def test_gpu_check_exits_nonzero_on_a_wrong_kernel_and_skips_rows_past_its_budget(tmp_path, monkeypatch):
    """Past the budget, rows are skipped, but never the headline shape's end-to-end rows nor the correctness rows of
    the first vocabulary."""
    ops = ops_module("torch")
    monkeypatch.setattr(ops, "dlogits_", scale_dlogits(ops.dlogits_))
    status = gpu_check.main([str(tmp_path), *CPU_RUN, "--budget", "0", "--shapes", "128x32x1000", "64x32x1000"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 1 and not any(row["ok"] for row in result["checks"])
    assert result["summary"][0].startswith("SUMMARY: FAIL") and "FAIL" in result["summary"][4]
    assert result["passes"] == []
    headline = [r for r in result["end_to_end"] if r["shape"] == "128x32x1000"]
    others = [r for r in result["end_to_end"] if r["shape"] != "128x32x1000"]
    assert [r["impl"] for r in headline] == ["floor", "grpo_fast", "grpo_fast 4+ chunks", "naive", "trl", "liger"]
    assert all("time_s" in r for r in headline if r["impl"] in ("floor", "grpo_fast", "grpo_fast 4+ chunks"))
    assert others and all(r.get("error") == "skipped: time budget spent" for r in others)
    assert "  64x32x1000: floor skipped: time budget" in result["summary"][-2], result["summary"]
    first, rest = (gpu_check.VOCABS_QUICK[0],), gpu_check.VOCABS_QUICK[1:]
    assert all(r["ok"] is False for r in result["checks"] if r["vocab"] in first)
    assert all(r["ok"] is None and r["skipped"] for r in result["checks"] if r["vocab"] in rest)


def failing_step(batch):
    raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")


def test_a_failed_floor_row_still_gives_a_summary(tmp_path, monkeypatch):
    """The other rows have times but no ratio to the floor: the summary says so instead of failing."""
    monkeypatch.setitem(gpu_check.IMPLEMENTATIONS, "floor",
                        dataclasses.replace(gpu_check.IMPLEMENTATIONS["floor"], step=failing_step))
    gpu_check.main([str(tmp_path), *CPU_RUN, "--shapes", "128x32x1000"])
    summary = (tmp_path / "SUMMARY.md").read_text().splitlines()
    rows = {r["impl"]: r for r in json.loads((tmp_path / "gpu_check.json").read_text())["end_to_end"]}
    assert "CUBLAS_STATUS_EXECUTION_FAILED" in rows["floor"]["error"] and "x_floor" not in rows["grpo_fast"]
    line = next(line for line in summary if line.startswith("  grpo_fast "))
    assert "no floor" in line and "d(weight) direct" in line, line


def test_an_environment_error_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch):
    def no_device(device):
        raise RuntimeError("CUDA driver initialization failed")

    def probe_crashes(device, dtype, backend):
        raise RuntimeError("triton compilation failed")

    monkeypatch.setattr(gpu_check, "machine_name", no_device)
    monkeypatch.setattr(gpu_check, "weight_grad_probe", probe_crashes, raising=False)
    status = gpu_check.main([str(tmp_path), *CPU_RUN, "--budget", "0", "--shapes", "128x32x1000"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    errors = result["environment"]["errors"]
    assert status == 0 and len(errors) == 2 and "CUDA driver" in errors[0] and "triton" in errors[1], errors
    assert result["environment"]["gemm_tflops"] > 0 and result["checks"] and result["end_to_end"]
    assert any("environment: machine: RuntimeError" in line for line in result["summary"]), result["summary"]


@pytest.mark.parametrize("crash_in", ["check_case", "pass_times"])
def test_what_was_measured_before_a_crash_is_on_disk(tmp_path, monkeypatch, crash_in):
    """A phase that dies (an exception the phases do not catch, as a fatal error would) leaves the rows measured
    before it in both files: the environment and the headline rows first, then the correctness rows."""
    def crash(*args, **kwargs):
        raise KeyboardInterrupt(f"crash in {crash_in}")

    monkeypatch.setattr(gpu_check, crash_in, crash)
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main([str(tmp_path), *CPU_RUN, "--shapes", "128x32x1000"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    summary = (tmp_path / "SUMMARY.md").read_text().splitlines()
    assert not result["finished"] and result["environment"]["gemm_tflops"] > 0
    assert [r["impl"] for r in result["end_to_end"] if "time_s" in r][:3] == [
        "floor", "grpo_fast", "grpo_fast 4+ chunks"]
    assert summary == result["summary"] and summary[0].startswith("SUMMARY: INCOMPLETE")
    done = {"check_case": "headline end to end", "pass_times": "buffer > 2^31"}[crash_in]
    assert result["phases_done"][-1] == done and f"last phase done {done}" in summary[0]
    assert len(result["checks"]) == (0 if crash_in == "check_case" else 2 * len(gpu_check.CONFIGS))


def test_the_summary_of_a_run_that_measured_almost_nothing():
    """No environment, no floor at the headline, one fused row at a second shape: every line still renders."""
    e2e = [{"shape": "8x4x10", "impl": "floor", "error": "RuntimeError: boom"},
           {"shape": "8x4x10", "impl": "grpo_fast", "time_s": 0.5, "peak_bytes": None, "dweight_path": "direct",
            "chunks": 1, "chunk_rows": 8, "chunk_bytes": 2**20},
           {"shape": "16x4x10", "impl": "floor", "time_s": 0.1, "x_floor": 1.0},
           {"shape": "16x4x10", "impl": "grpo_fast", "time_s": 0.2, "x_floor": 2.0, "peak_bytes": None,
            "dweight_path": "fp32", "chunks": 2, "chunk_rows": 8, "chunk_bytes": 2**10}]
    lines = gpu_check.summary({}, [], [], e2e, unfinished="headline end to end")
    assert lines[0] == "SUMMARY: INCOMPLETE, 0/0 correctness rows ok (unfinished: last phase done headline end to end)"
    assert lines[1].startswith("gpu_check on ?") and "copy ? GB/s" in lines[2]
    assert "no floor" in lines[5] and "1 x 8 rows, d(weight) direct" in lines[5], lines
    assert lines[6] == "  16x4x10: floor 1.00x, grpo_fast 2.00x (2 chunks, fp32)", lines


# pytest -v output of a kernel test run in 2 xdist workers, interrupted at its time limit
XDIST_OUTPUT = """created: 2/2 workers
2 workers [5 items]

scheduling tests via LoadScheduling

tests/kernels/test_x.py::test_passes[torch]
[gw0] [ 20%] PASSED tests/kernels/test_x.py::test_passes[torch]
tests/kernels/test_x.py::test_fails
tests/kernels/test_x.py::test_hangs
[gw0] [ 40%] FAILED tests/kernels/test_x.py::test_fails
tests/kernels/test_x.py::test_skips
[gw0] [ 60%] SKIPPED tests/kernels/test_x.py::test_skips
[gw1] [ 80%] ERROR tests/kernels/test_x.py::test_passes[torch]

=================================== FAILURES ===================================
=========================== short test summary info ============================
FAILED tests/kernels/test_x.py::test_fails - assert 1 == 2
!!!!!!!!!!!!!!!!!!!!!!!!!!!!!! KeyboardInterrupt !!!!!!!!!!!!!!!!!!!!!!!!!!!!!!!
========================= 1 failed, 1 passed in 8.54s ==========================
"""


def test_kernel_test_outcomes_of_a_run_cut_short():
    """Counted from pytest -v's line per test (xdist's form here; the one-process form in test_gpu_window.py): an
    error at teardown makes a passed test failed, the test still running is named, the rest is unfinished."""
    assert gpu_check.kernel_test_outcomes(XDIST_OUTPUT) == (
        "5 tests: 0 passed, 2 failed, 1 skipped, 2 unfinished; failed: tests/kernels/test_x.py::test_passes[torch] "
        "tests/kernels/test_x.py::test_fails; running when cut: tests/kernels/test_x.py::test_hangs")
    plain = "collected 40 items / 30 deselected / 10 selected\n" + "".join(
        f"tests/t.py::test_{i} FAILED [ {i}%]\n" for i in range(7))
    assert gpu_check.kernel_test_outcomes(plain, named=2) == (
        "10 tests: 0 passed, 7 failed, 0 skipped, 3 unfinished; failed: tests/t.py::test_0 tests/t.py::test_1 and 5 "
        "more")
    assert gpu_check.kernel_test_outcomes("12345\n") == ""
