"""The `grpo-fast` command: each subcommand imports what it runs (the trainer, the planner, the harness) when
it runs, so `import grpo_fast` loads the loss library alone."""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="grpo-fast", description="The GRPO-family loss without the logits.")
    commands = parser.add_subparsers(dest="command", required=True)
    from grpo_fast.benchmarks import demo

    demo_parser = commands.add_parser("demo", help="memory and time of the full-logits loss vs grpo_fast")
    demo.add_arguments(demo_parser)
    bench_parser = commands.add_parser("bench", help="time, memory and GEMM passes against naive, TRL and Liger")
    from grpo_fast.benchmarks import harness

    harness.add_arguments(bench_parser)
    plan_parser = commands.add_parser("plan", help="predicted peak GPU memory of a GRPO job, per component")
    from grpo_fast.train import plan as memory

    memory.add_arguments(plan_parser)
    train_parser = commands.add_parser(
        "train", help="GRPO training (default: a tiny model on the arithmetic task, on CPU)",
        usage="grpo-fast train [CONFIG.yaml] [--output-dir DIR] [--max-steps N] [--resume] [--key value ...]",
        description="Keys are the fields of grpo_fast.train.config.TrainConfig (dashes or underscores).")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"] and not {"-h", "--help"} & set(argv[1:]):
        return _train(argv[1:])                 # free-form --key value pairs: parsed by the config itself
    args = parser.parse_args(argv)
    if args.command == "plan":
        return memory.main(args)
    if args.command == "bench":
        return harness.main(args)
    if args.command == "demo":
        rows = demo.run(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.backend, args.repeats)
        return 0 if all("error" not in r for r in rows) else 1
    return 2



def _train(arguments: list) -> int:
    from grpo_fast.train.config import load_config, parse_overrides
    from grpo_fast.train.loop import train

    arguments = list(arguments)
    config_path = arguments.pop(0) if arguments and not arguments[0].startswith("--") else None
    resume = "--resume" in arguments
    arguments = [item for item in arguments if item != "--resume"]
    try:
        config = load_config(config_path, parse_overrides(arguments))
    except (ValueError, OSError) as error:
        print(f"grpo-fast train: {error}", file=sys.stderr)
        return 2
    try:
        history = train(config, resume=resume)
    except KeyboardInterrupt:
        print("stopped; the last checkpoint is in " + config.output_dir, file=sys.stderr)
        return 130
    if history and os.environ.get("RANK", "0") == "0":
        first, last = history[0]["reward"], history[-1]["reward"]
        print(f"done: {len(history)} steps, reward {first:.3f} -> {last:.3f}; {config.output_dir}/metrics.jsonl, "
              f"curves.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
