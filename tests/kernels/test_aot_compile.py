"""The Triton kernels compile ahead of time for sm_90 and sm_80 without a GPU, specialized as the JIT does at run
time, and the PTX shows what keeps them at memory bandwidth: 16-byte vector accesses (V a multiple of 16, or a
padded row stride), a pipelined stats loop (cp.async) without block-wide reductions, no spills; the SASS, where
cuobjdump is found (Triton ships it), how many instructions the stats loop issues per element. And what keeps them
right on a GPU, which the interpreter cannot show: every NaN-dropping max / min declared, no fma on a line that
must be exact."""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def reports():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = os.path.join(os.path.dirname(__file__), "aot_compile.py")
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    found = [json.loads(line) for line in done.stdout.splitlines()]
    print(f"\n{'kernel':<16} {'variant':<34} {'arch':<6} {'regs':>4} {'spill':>5} {'shared':>6} "
          f"{'loads':<12} {'stores':<8} {'cp.async':<8} {'bar/loop':>8} {'sass/elem':>9}")
    for r in found:
        print(f"{r['kernel']:<16} {r['variant']:<34} {r['arch']:<6} {r['registers']:>4} "
              f"{r['spill_stores'] + r['spill_loads']:>5} {r['shared_bytes']:>6} {str(r['load_bytes']):<12} "
              f"{str(r['store_bytes']):<8} {str(r['cp_async_bytes']):<8} {r['barriers_in_loops']:>8} "
              f"{r['sass_per_element'] if r['sass_per_element'] is None else round(r['sass_per_element'], 2):>9}")
    return found


def vectorizable(report) -> bool:
    """V a multiple of 16, or rows padded to 16 elements as grpo_fast.chunked allocates them."""
    return "V=151936" in report["variant"] or "/padded" in report["variant"]


def test_every_kernel_compiles_without_spills(reports):
    assert {r["kernel"] for r in reports} == {"logprob_forward", "policy_grad", "dlogits", "kept_logprob_forward",
                                              "kept_dlogits"}
    assert {r["arch"] for r in reports} == {"sm_90", "sm_80"}
    for r in reports:
        assert r["cubin_bytes"] > 0
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0, r
        assert r["shared_bytes"] <= r["shared_limit"], r
        assert r["registers"] <= 255, r


def test_specialization_is_the_jit_one(reports):
    for r in reports:
        if r["kernel"] == "policy_grad":
            continue
        assert "Logits" in r["divisible_by_16"], r            # 16-byte aligned allocations
        if vectorizable(r):
            assert "stride_row" in r["divisible_by_16"], r
        if "V=50257" in r["variant"]:
            assert "V" not in r["divisible_by_16"], r


def test_stats_loop_is_pipelined_without_block_reductions(reports):
    for r in reports:
        if r["kernel"] != "logprob_forward":
            continue
        # was 9 barriers and 24 shuffles per tile: a block-wide max and two sums in every iteration
        assert r["shuffles_in_loops"] == 0, r
        assert r["barriers_in_loops"] <= 2, r                 # the pipeline's stage handoff only
        if vectorizable(r):
            assert 16 in r["cp_async_bytes"], r               # next tiles prefetched as 16-byte copies


def test_dlogits_moves_16_byte_vectors(reports):
    for r in reports:
        if r["kernel"] == "dlogits" and vectorizable(r):
            assert 16 in r["load_bytes"] and r["store_bytes"] == [16], r


def test_kept_dlogits_clears_rows_in_16_byte_vectors(reports):
    # the row is written whole (zeros) and K gradients scattered: the clearing stores must be vectors
    for r in reports:
        if r["kernel"] == "kept_dlogits" and vectorizable(r):
            assert 16 in r["store_bytes"], r


def test_softcap_divides_once_per_element(reports):
    # The tanh needs one division per element; the scale by 1 / softcap is a multiplication (was a second one).
    for r in reports:
        if r["kernel"] == "dlogits" and "softcap=True" in r["variant"] and r["arch"] == "sm_90":
            twin = next(t for t in reports if t["kernel"] == "dlogits" and t["arch"] == "sm_90"
                        and t["variant"] == r["variant"].replace("softcap=True", "softcap=False"))
            assert r["div"] <= twin["ex2"], (r, twin)         # one exp (softmax) and one division per element


def test_stats_loop_issues_few_instructions_per_element(reports):
    """The bf16 stats loop at most 15 SASS instructions per element, 30 with a soft-cap (sm_90, rows 16-byte
    aligned; was 22.75 and 45): at 4.3 TB/s each of an H200's 132 SMs receives about 9 bf16 elements per clock and
    issues 128 thread instructions per clock, so past about 14 per element the loop, not memory, sets the pace."""
    rows = [r for r in reports if r["kernel"] == "logprob_forward" and r["arch"] == "sm_90" and vectorizable(r)
            and r["variant"].startswith("bf16")]
    if any(r["sass_per_element"] is None for r in rows):
        pytest.skip("no cuobjdump: Triton's bundled one is missing and none is on PATH")
    assert len(rows) == 4
    for r in rows:
        bound = 30 if "softcap=True" in r["variant"] else 15
        assert 0 < r["sass_per_element"] <= bound, r


def test_sum_pi_squared_adds_at_most_two_instructions_per_element(reports):
    """The optional running sum of p^2 (one multiply-add per element) is compiled only into the variant that asks
    for it, and costs that variant at most 2 SASS instructions per element over the plain stats loop (1.25 on
    sm_90 bf16: 15.3 against 14.1)."""
    plain = {(r["variant"], r["arch"]): r for r in reports if r["kernel"] == "logprob_forward"}
    with_sum = [r for r in reports if r["kernel"] == "logprob_forward" and r["variant"].startswith("sum_pi_squared/")]
    assert len(with_sum) == 8
    if any(r["sass_per_element"] is None for r in with_sum):
        pytest.skip("no cuobjdump: Triton's bundled one is missing and none is on PATH")
    for r in with_sum:
        base = plain[(r["variant"].removeprefix("sum_pi_squared/"), r["arch"])]
        assert base["sass_per_element"] < r["sass_per_element"] <= base["sass_per_element"] + 2, (r, base)


def source_line(location: str) -> str:
    """The text of "file.py:line" in grpo_fast's kernel folder. Never line 0: the audit reports the compiler's own
    code at the real line before it (aot_compile.instruction_sources), so that no instruction is checked against
    an empty line, which would declare nothing and hide an fma."""
    from grpo_fast import kernels

    name, number = location.split(":")
    assert int(number) > 0, f"{location}: an instruction without a real source line"
    with open(os.path.join(os.path.dirname(kernels.__file__), name)) as f:
        return f.read().splitlines()[int(number) - 1]


def test_every_nan_dropping_max_is_declared(reports):
    """A clamp must pass a NaN on (a NaN logit gives NaN out, as the torch backend does): max.f32 / min.f32 drop a
    NaN operand on a GPU (IEEE maxNum), while Triton's interpreter and torch propagate it. So every such instruction
    must come from a source line that says why dropping is harmless there (`# maxnum: ...`, e.g. the running max,
    whose NaN elements reach the sums anyway); every other clamp is nan_max / nan_min (max.NaN.f32). Before the
    NaN fix 8 lines failed this: the NEG_BIG floors of the stats and gradient passes, the soft-cap's cap, and 5
    of policy_grad's clamps."""
    for r in reports:
        undeclared = [line for line in r["maxnum_lines"] if "# maxnum:" not in source_line(line)]
        assert not undeclared, (r["kernel"], r["variant"], r["arch"], undeclared)
        if r["kernel"] in ("logprob_forward", "dlogits", "policy_grad") or "softcap=True" in r["variant"]:
            assert r["nan_max_min"] > 0, r                     # the clamps compiled to max.NaN / min.NaN


def test_no_contraction_on_lines_that_must_be_exact(reports):
    """A line marked `# exact: no fma` must compile without a fused multiply-add: `(x - m) * s` is 0 at x == m
    under any rounding, while `x * s - m * s` contracts to fma(x, s, -round(m * s)), whose residual reaches
    ulp(m * s) (8e12 at the NEG_BIG floor: exp2 = inf, lse NaN). The stats kernel's d had that form before."""
    marked = 0
    for r in reports:
        for line in r["fma_lines"]:
            assert "# exact: no fma" not in source_line(line), (r["kernel"], r["variant"], r["arch"], line)
    from grpo_fast import kernels

    for name in os.listdir(os.path.dirname(kernels.__file__)):
        if name.endswith(".py"):
            with open(os.path.join(os.path.dirname(kernels.__file__), name)) as f:
                marked += f.read().count("# exact: no fma")
    assert marked >= 3                 # the stats kernel's d and its two shifts
