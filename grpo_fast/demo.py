"""Side-by-side memory and time of the full-logits loss and the fused loss at one shape.

Each measurement runs in a fresh subprocess so peak memory is its own: on CPU the growth of peak RSS over the
process's RSS before the step, on CUDA torch.cuda.max_memory_allocated above the inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import torch

IMPLEMENTATIONS = ("reference", "grpo_fast")


def _inputs(tokens, hidden_size, vocab, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, hidden_size, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(vocab, hidden_size, generator=gen) / hidden_size**0.5).to(device, dtype).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    advantages = torch.randn(tokens, generator=gen).to(device)
    # Old and reference log-probs near a uniform policy's, so ratios and KL stay in a realistic range.
    uniform = -torch.log(torch.tensor(float(vocab)))
    old = (uniform + 0.1 * torch.randn(tokens, generator=gen)).to(device)
    ref = (uniform + 0.1 * torch.randn(tokens, generator=gen)).to(device)
    mask = torch.ones(tokens, dtype=torch.bool, device=device)
    return dict(hidden=hidden, weight=weight, targets=targets, advantages=advantages, mask=mask, old_logps=old,
                ref_logps=ref)


def _step(impl, inputs, backend):
    import grpo_fast
    from grpo_fast import reference

    fn = reference.grpo_loss if impl == "reference" else grpo_fast.grpo_loss
    extra = {} if impl == "reference" else {"backend": backend}
    loss, _ = fn(**inputs, beta=0.04, **extra)
    loss.backward()
    return loss.item()


def worker(impl, tokens, hidden_size, vocab, dtype_name, device, backend, repeats) -> dict:
    """One implementation, measured in this process (called in a fresh subprocess by `measure`)."""
    from grpo_fast.profiling import peak_rss_bytes, start_peak_rss

    dtype = getattr(torch, dtype_name)
    inputs = _inputs(tokens, hidden_size, vocab, dtype, device)
    small = _inputs(64, hidden_size, min(vocab, 1024), dtype, device, seed=1)
    _step(impl, small, backend)                                  # warm-up: kernels, allocator, thread pools
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = start_peak_rss()
    times = []
    for _ in range(repeats):
        inputs["hidden"].grad = inputs["weight"].grad = None
        start = time.perf_counter()
        loss = _step(impl, inputs, backend)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()) - base
    return {"impl": impl, "loss": loss, "seconds": sorted(times)[len(times) // 2], "peak_bytes": peak}


def measure(impl, tokens, hidden_size, vocab, dtype="float32", device="cpu", backend="auto", repeats=1) -> dict:
    args = [sys.executable, "-m", "grpo_fast.demo", "--worker", impl, "--tokens", str(tokens), "--hidden",
            str(hidden_size), "--vocab", str(vocab), "--dtype", dtype, "--device", device, "--backend", backend,
            "--repeats", str(repeats)]
    done = subprocess.run(args, capture_output=True, text=True)
    if done.returncode != 0:
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        return {"impl": impl, "error": tail[0]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def machine_name(device: str) -> str:
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} cores"


def run(tokens, hidden_size, vocab, dtype, device, backend, repeats) -> list:
    logits_bytes = tokens * vocab * 4
    print(f"grpo_fast demo on {machine_name(device)}: N={tokens} tokens, H={hidden_size}, V={vocab}, {dtype}; "
          f"fp32 logits alone would take {logits_bytes / 2**20:.0f} MiB")
    print("dapo loss with k3 KL (beta=0.04), forward + backward through hidden and the LM-head weight")
    rows = [measure(impl, tokens, hidden_size, vocab, dtype, device, backend, repeats) for impl in IMPLEMENTATIONS]
    print(f"{'implementation':<16} {'time (s)':>9} {'peak memory (MiB)':>18} {'loss':>12}")
    for row in rows:
        if "error" in row:
            print(f"{row['impl']:<16} failed: {row['error']}")
        else:
            print(f"{row['impl']:<16} {row['seconds']:>9.2f} {row['peak_bytes'] / 2**20:>18.0f} {row['loss']:>12.6f}")
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        ref, fused = ok
        print(f"grpo_fast uses {ref['peak_bytes'] / max(fused['peak_bytes'], 1):.1f}x less memory and takes "
              f"{fused['seconds'] / ref['seconds']:.2f}x the time; loss difference "
              f"{abs(fused['loss'] - ref['loss']):.2e}")
    return rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--tokens", type=int, default=4096, help="completion tokens N (default 4096)")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size H (default 256)")
    parser.add_argument("--vocab", type=int, default=32768, help="vocabulary size V (default 32768)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--device", default=default_device)
    parser.add_argument("--backend", default="auto", choices=["auto", "torch", "triton"])
    parser.add_argument("--repeats", type=int, default=1, help="timed repeats per implementation (median)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo_fast.demo")
    add_arguments(parser)
    parser.add_argument("--worker", choices=IMPLEMENTATIONS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args.worker, args.tokens, args.hidden, args.vocab, args.dtype, args.device,
                                args.backend, args.repeats)))
        return 0
    rows = run(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.backend, args.repeats)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
