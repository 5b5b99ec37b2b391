"""Synchronous vs asynchronous rollouts, side by side in one run: max_staleness 0, 1, 2 with each engine.

python -m grpo_fast.benchmarks.async_rollouts --out benchmarks/results/cpu [--engines hf vllm] [--staleness 0 1 2]

Two jobs, each a `grpo-fast train` in a fresh process (so that every run starts with the same threads):
  default: the README's main job as it is (300 steps, evaluations on): reward curve, held-out accuracy, wall time.
  long:    the same model with 256-token completions (ignore_eos), 4 prompts x 8 a step, 8 steps, no evaluations:
           generation dominates the step, as in reasoning RL. Its reward is 0 (it times the loop, nothing else).
For each run: the steady-state seconds per step (steps after the first max_staleness + 1, whose rollouts the
engine could not start early), steps per hour from them, the share of the trainer's step spent waiting for its
rollout, and the share of the engine's time spent idle (waiting for a request or loading pushed weights).
Writes async_rollouts.md / .json / .png to --out.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from grpo_fast.benchmarks.profiling import machine_name
from grpo_fast.train.run.record import read_records

JOBS = {
    "default": [],
    "long": ["--max-completion-length", "256", "--ignore-eos", "true", "--prompts-per-step", "4", "--max-steps", "8",
             "--eval-every", "0", "--save-every", "1000", "--log-completions", "0"],
}


def run_one(job: str, engine: str, staleness: int, folder: str) -> dict:
    """One training run in its own process; its metrics summarized."""
    output_dir = os.path.join(folder, f"{job}-{engine}-{staleness}")
    command = [sys.executable, "-m", "grpo_fast.cli", "train", "--engine", engine, "--max-staleness", str(staleness),
               "--output-dir", output_dir, *JOBS[job]]
    started = time.perf_counter()
    process = subprocess.run(command, capture_output=True, text=True)
    wall = time.perf_counter() - started
    row = {"job": job, "engine": engine, "max_staleness": staleness, "run_seconds": wall}
    if process.returncode != 0:
        row["error"] = (process.stderr.strip().splitlines() or ["exit code %d" % process.returncode])[-1]
        return row
    records = read_records(os.path.join(output_dir, "metrics.jsonl"))
    steady = records[staleness + 1:]
    step_seconds = sum(r["seconds"] for r in steady) / len(steady)
    row.update(steps=len(records), step_seconds=step_seconds, steps_per_hour=3600 / step_seconds,
               trainer_wait_share=sum(r["generation_seconds"] for r in steady) / sum(r["seconds"] for r in steady),
               update_seconds=sum(r["update_seconds"] for r in steady) / len(steady),
               rewards=[r["reward"] for r in records])
    if staleness:
        engine_busy = sum(r["engine_generation_seconds"] for r in steady)
        engine_idle = sum(r["engine_idle_seconds"] for r in steady)
        row.update(engine_generation_seconds=engine_busy / len(steady),
                   engine_idle_share=engine_idle / (engine_busy + engine_idle),
                   staleness_max=max(r["staleness"] for r in records))
    else:
        row["engine_generation_seconds"] = row["trainer_wait_share"] * step_seconds
    tenth = max(1, len(records) // 10)
    row["reward_first_tenth"] = sum(row["rewards"][:tenth]) / tenth
    row["reward_last_tenth"] = sum(row["rewards"][-tenth:]) / tenth
    eval_path = os.path.join(output_dir, "eval.jsonl")
    if os.path.exists(eval_path):
        evals = read_records(eval_path)
        row["eval_accuracy"] = [evals[0]["accuracy"], evals[-1]["accuracy"]]
    return row


def table(rows: list) -> str:
    lines = ["| job | engine | max_staleness | s / step | steps / hour | vs staleness 0 | update s | generation s "
             "| trainer waits | engine idle | reward first -> last tenth | held-out accuracy | run s |",
             "|" + "---|" * 13]
    base = {(r["job"], r["engine"]): r.get("step_seconds") for r in rows if r["max_staleness"] == 0}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['job']} | {r['engine']} | {r['max_staleness']} | error: {r['error']} |" + " |" * 9)
            continue
        speedup = base.get((r["job"], r["engine"]))
        accuracy = r.get("eval_accuracy")
        lines.append(
            f"| {r['job']} | {r['engine']} | {r['max_staleness']} | {r['step_seconds']:.3f} | "
            f"{r['steps_per_hour']:.0f} | {speedup / r['step_seconds']:.2f}x | {r['update_seconds']:.3f} | "
            f"{r['engine_generation_seconds']:.3f} | {r['trainer_wait_share']:.0%} | "
            + (f"{r['engine_idle_share']:.0%}" if "engine_idle_share" in r else "-") + " | "
            f"{r['reward_first_tenth']:.3f} -> {r['reward_last_tenth']:.3f} | "
            + (f"{accuracy[0]:.3f} -> {accuracy[1]:.3f}" if accuracy else "-") + f" | {r['run_seconds']:.0f} |")
    return "\n".join(lines)


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 1, figsize=(7, 4))
    for r in rows:
        if r["job"] != "default" or "error" in r:
            continue
        rewards, window = r["rewards"], 20
        smooth = [sum(rewards[max(0, i - window + 1):i + 1]) / len(rewards[max(0, i - window + 1):i + 1])
                  for i in range(len(rewards))]
        axes.plot(range(1, len(rewards) + 1), smooth, label=f"{r['engine']}, max_staleness {r['max_staleness']}",
                  linestyle="-" if r["engine"] == "hf" else "--")
    axes.set(xlabel="step", ylabel="mean reward (20 steps)", title="default job: reward by staleness")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"])
    parser.add_argument("--staleness", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for job in args.jobs:
            for engine in args.engines:
                for staleness in args.staleness:
                    rows.append(run_one(job, engine, staleness, folder))
                    print(json.dumps({k: v for k, v in rows[-1].items() if k != "rewards"}), flush=True)
    command = "python -m grpo_fast.benchmarks.async_rollouts " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"machine": machine_name("cuda" if torch.cuda.is_available() else "cpu"), "command": command,
              "rows": rows}
    print(report(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "async_rollouts.md"), "w") as f:
            f.write(report(result))
        with open(os.path.join(args.out, "async_rollouts.json"), "w") as f:
            json.dump(result, f, indent=1)
        plot(rows, os.path.join(args.out, "async_rollouts.png"))


def report(result: dict) -> str:
    """The markdown of a run (async_rollouts.json's contents)."""
    return f"# Asynchronous rollouts on {result['machine']}\n\n`{result['command']}`\n\n{table(result['rows'])}\n"


if __name__ == "__main__":
    main()
