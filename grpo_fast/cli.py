"""The `grpo-fast` command."""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-fast", description="The GRPO-family loss without the logits.")
    commands = parser.add_subparsers(dest="command", required=True)
    from grpo_fast import demo

    demo_parser = commands.add_parser("demo", help="memory and time of the full-logits loss vs grpo_fast")
    demo.add_arguments(demo_parser)
    bench_parser = commands.add_parser("bench", help="time, memory and GEMM passes against naive, TRL and Liger")
    from grpo_fast.benchmarks import harness

    harness.add_arguments(bench_parser)
    args = parser.parse_args(argv)
    if args.command == "bench":
        return harness.main(args)
    if args.command == "demo":
        rows = demo.run(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.backend, args.repeats)
        return 0 if all("error" not in r for r in rows) else 1
    return 2


if __name__ == "__main__":
    sys.exit(main())
