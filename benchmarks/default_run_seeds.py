"""The default run over seeds and thread counts: how far its result depends on the order of floating-point sums.

python -m grpo_fast.benchmarks.default_run_seeds [--seeds 0 1 2 3 4] [--threads 1 2] [--isa default avx2] [--jobs 2]
    [--out FILE.json] [-- KEY VALUE ...]

Each run is `grpo-fast train --seed S` in a fresh process with OMP_NUM_THREADS set. From the same seed two
machines start alike and then part ways through the order of their floating-point sums, which RL amplifies: a
thread count can change that order, and so can the vector instructions, which `--isa avx2` picks on an AVX-512
CPU (ATEN_CPU_CAPABILITY for torch's kernels, MKL_ENABLE_INSTRUCTIONS for its GEMMs), as another CPU would.
Arguments after `--` go to every run (`-- --learning-rate 1e-3`), to try another default. `--jobs` runs that
many at once (two single-thread runs on two cores; wall times then include the sharing). Prints one row per run
(mean reward of the first and last tenth of the steps, held-out accuracy before and after GRPO, wall and CPU
time) and min / median / max; `--out` also writes them as JSON, never over an existing file.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

COLUMNS = ("reward_first_tenth", "reward_last_tenth", "accuracy_before", "accuracy_after", "wall_seconds",
           "cpu_seconds")


ISA = {"default": {}, "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
       "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"}}


def run_one(seed: int, threads: int, isa: str, folder: str, extra: list) -> dict:
    """One `grpo-fast train` in its own process; its metrics summarized."""
    output_dir = os.path.join(folder, f"seed{seed}-threads{threads}-{isa}")
    command = [sys.executable, "-m", "grpo_fast.cli", "train", "--seed", str(seed), "--output-dir", output_dir,
               *extra]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), **ISA[isa]}
    started = time.perf_counter()
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
        _, status, usage = os.wait4(process.pid, 0)
        process.returncode = os.waitstatus_to_exitcode(status)
        stderr.seek(0)
        errors = stderr.read()
    # the run's own CPU time: on a shared machine the wall time counts the others' work, this does not (a
    # one-thread run's CPU seconds are its wall time on a quiet core)
    row = {"seed": seed, "threads": threads, "isa": isa, "wall_seconds": time.perf_counter() - started,
           "cpu_seconds": usage.ru_utime + usage.ru_stime}
    if process.returncode != 0:
        row["error"] = (errors.strip().splitlines() or [f"exit code {process.returncode}"])[-1]
        return row
    from grpo_fast.train.run.record import read_records

    rewards = [record["reward"] for record in read_records(os.path.join(output_dir, "metrics.jsonl"))]
    evals = read_records(os.path.join(output_dir, "eval.jsonl"))
    tenth = max(1, len(rewards) // 10)
    row.update(steps=len(rewards), reward_first_tenth=sum(rewards[:tenth]) / tenth,
               reward_last_tenth=sum(rewards[-tenth:]) / tenth, accuracy_before=evals[0]["accuracy"],
               accuracy_after=evals[-1]["accuracy"], accuracy_by_step={r["step"]: r["accuracy"] for r in evals})
    return row


def table(rows: list) -> str:
    lines = ["| seed | threads | isa | reward, first tenth | reward, last tenth | held-out before | after | wall time "
             "| CPU time |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['seed']} | {row['threads']} | {row['isa']} | error: {row['error']} |")
            continue
        lines.append(f"| {row['seed']} | {row['threads']} | {row['isa']} | {row['reward_first_tenth']:.3f} | "
                     f"{row['reward_last_tenth']:.3f} | {row['accuracy_before']:.3f} | {row['accuracy_after']:.3f} | "
                     f"{row['wall_seconds']:.0f} s | {row['cpu_seconds']:.0f} s |")
    done = [row for row in rows if "error" not in row]
    if done:
        for name, pick in (("min", min), ("median", statistics.median), ("max", max)):
            values = [pick(row[column] for row in done) for column in COLUMNS]
            lines.append(f"| {name} | | | {values[0]:.3f} | {values[1]:.3f} | {values[2]:.3f} | {values[3]:.3f} | "
                         f"{values[4]:.0f} s | {values[5]:.0f} s |")
    return "\n".join(lines)


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--isa", nargs="+", default=["default"], choices=sorted(ISA),
                        help="vector instructions of torch's kernels and MKL (default: the CPU's best)")
    parser.add_argument("--jobs", type=int, default=1, help="runs at once")
    parser.add_argument("--runs-dir", default=None, help="where the runs go (default: a temporary folder)")
    parser.add_argument("--out", default=None, help="a JSON file for the rows (refused if it exists)")
    args = parser.parse_args(argv)
    if args.out and os.path.exists(args.out):
        parser.error(f"{args.out} exists: pass another --out")
    folder = args.runs_dir or tempfile.mkdtemp(prefix="default_run_seeds-")
    cases = [(seed, threads, isa) for isa in args.isa for threads in args.threads for seed in args.seeds]
    print(f"{len(cases)} runs into {folder}, {args.jobs} at a time; extra arguments: {extra}", flush=True)
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda case: run_one(*case, folder, extra), cases))
    print(table(rows))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "x") as f:
            json.dump({"extra_arguments": extra, "cpu_count": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0 if all("error" not in row for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
