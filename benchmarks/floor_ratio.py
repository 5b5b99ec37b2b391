"""The fused loss's time as a multiple of its 3-GEMM floor, measured side by side in one process.

python -m benchmarks.floor_ratio --shape 2048x512x32768 --threads 2 --rounds 7

Per round, interleaved: the floor (logits = h W^T, d(hidden) = dlogits W, d(weight) = dlogits^T h by torch.mm
into preallocated buffers; floor_alloc: the same into fresh tensors, as `grpo-fast bench` times it), the naive
full-logits loss (grpo_fast.reference) with its backward, the fused loss (grpo_loss, dapo with a KL term, the torch
backend, all tokens in one chunk; fused_default: in the chunks of the default budget, as a caller gets them) with
its backward, and the torch backend's two per-chunk passes alone (stats_
then dlogits_ on a chunk of logits, the logits GEMM untimed). The minimum over rounds is the number to compare
(the machine may be shared); the median is printed beside it. Ratios are to the preallocated floor.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import torch

import grpo_fast as gf
from grpo_fast import backends, reference
from grpo_fast.variants import LossConfig

LOSS = dict(loss_type="dapo", beta=0.04, epsilon_low=0.2, epsilon_high=0.28)


def make_inputs(tokens: int, hidden_size: int, vocab: int, dtype: torch.dtype, sequences: int = 8) -> dict:
    """A step's inputs: `sequences` completions of tokens / sequences tokens each, every token counted."""
    gen = torch.Generator().manual_seed(0)
    seq = max(tokens // sequences, 1)
    batch = max(tokens // seq, 1)
    uniform = -math.log(vocab)
    return dict(
        hidden=torch.randn(batch, seq, hidden_size, generator=gen).to(dtype).requires_grad_(),
        weight=(torch.randn(vocab, hidden_size, generator=gen) * (2.0 / hidden_size**0.5)).to(dtype).requires_grad_(),
        targets=torch.randint(0, vocab, (batch, seq), generator=gen),
        advantages=torch.randn(batch, generator=gen),
        mask=torch.ones(batch, seq, dtype=torch.bool),
        old_logps=uniform + 0.2 * torch.randn(batch, seq, generator=gen),
        ref_logps=uniform + 0.2 * torch.randn(batch, seq, generator=gen),
    )


def floor_step(inputs):
    hidden = inputs["hidden"].detach().reshape(-1, inputs["hidden"].shape[-1])
    weight = inputs["weight"].detach()
    logits = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype)
    d_hidden, d_weight = torch.empty_like(hidden), torch.empty_like(weight)

    def step():
        torch.mm(hidden, weight.t(), out=logits)
        torch.mm(logits, weight, out=d_hidden)
        torch.mm(logits.t(), hidden, out=d_weight)
    return step


def floor_alloc_step(inputs):
    hidden = inputs["hidden"].detach().reshape(-1, inputs["hidden"].shape[-1])
    weight = inputs["weight"].detach()

    def step():
        logits = hidden @ weight.t()
        d_hidden, d_weight = logits @ weight, logits.t() @ hidden
        del d_hidden, d_weight
    return step


def naive_step(inputs):
    def step():
        loss, _ = reference.grpo_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"],
                                      inputs["mask"], old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"],
                                      config=gf.LossConfig(**LOSS))
        torch.autograd.grad(loss, (inputs["hidden"], inputs["weight"]))
    return step


def fused_step(inputs, default_chunks=False):
    """The fused loss and its backward: all tokens in one chunk, or (default_chunks) the default chunk budget."""
    tokens, vocab = inputs["mask"].numel(), inputs["weight"].shape[0]
    # the whole batch in one chunk: rows padded to 16 elements, bytes per logit as the backend counts them
    one_chunk = tokens * (vocab + 16) * backends.resolve("torch", torch.device("cpu")).bytes_per_logit(
        inputs["hidden"].dtype)
    execution = gf.Execution(chunk_bytes=None if default_chunks else one_chunk, backend="torch")

    def step():
        loss, _ = gf.grpo_loss(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"],
                               inputs["mask"], old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"],
                               config=LossConfig(**LOSS), execution=execution)
        torch.autograd.grad(loss, (inputs["hidden"], inputs["weight"]))
    return step


def passes_step(inputs):
    """The per-chunk elementwise work of the torch backend alone: returns its own time (the GEMM refill not)."""
    ops = backends.resolve("torch", torch.device("cpu"))
    hidden = inputs["hidden"].detach().reshape(-1, inputs["hidden"].shape[-1])
    weight = inputs["weight"].detach()
    targets = inputs["targets"].reshape(-1)
    buffer = torch.empty(hidden.shape[0], weight.shape[0], dtype=hidden.dtype)
    g_logp = torch.randn(hidden.shape[0], generator=torch.Generator().manual_seed(1))
    transform = gf.LogitTransform()

    def step():
        torch.mm(hidden, weight.t(), out=buffer)
        start = time.perf_counter()
        state = ops.stats_(buffer, targets, transform, True)
        ops.dlogits_(buffer, state, targets, g_logp, None, transform)
        return time.perf_counter() - start
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="2048x512x32768", help="N x H x V (tokens x hidden x vocabulary)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    tokens, hidden_size, vocab = (int(part) for part in args.shape.lower().split("x"))
    inputs = make_inputs(tokens, hidden_size, vocab, getattr(torch, args.dtype))
    steps = {"floor": floor_step(inputs), "floor_alloc": floor_alloc_step(inputs), "naive": naive_step(inputs),
             "fused": fused_step(inputs), "fused_default": fused_step(inputs, default_chunks=True),
             "passes": passes_step(inputs)}
    times: dict = {name: [] for name in steps}
    for step in steps.values():           # warm-up: thread pools, first-call paths, the heap at this shape
        step()
    for _ in range(args.rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            own = step()
            times[name].append(own if own is not None else time.perf_counter() - start)
    floor = min(times["floor"])
    print(f"shape {args.shape}, {args.dtype}, {args.threads} threads, {args.rounds} rounds "
          f"(torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()})")
    for name, values in times.items():
        best = min(values)
        print(f"{name:13s} min {best:7.3f} s  median {statistics.median(values):7.3f} s  "
              f"min / floor {best / floor:5.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
