"""Correctness of the fused loss in bf16 against the float64 reference, then its time against the GEMM floor.

python benchmarks/gpu_check.py OUT_DIR                         # on a GPU: Triton backend, bf16, real shapes
python benchmarks/gpu_check.py OUT_DIR --device cpu --dtype float32 --shapes 512x64x4096   # a CPU smoke run

Floor: the three plain GEMMs of the same shapes (logits, d(hidden), d(weight)) that no method can skip, timed
in the same process. Writes OUT_DIR/gpu_check.json and OUT_DIR/gpu_check.md with the device named.
"""

import argparse
import json
import os
import sys
import time

import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.demo import machine_name

DEFAULT_SHAPES = ["4096x896x151936", "16384x896x151936", "4096x3584x151936", "8192x2304x256000"]
CHECKS = [
    dict(loss_type="dapo", beta=0.04),
    dict(loss_type="grpo", epsilon_high=0.28, delta=1.5, entropy_coef=0.01),
    dict(loss_type="cispo", epsilon_high=5.0, temperature=0.7),
    dict(loss_type="sapo", logit_softcap=30.0),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04),
]


def inputs(tokens, hidden_size, vocab, dtype, device, seed=0, batch=4):
    gen = torch.Generator().manual_seed(seed)
    seq = tokens // batch
    hidden = torch.randn(batch, seq, hidden_size, generator=gen)
    weight = torch.randn(vocab, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)
    mask = torch.rand(batch, seq, generator=gen) > 0.1
    targets = torch.randint(0, vocab, (batch, seq), generator=gen)
    uniform = -torch.log(torch.tensor(float(vocab)))
    old = uniform + 0.2 * torch.randn(batch, seq, generator=gen)
    ref = uniform + 0.2 * torch.randn(batch, seq, generator=gen)
    return dict(hidden=hidden.to(device, dtype), weight=weight.to(device, dtype), targets=targets.to(device),
                advantages=torch.randn(batch, generator=gen).to(device), mask=mask.to(device),
                old_logps=old.to(device), ref_logps=ref.to(device))


def rel_error(actual, expected):
    return ((actual.double() - expected.double()).abs().max() / expected.double().abs().max().clamp(min=1e-12)).item()


def grads_of(fn, hidden, weight, data, options):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss, _ = fn(hidden, weight, **data, **options)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def check(dtype, device, backend):
    """Errors of grpo_fast and of the same-dtype full-logits loss, both against the float64 reference.

    Clipping is discontinuous: rounding the logits to bf16 moves some ratios across a clip boundary, so in half
    precision a row passes when its error is within 2e-2 or at most twice the same-dtype reference's.
    """
    rows = []
    for options in CHECKS:
        data = inputs(1024, 128, 5000, dtype, device, seed=len(rows))
        hidden, weight = data.pop("hidden"), data.pop("weight")
        ours = grads_of(lambda *a, **k: gf.grpo_loss(*a, **k, backend=backend), hidden, weight, data, options)
        exact = grads_of(reference.grpo_loss, hidden.double(), weight.double(), data, options)
        naive = grads_of(reference.grpo_loss, hidden, weight, data, options)
        row = {"options": options}
        for name, a, b, e in zip(("loss", "dhidden", "dweight"), ours, naive, exact):
            row[f"{name}_error"] = rel_error(a, e)
            row[f"{name}_naive_error"] = rel_error(b, e)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        row["ok"] = all(row[f"{n}_error"] <= max(tol, 2 * row[f"{n}_naive_error"])
                        for n in ("loss", "dhidden", "dweight"))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def timed(fn, device, repeats):
    fn()                                                        # warm-up (compiles kernels)
    times = []
    for _ in range(repeats):
        if device.startswith("cuda"):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def bench(shape, dtype, device, backend, repeats):
    tokens, hidden_size, vocab = map(int, shape.split("x"))
    row = {"shape": shape, "tokens": tokens, "hidden": hidden_size, "vocab": vocab}
    try:
        data = inputs(tokens, hidden_size, vocab, dtype, device)
        hidden = data.pop("hidden").requires_grad_()
        weight = data.pop("weight").requires_grad_()
        flat_h = hidden.detach().reshape(-1, hidden_size)[: int(data["mask"].sum())].contiguous()
        w = weight.detach()

        def floor():
            logits = flat_h @ w.t()
            logits @ w
            logits.t() @ flat_h

        def fused():
            loss, _ = gf.grpo_loss(hidden, weight, **data, beta=0.04, backend=backend)
            torch.autograd.grad(loss, (hidden, weight))

        def logprobs_no_grad():
            with torch.no_grad():
                gf.token_logprobs(hidden, weight, data["targets"].clamp(min=0), backend=backend)

        row["floor_s"] = timed(floor, device, repeats)
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        row["fused_s"] = timed(fused, device, repeats)
        if device.startswith("cuda"):
            row["fused_peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        row["logprobs_no_grad_s"] = timed(logprobs_no_grad, device, repeats)
        row["fused_over_floor"] = row["fused_s"] / row["floor_s"]
        flops = 3 * 2 * flat_h.shape[0] * hidden_size * vocab
        row["fused_tflops"] = flops / row["fused_s"] / 1e12
        row["floor_tflops"] = flops / row["floor_s"] / 1e12
    except torch.OutOfMemoryError as error:
        row["error"] = f"out of memory: {str(error).splitlines()[0]}"
    print(json.dumps(row), flush=True)
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="NxHxV")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    os.makedirs(args.out_dir, exist_ok=True)
    machine = machine_name(args.device)
    print(f"{machine}: torch {torch.__version__}", flush=True)
    checks = check(dtype, args.device, args.backend)
    rows = [bench(shape, dtype, args.device, args.backend, args.repeats) for shape in args.shapes]
    with open(os.path.join(args.out_dir, "gpu_check.json"), "w") as f:
        json.dump({"machine": machine, "torch": torch.__version__, "dtype": args.dtype, "backend": args.backend,
                   "checks": checks, "rows": rows}, f, indent=1)
    lines = [f"# grpo_fast on {machine} ({args.dtype}, backend {args.backend}, torch {torch.__version__})", "",
             "Error against the float64 reference (max error / max |reference|), grpo_fast and in brackets the "
             f"full-logits loss in {args.dtype}:", "",
             "| options | loss | d(hidden) | d(weight) | ok |", "|---|---|---|---|---|"]
    lines += [f"| {c['options']} | " + " | ".join(
        f"{c[n + '_error']:.1e} ({c[n + '_naive_error']:.1e})" for n in ("loss", "dhidden", "dweight"))
        + f" | {c['ok']} |" for c in checks]
    lines += ["", "Time of dapo + KL forward+backward against three plain GEMMs of the same shapes (floor):", "",
              "| N x H x V | floor (ms) | fused (ms) | fused / floor | fused TFLOP/s | logprobs no_grad (ms) | "
              "fused peak (MiB) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['shape']} | {r['error']} | | | | | |")
        else:
            lines.append(f"| {r['shape']} | {r['floor_s'] * 1e3:.1f} | {r['fused_s'] * 1e3:.1f} | "
                         f"{r['fused_over_floor']:.2f} | {r['fused_tflops']:.3g} | {r['logprobs_no_grad_s'] * 1e3:.1f}"
                         f" | {r.get('fused_peak_mib', float('nan')):.0f} |")
    with open(os.path.join(args.out_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
