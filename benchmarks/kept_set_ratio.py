"""The rollout correction's ratio on unchanged weights under truncated sampling, with and without the kept set.

    python -m grpo_fast.benchmarks.kept_set_ratio --out benchmarks/results/cpu/kept_set_ratio
    python -m grpo_fast.benchmarks.kept_set_ratio --model smollm2-135m-instruct --task gsm8k ...

For each engine and sampling setting, the engine samples completions from the policy the trainer holds (no update
in between), and the ratio exp(trainer log-prob - engine log-prob) of every sampled token is computed twice: with
the trainer's log-probs over the whole vocabulary, and over each token's kept set (what the trainer does now). On
unchanged weights the right ratio is 1: the first carries the kept mass of each position (the bias), the second
only the engines' numerics. Reported: the mean ratio, the share of tokens outside [0.9, 1.1] and the largest
|log ratio|, per setting. vLLM needs top_k > 0 for its kept sets: its top-p rows run with top_k = --vllm-top-k.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

import torch

from grpo_fast.benchmarks.harness import refuse_to_overwrite, write_results
from grpo_fast.benchmarks.profiling import machine_name
from grpo_fast.kept import KeptSet
from grpo_fast.train import tasks
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.loop import load_data, load_policy
from grpo_fast.train.rollout.engines import make_engine
from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs

SETTINGS = ("top_p=1.0", "top_p=0.9", "top_p=0.8", "top_k=20")


def parse_setting(text: str) -> dict:
    """"top_p=0.9" or "top_k=20" (or both, comma-separated) -> TrainConfig fields."""
    fields = {}
    for part in text.split(","):
        name, _, value = part.partition("=")
        if name not in ("top_p", "top_k") or not value:
            raise argparse.ArgumentTypeError(f"a setting is top_p=P and/or top_k=K, got {text!r}")
        fields[name] = float(value) if name == "top_p" else int(value)
    return fields


def ratio_stats(trainer: torch.Tensor, engine: torch.Tensor, mask: torch.Tensor) -> dict:
    """Mean of exp(trainer - engine) over the masked tokens, the share outside [0.9, 1.1], the largest |log|."""
    log_ratio = (trainer - engine)[mask].double()
    ratio = log_ratio.exp()
    outside = ((ratio < 0.9) | (ratio > 1.1)).double().mean().item()
    return {"mean_ratio": ratio.mean().item(), "outside_0.9_1.1": outside,
            "max_abs_log_ratio": log_ratio.abs().max().item()}


def measure(engine, base: TrainConfig, setting: dict, model, prompts: list, vllm_top_k: int) -> dict:
    """One row: `engine` (started by start_engine) samples under `setting` (over `base`), the trainer scores the
    samples."""
    fields = dict(setting)
    if engine.name == "vllm" and fields.get("top_p", 1.0) < 1 and not fields.get("top_k"):
        fields["top_k"] = vllm_top_k
    config = base.replace(**{"engine": engine.name, "top_p": 1.0, "top_k": 0, **fields})
    engine.rollout = config.rollout
    engine_name = config.rollout.engine
    generation = engine.generate(prompts, seed=config.run.seed)
    batch = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                        generation.completion_ids, loss_mask=generation.completion_mask,
                        advantages=torch.zeros(generation.input_ids.shape[0]))
    policy, mask = Policy.of(model), generation.completion_mask
    whole = completion_logprobs(policy, batch, config.batching, config.rollout.temperature)
    row = {"engine": engine_name, "setting": ", ".join(f"{k}={v}" for k, v in fields.items()),
           "tokens": int(mask.sum()), "vocabulary": ratio_stats(whole, generation.sampling_logps, mask)}
    if generation.kept_ids is not None:
        batch.kept = KeptSet.of(generation.kept_ids, generation.kept_offsets)
        kept = completion_logprobs(policy, batch, config.batching, config.rollout.temperature)
        row["kept_set"] = ratio_stats(kept, generation.sampling_logps, mask)
        sizes = batch.kept.sizes().view(mask.shape)[mask].double()
        row["mean_kept_size"] = sizes.mean().item()
    return row


def start_engine(engine_name: str, base: TrainConfig, model, tokenizer, longest_prompt: int, top_k: int):
    """One engine for every setting (vLLM starts once): started with the largest top_k the settings use, which
    sizes the log-probs vLLM may return."""
    engine = make_engine(base.replace(engine=engine_name, top_k=top_k), model, tokenizer,
                         longest_prompt)
    if engine_name == "hf":
        engine.sampling_logps = True              # the engine's own log-prob of each sampled token
    return engine


def markdown(rows: list, args, machine: str, command: str) -> str:
    lines = [f"# The rollout correction's ratio on unchanged weights, {args.model} ({machine})", "",
             f"`{command}`", "",
             f"{args.prompts} prompts x {args.group_size} completions, at most {args.tokens} tokens, temperature "
             f"{args.temperature}; vLLM in {args.vllm_dtype}. Ratio = exp(trainer - engine) per sampled token.", "",
             "| engine | sampling | tokens | mean kept | mean ratio, whole vocabulary | outside [0.9, 1.1] | "
             "mean ratio, kept set | outside [0.9, 1.1] | max abs log ratio, kept set |",
             "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        whole, kept = row["vocabulary"], row.get("kept_set")
        kept_cells = ("-", "-", "-", "-") if kept is None else (
            f"{row['mean_kept_size']:.1f}", f"{kept['mean_ratio']:.6f}", f"{100 * kept['outside_0.9_1.1']:.1f}%",
            f"{kept['max_abs_log_ratio']:.1e}")
        lines.append(f"| {row['engine']} | {row['setting']} | {row['tokens']} | {kept_cells[0]} | "
                     f"{whole['mean_ratio']:.4f} | {100 * whole['outside_0.9_1.1']:.1f}% | {kept_cells[1]} | "
                     f"{kept_cells[2]} | {kept_cells[3]} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny",
                        help='"tiny" (the built-in default, warm-started) or a model name (as shipped)')
    parser.add_argument("--task", default=None, help="the trainer's task (default: the config's)")
    parser.add_argument("--prompt-format", default=None, choices=("plain", "chat"))
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=("hf", "vllm"))
    parser.add_argument("--settings", nargs="+", default=[parse_setting(s) for s in SETTINGS], type=parse_setting)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--vllm-top-k", type=int, default=512, help="top_k of vLLM's top-p rows")
    parser.add_argument("--vllm-dtype", default="float32", choices=("float32", "bfloat16", "auto"))
    parser.add_argument("--out", default=None, help="folder for kept_set_ratio.md / .json (default: print only)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = parser.parse_args(argv)
    refuse_to_overwrite(parser, args.out, "kept_set_ratio", args.overwrite)
    torch.manual_seed(0)
    # the engines' model folder and the run's files are scratch: only the table and its JSON are results
    run_dir = tempfile.mkdtemp(prefix="kept_set_ratio_")
    overrides = {k: v for k, v in (("task", args.task), ("prompt_format", args.prompt_format)) if v is not None}
    # the tiny model gets the trainer's warm start (it stands in for pretraining); a pretrained one runs as shipped
    overrides["sft_steps"] = TrainConfig().warm_start.sft_steps if args.model == "tiny" else 0
    base = TrainConfig.from_keys(model=args.model, group_size=args.group_size, max_completion_length=args.tokens,
                                 temperature=args.temperature, vllm_dtype=args.vllm_dtype, eval_every=0,
                                 output_dir=run_dir, **overrides)
    data = load_data(base.replace(engine="hf"), None, log=lambda *a: None)
    model, tokenizer, longest, _ = load_policy(base, data, None, None, torch.device("cpu"), base.policy.dtype,
                                               log=lambda *a: None)
    model.eval()
    prompts = tasks.prompt_ids([tasks.prompt_text(s, tokenizer, base.data) for s in data.samples[:args.prompts]],
                               tokenizer)
    rows = []
    largest_top_k = max([args.vllm_top_k] + [setting.get("top_k", 0) for setting in args.settings])
    for engine_name in args.engines:
        engine = start_engine(engine_name, base, model, tokenizer, longest, largest_top_k)
        for setting in args.settings:
            row = measure(engine, base, setting, model, prompts, args.vllm_top_k)
            print(row, flush=True)
            rows.append(row)
        del engine
    shutil.rmtree(run_dir, ignore_errors=True)
    command = "python -m grpo_fast.benchmarks.kept_set_ratio " + " ".join(sys.argv[1:] if argv is None else argv)
    table = markdown(rows, args, machine_name("cpu"), command)
    print(table)
    print("RESULT " + __import__("json").dumps({"rows": rows}), flush=True)
    if args.out:
        write_results(args.out, "kept_set_ratio", table, {"command": command, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
