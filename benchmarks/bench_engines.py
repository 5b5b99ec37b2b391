"""Rollout throughput of the trainer's engines, side by side in one run: HF generate and vLLM.

python -m grpo_fast.benchmarks.bench_engines [--out DIR] [--tokens 128] [--prompts 8] [--group-size 8]

Both engines sample the same prompts from the same tiny Qwen2-style model (random weights, so completions run to
max length) with the settings the trainer uses; each is timed over --repeats calls after a warm-up call. Writes
engines.md / engines.json to --out when given (never over results already there without --overwrite).
"""

import argparse
import statistics
import tempfile
import time

import torch

from grpo_fast.benchmarks.harness import refuse_to_overwrite, write_results
from grpo_fast.benchmarks.profiling import machine_name
from grpo_fast.train import tasks
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.policy import tiny_qwen2, train_tokenizer
from grpo_fast.train.rollout.engines import make_engine

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def measure(engine, prompts, repeats: int) -> dict:
    engine.generate(prompts, seed=0)                           # warm-up: caches, allocator, first-call setup
    seconds, tokens = [], []
    for repeat in range(repeats):
        started = time.perf_counter()
        generation = engine.generate(prompts, seed=repeat + 1)
        seconds.append(time.perf_counter() - started)
        tokens.append(int(generation.completion_mask.sum()))
    median = statistics.median(seconds)
    return {"seconds": median, "tokens": statistics.median(tokens),
            "tokens_per_s": statistics.median(t / s for t, s in zip(tokens, seconds))}


def run(tokens: int, num_prompts: int, group_size: int, repeats: int, engines=("hf", "vllm")) -> list:
    samples = tasks.arithmetic_task(num_prompts, seed=0)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples], vocab_size=300)
    tokenizer.padding_side = "left"
    model = tiny_qwen2(len(tokenizer), seed=0, eos_token_id=tokenizer.eos_token_id,
                       pad_token_id=tokenizer.pad_token_id, max_positions=tokens + 64)
    prompts = [tokenizer(s["prompt"], add_special_tokens=False)["input_ids"] for s in samples]
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in engines:
            config = TrainConfig.from_keys(engine=name, group_size=group_size, max_completion_length=tokens,
                                           output_dir=folder, device=DEVICE)
            try:
                engine = make_engine(config, model, tokenizer, max(map(len, prompts)))
                rows.append({"engine": name, **measure(engine, prompts, repeats)})
            except ImportError as error:
                rows.append({"engine": name, "error": str(error).splitlines()[0]})
    return rows


def markdown(rows: list, settings: dict) -> str:
    lines = [f"# Rollout engines on {machine_name(DEVICE)}", "",
             "`python -m grpo_fast.benchmarks.bench_engines " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v
                                                                        in settings.items()) + "`", "",
             "| engine | completion tokens per call | seconds per call (median) | tokens/s |", "|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['engine']} | - | - | {row['error']} |")
        else:
            lines.append(f"| {row['engine']} | {row['tokens']:.0f} | {row['seconds']:.3f} | "
                         f"{row['tokens_per_s']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128, help="max_completion_length")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="folder for engines.md / engines.json")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    args = parser.parse_args(argv)
    refuse_to_overwrite(parser, args.out, "engines", args.overwrite)
    settings = dict(tokens=args.tokens, prompts=args.prompts, group_size=args.group_size, repeats=args.repeats)
    rows = run(args.tokens, args.prompts, args.group_size, args.repeats)
    text = markdown(rows, settings)
    print(text)
    if args.out:
        write_results(args.out, "engines", text, {"settings": settings, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
