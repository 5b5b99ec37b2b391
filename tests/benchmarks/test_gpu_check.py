"""gpu_check can fail: its correctness rows pass on the real chunk passes and fail on injected bugs.

The bugs go in through the backend the loss resolves (`grpo_fast.backends.resolve`: one instance per backend), so
the rows see exactly what the loss computes. Tiny shapes; the Triton backend runs under TRITON_INTERPRET=1 on CPU.
"""

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
    def stats_(buffer, targets, transform, need_entropy):
        state = real(buffer, targets, transform, need_entropy)
        state.logp = state.logp + delta
        return state
    return stats_


def failing(rows):
    return {row["case"] for row in rows if not row["ok"]}


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp32_rows_pass_on_the_real_passes_and_fail_on_injected_bugs(backend, monkeypatch):
    ops = ops_module(backend)
    rows = gpu_check.correctness(DEVICE, backend, [torch.float32], **SIZES, log=lambda line: None)
    assert not failing(rows), [gpu_check.row_line(r) for r in rows]
    assert len(rows) == len(gpu_check.CONFIGS) and all(r["chunks"].startswith("4 x ") for r in rows)

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


def test_gpu_check_exits_nonzero_on_a_wrong_kernel_and_skips_rows_past_its_budget(tmp_path, monkeypatch):
    ops = ops_module("torch")
    monkeypatch.setattr(ops, "dlogits_", scale_dlogits(ops.dlogits_))
    status = gpu_check.main([str(tmp_path), "--device", "cpu", "--dtype", "float32", "--backend", "torch",
                             "--quick", "--budget", "0"])
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert status == 1 and not any(row["ok"] for row in result["checks"])
    assert result["summary"][0].startswith("SUMMARY: FAIL") and "FAIL" in result["summary"][4]
    assert result["passes"] == []
    assert all(r.get("error") == "skipped: time budget spent" for r in result["end_to_end"])
