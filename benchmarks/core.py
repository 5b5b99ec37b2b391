"""Peak memory and time of the full-logits loss and grpo_fast's fused loss as the token count grows.

python benchmarks/core.py [--tokens 1024 2048 4096 8192] [--hidden 256] [--vocab 32768] [--out benchmarks/results]

Each (implementation, N) runs in a fresh process (`grpo_fast.demo.measure`), dapo with k3 KL, forward and
backward through hidden and the LM-head weight. Writes a markdown table and a JSON next to it, machine named.
"""

import argparse
import json
import os
import platform
import sys

import torch

import grpo_fast
from grpo_fast.demo import IMPLEMENTATIONS, machine_name, measure


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args(argv)

    machine = machine_name(args.device)
    rows = []
    for tokens in args.tokens:
        for impl in IMPLEMENTATIONS:
            row = measure(impl, tokens, args.hidden, args.vocab, args.dtype, args.device, repeats=args.repeats)
            row.update(tokens=tokens, hidden=args.hidden, vocab=args.vocab, dtype=args.dtype)
            rows.append(row)
            print(json.dumps(row), flush=True)

    lines = [f"# Core loss: full logits vs grpo_fast on {machine}", "",
             f"dapo + k3 KL, forward + backward, H={args.hidden}, V={args.vocab}, {args.dtype}, median of "
             f"{args.repeats}, each implementation in a fresh process; memory is peak growth above the inputs.",
             f"torch {torch.__version__}, grpo_fast {grpo_fast.__version__}, Python {platform.python_version()}.",
             "Command: `python " + " ".join(["benchmarks/core.py"] + (argv if argv is not None else sys.argv[1:]))
             + "`", "",
             "| N | fp32 logits (MiB) | reference time (s) | grpo_fast time (s) | time ratio | "
             "reference peak (MiB) | grpo_fast peak (MiB) | memory ratio |",
             "|---|---|---|---|---|---|---|---|"]
    for tokens in args.tokens:
        ref, fused = (next(r for r in rows if r["tokens"] == tokens and r["impl"] == impl) for impl in IMPLEMENTATIONS)
        logits_mib = tokens * args.vocab * 4 / 2**20
        if "error" in ref or "error" in fused:
            lines.append(f"| {tokens} | {logits_mib:.0f} | {ref.get('error', '')} | {fused.get('error', '')} |"
                         " | | | |")
            continue
        lines.append(
            f"| {tokens} | {logits_mib:.0f} | {ref['seconds']:.2f} | {fused['seconds']:.2f} | "
            f"{fused['seconds'] / ref['seconds']:.2f} | {ref['peak_bytes'] / 2**20:.0f} | "
            f"{fused['peak_bytes'] / 2**20:.0f} | {ref['peak_bytes'] / max(fused['peak_bytes'], 1):.1f}x |")
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"core-{args.device.split(':')[0]}")
    with open(stem + ".md", "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(stem + ".json", "w") as f:
        json.dump({"machine": machine, "cores": os.cpu_count(), "torch": torch.__version__,
                   "grpo_fast": grpo_fast.__version__, "rows": rows}, f, indent=1)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
