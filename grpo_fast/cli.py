"""The `grpo-fast` command: train, eval, generate, export, plan, bench, demo. The loss library never imports this
module; it imports the trainer, the planner and the benchmark harness (`grpo_fast.benchmarks`, installed from
benchmarks/)."""

from __future__ import annotations

import argparse
import os
import sys
import warnings

NOT_INSTALLED = ("grpo-fast {command}: the benchmark harness (grpo_fast.benchmarks, from the repository's benchmarks/ "
                 "folder) is importable only from an install: run `pip install -e .` in the repository")


def main(argv=None) -> int:
    own = argv is None                          # this process's command line (not a program calling main)
    if own:
        from grpo_fast.train.run import quiet

        quiet.quiet_output()
    argv = sys.argv[1:] if own else list(argv)
    if argv[:1] == ["train"] and not {"-h", "--help"} & set(argv[1:]):
        return _train(argv[1:], own)            # free-form --key value pairs: parsed by the config itself
    if argv[:1] == ["eval"] and argv[1:2] and not {"-h", "--help"} & set(argv[1:]):
        return _eval(argv[1], argv[2:])
    from grpo_fast.train.plan import command as plan_command
    from grpo_fast.train.saved import generate as generate_command

    try:
        from grpo_fast.benchmarks import demo, harness
    except ModuleNotFoundError as error:       # a source tree on sys.path without an install
        if not (error.name or "").startswith("grpo_fast.benchmarks"):
            raise
        demo = harness = None
    parser = argparse.ArgumentParser(prog="grpo-fast", description="The GRPO-family loss without the logits.")
    commands = parser.add_subparsers(dest="command", required=True)
    demo_parser = commands.add_parser("demo", help="memory and time of the full-logits loss vs grpo_fast")
    bench_parser = commands.add_parser("bench", help="time, memory and GEMM passes against naive, TRL and Liger")
    if harness is not None:
        demo.add_arguments(demo_parser)
        harness.add_arguments(bench_parser)
    plan_parser = commands.add_parser("plan", help="predicted peak GPU memory of a GRPO job, per component")
    plan_command.add_arguments(plan_parser)
    export_parser = commands.add_parser("export", help="a run's newest checkpoint as a Hugging Face model folder "
                                        "(LoRA adapters merged)")
    export_parser.add_argument("run_dir", help="a training run's output_dir")
    export_parser.add_argument("out_dir", help="the folder to create (must not exist)")
    export_parser.add_argument("--peft-adapter", action="store_true",
                               help="a LoRA run's adapters also as a PEFT adapter in OUT_DIR/adapter")
    commands.add_parser(
        "eval", help="accuracy, pass@k and completion length on held-out problems (a run or a model folder)",
        usage="grpo-fast eval RUN_DIR|MODEL_DIR [--task T] [--num-samples K] [--engine hf|vllm] [--key value ...]",
        description="RUN_DIR: a training run, evaluated with its config on the problems it held out, at its "
                    "newest checkpoint (its model/ export when that is the same step). MODEL_DIR: a Hugging Face "
                    "model folder, on all problems of --task. --num-samples K: completions per problem (pass@k "
                    "for k up to K; default eval_samples). Any key of `grpo-fast train` may follow (e.g. "
                    "--eval-prompts 200 --max-completion-length 512 --prompt-format chat). Prints the record as one "
                    "JSON line.")
    generate_parser = commands.add_parser(
        "generate", help="the trained model answers a prompt, rendered and sampled as its run does (a run or a "
                         "model folder)",
        description="RUN_OR_MODEL: a training run, answering with its config (prompt format, system prompt, "
                    "temperature, top_p, top_k, max_completion_length) at its newest checkpoint (its model/ export "
                    "when that is the same step), or a Hugging Face model folder, with the trainer's defaults. "
                    "Prints each completion's text, a header line before each when there are several.")
    generate_command.add_arguments(generate_parser)
    from grpo_fast.train.config import keys_help

    commands.add_parser(
        "train", help="GRPO training (default: a tiny model on the max task, the largest of four numbers, on "
                      "CPU)",
        usage="grpo-fast train [CONFIG.yaml] [--output-dir DIR] [--max-steps N] [--resume] [--key value ...]",
        description="Keys (in CONFIG.yaml, or as --key value with dashes or underscores), with their defaults:\n\n"
                    + keys_help(), formatter_class=argparse.RawDescriptionHelpFormatter)
    # without the harness its commands' options are unknown here: parse what is known, then say how to install
    args = parser.parse_args(argv) if harness is not None else parser.parse_known_args(argv)[0]
    if args.command == "plan":
        return plan_command.main(args)
    if args.command == "export":
        return _export(args.run_dir, args.out_dir, args.peft_adapter)
    if args.command == "generate":
        return _generate(args)
    if args.command == "eval":                  # here only without a target (else dispatched above)
        print("grpo-fast eval: name a run folder or a model folder (grpo-fast eval --help)", file=sys.stderr)
        return 2
    if harness is None:
        print(NOT_INSTALLED.format(command=args.command), file=sys.stderr)
        return 2
    if args.command == "bench":
        return harness.main(args)
    rows = demo.run(args.tokens, args.hidden, args.vocab, args.dtype, args.device, args.backend, args.repeats)
    return 0 if all("error" not in r for r in rows) else 1


def _export(run_dir: str, out_dir: str, adapter: bool = False) -> int:
    from grpo_fast.train.saved.export import export_run

    try:
        print(f"exported {export_run(os.path.expanduser(run_dir), os.path.expanduser(out_dir), adapter)}")
    except (ValueError, OSError) as error:
        print(f"grpo-fast export: {error}", file=sys.stderr)
        return 2
    return 0


def _generate(args) -> int:
    from grpo_fast.train.saved import generate

    try:
        generate.main(os.path.expanduser(args.target), args.prompt, generate.overrides_of(args), args.max_new_tokens,
                      args.num_samples)
    except (ValueError, OSError) as error:
        print(f"grpo-fast generate: {error}", file=sys.stderr)
        return 2
    return 0


def _eval(target: str, arguments: list) -> int:
    from grpo_fast.train.config import parse_overrides
    from grpo_fast.train.saved.eval_command import main as evaluate_main

    try:
        overrides = parse_overrides(arguments)
        if "num_samples" in overrides:
            if "eval_samples" in overrides:
                raise ValueError("--num-samples and --eval-samples are the same key: give one of them")
            overrides["eval_samples"] = overrides.pop("num_samples")
        evaluate_main(os.path.expanduser(target), overrides)
    except (ValueError, OSError) as error:
        print(f"grpo-fast eval: {error}", file=sys.stderr)
        return 2
    return 0


def _late_config(arguments: list):
    """The YAML file named where a --key belongs (after --key value pairs), or None."""
    index = 0
    while index < len(arguments):
        item = arguments[index]
        if not item.startswith("--"):
            return item if item.endswith((".yaml", ".yml")) else None
        index += 1 if "=" in item else 2
    return None


def _thread_note(device: str) -> None:
    """A line of the run's log when torch runs several threads on CPU on a host of at most 2 cores: when other
    processes share those cores, OpenMP's threads wait for each other and run tens of times slower than one thread.
    The count is the user's (OMP_NUM_THREADS): it is named, not changed."""
    import torch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if on_cpu and cores <= 2 and torch.get_num_threads() > 1:
        print(f"note: torch runs {torch.get_num_threads()} threads on {cores} cores; if other processes share them, "
              "set OMP_NUM_THREADS=1 (several threads on busy cores run tens of times slower than one)")


def _train(arguments: list, own: bool = False) -> int:
    from grpo_fast.train.config import load_config, parse_overrides
    from grpo_fast.train.loop import RunError, train
    from grpo_fast.train.run import signals
    from grpo_fast.train.run.record import read_records
    from grpo_fast.train.saved.checkpoint import latest_checkpoint

    arguments = list(arguments)
    config_path = arguments.pop(0) if arguments and not arguments[0].startswith("--") else None
    resume = "--resume" in arguments
    arguments = [item for item in arguments if item != "--resume"]
    late = None if config_path else _late_config(arguments)
    if late:
        rest = " ".join([item for item in arguments if item is not late] + ["--resume"] * resume)
        print(f"grpo-fast train: the config file comes first, got {late!r} after --key value pairs: grpo-fast train "
              f"{late} {rest}", file=sys.stderr)
        return 2
    try:
        with warnings.catch_warnings(record=True) as caught:      # a flat config file: one line, then it trains
            warnings.simplefilter("always", FutureWarning)
            config = load_config(config_path, parse_overrides(arguments))
        for warning in caught:
            print(f"grpo-fast train: {warning.message}", file=sys.stderr)
    except (ValueError, OSError) as error:
        print(f"grpo-fast train: {error}", file=sys.stderr)
        return 2
    if own:                            # a program calling main sets its own threads
        _thread_note(config.policy.device)
    signals.stop_once_for_good()       # the first Ctrl-C / SIGTERM stops the run; later ones cannot cut its save
    try:
        history = train(config, resume=resume)
    except KeyboardInterrupt as interrupt:
        # the checkpoint the loop saved, or (stopped before its loop) the one a resume started from
        saved = getattr(interrupt, "checkpoint", None) or (resume and latest_checkpoint(config.run.output_dir))
        signals.ignore_stops()         # saved: this is the last line, and the exit is not cut
        print("stopped" + (f"; resume from {saved} with --resume" if saved else " before the first step; nothing "
                           "was saved"), file=sys.stderr)
        return 130
    except (ValueError, OSError, RunError) as error:         # the cause is named: one line, not a traceback
        print(f"grpo-fast train: {error}", file=sys.stderr)
        return 2
    metrics_path = os.path.join(config.run.output_dir, "metrics.jsonl")
    if history and os.path.exists(metrics_path):      # the whole run's steps, a resumed one's earlier part too
        records = read_records(metrics_path)          # (resume checked each line is a step's record)
        history = [r for r in records if isinstance(r.get("reward"), (int, float))] or history
    if history and os.environ.get("RANK", "0") == "0":
        tenth = max(1, len(history) // 10)
        first = sum(r["reward"] for r in history[:tenth]) / tenth
        last = sum(r["reward"] for r in history[-tenth:]) / tenth
        line = f"done: {len(history)} steps, mean reward {first:.3f} (first tenth) -> {last:.3f} (last tenth)"
        evals_path = os.path.join(config.run.output_dir, "eval.jsonl")
        if os.path.exists(evals_path):
            evals = read_records(evals_path)
            if evals:
                line += (f", held-out accuracy {evals[0]['accuracy']:.3f} (step {evals[0]['step']}) -> "
                         f"{evals[-1]['accuracy']:.3f} (step {evals[-1]['step']})")
        written = [name for name in ("metrics.jsonl", "eval.jsonl", "curves.png", "model")
                   if os.path.exists(os.path.join(config.run.output_dir, name))]
        print(f"{line}; {config.run.output_dir}/" + ", ".join(name + "/" if name == "model" else name
                                                          for name in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
