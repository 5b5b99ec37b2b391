"""Side-by-side memory and time of the full-logits loss and the fused loss at one shape.

A two-row run of the benchmark harness (`grpo_fast.benchmarks.harness`): each implementation is measured in a
fresh process on CPU (peak RSS growth above the inputs) or in this one on CUDA (the allocator's peak).
"""

from __future__ import annotations

import argparse
import sys

import torch

from grpo_fast.benchmarks.harness import Shape, measure_row, positive_int
from grpo_fast.benchmarks.profiling import machine_name

LABELS = {"naive": "reference"}


def fused_name(backend: str, device: str) -> str:
    """The harness implementation of grpo_fast's fused loss for `backend` on `device`."""
    triton = backend == "triton" or (backend == "auto" and device.startswith("cuda"))
    return "grpo_fast[triton]" if triton else "grpo_fast"


def run(tokens, hidden_size, vocab, dtype, device, backend, repeats) -> list:
    logits_bytes = tokens * vocab * 4
    print(f"grpo_fast demo on {machine_name(device)}: N={tokens} tokens, H={hidden_size}, V={vocab}, {dtype}; "
          f"fp32 logits alone would take {logits_bytes / 2**20:.0f} MiB")
    print("dapo loss with k3 KL (beta=0.04), forward + backward through hidden and the LM-head weight")
    shape = Shape(tokens, hidden_size, vocab)
    rows = [{"impl": LABELS.get(name, name), **measure_row(name, shape, dtype, device, repeats)}
            for name in ("naive", fused_name(backend, device))]
    print(f"{'implementation':<18} {'time (s)':>9} {'peak memory (MiB)':>18} {'loss':>12}")
    for row in rows:
        if "error" in row:
            print(f"{row['impl']:<18} failed: {row['error']}")
        else:
            print(f"{row['impl']:<18} {row['time_s']:>9.2f} {row['peak_bytes'] / 2**20:>18.0f} {row['loss']:>12.6f}")
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        ref, fused = ok
        print(f"grpo_fast uses {ref['peak_bytes'] / max(fused['peak_bytes'], 1):.1f}x less memory and takes "
              f"{fused['time_s'] / ref['time_s']:.2f}x the time; loss difference "
              f"{abs(fused['loss'] - ref['loss']):.2e}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--tokens", type=positive_int, default=4096, help="completion tokens N (default 4096)")
    parser.add_argument("--hidden", type=positive_int, default=256, help="hidden size H (default 256)")
    parser.add_argument("--vocab", type=positive_int, default=32768, help="vocabulary size V (default 32768)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--repeats", type=positive_int, default=1,
                        help="timed repeats per implementation (median)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_fast.benchmarks.demo")
    add_arguments(parser)
    args = parser.parse_args(argv)
    rows = run(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.backend, args.repeats)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
