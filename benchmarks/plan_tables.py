"""The planner's tables of docs/long-context-and-planner.md for Qwen2.5-7B and Qwen3-8B at 16k-128k on H100 80GB
cards, each cell one `grpo-fast plan` command (printed with --commands):

    python -m grpo_fast.benchmarks.plan_tables [--table per-gpu|one-card] [--commands]

per-gpu: full (the default dtype), full bf16 and LoRA r=64, on 1 GPU and on 8 (FSDP2, sequence parallel 1, 4,
8). one-card: LoRA r=64 on 1 GPU, then with --load-in-4bit, --offload-activations and --vllm-sleep added in turn,
the least vLLM share that holds its weights and one sequence (the planner's advice) and the host memory the
offload takes. Each cell is the GiB one card needs, "fits" where the plan says it does and "(pool)" where the
total fits but vLLM's pool is below its bf16 weights and one sequence's KV cache at full length.
"""

import argparse
import contextlib
import io
import json
import shlex

from grpo_fast.train.plan import command as plan_command
from grpo_fast.train.plan.memory import CARDS, Job, least_pool_share, load_shape

GIB = 2**30
CARD = "H100 80GB"
LENGTHS = {"16k": 16384, "32k": 32768, "64k": 65536, "128k": 130560}     # 128k: 512 + 130560 = 131072 positions
# YaRN as Qwen documents it for 131072 positions, past each model's own (Qwen3-8B was trained at 32768)
YARN = {"qwen2.5-7b": '{"rope_type": "yarn", "factor": 4}',
        "qwen3-8b": '{"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 32768}'}
CONTEXT = {"qwen2.5-7b": 32768, "qwen3-8b": 40960}
NAMES = {"qwen2.5-7b": "Qwen2.5-7B", "qwen3-8b": "Qwen3-8B"}
MODES = {"full": [], "full bf16": ["--dtype", "bf16"], "LoRA": ["--lora-rank", "64"]}
GPUS = {"1 GPU": [], **{f"8 GPUs, N {n}": ["--gpus", "8", "--distributed", "fsdp2", "--sequence-parallel", str(n)]
                        for n in (1, 4, 8)}}
ONE_CARD = {"LoRA": ["--lora-rank", "64"], "+ `--load-in-4bit`": ["--load-in-4bit"],
            "+ `--offload-activations`": ["--offload-activations"], "+ `--vllm-sleep`": ["--vllm-sleep"]}


def command(model: str, length: str, options: list) -> list:
    """`grpo-fast plan`'s arguments for one cell."""
    words = [model, "--completion-length", str(LENGTHS[length]), "--engine", "vllm", "--micro-batch-size", "1"]
    if 512 + LENGTHS[length] > CONTEXT[model]:
        words += ["--rope-scaling", YARN[model]]
    return words + options


def planned(words: list) -> dict:
    """`grpo-fast plan WORDS --json`, read back."""
    parser = argparse.ArgumentParser(prog="grpo-fast plan")
    plan_command.add_arguments(parser)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        if plan_command.main(parser.parse_args([*words, "--json"])) != 0:
            raise RuntimeError(f"grpo-fast plan {shlex.join(words)} failed")
    return json.loads(out.getvalue())


def cell(result: dict) -> str:
    card = result["cards"][CARD]
    needed = f"{card['needed_bytes'] / GIB:.1f}"
    if card["fits"]:
        return needed + " fits"
    return needed + (" (pool)" if card["pool_shortfall"] and card["needed_bytes"] <= card["capacity_bytes"] else "")


def per_gpu(commands: list) -> list:
    lines = ["| model | completion | mode | " + " | ".join(GPUS) + " |", "|---|---|---|" + "---|" * len(GPUS)]
    for model in YARN:
        for length in LENGTHS:
            for mode, options in MODES.items():
                cells = []
                for gpus in GPUS.values():
                    words = command(model, length, options + gpus)
                    commands.append(words)
                    cells.append(cell(planned(words)))
                lines.append(f"| {NAMES[model]} | {length} | {mode} | " + " | ".join(cells) + " |")
    return lines


def one_card(commands: list) -> list:
    lines = ["| model | completion | " + " | ".join(ONE_CARD) + " | share: GiB | host GiB |",
             "|---|---|" + "---|" * (len(ONE_CARD) + 2)]
    for model in YARN:
        for length in LENGTHS:
            options, cells = [], []
            for added in ONE_CARD.values():
                options = options + added
                words = command(model, length, options)
                commands.append(words)
                result = planned(words)
                cells.append(cell(result))
            share = least_share(result)
            if share is None:
                cells.append(f"{result['job']['gpu_memory_utilization']}: {cells[-1]}")
            else:
                words = command(model, length, options + ["--gpu-memory-utilization", str(share)])
                commands.append(words)
                cells.append(f"{share}: {cell(planned(words))}")
            cells.append(f"{result['host_activations'] / GIB:.1f}")
            lines.append(f"| {NAMES[model]} | {length} | " + " | ".join(cells) + " |")
    return lines


def least_share(result: dict):
    """The vLLM share the planner's advice names for the card, or None where the pool already holds its minimum."""
    return least_pool_share(load_shape(result["model"]), Job(**result["job"]), CARDS[CARD])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table", choices=["per-gpu", "one-card"], default=None, help="one table (default: both)")
    parser.add_argument("--commands", action="store_true", help="also print each cell's grpo-fast plan command")
    args = parser.parse_args(argv)
    for name, build in (("per-gpu", per_gpu), ("one-card", one_card)):
        if args.table in (None, name):
            commands = []
            print("\n".join(build(commands)) + "\n")
            if args.commands:
                print("\n".join("grpo-fast plan " + shlex.join(words) for words in commands) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
