"""One GPU, one command: the Triton path checked in bf16 against the float64 reference, then the GPU sweep.

python -m grpo_fast.benchmarks.gpu_check OUT_DIR [--wheels DIR] [--budget 480]

Everything lands in OUT_DIR: gpu_check.md / .json (correctness), bench.md / .json and the plots (the sweep of
`grpo_fast.benchmarks.harness` over the GPU shapes). It runs where torch and Triton are installed but TRL and
liger-kernel may not be: wheel files in --wheels are installed first (without dependencies); peers that still
cannot be imported get rows that say so. The sweep skips the rows left when the time budget is spent.
CPU smoke run: --device cpu --dtype float32 --backend torch --shapes 256x32x2000.
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.benchmarks import harness
from grpo_fast.profiling import machine_name

CHECKS = [
    dict(loss_type="dapo", beta=0.04),
    dict(loss_type="grpo", epsilon_high=0.28, delta=1.5, entropy_coef=0.01),
    dict(loss_type="cispo", epsilon_high=5.0, temperature=0.7),
    dict(loss_type="sapo", logit_softcap=30.0),
    dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.04),
]


def install_wheels(folder, log=print) -> None:
    wheels = sorted(glob.glob(os.path.join(folder, "*.whl")))
    if not wheels:
        log(f"no wheels in {folder}")
        return
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", *wheels],
                          capture_output=True, text=True)
    log(f"installed {len(wheels)} wheels (exit {done.returncode}){': ' + done.stderr[-300:] if done.returncode else ''}")


def grads_of(fn, hidden, weight, data, options):
    hidden = hidden.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    loss, _ = fn(hidden, weight, **data, **options)
    return (loss, *torch.autograd.grad(loss, (hidden, weight)))


def check(dtype, device, backend, log=print) -> list:
    """Errors of grpo_fast and of the same-dtype full-logits loss, both against the float64 reference.

    Clipping is discontinuous: rounding the logits to bf16 moves some ratios across a clip boundary, so in half
    precision a row passes when its error is within 2e-2 or at most twice the same-dtype reference's.
    """
    rows = []
    for options in CHECKS:
        batch = harness.make_batch(harness.Shape(1024, 128, 5000), dtype, device, seed=len(rows))
        data = dict(targets=batch.targets, advantages=batch.advantages, mask=batch.mask,
                    old_logps=batch.old_logps, ref_logps=batch.ref_logps)
        hidden, weight = batch.hidden, batch.weight
        ours = grads_of(lambda *a, **k: gf.grpo_loss(*a, **k, backend=backend), hidden, weight, data, options)
        exact = grads_of(reference.grpo_loss, hidden.double(), weight.double(), data, options)
        naive = grads_of(reference.grpo_loss, hidden, weight, data, options)
        row = {"options": options}
        for name, a, b, e in zip(("loss", "dhidden", "dweight"), ours, naive, exact):
            row[f"{name}_error"] = harness.relative_error(a, e)
            row[f"{name}_naive_error"] = harness.relative_error(b, e)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        row["ok"] = all(row[f"{n}_error"] <= max(tol, 2 * row[f"{n}_naive_error"])
                        for n in ("loss", "dhidden", "dweight"))
        rows.append(row)
        log(json.dumps(row))
    return rows


def write_check(checks, out_dir, machine, dtype_name, backend) -> None:
    with open(os.path.join(out_dir, "gpu_check.json"), "w") as f:
        json.dump({"machine": machine, "torch": torch.__version__, "dtype": dtype_name, "backend": backend,
                   "checks": checks}, f, indent=1)
    lines = [f"# grpo_fast correctness on {machine} ({dtype_name}, backend {backend}, torch {torch.__version__})",
             "", "Error against the float64 reference (max error / max |reference|); in brackets the full-logits "
             f"loss in {dtype_name}:", "", "| options | loss | d(hidden) | d(weight) | ok |", "|---|---|---|---|---|"]
    lines += [f"| {c['options']} | " + " | ".join(
        f"{c[n + '_error']:.1e} ({c[n + '_naive_error']:.1e})" for n in ("loss", "dhidden", "dweight"))
        + f" | {c['ok']} |" for c in checks]
    with open(os.path.join(out_dir, "gpu_check.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_fast.benchmarks.gpu_check")
    parser.add_argument("out_dir")
    parser.add_argument("--wheels", help="folder of wheel files to install first (trl, liger-kernel, ...)")
    parser.add_argument("--budget", type=float, default=480, help="seconds for the whole script (default 480)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--shapes", nargs="+", type=harness.Shape.parse, help="NxHxV (default: the GPU sweep)")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    started = time.monotonic()
    os.makedirs(args.out_dir, exist_ok=True)
    if args.wheels:
        install_wheels(args.wheels)
    machine = machine_name(args.device)
    print(f"{machine}: torch {torch.__version__}", flush=True)
    dtype = getattr(torch, args.dtype)
    checks = check(dtype, args.device, args.backend)
    write_check(checks, args.out_dir, machine, args.dtype, args.backend)
    shapes = args.shapes or harness.default_shapes(args.device, quick=False)
    names = harness.default_impls(args.device, quick=False)
    remaining = args.budget - (time.monotonic() - started)
    command = "python -m grpo_fast.benchmarks.gpu_check " + " ".join(sys.argv[1:] if argv is None else argv)
    harness.run(shapes, names, args.dtype, args.device, args.repeats, args.out_dir, time_budget=remaining,
                command=command)
    return 0 if all(c["ok"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
