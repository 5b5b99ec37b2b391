"""Peak memory of one HF-engine rollout with and without the sampling log-probs a rollout process records.

python -m grpo_fast.benchmarks.hf_rollout_memory [--model smollm2-135m-instruct] [--tokens 2048] [--group-size 2]
                                                 [--variants none logps kept-logits] [--repeats 1] [--threads N]
                                                 [--malloc-mmap-threshold BYTES] [--out DIR] [--overwrite]

Each variant runs in a fresh process: the HF engine built as the trainer's rollout process builds it (fp32, the
model's folder), one GSM8K prompt in the chat template, group_size completions forced to --tokens tokens
(ignore_eos), the same seed. Memory is the process's peak RSS during the rollout above its RSS before it (after
a short warm-up rollout that loads what generation loads lazily). Variants:

    none         the engine without sampling log-probs (what the trainer's own process runs)
    logps        with them: the sampler takes each drawn token's log-prob as it draws it
    kept-logits  with them as the engine took them before: every decode step's fp32 logits kept by `generate`
                 (output_logits), stacked, divided by the temperature and log-softmaxed after the call

--repeats N runs the variants in turn N times (peak RSS under glibc's default allocator settings moves by tens of
MiB between identical runs: freed blocks below its rising mmap threshold stay in the process; a fixed
--malloc-mmap-threshold returns larger blocks when freed, so that peak RSS follows the live memory). Writes
hf_rollout_memory.md / .json (hf_rollout_memory_mmap<BYTES> with a fixed threshold) to --out, kept unless
--overwrite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

GIB = 2**30
VARIANTS = ("none", "logps", "kept-logits")
NAME = "hf_rollout_memory"


def keep_logits(engine) -> None:
    """Makes `engine` record its log-probs as it did before they were taken in the sampler: `generate` keeps every
    decode step's fp32 logits, which are stacked, divided by the temperature and log-softmaxed after the call
    (the engine's own values are kept; these only occupy the memory the old recording did)."""
    model, original = engine.model, engine.model.generate
    temperature = engine.rollout.temperature

    def generate(*args, **kwargs):
        output = original(*args, **kwargs, output_logits=True)
        sampled = output.sequences[:, -len(output.logits):]
        logits = torch.stack(output.logits, dim=1).float() / temperature
        logits.log_softmax(-1).gather(-1, sampled[..., None]).squeeze(-1).tolist()
        return output

    model.generate = generate


def worker(args) -> dict:
    """One rollout of variant args.worker in this process."""
    from grpo_fast.benchmarks.profiling import peak_rss_bytes, start_peak_rss
    from grpo_fast.benchmarks.real_model import gsm8k_prompts
    from grpo_fast.train import pretrained
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.rollout.process import _build_engine

    variant = args.worker
    if args.threads:
        torch.set_num_threads(args.threads)
    config = TrainConfig.from_keys(model=args.model, engine="hf", group_size=args.group_size, ignore_eos=True,
                                   max_completion_length=args.tokens, device="cpu")
    engine = _build_engine({"rollout": config.rollout, "seed": 0, "model_dir": pretrained.model_folder(args.model),
                            "dtype": torch.float32, "device": "cpu", "rope_scaling": None})
    engine.sampling_logps = variant != "none"
    if variant == "kept-logits":
        keep_logits(engine)
    prompts = gsm8k_prompts(engine.tokenizer, 1)
    engine.generate(prompts, seed=0, max_tokens=8)               # warm-up: what generation loads on first use
    baseline = start_peak_rss()
    started = time.perf_counter()
    generation = engine.generate(prompts, seed=0)
    seconds = time.perf_counter() - started
    peak = peak_rss_bytes() - baseline
    sampled = int(generation.completion_mask.sum())
    assert sampled == args.group_size * args.tokens, (sampled, args.group_size, args.tokens)
    return {"variant": variant, "prompt_tokens": len(prompts[0]), "completions": args.group_size,
            "completion_tokens": args.tokens, "peak_growth_bytes": int(peak), "baseline_rss_bytes": int(baseline),
            "seconds": seconds, "tokens_per_s": sampled / seconds,
            "completions_sha1": hashlib.sha1(generation.completion_ids.numpy().tobytes()).hexdigest()}


def in_fresh_process(args, variant: str) -> dict:
    """worker() for `variant` in a fresh interpreter: its JSON line, or the row with the error that stopped it."""
    command = [sys.executable, "-m", "grpo_fast.benchmarks.hf_rollout_memory", "--worker", variant,
               "--model", args.model, "--tokens", str(args.tokens), "--group-size", str(args.group_size),
               "--threads", str(args.threads)]
    env = None
    if args.malloc_mmap_threshold:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(args.malloc_mmap_threshold))
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"variant": variant, "error": f"timed out after {args.timeout} s (--timeout)"}
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"variant": variant, "error": tail[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def results_name(args) -> str:
    """hf_rollout_memory, or hf_rollout_memory_mmap<BYTES> with a fixed glibc mmap threshold."""
    return NAME + (f"_mmap{args.malloc_mmap_threshold}" if args.malloc_mmap_threshold else "")


def summary(rows: list) -> dict:
    """{variant: (median peak RSS growth, the runs' growths, median seconds, median tokens/s)} of the rows that
    finished, in the order the variants first ran."""
    out = {}
    for variant in dict.fromkeys(row["variant"] for row in rows):
        done = [row for row in rows if row["variant"] == variant and "error" not in row]
        if done:
            growths = [row["peak_growth_bytes"] for row in done]
            out[variant] = (statistics.median(growths), growths, statistics.median(r["seconds"] for r in done),
                            statistics.median(r["tokens_per_s"] for r in done))
    return out


def table(rows: list) -> list:
    """Markdown rows: each variant's median peak RSS growth over its runs (and each run's), also as a ratio to the
    median without log-probs; then the runs that failed."""
    medians = summary(rows)
    base = medians.get("none", (0,))[0]
    lines = ["| variant | completions x tokens | peak RSS growth, median (GiB) | each run (GiB) | vs without "
             "log-probs | rollout (s) | tokens/s |", "|---|---|---|---|---|---|---|"]
    shape = next((f"{row['completions']} x {row['completion_tokens']}" for row in rows if "error" not in row), "-")
    for variant, (median, growths, seconds, rate) in medians.items():
        ratio = f"{median / base:.3f}x" if base > 0 else "-"
        runs = ", ".join(f"{growth / GIB:.3f}" for growth in growths)
        lines.append(f"| {variant} | {shape} | {median / GIB:.3f} | {runs} | {ratio} | {seconds:.0f} | "
                     f"{rate:.1f} |")
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['variant']} | - | {row['error']} | - | - | - | - |")
    return lines


def write(rows: list, args, command: str) -> None:
    from grpo_fast.benchmarks.harness import write_results
    from grpo_fast.benchmarks.profiling import machine_name

    same = len({row["completions_sha1"] for row in rows if "error" not in row}) == 1
    threshold = (f", glibc's mmap threshold fixed at {args.malloc_mmap_threshold} bytes (MALLOC_MMAP_THRESHOLD_)"
                 if args.malloc_mmap_threshold else ", glibc's default allocator settings")
    setting = (f"{args.model} (fp32), the HF engine as the trainer's rollout process builds it, GSM8K's first "
               f"problem in the chat template, {args.group_size} completions forced to {args.tokens} tokens "
               f"(ignore_eos), seed 0, {args.threads or 'torch default'} thread(s); peak RSS of a fresh process "
               f"during the rollout above its RSS before it{threshold}; the same completions in every variant: "
               f"{'yes' if same else 'NO'}")
    lines = [f"# HF rollout memory with and without sampling log-probs on {machine_name('cpu')}", "", setting, "",
             f"`{command}`", ""] + table(rows)
    write_results(args.out, results_name(args), "\n".join(lines) + "\n",
                  {"setting": setting, "command": command, "same_completions": same, "rows": rows})


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct",
                        help="smollm2-135m-instruct or a local Hugging Face model folder")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--repeats", type=int, default=1, help="run the variants in turn this many times")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch threads of the workers (default: torch's own; 1 on a machine others share, "
                             "where two threads' barriers wait on each other)")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="the workers' glibc MALLOC_MMAP_THRESHOLD_ (default: glibc's own)")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument("--worker", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    from grpo_fast.benchmarks.harness import refuse_to_overwrite

    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    refuse_to_overwrite(parser, args.out, results_name(args), args.overwrite)
    command = "python -m grpo_fast.benchmarks.hf_rollout_memory " + shlex.join(sys.argv[1:] if argv is None
                                                                                 else argv)
    rows = []
    for _ in range(args.repeats):
        for variant in args.variants:
            rows.append(in_fresh_process(args, variant))
            print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            if args.out:
                write(rows, args, command)
    print("\n".join(table(rows)))
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
