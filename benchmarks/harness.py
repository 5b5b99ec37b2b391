"""Side-by-side benchmark of the LM head + GRPO loss: time, peak memory, GEMM passes and accuracy per method.

grpo-fast bench --quick                          # CPU subset, a few minutes on 2 cores: runs/bench-quick-<time>/
grpo-fast bench --device cuda                    # the GPU sweep (bf16, Qwen2.5 / Gemma-2 head shapes)

For each shape every implementation runs forward + backward on the same inputs. Time: median of the repeats
after a warm-up (CUDA events on GPU). Memory: peak above the inputs: torch.cuda.max_memory_allocated on GPU, on
CPU the growth of peak RSS in a fresh subprocess per row. GEMM passes: matmul FLOPs counted by a dispatch mode
(out= and in-place forms included) divided by 2 N H V. Accuracy: loss and gradient errors against the float64
reference at one small shape, so a fast but wrong row shows. A failure (out of memory included) is a row result;
`grpo-fast bench` writes every row, then exits with status 1 if a measured row failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from grpo_fast.benchmarks.implementations import IMPLEMENTATIONS, Batch, kept_set
from grpo_fast.benchmarks.profiling import GemmCounter, machine_name, peak_rss_bytes, start_peak_rss

GPU_HEADS = [(896, 151936), (3584, 152064), (2304, 256000)]         # Qwen2.5-0.5B, Qwen2.5-7B, Gemma-2-2B
GPU_TOKENS = [1024, 4096, 16384, 65536]
CPU_HEADS = [(512, 32768), (1024, 65536)]
CPU_TOKENS = [1024, 2048, 4096, 8192]
QUICK_HEADS = [(512, 32768)]
QUICK_TOKENS = [1024, 2048]
QUICK_IMPLS = ["floor", "grpo_fast", "grpo_fast_kept512", "grpo_fast_two_phase", "naive", "trl", "liger",
               "torch_linear_ce"]
CHECK_SHAPE = (512, 64, 2000)                                         # N, H, V of the accuracy check
SKIPPED = "skipped: time budget spent"
OUTPUT_FILES = ("bench.md", "bench.json", "time_vs_tokens.png", "memory_vs_tokens.png")


@dataclass(frozen=True)
class Shape:
    tokens: int
    hidden: int
    vocab: int

    @property
    def label(self) -> str:
        return f"{self.tokens}x{self.hidden}x{self.vocab}"

    @classmethod
    def parse(cls, text: str) -> "Shape":
        try:
            tokens, hidden, vocab = (int(part) for part in text.lower().split("x"))
        except ValueError:
            tokens = hidden = vocab = 0
        if min(tokens, hidden, vocab) < 1:
            raise ValueError(f"a shape is NxHxV of positive integers (e.g. 4096x896x151936), got {text!r}")
        return cls(tokens, hidden, vocab)


# argparse types: an ArgumentTypeError's message reaches the user as is (a ValueError's would not), and argparse
# exits with status 2 naming the option
def shape_argument(text: str) -> Shape:
    try:
        return Shape.parse(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"expected a number of seconds >= 0, got {text!r}")
    return value


def make_batch(shape: Shape, dtype: torch.dtype, device: str, seed: int = 0, sequences: int = 8,
               kept: int = 0) -> Batch:
    """Inputs of one step: `sequences` completions of shape.tokens / sequences tokens, every token counted; kept:
    ids per token in kept sets (implementations.kept_set), 0 for none."""
    gen = torch.Generator().manual_seed(seed)
    seq = max(shape.tokens // sequences, 1)
    batch = max(shape.tokens // seq, 1)
    hidden = torch.randn(batch, seq, shape.hidden, generator=gen)
    weight = torch.randn(shape.vocab, shape.hidden, generator=gen) * (2.0 / shape.hidden**0.5)
    uniform = -math.log(shape.vocab)
    targets = torch.randint(0, shape.vocab, (batch, seq), generator=gen).to(device)
    kept_ids, kept_offsets = kept_set(targets, shape.vocab, kept) if kept else (None, None)
    return Batch(
        hidden=hidden.to(device, dtype).requires_grad_(),
        weight=weight.to(device, dtype).requires_grad_(),
        targets=targets,
        mask=torch.ones(batch, seq, dtype=torch.bool, device=device),
        advantages=torch.randn(batch, generator=gen).to(device),
        old_logps=(uniform + 0.2 * torch.randn(batch, seq, generator=gen)).to(device),
        ref_logps=(uniform + 0.2 * torch.randn(batch, seq, generator=gen)).to(device),
        kept_ids=kept_ids, kept_offsets=kept_offsets,
    )


def relative_error(actual, expected) -> float:
    """max |actual - expected| / max |expected|, in float64."""
    expected = expected.double()
    return ((actual.double() - expected).abs().max() / expected.abs().max().clamp(min=1e-30)).item()


def check(name: str, dtype: torch.dtype, device: str) -> dict:
    """GEMM passes and errors against the float64 reference of one implementation at CHECK_SHAPE."""
    impl = IMPLEMENTATIONS[name]
    shape = Shape(*CHECK_SHAPE)
    batch = make_batch(shape, dtype, device, seed=1, kept=impl.kept)
    result = {}
    try:
        with GemmCounter() as counter:
            loss, d_hidden, d_weight = impl.step(batch)
        result["gemm_passes"] = counter.flops / (2 * int(batch.num_items) * shape.hidden * shape.vocab)
    except Exception as error:  # a peer that does not run under a dispatch mode still gets its error columns
        result["gemm_passes"] = None
        result["check_note"] = f"FLOPs not counted: {type(error).__name__}"
        loss, d_hidden, d_weight = impl.step(batch)
    if loss is None:                                     # the floor computes no loss: nothing to compare
        return {**result, "loss_error": None, "grad_error": None}
    exact = make_batch(shape, torch.float64, "cpu", seed=1, kept=impl.kept)     # the reference: same kept sets
    exact.hidden.data.copy_(batch.hidden.detach().cpu())
    exact.weight.data.copy_(batch.weight.detach().cpu())
    ref_loss, ref_hidden, ref_weight = IMPLEMENTATIONS["naive"].step(exact)
    result["loss_error"] = relative_error(loss.cpu(), ref_loss)
    result["grad_error"] = max(relative_error(d_hidden.cpu(), ref_hidden),
                               relative_error(d_weight.cpu(), ref_weight))
    return result


def _cuda_time(step, batch, repeats):
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(batch)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return times


def measure(name: str, shape: Shape, dtype: torch.dtype, device: str, repeats: int) -> dict:
    """Time and peak memory of one implementation at one shape, in this process.

    The first full-shape step is the warm-up and the memory measurement (its peak above the inputs, on a heap
    not yet grown by this shape); the next `repeats` steps are timed.
    """
    impl = IMPLEMENTATIONS[name]
    cuda = device.startswith("cuda")
    try:
        if not cuda:  # thread pools and first-call paths, on a problem too small to leave memory behind
            impl.step(make_batch(Shape(64, shape.hidden, min(shape.vocab, 1024)), dtype, device, seed=2,
                                 kept=impl.kept))
        batch = make_batch(shape, dtype, device, kept=impl.kept)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            loss = impl.step(batch)[0]
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - base
            times = _cuda_time(impl.step, batch, repeats)
        else:
            base = start_peak_rss()
            loss = impl.step(batch)[0]
            peak = peak_rss_bytes() - base
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                impl.step(batch)
                times.append(time.perf_counter() - start)
        return {"time_s": sorted(times)[len(times) // 2], "peak_bytes": peak,
                "loss": None if loss is None else loss.item()}
    except (torch.OutOfMemoryError, MemoryError) as error:
        return {"error": "out of memory: " + (str(error).splitlines() or [""])[0][:120]}
    except Exception as error:
        return {"error": f"{type(error).__name__}: " + (str(error).splitlines() or [""])[0][:160]}
    finally:
        if cuda:
            torch.cuda.empty_cache()


def print_result(result: dict) -> None:
    """Print `result` as the `RESULT {json}` line that `last_result` reads back from a child process's output."""
    print("RESULT " + json.dumps(result), flush=True)


def last_result(stdout: str) -> dict | None:
    """The JSON of the last `RESULT {json}` line of a child process's output; None where it printed none."""
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT "):]) if lines else None


def measure_in_subprocess(name, shape, dtype_name, device, repeats, timeout=1800) -> dict:
    """`measure` in a fresh interpreter, so that CPU peak RSS belongs to this row alone."""
    command = [sys.executable, "-m", "grpo_fast.benchmarks.harness", "--worker", name, "--shapes", shape.label,
               "--dtype", dtype_name, "--device", device, "--repeats", str(repeats)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        if done.returncode in (-9, 137):
            return {"error": "out of memory: killed"}
        return {"error": lines[-1][:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_row(name, shape, dtype_name, device, repeats) -> dict:
    """`measure` in this process on GPU (the allocator's peak is per row), in a fresh one on CPU (RSS is not)."""
    if device.startswith("cuda"):
        return measure(name, shape, getattr(torch, dtype_name), device, repeats)
    return measure_in_subprocess(name, shape, dtype_name, device, repeats)


def assemble_rows(shapes, names, measurements: dict, checks: dict) -> list:
    """One row per (shape, implementation): measurement, check columns and the ratio to the floor's time."""
    rows = []
    for shape in shapes:
        floor = measurements.get((shape, "floor"), {})
        for name in names:
            row = {"shape": shape.label, "tokens": shape.tokens, "hidden": shape.hidden, "vocab": shape.vocab,
                   "impl": name, **measurements.get((shape, name), {"error": "not run"}), **checks.get(name, {})}
            if "time_s" in row and "time_s" in floor:
                row["floor_ratio"] = row["time_s"] / floor["time_s"]
            rows.append(row)
    return rows


def _fmt(value, spec, missing="-"):
    return missing if value is None else format(value, spec)


def markdown_table(rows) -> str:
    lines = ["| shape (N x H x V) | implementation | time (ms) | x floor | peak memory (MiB) | GEMM passes | "
             "loss error | grad error |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['impl']} | {r['error']} | | | {_fmt(r.get('gemm_passes'), '.1f')} |"
                         f" {_fmt(r.get('loss_error'), '.1e')} | {_fmt(r.get('grad_error'), '.1e')} |")
            continue
        lines.append(
            f"| {r['shape']} | {r['impl']} | {r['time_s'] * 1e3:.1f} | {_fmt(r.get('floor_ratio'), '.2f')} | "
            f"{r['peak_bytes'] / 2**20:.0f} | {_fmt(r.get('gemm_passes'), '.1f')} | "
            f"{_fmt(r.get('loss_error'), '.1e')} | {_fmt(r.get('grad_error'), '.1e')} |")
    return "\n".join(lines)


def plot(rows, out_dir: str, machine: str) -> list:
    """time_vs_tokens.png and memory_vs_tokens.png: one panel per (H, V), one line per implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = sorted({(r["hidden"], r["vocab"]) for r in rows})
    names = list(dict.fromkeys(r["impl"] for r in rows))
    paths = []
    for key, label, scale in (("time_s", "forward + backward time (s)", 1.0),
                              ("peak_bytes", "peak memory above inputs (MiB)", 1 / 2**20)):
        fig, axes = plt.subplots(1, len(heads), figsize=(6 * len(heads), 4.5), squeeze=False)
        for ax, (hidden, vocab) in zip(axes[0], heads):
            for name in names:
                points = sorted((r["tokens"], r[key] * scale) for r in rows
                                if r["impl"] == name and (r["hidden"], r["vocab"]) == (hidden, vocab)
                                and r.get(key) is not None and r[key] > 0)
                if points:
                    ax.plot(*zip(*points), marker="o", label=name)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("completion tokens N")
            ax.set_ylabel(label)
            ax.set_title(f"H={hidden}, V={vocab}")
            ax.grid(True, which="both", alpha=0.3)
        if axes[0][0].lines:
            axes[0][0].legend(fontsize=8)
        fig.suptitle(f"LM head + GRPO loss on {machine}")
        fig.tight_layout()
        path = os.path.join(out_dir, ("time" if key == "time_s" else "memory") + "_vs_tokens.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)
    return paths


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("torch", "triton", "trl", "liger-kernel", "grpo-fast"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = None
    return found


def default_shapes(device: str, quick: bool) -> list:
    if quick:
        return [Shape(n, h, v) for h, v in QUICK_HEADS for n in QUICK_TOKENS]
    heads, tokens = (GPU_HEADS, GPU_TOKENS) if device.startswith("cuda") else (CPU_HEADS, CPU_TOKENS)
    return [Shape(n, h, v) for h, v in heads for n in tokens]


def default_impls(device: str, quick: bool) -> list:
    names = QUICK_IMPLS if quick else list(IMPLEMENTATIONS)
    return [name for name in names if device.split(":")[0] in IMPLEMENTATIONS[name].devices]


def run(shapes, names, dtype_name, device, repeats, out_dir, time_budget=None, log=print, command=None) -> list:
    dtype = getattr(torch, dtype_name)
    machine = machine_name(device)
    started = time.monotonic()
    log(f"grpo_fast bench on {machine}: {dtype_name}, shapes {[s.label for s in shapes]}")
    checks, measurements = {}, {}
    for name in names:
        reason = IMPLEMENTATIONS[name].unavailable(device)
        try:
            checks[name] = {"error": reason} if reason else check(name, dtype, device)
        except Exception as error:      # the timed rows still run and report their own failure
            checks[name] = {"check_note": f"check failed: {type(error).__name__}: {str(error)[:120]}"}
        log(json.dumps({"check": name, **checks[name]}))
    for shape in shapes:
        for name in names:
            if checks[name].get("error"):
                measurements[(shape, name)] = {"error": checks[name]["error"]}
            elif time_budget is not None and time.monotonic() - started > time_budget:
                measurements[(shape, name)] = {"error": SKIPPED}
            else:
                measurements[(shape, name)] = measure_row(name, shape, dtype_name, device, repeats)
            log(json.dumps({"shape": shape.label, "impl": name, **measurements[(shape, name)]}))
    checks = {name: {k: v for k, v in c.items() if k != "error"} for name, c in checks.items()}
    rows = assemble_rows(shapes, names, measurements, checks)
    table = markdown_table(rows)
    os.makedirs(out_dir, exist_ok=True)
    header = (f"# LM head + GRPO loss on {machine}\n\n{dtype_name}; dapo + k3 KL (beta 0.04), forward + backward "
              f"through hidden and weight; median of {repeats} after a warm-up. Errors are against the float64 "
              f"reference at N x H x V = {'x'.join(map(str, CHECK_SHAPE))}. Versions: {json.dumps(versions())}.\n\n"
              f"Command: `{command or 'python ' + ' '.join(sys.argv)}`\n\n")
    with open(os.path.join(out_dir, "bench.md"), "w") as f:
        f.write(header + table + "\n")
    with open(os.path.join(out_dir, "bench.json"), "w") as f:
        json.dump({"machine": machine, "cpu_count": os.cpu_count(), "device": device, "dtype": dtype_name,
                   "repeats": repeats, "versions": versions(), "rows": rows}, f, indent=1)
    try:
        plot(rows, out_dir, machine)
    except ImportError as error:       # e.g. a GPU image without matplotlib: the table and JSON still stand
        log(f"plots skipped: {error}")
    log(table)
    log(f"wrote {out_dir}/bench.md, bench.json, time_vs_tokens.png, memory_vs_tokens.png "
        f"in {time.monotonic() - started:.0f} s")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--quick", action="store_true", help="a CPU subset: 2 shapes, 8 implementations")
    parser.add_argument("--shapes", nargs="+", type=shape_argument, help="NxHxV ... (default: by device)")
    parser.add_argument("--impls", nargs="+", choices=sorted(IMPLEMENTATIONS), help="default: all for the device")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"],
                        help="default: bfloat16 on GPU, float32 on CPU")
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timed repeats (default 5 on GPU, 3 on CPU)")
    parser.add_argument("--out", default=None,
                        help="output folder (default: benchmarks/results/cpu or gpu, the committed results; with "
                             "--quick a new folder of its own, runs/bench-quick-YYYYmmdd-HHMMSS)")
    parser.add_argument("--time-budget", type=seconds, default=None, help="seconds after which rows are skipped")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")


def main(args) -> int:
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    repeats = args.repeats or (5 if cuda else (2 if args.quick else 3))
    shapes = args.shapes or default_shapes(args.device, args.quick)
    names = args.impls or default_impls(args.device, args.quick)
    if "floor" not in names:
        names = ["floor", *names]
    out = args.out or default_out(args.device, args.quick)
    if not getattr(args, "overwrite", False) and os.path.isfile(os.path.join(out, "bench.json")):
        print(f"grpo-fast bench: {os.path.join(out, 'bench.json')} exists: pass --overwrite to replace it, or "
              "another --out", file=sys.stderr)
        return 2
    problem = unwritable(out)
    if problem:                          # found now, not after an hour of measurements
        print(f"grpo-fast bench: --out must be a folder that can be created and written, got {out!r}: {problem}",
              file=sys.stderr)
        return 2
    rows = run(shapes, names, dtype, args.device, repeats, out, args.time_budget,
               command="grpo-fast " + " ".join(sys.argv[1:]))
    failed = failed_rows(rows, args.device)
    if failed:
        print(f"grpo-fast bench: {len(failed)} of {len(rows)} rows failed: "
              + "; ".join(f"{r['shape']} {r['impl']}: {r['error']}" for r in failed[:3])
              + ("; ..." if len(failed) > 3 else ""), file=sys.stderr)
    return 0 if rows and not failed else 1


def default_out(device: str, quick: bool, now: float | None = None) -> str:
    """The output folder when --out is not given. A quick run is a try of the harness, not results to keep: it gets
    a new folder under runs/ (which git ignores), so that it runs as given in a fresh clone, whose
    benchmarks/results/cpu holds the committed results. A sweep writes to benchmarks/results/cpu or gpu, where it
    replaces what is there only with --overwrite."""
    if quick:
        return os.path.join("runs", time.strftime("bench-quick-%Y%m%d-%H%M%S", time.localtime(now)))
    return os.path.join("benchmarks", "results", "gpu" if device.startswith("cuda") else "cpu")


def unwritable(out_dir: str):
    """Why the results cannot be written to `out_dir` (created here if missing), or None."""
    import tempfile

    try:
        os.makedirs(out_dir, exist_ok=True)
        for name in OUTPUT_FILES:
            path = os.path.join(out_dir, name)
            if os.path.lexists(path) and not os.path.isfile(path):
                return f"{path} exists and is not a file"
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as error:
        return f"{error.strerror or error}{': ' + error.filename if error.filename else ''}"
    return None


def refuse_to_overwrite(parser: argparse.ArgumentParser, out_dir, name: str, overwrite: bool) -> None:
    """parser.error when out_dir/name.json holds results already and --overwrite was not given: a benchmark never
    replaces committed results by default."""
    path = os.path.join(out_dir, f"{name}.json") if out_dir else None
    if path and not overwrite and os.path.exists(path):
        parser.error(f"{path} exists: pass --overwrite to replace it, or another --out")


def write_results(out_dir: str, name: str, markdown: str, payload: dict) -> None:
    """out_dir/name.md (the table) and out_dir/name.json (the machine, then `payload`), the folder made if
    missing."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"{name}.md"), "w") as f:
        f.write(markdown)
    with open(os.path.join(out_dir, f"{name}.json"), "w") as f:
        json.dump({"machine": machine_name("cuda" if torch.cuda.is_available() else "cpu"), **payload}, f, indent=1)


def failed_rows(rows, device: str) -> list:
    """Rows whose measurement ran and failed (out of memory included); a peer not installed here or a row the
    time budget skipped is not a failure."""
    return [r for r in rows if "error" in r and r["error"] != SKIPPED
            and not IMPLEMENTATIONS[r["impl"]].unavailable(device)]


def _worker(argv) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", required=True)
    parser.add_argument("--shapes", type=Shape.parse, required=True)
    parser.add_argument("--dtype", required=True)
    parser.add_argument("--device", required=True)
    parser.add_argument("--repeats", type=int, required=True)
    args = parser.parse_args(argv)
    result = measure(args.worker, args.shapes, getattr(torch, args.dtype), args.device, args.repeats)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
