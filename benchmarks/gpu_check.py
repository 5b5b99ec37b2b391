"""One GPU, one command, about five minutes: the machine, whether the fused loss is right, and where its time goes.

python -m grpo_fast.benchmarks.gpu_check OUT_DIR [--wheels DIR] [--budget 280]
python -m grpo_fast.benchmarks.gpu_check OUT_DIR --device cpu --backend torch --quick     # CPU smoke run

The most valuable rows first, so that neither the budget nor a crash costs them: (1) the environment: GPU,
versions, measured copy bandwidth and GEMM TFLOP/s, the d(weight) GEMM path (each part guarded: an error there
is recorded and the run goes on); (2) forward + backward end to end at the headline shape against the 3-GEMM
floor: grpo_fast with its default chunks and forced to FORCED_CHUNKS+ chunks, beside the naive, TRL and Liger
implementations (wheels in --wheels are installed first, without dependencies); these rows always run, whatever
the budget; (3) correctness against the float64 reference on the same rounded inputs (every loss family, V in
VOCABS, 3+ chunks with a ragged last one, old log-probs near the clip band, strided targets), within
CORRECTNESS_SHARE of the time left, the first vocabulary of each dtype always; (4) on GPU one chunk buffer of
more than 2^31 elements, its rows padded; (5) the time of each pass of one chunk at the headline shape; (6) end to
end at the other shapes. Rows left when --budget is spent are skipped and say so.
OUT_DIR gets gpu_check.json (everything) and SUMMARY.md (the at most 30 lines printed last), both rewritten after
every phase and every end-to-end row, so that a crash or a timeout keeps what was measured. Exit status 1 when a
correctness row fails. The kernel tests run on the same GPU with KERNEL_TESTS (from a source checkout);
benchmarks/gpu_window.sh runs both in one command, the kernel tests first and in parallel.
"""

import argparse
import glob
import importlib
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from importlib.metadata import PackageNotFoundError, version

import torch

import grpo_fast as gf
from grpo_fast import backends, chunked, reference
from grpo_fast.benchmarks.harness import Shape, relative_error, shape_argument
from grpo_fast.benchmarks.implementations import IMPLEMENTATIONS, LOSS, Batch, grpo_fast_fused, kept_set
from grpo_fast.benchmarks.profiling import machine_name
from grpo_fast.kept import KeptSet
from grpo_fast.numerics import LogitTransform
from grpo_fast.options import Execution
from grpo_fast.variants import LossConfig, TokenTerms

CONFIGS = {
    "dapo+kl": dict(loss_type="dapo", beta=0.04),
    "grpo+delta+entropy": dict(loss_type="grpo", epsilon_high=0.28, delta=1.5, entropy_coef=0.01),
    "cispo/T0.7": dict(loss_type="cispo", epsilon_high=5.0, temperature=0.7),
    "sapo+softcap": dict(loss_type="sapo", logit_softcap=30.0),
    "luspo(seq)": dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04),
    "token_logprobs": dict(temperature=1.3, logit_softcap=30.0),    # log-probs and entropies, both differentiated
    "dapo+kl/kept512": dict(loss_type="dapo", beta=0.04),            # over kept sets (KEPT_CASES), top_k 512's
}
KEPT_CASES = {"dapo+kl/kept512": 512}     # the cases over kept sets: ids per token (kernels/kept_*.py)
VOCABS = (5000, 32768, 50257, 151936)
VOCABS_QUICK = (500, 3000)
FP32_TOL = 1e-5                                 # max error / max |reference|, every output
# Half precision: the full-logits loss in the same dtype rounds the same logits and dlogits at the same points, so
# a correct fused loss has its error up to rounding flips of single elements, which move a max-wise error by a
# whole ulp but a norm-wise one by nothing: norm-wise, correct passes sit at 1.00x the naive error, a sign flip of
# the entropy gradient at 1.6-2.3x (V >= 5000), dlogits x 1.01 at 1.3-3.9x, fp32 -> bf16 by truncation up to 1.5x.
# The fp32 rows (1e-5) are the sharp check of the math; these catch what only half precision does.
HALF_RATIO, HALF_FLOOR, HALF_CAP = 1.25, 1e-3, 2e-2
# Qwen2.5-7B's LM head (hidden 3584, 152064 rows: its tokenizer's 151,665 ids padded; the models up to 3B have
# 151936 rows), 16k completion tokens
HEADLINE = Shape(16384, 3584, 152064)
SHAPES = [HEADLINE, Shape(4096, 3584, 152064), Shape(65536, 3584, 152064),
          Shape(16384, 896, 151936),                              # Qwen2.5-0.5B's head
          Shape(16384, 2304, 256000)]                             # Gemma 2 2B's head
PEERS = ["naive", "trl", "liger"]
# The regression cases of the GPU-only bugs first: a window that runs out of time cuts the tail.
# Without -q: benchmarks/gpu_window.sh adds -v, whose line per test is the record of a phase cut short.
KERNEL_TESTS = ("python -m pytest tests/kernels/test_sure_tokens.py tests/kernels/test_gpu_numerics.py "
                "tests/kernels/test_kernels.py tests/loss/test_kept.py tests/loss/test_logprobs.py "
                "tests/loss/test_loss.py")
# pytest -v's line per finished test (`ID OUTCOME [ 5%]`, or `[gw0] [ 5%] OUTCOME ID` under pytest-xdist), the
# -rfE summary's `FAILED ID - why`, a started test's `ID` alone, and the number of tests collected
_OUTCOME = "PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS"
_TEST_LINES = (re.compile(rf"^(?P<id>\S+::\S+) (?P<outcome>{_OUTCOME})\b"),
               re.compile(rf"^\[gw\d+\] \[ *\d+%\] (?P<outcome>{_OUTCOME}) (?P<id>\S+::\S+)"),
               re.compile(r"^(?P<outcome>FAILED|ERROR) (?P<id>\S+::\S+)"))
_STARTED = re.compile(r"^(?P<id>[^\s\[]\S*::\S+)\s*$")
_COLLECTED = re.compile(r"collected (\d+) items?(?: / \d+ deselected)?(?: / (\d+) selected)?|\[(\d+) items?\]")
# Under compute-sanitizer's memcheck (benchmarks/gpu_window.sh, when time is left): the row layouts (padded,
# strided, V just below a tile) and the kept sets' gathers and scatters, where an index goes out of bounds first.
SANITIZER_TESTS = ("python -m pytest tests/kernels/test_gpu_numerics.py -q -k "
                   "'triton and (layouts or kept_sets or against_float64)'")
SUMMARY_LINES = 30
FORCED_CHUNKS = 4                  # the headline's multi-chunk row: what the fp32 d(weight) accumulator costs
CORRECTNESS_SHARE = 0.5            # of the time left when the correctness rows start
BIG_BUFFER = (43008, 50257)        # tokens x V of the > 2^31 buffer row: 43008 x 50272 padded = 2.16e9 elements
BIG_BUFFER_MIN_S = 45              # that check needs about this much (a fresh process, 4.3 GB of bf16 logits)


def kernel_test_outcomes(output: str, named=5) -> str:
    """One line of what a kernel test run did, from its pytest -v output however it ended (a run killed at its
    time limit prints no summary of its own): tests collected, passed, failed (errors included), skipped,
    unfinished, the first `named` failures and the tests running when it was cut. "" when the output holds no
    pytest run."""
    outcomes, started, total = {}, [], None
    for line in output.splitlines():
        found = _COLLECTED.search(line)
        if found and total is None:
            total = int(next(n for n in (found.group(2), found.group(1), found.group(3)) if n))
        for pattern in _TEST_LINES:
            found = pattern.match(line)
            if found:                                   # a failure wins over a pass (an error at teardown)
                if outcomes.get(found["id"]) not in ("FAILED", "ERROR"):
                    outcomes[found["id"]] = found["outcome"]
                break
        else:
            found = _STARTED.match(line)
            if found:
                started.append(found["id"])
    if total is None and not outcomes:
        return ""
    counts = {kind: sum(o in group for o in outcomes.values())
              for kind, group in (("passed", ("PASSED", "XPASS")), ("failed", ("FAILED", "ERROR")),
                                  ("skipped", ("SKIPPED", "XFAIL")))}
    total = max(total or 0, len(outcomes))
    line = f"{total} tests: " + ", ".join(f"{n} {kind}" for kind, n in counts.items())
    line += f", {total - len(outcomes)} unfinished"
    failed = [test for test, outcome in outcomes.items() if outcome in ("FAILED", "ERROR")]
    if failed:
        line += "; failed: " + " ".join(failed[:named]) + (f" and {len(failed) - named} more" if len(failed) > named
                                                            else "")
    running = list(dict.fromkeys(test for test in started if test not in outcomes))
    if running and total > len(outcomes):
        line += "; running when cut: " + " ".join(running[:named])
    return line


def install_wheels(folder, log=print) -> None:
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        return log(f"no wheels in {folder}")
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", *wheels],
                          capture_output=True, text=True)
    importlib.invalidate_caches()          # so that the availability checks below see what was just installed
    tail = done.stderr[-300:] if done.returncode else ""
    log(f"installed {len(wheels)} wheels: pip exit status {done.returncode} {tail}")


def median_seconds(fn, device, repeats, warmup=True) -> float:
    """Median time of fn() over `repeats` calls (CUDA events on GPU), after an untimed one."""
    if warmup:
        fn()
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def chunk_bytes_for(rows, vocab, dtype, ops) -> int:
    """The smallest chunk budget that gives `rows` tokens per chunk, whatever row padding the chunk loop adds."""
    budget = rows * vocab * ops.bytes_per_logit(dtype)
    while chunked.chunk_rows(vocab, dtype, budget, ops) < rows:
        budget += rows * ops.bytes_per_logit(dtype)
    return budget


def ragged_rows(tokens, least=3) -> int:
    """Tokens per chunk that split `tokens` into more than `least` chunks as the chunk loop sizes them
    (chunked.balanced_rows: equal chunks), the last one shorter than the others, so that a partial chunk is
    checked; where no such split exists (a handful of tokens), the nearest equal one."""
    start = max(4, (tokens - 1) // least)
    for limit in range(start, 3, -1):
        rows = chunked.balanced_rows(tokens, limit)
        if tokens % rows:
            return rows
    return chunked.balanced_rows(tokens, start)


def weight_grad_paths() -> str:
    """The d(weight) GEMM paths the chunked passes took since the last reset, e.g. "fp32-out-gemm"."""
    return "+".join(name for name, count in chunked.weight_grad_paths().items() if count) or "none"


def device_batch(shape: Shape, dtype, device, seed=0, sequences=8) -> Batch:
    """The benchmark inputs (those of harness.make_batch) drawn on the device itself: nothing crosses PCIe."""
    gen = torch.Generator(device=device).manual_seed(seed)
    seq = max(shape.tokens // sequences, 1)
    rows = max(shape.tokens // seq, 1)
    normal = lambda *size, dtype=torch.float32: torch.randn(*size, generator=gen, device=device, dtype=dtype)  # noqa
    uniform = -math.log(shape.vocab)
    return Batch(hidden=normal(rows, seq, shape.hidden, dtype=dtype).requires_grad_(),
                 weight=normal(shape.vocab, shape.hidden, dtype=dtype).mul_(2 / shape.hidden**0.5).requires_grad_(),
                 targets=torch.randint(0, shape.vocab, (rows, seq), generator=gen, device=device),
                 mask=torch.ones(rows, seq, dtype=torch.bool, device=device), advantages=normal(rows),
                 old_logps=uniform + 0.2 * normal(rows, seq), ref_logps=uniform + 0.2 * normal(rows, seq))


def package_versions() -> dict:
    """The installed versions of the packages the results depend on (None where one is missing)."""
    found = {}
    for package in ("torch", "triton", "transformers", "trl", "liger-kernel"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def ceilings(device, dtype, backend) -> dict:
    """The two ceilings the passes are measured against: device copy GB/s and a square GEMM's TFLOP/s."""
    cuda = device.startswith("cuda")
    source = torch.empty(2**28 if cuda else 2**22, device=device)               # 1 GiB on GPU
    target = torch.empty_like(source)
    copy_s = median_seconds(lambda: target.copy_(source), device, 10)
    m = 8192 if cuda else 512
    a, b, out = (torch.randn(m, m, device=device, dtype=dtype) for _ in range(3))
    gemm_s = median_seconds(lambda: torch.mm(a, b, out=out), device, 10)
    return {"copy_gbs": 2 * source.numel() * 4 / copy_s / 1e9, "gemm_size": m, "gemm_tflops": 2 * m**3 / gemm_s / 1e12}


def weight_grad_probe(device, dtype, backend) -> dict:
    """The d(weight) path of a loss in two chunks here (on GPU, the first launch of the backend's kernels)."""
    batch = device_batch(Shape(64, 64, 1000), dtype, device, seed=9)
    chunked.reset_weight_grad_paths()
    gf.grpo_loss(batch.hidden, batch.weight, batch.targets, batch.advantages, batch.mask, old_logps=batch.old_logps,
                 ref_logps=batch.ref_logps, config=LossConfig(**LOSS),
                 execution=Execution(chunk_bytes=chunk_bytes_for(32, 1000, dtype,
                                                                 backends.resolve(backend, torch.device(device))),
                                     backend=backend))
    return {"weight_grad_path": weight_grad_paths()}


def environment(device, dtype, backend) -> dict:
    """Machine, versions, the two ceilings (see `ceilings`) and the d(weight) path (see `weight_grad_probe`).
    Each part is guarded: one that raises leaves its keys out and its error in "errors", and the others run."""
    env = {"machine": None, "dtype": str(dtype).split(".")[-1], "versions": package_versions(), "errors": [],
           "commit": os.environ.get("GRPO_FAST_COMMIT") or "unknown (set GRPO_FAST_COMMIT)"}
    parts = (("machine", lambda *args: {"machine": machine_name(device)}), ("ceilings", ceilings),
             ("weight_grad_probe", weight_grad_probe))
    for name, part in parts:
        try:
            env.update(part(device, dtype, backend))
        except Exception as error:          # the GPU's first launches happen here: keep going, say what broke
            env["errors"].append(f"{name}: {type(error).__name__}: {str(error)[:160]}")
    return env


def header_lines(env) -> list:
    """Two lines: machine and versions, then the ceilings and the d(weight) path ('?' for what was not measured)."""
    ceiling = (f"copy {env['copy_gbs']:.0f} GB/s, {env['dtype']} GEMM {env['gemm_tflops']:.1f} TFLOP/s "
               f"({env['gemm_size']}^3)" if "gemm_tflops" in env else "copy ? GB/s, GEMM ? TFLOP/s")
    return [f"gpu_check on {env.get('machine') or '?'} at commit {str(env.get('commit', '?'))[:12]}: " +
            ", ".join(f"{k} {v or '-'}" for k, v in env.get("versions", {}).items()),
            f"ceilings: {ceiling}; d(weight) path of a multi-chunk loss: {env.get('weight_grad_path', '?')}"]


def correctness_inputs(sequences, length, hidden_size, vocab, dtype, device, seed, sample=True) -> dict:
    """Inputs drawn on the device: targets sampled from the model (uniform without `sample`), 10% of positions
    masked (target -100 there), targets passed as strided columns of one (B, T, 2) id tensor."""
    gen = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(sequences, length, hidden_size, generator=gen, device=device).to(dtype)
    weight = (torch.randn(vocab, hidden_size, generator=gen, device=device) * (2 / hidden_size**0.5)).to(dtype)
    ids = torch.randint(0, vocab, (sequences, length, 2), generator=gen, device=device)
    if sample:
        probs = torch.softmax(reference.logits(hidden.double(), weight.double()).view(-1, vocab), -1)
        ids[..., 1] = torch.multinomial(probs, 1, generator=gen).view(sequences, length)
    mask = torch.rand(sequences, length, generator=gen, device=device) > 0.1
    ids[..., 0] = torch.where(mask, ids[..., 1], -100)
    return dict(hidden=hidden, weight=weight, targets=ids[..., 0], sampled=ids[..., 1], mask=mask,
                advantages=0.5 + torch.randn(sequences, generator=gen, device=device),   # a loss far from 0
                noise=0.1 * torch.randn(2, sequences, length, generator=gen, device=device),
                cotangents=torch.randn(2, sequences, length, generator=gen, device=device))


def kept_keywords(name, inputs, vocab) -> dict:
    """kept_ids / kept_offsets for a case of KEPT_CASES (k ids per token around each sampled one), else none."""
    if name not in KEPT_CASES:
        return {}
    ids, offsets = kept_set(inputs["sampled"], vocab, KEPT_CASES[name])
    return {"kept_ids": ids, "kept_offsets": offsets}


TRANSFORM_OPTIONS = {"temperature": "temperature", "logit_scale": "scale", "logit_softcap": "softcap"}


def grpo_fast_options(options: dict, fused: dict, loss: bool) -> dict:
    """grpo_fast's option groups for a case's flat options (the full-logits reference's keywords: logit transform,
    kept_ids / kept_offsets and, with `loss`, the loss options) and `fused`'s chunk_bytes / backend."""
    transform = {TRANSFORM_OPTIONS[k]: v for k, v in options.items() if k in TRANSFORM_OPTIONS}
    if options.get("kept_ids") is not None:
        transform["kept"] = KeptSet(options["kept_ids"], options["kept_offsets"])
    grouped = {"transform": LogitTransform(**transform), "execution": Execution(**fused)}
    if loss:
        grouped["config"] = LossConfig(**{k: v for k, v in options.items()
                                          if k not in TRANSFORM_OPTIONS and k not in ("kept_ids", "kept_offsets")})
    return grouped


def case_outputs(name, inputs, hidden, weight, old=None, ref=None, fused=None) -> dict:
    """The outputs of one case and the gradients of hidden and weight: grpo_fast with `fused` options
    (chunk_bytes, backend), else the full-logits reference (float64 for float64 hidden and weight)."""
    options = CONFIGS[name] if name in CONFIGS else {}
    hidden, weight = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    if name in ("token_logprobs", "buffer > 2^31"):
        if fused:
            logp, entropy = gf.token_logprobs(hidden, weight, inputs["sampled"], return_entropy=True,
                                              **grpo_fast_options(options, fused, loss=False))
        else:
            logp, entropy = reference.token_logprobs(hidden, weight, inputs["sampled"], return_entropy=True,
                                                     **options)
        u, v = inputs["cotangents"]
        values, objective = {"logp": logp, "entropy": entropy}, (logp * u + entropy * v).sum()
    else:
        options = {**options, **kept_keywords(name, inputs, weight.shape[0])}
        tensors = (hidden, weight, inputs["targets"], inputs["advantages"], inputs["mask"])
        if fused:
            objective, _ = gf.grpo_loss(*tensors, old_logps=old, ref_logps=ref,
                                        **grpo_fast_options(options, fused, loss=True))
        else:
            objective, _ = reference.grpo_loss(*tensors, old_logps=old, ref_logps=ref,
                                               **grpo_fast_options(options, {}, loss=True))
        values = {"loss": objective}
    d_hidden, d_weight = torch.autograd.grad(objective, (hidden, weight))
    return {**{k: v.detach() for k, v in values.items()}, "dhidden": d_hidden, "dweight": d_weight}


def norm_error(actual, expected) -> float:
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def check_case(name, inputs, dtype, backend, ops) -> dict:
    """Errors of grpo_fast (forced to 3+ chunks, the last ragged) and of the same-dtype full-logits loss against
    float64 on the same rounded inputs; fp32 max-wise within FP32_TOL, half precision norm-wise (HALF_*)."""
    hidden, weight, vocab = inputs["hidden"], inputs["weight"], inputs["weight"].shape[0]
    transform = {k: v for k, v in CONFIGS[name].items() if k in ("temperature", "logit_softcap")}
    exact_logp = reference.token_logprobs(hidden.double(), weight.double(), inputs["sampled"], **transform,
                                          **kept_keywords(name, inputs, vocab))
    old, ref = ((exact_logp + noise).float() for noise in inputs["noise"])       # ratios near the clip band
    # the chunk loop's tokens: all of them for token_logprobs, the masked ones compacted for a loss
    looped = hidden if name == "token_logprobs" else hidden[inputs["mask"]]
    tokens = looped.numel() // looped.shape[-1]
    fused = dict(chunk_bytes=chunk_bytes_for(ragged_rows(tokens), vocab, dtype, ops), backend=backend)
    _, _, rows = chunked.chunk_plan(looped, weight, fused["chunk_bytes"], backend, ops)     # as the loop plans it
    chunks = -(-tokens // rows)
    ours = case_outputs(name, inputs, hidden, weight, old, ref, fused)
    naive = case_outputs(name, inputs, hidden, weight, old, ref)
    exact = case_outputs(name, inputs, hidden.double(), weight.double(), old, ref)
    metric = relative_error if dtype == torch.float32 else norm_error
    errors = {}
    for output, value in exact.items():
        error, naive_error = metric(ours[output], value), metric(naive[output], value)
        tol = FP32_TOL if dtype == torch.float32 else min(HALF_CAP, max(HALF_FLOOR, HALF_RATIO * naive_error))
        errors[output] = {"error": error, "naive": naive_error, "tol": tol}
    return {"case": name, "dtype": str(dtype).split(".")[-1], "vocab": vocab, "errors": errors,
            "metric": "max" if dtype == torch.float32 else "norm",
            "chunks": f"{chunks} x {rows} rows, last {tokens - (chunks - 1) * rows}",
            "ok": all(e["error"] <= e["tol"] for e in errors.values())}


def correctness(device, backend, dtypes, vocabs, sequences=8, length=128, hidden_size=256, cases=tuple(CONFIGS),
                log=print, deadline=None, rows=None) -> list:
    """One row per (V, dtype, case), see check_case, appended to `rows` (a new list by default) as each is done.
    fp32 GEMMs stay fp32: TF32 would test cuBLAS, not us. Triton's CPU interpreter rounds fp32 to bf16 toward
    zero (GPUs round to nearest): there, check fp32 only. Past `deadline` (time.monotonic()) the rows of every
    vocabulary but the first are skipped ("ok": None): each dtype keeps its sharp check."""
    torch.backends.cuda.matmul.allow_tf32 = False
    ops = backends.resolve(backend, torch.device(device))
    rows = [] if rows is None else rows
    for i, vocab in enumerate(vocabs):
        for dtype in dtypes:
            inputs = None
            for name in cases:
                row = {"case": name, "dtype": str(dtype).split(".")[-1], "vocab": vocab}
                if i > 0 and deadline is not None and time.monotonic() > deadline:
                    row.update(ok=None, skipped="time budget spent")
                else:
                    try:
                        inputs = inputs or correctness_inputs(sequences, length, hidden_size, vocab, dtype, device,
                                                              seed=vocab)
                        row = check_case(name, inputs, dtype, backend, ops)
                    except Exception as error:      # a crash is a failed row; the other rows still run
                        row.update(ok=False, error=f"{type(error).__name__}: {str(error)[:120]}")
                rows.append(row)
                log(row_line(row))
    return rows


def row_line(row) -> str:
    where = f"{row['dtype']:8} V={row['vocab']:<6} {row['case']:18}" if "vocab" in row else row["case"]
    if row.get("skipped"):
        return f"skip {where} {row['skipped']}"
    if "errors" not in row:
        return f"FAIL {where} {row['error']}"
    errors = " ".join(f"{k} {e['error']:.1e}/{e['tol']:.1e}" for k, e in row["errors"].items())
    return f"{'ok  ' if row['ok'] else 'FAIL'} {where} {row['metric']} error/tol: {errors} ({row['chunks']})"


def big_buffer(device, backend, tokens=BIG_BUFFER[0], hidden_size=256, vocab=BIG_BUFFER[1],
               dtype=torch.bfloat16) -> dict:
    """token_logprobs through one chunk buffer of more than 2^31 elements, its rows padded (V = 50257, not a
    multiple of 16, so the kernels read and write the padding columns at offsets past 2^31), against float64 in
    row slices."""
    inputs = correctness_inputs(1, tokens, hidden_size, vocab, dtype, device, seed=31, sample=False)
    ops = backends.resolve(backend, torch.device(device))
    fused = dict(chunk_bytes=chunk_bytes_for(tokens, vocab, dtype, ops), backend=backend)
    ours = case_outputs("buffer > 2^31", inputs, inputs["hidden"], inputs["weight"], fused=fused)
    parts = []
    for s in range(0, tokens, 2048):
        piece = {"sampled": inputs["sampled"][:, s:s + 2048], "cotangents": inputs["cotangents"][:, :, s:s + 2048]}
        parts.append(case_outputs("buffer > 2^31", piece, inputs["hidden"][:, s:s + 2048].double(),
                                  inputs["weight"].double()))
    exact = {k: torch.cat([p[k] for p in parts], 1) for k in ("logp", "entropy", "dhidden")}
    exact["dweight"] = sum(p["dweight"] for p in parts)
    errors = {k: {"error": norm_error(ours[k], exact[k]), "tol": HALF_CAP} for k in exact}
    width = chunked.padded_width(vocab)
    return {"case": "buffer > 2^31", "metric": "norm",
            "chunks": f"1 x {tokens} x {vocab} padded to {width} = {tokens * width:.2e}",
            "errors": errors, "ok": all(e["error"] <= e["tol"] for e in errors.values())}


def big_buffer_in_subprocess(device, backend, timeout) -> dict:
    """big_buffer in a fresh process: an out-of-bounds access there cannot take this process's CUDA context."""
    code = ("import json; from grpo_fast.benchmarks.gpu_check import big_buffer; "
            f"print(json.dumps(big_buffer({device!r}, {backend!r})))")
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"case": "buffer > 2^31", "ok": False, "error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"case": "buffer > 2^31", "ok": False, "error": (done.stderr.strip().splitlines() or ["?"])[-1][:160]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def pass_times(shape, dtype, device, backend, env, repeats=5) -> list:
    """Each pass of one chunk of `shape`, as large as the loss makes it here, run in the loss's order."""
    ops = backends.resolve(backend, torch.device(device))
    batch = device_batch(shape, dtype, device, seed=5, sequences=1)
    hidden, weight = batch.hidden.detach()[0], batch.weight.detach()
    rows = min(shape.tokens, chunked.chunk_rows(shape.vocab, dtype, chunked.default_chunk_bytes(hidden.device), ops))
    # the chunk loop's buffer, rows padded
    buffer = torch.empty(rows, chunked.padded_width(shape.vocab), dtype=dtype, device=device)[:, :shape.vocab]
    h, targets, d_hidden = hidden[:rows], batch.targets[0, :rows], torch.empty_like(hidden[:rows])
    terms = TokenTerms(LossConfig(**LOSS), advantages=batch.advantages.expand(rows).contiguous(),
                       weights=torch.full((rows,), 1 / shape.tokens, device=device),
                       old_logps=batch.old_logps[0, :rows], ref_logps=batch.ref_logps[0, :rows])
    transform, state = LogitTransform(), {}
    if rows >= shape.tokens:                                      # one chunk: its GEMM writes d(weight) directly
        gemm3 = lambda: chunked.WeightGrad(weight.shape, dtype, weight.device, True).add(buffer, h)  # noqa: E731
    else:                                                         # a later chunk: adds into the fp32 accumulator
        accumulator = chunked.WeightGrad(weight.shape, dtype, weight.device, False)
        accumulator.add(buffer, h)
        gemm3 = lambda: accumulator.add(buffer, h)  # noqa: E731
    flops, logit_bytes = 2 * rows * shape.hidden * shape.vocab, rows * shape.vocab * buffer.element_size()
    passes = [  # name, step, FLOPs (> 0) or bytes moved (< 0)
        ("GEMM 1 (logits)", lambda: torch.mm(h, weight.t(), out=buffer), flops),
        ("stats", lambda: state.update(s=ops.stats_(buffer, targets, transform, True)), -logit_bytes),
        ("policy_grad", lambda: state.update(g=ops.policy_grad(state["s"].logp, terms)), -rows * 4 * 8),
        ("dlogits", lambda: ops.dlogits_(buffer, state["s"], targets, state["g"], None, transform), -2 * logit_bytes),
        ("GEMM 2 (d hidden)", lambda: torch.mm(buffer, weight, out=d_hidden), flops),
        ("GEMM 3 (d weight)", gemm3, flops)]
    times = {name: [] for name, *_ in passes}
    for _ in range(repeats + 1):                   # the whole sequence again each time: GEMM 1 refills the buffer
        for name, step, _ in passes:
            times[name].append(median_seconds(step, device, 1, warmup=False))
    result = []
    for name, _, amount in passes:
        seconds = statistics.median(times[name][1:])
        rate = abs(amount) / seconds / (1e12 if amount > 0 else 1e9)
        ceiling = env.get("gemm_tflops" if amount > 0 else "copy_gbs")         # None when it was not measured
        result.append({"pass": name, "shape": shape.label, "chunk_rows": rows, "ms": seconds * 1e3, "rate": rate,
                       "unit": "TFLOP/s" if amount > 0 else "GB/s",
                       "share": rate / ceiling if ceiling else None})
    return result


def measure(step, batch, device, repeats, fused=False) -> dict:
    """Peak memory above the inputs (first step) and median time of the next `repeats` steps of one method; for
    a fused (grpo_fast) step also the d(weight) path it took."""
    cuda = device.startswith("cuda")
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() if cuda else 0
        chunked.reset_weight_grad_paths()
        step(batch)
        peak = torch.cuda.max_memory_allocated() - base if cuda else None
        paths = weight_grad_paths() if fused else None
        return {"time_s": median_seconds(lambda: step(batch), device, repeats, warmup=False), "peak_bytes": peak,
                "dweight_path": paths}
    except (torch.OutOfMemoryError, MemoryError) as error:
        return {"error": "out of memory: " + (str(error).splitlines() or [""])[0][:100]}
    except Exception as error:
        return {"error": f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0][:140]}


def forced_chunks_name(fused) -> str:
    return f"{fused} {FORCED_CHUNKS}+ chunks"


def chunking(batch, backend, chunk_bytes) -> dict:
    """How the fused loss chunks this batch: the budget (None: the default), tokens per chunk and chunks."""
    _, budget, rows = chunked.chunk_plan(batch.hidden, batch.weight, chunk_bytes, backend)
    tokens = int(batch.mask.sum())
    return {"chunk_bytes": budget, "chunk_rows": min(rows, tokens), "chunks": -(-tokens // rows)}


def forced_chunk_bytes(batch, backend, chunks=FORCED_CHUNKS) -> int:
    """A chunk budget that splits the batch's tokens into at least `chunks` chunks."""
    ops = backends.resolve(backend, batch.hidden.device)
    rows = max(1, int(batch.mask.sum()) // chunks)
    return rows * chunked.padded_width(ops.chunk_vocab(batch.weight.shape[0])) * ops.bytes_per_logit(batch.hidden.dtype)


def end_to_end(shapes, names, dtype, device, repeats, deadline, log=print, rows=None) -> list:
    """Forward + backward of every method on one batch per shape, made on the device; time as a ratio to the floor.
    A name `forced_chunks_name(fused)` is the fused method with a budget of FORCED_CHUNKS+ chunks. Rows go into
    `rows` (a new list by default) as each is measured; past `deadline` (None: never) they are skipped."""
    rows = [] if rows is None else rows
    forced = {forced_chunks_name(name): name for name in IMPLEMENTATIONS if name.startswith("grpo_fast")}
    for shape in shapes:
        batch, floor = None, None
        for name in names:
            row = {"shape": shape.label, "impl": name}
            impl = IMPLEMENTATIONS[forced.get(name, name)]
            fused = impl.name in ("grpo_fast", "grpo_fast[triton]")
            backend = "triton" if impl.name.endswith("[triton]") else "torch"
            reason = impl.unavailable(device)
            if reason or (deadline is not None and time.monotonic() > deadline):
                row["error"] = reason or "skipped: time budget spent"
            else:
                try:
                    batch = batch or device_batch(shape, dtype, device)
                    budget = forced_chunk_bytes(batch, backend) if name in forced else None
                    step = grpo_fast_fused(backend, budget) if name in forced else impl.step
                    if fused:
                        row.update(chunking(batch, backend, budget))
                    row.update(measure(step, batch, device, repeats, fused))
                except torch.OutOfMemoryError:
                    row["error"] = "out of memory making the inputs"
                except Exception as error:          # one broken method costs its row, not the run
                    row["error"] = f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0][:140]
            if name == "floor" and "time_s" in row:
                floor = row["time_s"]
                row["tflops"] = 6 * shape.tokens * shape.hidden * shape.vocab / floor / 1e12
            if floor and "time_s" in row:
                row["x_floor"] = row["time_s"] / floor
            rows.append(row)
            log(json.dumps(row))
        del batch
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def e2e_line(row) -> str:
    """One headline row: time, ratio to the floor, peak memory, and for fused rows the chunks and d(weight) path."""
    if "time_s" not in row:
        return f"  {row['impl']:24} {row.get('error', '?')[:80]}"
    parts = [f"{row['time_s'] * 1e3:9.1f} ms", f"{row['x_floor']:5.2f}x floor" if "x_floor" in row else "   no floor"]
    if row.get("peak_bytes") is not None:
        parts.append(f"{row['peak_bytes'] / 2**30:6.2f} GiB peak")
    line = f"  {row['impl']:24} " + " ".join(parts)
    if "tflops" in row:
        line += f", {row['tflops']:.0f} TFLOP/s"
    if "chunks" in row:
        line += f", {row['chunks']} x {row['chunk_rows']} rows, d(weight) {row.get('dweight_path') or '?'}"
    return line


def summary(env, checks, passes, e2e, notes=(), unfinished=None) -> list:
    """At most SUMMARY_LINES lines: the verdict first, then the headline rows, then where the time goes. A check
    with "ok" None was skipped; `unfinished` names the last phase done while the run is still going (or died)."""
    failed = [c for c in checks if c["ok"] is False]
    skipped = [c for c in checks if c["ok"] is None]
    verdict = "FAIL" if failed else "INCOMPLETE" if skipped or unfinished or not checks else "PASS"
    ran = len(checks) - len(skipped)
    lines = [f"SUMMARY: {verdict}, {ran - len(failed)}/{ran} correctness rows ok"
             + (f", {len(skipped)} skipped" if skipped else "")
             + (f" (unfinished: last phase done {unfinished})" if unfinished else ""), *header_lines(env)]
    for dtype in dict.fromkeys(c["dtype"] for c in checks if "dtype" in c):
        group = [c for c in checks if c.get("dtype") == dtype]
        done = [c for c in group if c["ok"] is not None]
        ratio, output, c = max(((e["error"] / e["tol"], k, c) for c in group for k, e in c.get("errors", {}).items()),
                               key=lambda worst: worst[0], default=(math.nan, "-", {"case": "-", "vocab": "-"}))
        lines.append(f"correctness {dtype} ({'max' if dtype == 'float32' else 'norm'}-wise): "
                     f"{sum(bool(c['ok']) for c in done)}/{len(done)} ok"
                     + (f" ({len(group) - len(done)} skipped)" if len(done) < len(group) else "")
                     + f", worst {output} at {ratio:.2f} of tol ({c['case']}, V={c['vocab']})")
    lines += [row_line(c)[:150] for c in failed if "vocab" in c][:4]
    lines += [f"... {len(failed) - 4} more failures in gpu_check.json"] if len(failed) > 4 else []
    lines += [row_line(c)[:150] for c in checks if "vocab" not in c]
    lines += [f"environment: {error}"[:150] for error in env.get("errors", [])] + [n[:150] for n in notes]
    for i, shape in enumerate(dict.fromkeys(r["shape"] for r in e2e)):
        rows = [r for r in e2e if r["shape"] == shape]
        if i == 0:
            lines.append(f"end to end, forward + backward, {shape}:")
            lines += [e2e_line(r) for r in rows]
            if passes:
                lines.append(f"passes of one chunk of {passes[0]['chunk_rows']} tokens of {passes[0]['shape']}:")
                lines += [f"  {p['pass']:18} {p['ms']:8.3f} ms {p['rate']:7.1f} {p['unit']:7} "
                          + (f"{p['share']:4.0%} of ceiling" if p["share"] is not None else "") for p in passes]
        else:
            lines.append(f"  {shape}: " + ", ".join(
                f"{r['impl']} " + (f"{r['x_floor']:.2f}x" if "x_floor" in r else
                                   f"{r['time_s'] * 1e3:.1f} ms" if "time_s" in r else r["error"][:24])
                + (f" ({r['chunks']} chunks, {r.get('dweight_path') or '?'})" if "chunks" in r and "time_s" in r
                   else "") for r in rows))
    if passes and not e2e:
        lines.append(f"passes of one chunk of {passes[0]['chunk_rows']} tokens of {passes[0]['shape']}: "
                     + ", ".join(f"{p['pass']} {p['ms']:.3f} ms" for p in passes))
    return lines[:SUMMARY_LINES - 1] + [f"kernel tests on this GPU (gpu_window.sh: in parallel): {KERNEL_TESTS}"]


class Report:
    """Everything measured so far. `write` rewrites OUT_DIR/gpu_check.json and SUMMARY.md (each replaced whole,
    never left half written), so that a crash or a timeout between two writes keeps all that came before."""

    def __init__(self, out_dir, command):
        self.out_dir, self.command = out_dir, command
        self.env, self.checks, self.passes, self.e2e, self.notes, self.phases = {}, [], [], [], [], []

    def write(self, phase=None, finished=False) -> list:
        """Record `phase` as done, write both files, return the summary lines."""
        if phase:
            self.phases.append(phase)
        lines = summary(self.env, self.checks, self.passes, self.e2e, self.notes,
                        None if finished else (self.phases[-1] if self.phases else "none"))
        record = {"command": self.command, "phases_done": self.phases, "finished": finished,
                  "environment": self.env, "checks": self.checks, "passes": self.passes, "end_to_end": self.e2e,
                  "notes": self.notes, "summary": lines}
        for name, text in (("gpu_check.json", json.dumps(record, indent=1)), ("SUMMARY.md", "\n".join(lines) + "\n")):
            path = os.path.join(self.out_dir, name)
            with open(path + ".tmp", "w") as f:
                f.write(text)
            os.replace(path + ".tmp", path)
        return lines


def main(argv=None) -> int:
    """Run every phase in order of value (see the module docstring); 1 when a correctness row fails, else 0."""
    parser = argparse.ArgumentParser(prog="python -m grpo_fast.benchmarks.gpu_check")
    parser.add_argument("out_dir")
    parser.add_argument("--wheels", help="folder of wheel files to install first (trl, liger-kernel, ...)")
    parser.add_argument("--budget", type=float, default=280, help="seconds for the whole script (default 280); "
                        "the headline rows run whatever is left")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                        help="of the timed rows and of the half-precision correctness rows")
    parser.add_argument("--backend", default="auto", choices=backends.BACKENDS)
    parser.add_argument("--shapes", nargs="+", type=shape_argument, help="NxHxV ..., the first one the headline")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="small shapes: a smoke run (seconds on CPU)")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget
    os.makedirs(args.out_dir, exist_ok=True)
    report = Report(args.out_dir, "python -m grpo_fast.benchmarks.gpu_check "
                    + " ".join(sys.argv[1:] if argv is None else argv))

    def progress(line):                      # every row: printed, and on disk before the next one starts
        print(line, flush=True)
        report.write()

    if args.wheels:
        install_wheels(args.wheels, log=report.notes.append)
    cuda, dtype = args.device.startswith("cuda"), getattr(torch, args.dtype)
    report.env = environment(args.device, dtype, args.backend)
    print("\n".join(header_lines(report.env) + report.env["errors"]), flush=True)
    report.write("environment")

    shapes = args.shapes or ([Shape(256, 64, 4096)] if args.quick else SHAPES)
    fused = "grpo_fast[triton]" if args.backend == "triton" or (args.backend == "auto" and cuda) else "grpo_fast"
    names = ["floor", fused, forced_chunks_name(fused), *PEERS]
    end_to_end(shapes[:1], names, dtype, args.device, args.repeats, None, progress, report.e2e)
    report.write("headline end to end")

    dtypes = [torch.float32] + ([dtype] if dtype != torch.float32 else [])
    sizes = dict(vocabs=VOCABS_QUICK, sequences=2, length=48, hidden_size=32) if args.quick else dict(vocabs=VOCABS)
    share = time.monotonic() + CORRECTNESS_SHARE * max(0.0, deadline - time.monotonic())
    correctness(args.device, args.backend, dtypes, **sizes, log=progress, deadline=share, rows=report.checks)
    report.write("correctness")

    if not cuda or args.quick:
        report.notes.append("buffer > 2^31 elements: a GPU check, not run here")
    elif deadline - time.monotonic() < BIG_BUFFER_MIN_S:
        report.checks.append({"case": "buffer > 2^31", "ok": None, "skipped": "time budget spent"})
    else:
        report.checks.append(big_buffer_in_subprocess(args.device, args.backend, deadline - time.monotonic()))
    if report.checks and report.checks[-1]["case"] == "buffer > 2^31":
        print(row_line(report.checks[-1]), flush=True)
    report.write("buffer > 2^31")

    if time.monotonic() < deadline:
        try:
            report.passes = pass_times(shapes[0], dtype, args.device, args.backend, report.env)
        except Exception as error:                   # the other shapes' rows still run
            report.notes.append(f"pass times failed: {type(error).__name__}: {str(error)[:100]}")
    else:
        report.notes.append("pass times: skipped, time budget spent")
    report.write("pass times")

    end_to_end(shapes[1:], ["floor", fused, *PEERS], dtype, args.device, args.repeats, deadline, progress,
               report.e2e)
    lines = report.write("other shapes end to end", finished=True)
    print("\n".join(lines), flush=True)
    return 1 if any(c["ok"] is False for c in report.checks) else 0


if __name__ == "__main__":
    sys.exit(main())
