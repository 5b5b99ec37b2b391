"""A training run's records as a results page: one table row per step of its metrics.jsonl, beside a copy of it.

python -m grpo_fast.benchmarks.run_summary RUN_DIR --name dapo_smollm2_cpu --command "grpo-fast train ..." \
    [--out benchmarks/results/cpu] [--overwrite]

Writes NAME.md (the command, the machine, the table: reward, the share of groups dynamic sampling dropped and its
rounds, the clip fractions, loss, completion length, truncation, seconds) and NAME_metrics.jsonl (the run's
records as they are) to --out; existing ones are kept unless --overwrite.
"""

import argparse
import json
import math
import os
import shutil
import sys

# (record key, column title, format); a key a run does not log shows "-"
COLUMNS = [("step", "step", "{:d}"), ("reward", "reward", "{:.3f}"), ("reward_kept", "reward kept", "{:.3f}"),
           ("frac_filtered_groups", "groups dropped", "{:.2f}"), ("sampling_rounds", "rounds", "{:d}"),
           ("clip_ratio/low_mean", "clip low", "{:.4f}"), ("clip_ratio/high_mean", "clip high", "{:.4f}"),
           ("clip_ratio/region_mean", "clip region", "{:.4f}"), ("loss", "loss", "{:.4f}"),
           ("completion_len", "completion tokens", "{:.0f}"), ("truncated", "truncated", "{:.3f}"),
           ("seconds", "seconds", "{:.0f}")]


def records(run_dir: str) -> list:
    """The run's metrics.jsonl, one dict per step; ValueError naming the file when there is none."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise ValueError(f"{run_dir}: no metrics.jsonl (not a run folder, or a run that has not finished a step)")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def cell(value, spec: str) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return spec.format(int(value) if spec == "{:d}" else value)


def table(rows: list) -> str:
    columns = [column for column in COLUMNS if any(column[0] in row for row in rows)]
    lines = ["| " + " | ".join(title for _, title, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(key), spec) for key, _, spec in columns) + " |" for row in rows]
    return "\n".join(lines)


def page(rows: list, name: str, command: str, machine: str) -> str:
    return (f"# {name} on {machine}\n\n`{command}`\n\n{table(rows)}\n\n"
            f"The run's records: `{name}_metrics.jsonl`.\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir")
    parser.add_argument("--name", required=True)
    parser.add_argument("--command", required=True, help="the command that made the run, for the page")
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    rows = records(args.run_dir)
    targets = [os.path.join(args.out, f"{args.name}.md"), os.path.join(args.out, f"{args.name}_metrics.jsonl")]
    if any(os.path.exists(path) for path in targets) and not args.overwrite:
        parser.error(f"{targets[0]} exists: pass --overwrite to replace it, or another --out")
    from grpo_fast.benchmarks.profiling import machine_name

    os.makedirs(args.out, exist_ok=True)
    with open(targets[0], "w", encoding="utf-8") as f:
        f.write(page(rows, args.name, args.command, machine_name("cpu")))
    shutil.copyfile(os.path.join(args.run_dir, "metrics.jsonl"), targets[1])
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
