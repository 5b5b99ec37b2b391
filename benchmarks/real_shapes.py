"""A real architecture's shape: peak memory, step time and loss of the trainer's policy update on Qwen2.5-0.5B
(random weights) for each memory option, next to what `grpo_fast.train.plan.memory.plan` predicts.

python -m grpo_fast.benchmarks.real_shapes [--runs fp32 bf16-adamw bf16-adamw8bit bf16-adamw-bf16 lora16]
                                           [--completion-length 1024] [--group-size 2] [--steps 2] [--small]
                                           [--out DIR]

The model is Qwen2.5-0.5B's config.json (written in this file: no model hub is needed), saved to --out and built
with random weights under a fixed seed; the planner reads the same file (`ModelShape.from_config`). --small swaps
in a 2-layer, hidden-128, vocabulary-1024 model of the same architecture, for tests. Each run goes in a fresh
process, its weights in the run's dtype from the start:

    fp32             fp32 weights, torch's AdamW
    bf16-adamw       bf16 weights, AdamW with fp32 master weights (grpo_fast.train.update.optim.MasterWeightAdamW)
    bf16-adamw8bit   bf16 weights, torchao's AdamW8bit (bf16 stochastic rounding)
    bf16-adamw-bf16  bf16 weights, torchao's bf16-state AdamW (bf16 stochastic rounding)
    lora16           LoRA r=16 (alpha 32, fp32 adapters) on a frozen bf16 base, AdamW

Learning rate 1e-5 for full training, 1e-4 for LoRA (its adapters start as a no-op and are few); no weight decay.
Every run gets the same rollout: one 64-token random prompt, --group-size random completions of
--completion-length tokens, advantages +1 / -1 alternating, every completion token in the loss; then --steps
optimizer steps of `grpo_fast.train.update.step.policy_update` (one sequence per micro-batch, gradient checkpointing,
loss_type dapo, no KL) on CPU.

Measured (glibc's mmap threshold at 64 KiB, see MMAP_THRESHOLD): peak RSS above the process's RSS after every import
(transformers, peft, torchao) and before the model is built; the median step (with torchao the first step includes
torch.compile of its optimizer step); the loss of each step; and the surrogate loss -sum(A * log p) / tokens of the
rollout before the steps and after them (one no-grad pass of `completion_logprobs`, no update). On-policy the
trainer's loss is -sum(A) / tokens whatever the weights (its ratio is exactly 1; 0 for these advantages) and only
its gradient moves: the surrogate has the same gradient and a value that follows the weights, so it is what sets
each run's result next to fp32's. Writes real_shapes.md / .json to --out; a run whose process fails is a row with
its error's last line, and the script exits 1.
"""

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import time

import torch

GIB = 2**30
PROMPT = 64
SEED = 0
CONFIG_FILE = "real_shapes.config.json"
# glibc's heap keeps freed blocks below its mmap threshold (which grows up to 32 MiB), and RSS counts them: a
# decoder layer's tensors at 1k tokens are 1-40 MiB, so with the default the peak RSS depended on the order of
# allocations (LoRA r=16: 3.8 GiB, against 1.4 GiB of live tensors). Workers map every block above 64 KiB, which
# is returned when freed: the peak RSS then follows the live tensors, what the planner counts (and what a GPU's
# caching allocator holds). 64 KiB as in every other CPU measurement here (at 1 MiB a bf16 run's sub-MiB tensors,
# the key / value rows of a 1k-token layer, stayed in the heap: LoRA r=16 read 1.34 GiB against 1.30).
MMAP_THRESHOLD = 2**16

# Qwen2.5-0.5B's config.json as published (Qwen/Qwen2.5-0.5B). Hugging Face's Qwen2 has biases on q, k and v
# whatever the config says, and the planner infers them from model_type qwen2, as from the real file.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "hidden_act": "silu",
    "hidden_size": 896,
    "initializer_range": 0.02,
    "intermediate_size": 4864,
    "max_position_embeddings": 32768,
    "max_window_layers": 24,
    "model_type": "qwen2",
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}
# the same architecture and keys, small enough for a test: 4 heads of 32, 2 KV heads, ids below 1024
SMALL = {**QWEN25_05B, "hidden_size": 128, "intermediate_size": 512, "num_hidden_layers": 2, "max_window_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1024, "bos_token_id": 1023,
         "eos_token_id": 1023}

# run -> (dtype, optimizer, lora_rank, learning rate), in the names of TrainConfig and `grpo-fast plan`
RUNS = {
    "fp32": ("fp32", "adamw", 0, 1e-5),
    "bf16-adamw": ("bf16", "adamw", 0, 1e-5),
    "bf16-adamw8bit": ("bf16", "adamw8bit", 0, 1e-5),
    "bf16-adamw-bf16": ("bf16", "adamw-bf16", 0, 1e-5),
    "lora16": ("bf16", "adamw", 16, 1e-4),
}


def train_config(args, run: str):
    from grpo_fast.train.config import TrainConfig

    dtype, optimizer, lora_rank, lr = RUNS[run]
    return TrainConfig.from_keys(dtype=dtype, optimizer=optimizer, lora_rank=lora_rank, learning_rate=lr,
                                 weight_decay=0.0, group_size=args.group_size,
                                 max_completion_length=args.completion_length, micro_batch_size=1,
                                 gradient_checkpointing=True, loss_type="dapo", beta=0.0, device="cpu")


def job_for(args, run: str):
    from grpo_fast.train.plan.memory import Job

    dtype, optimizer, lora_rank, _ = RUNS[run]
    return Job(prompt_length=PROMPT, completion_length=args.completion_length, group_size=args.group_size,
               prompts_per_step=1, micro_batch_size=1, dtype=dtype, optimizer=optimizer, lora_rank=lora_rank,
               gradient_checkpointing=True, loss="grpo_fast", beta=0, engine="hf", device="cpu")


def surrogate_loss(policy, rollout, config) -> float:
    """-sum(A * log p) / tokens over the loss mask: the on-policy dapo loss's gradient, with a value that moves."""
    from grpo_fast.train.update.step import completion_logprobs

    logps = completion_logprobs(policy, rollout, config.batching, config.rollout.temperature).double()
    mask = rollout.loss_mask.double()
    return float(-(rollout.advantages.double()[:, None] * logps * mask).sum() / mask.sum())


def worker(args) -> dict:
    """One run in this process."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_fast.benchmarks.profiling import peak_rss_bytes, start_peak_rss
    from grpo_fast.train import lora
    from grpo_fast.train.update import optimizer as optim
    from grpo_fast.train.update import precision
    from grpo_fast.train.update.step import Policy, UpdateBatch, policy_update

    run = args.worker_run
    dtype, optimizer_name, lora_rank, lr = RUNS[run]
    config = train_config(args, run)
    # imported before the baseline: libraries are not the job's memory (transformers may import torchao itself)
    if lora_rank:
        import peft  # noqa: F401
    if optimizer_name in optim.LOW_BIT:
        import torchao.optim  # noqa: F401
    with open(args.worker_config) as f:
        model_config = Qwen2Config(**json.load(f))

    baseline = start_peak_rss()
    # Built in the weights' dtype from the start (as from_pretrained(dtype=...) does), so that a bf16 run never
    # holds an fp32 copy; the initializer draws the same numbers, so bf16 weights are fp32's rounded.
    torch.manual_seed(SEED)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(precision.weights_dtype(dtype))
    try:
        model = Qwen2ForCausalLM(model_config)
    finally:
        torch.set_default_dtype(default_dtype)
    if lora_rank:
        model = lora.add_adapters(model, config.policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = optim.make_optimizer(model.parameters(), optimizer_name, lr, 0.0)
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)

    # the same rollout in every run: one prompt shared by the group (as GRPO samples it), random completions
    generator = torch.Generator().manual_seed(SEED)
    rows, length, vocab = args.group_size, args.completion_length, model_config.vocab_size
    prompt = torch.randint(0, vocab, (1, PROMPT), generator=generator).expand(rows, PROMPT)
    completions = torch.randint(0, vocab, (rows, length), generator=generator)
    input_ids = torch.cat([prompt, completions], dim=1)
    rollout = UpdateBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids, dtype=torch.bool),
                      prompt_length=PROMPT, completion_ids=completions,
                      loss_mask=torch.ones(rows, length, dtype=torch.bool),
                      advantages=torch.tensor([1.0 if row % 2 == 0 else -1.0 for row in range(rows)]))
    policy = Policy.of(model, dtype)

    before = surrogate_loss(policy, rollout, config)
    seconds, losses, grad_norms = [], [], []
    for _ in range(args.steps):
        started = time.perf_counter()
        metrics = policy_update(policy, optimizer, rollout, config.loss_at(0), config.batching, config.optimization,
                                config.rollout.temperature)
        seconds.append(time.perf_counter() - started)
        losses.append(metrics["loss"])
        grad_norms.append(metrics["grad_norm"])
        if metrics["skipped"]:
            raise RuntimeError(f"step {len(losses)} was skipped: loss {metrics['loss']}, gradient norm "
                               f"{metrics['grad_norm']} (not finite)")
    after = surrogate_loss(policy, rollout, config)
    peak = peak_rss_bytes() - baseline
    return {"run": run, "trained_parameters": trained, "peak_bytes": int(peak), "step_seconds": seconds,
            "median_step_seconds": statistics.median(seconds), "losses": losses, "grad_norms": grad_norms,
            "surrogate_before": before, "surrogate_after": after}


def measure(args, run: str, config_path: str) -> dict:
    """worker() in a fresh interpreter; a failure is {"error": its last line}."""
    command = [sys.executable, "-m", "grpo_fast.benchmarks.real_shapes", "--worker-run", run,
               "--worker-config", config_path, "--completion-length", str(args.completion_length),
               "--group-size", str(args.group_size), "--steps", str(args.steps)]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout,
                              env={**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)})
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s (--timeout)"}
    if done.returncode != 0:
        if done.returncode in (-9, 137):
            return {"error": "out of memory: killed"}
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"error": tail[:300]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run_all(args, config_path: str) -> list:
    from grpo_fast.train.plan.memory import ModelShape, plan

    shape = ModelShape.from_config(config_path)
    rows = []
    for run in args.runs:
        dtype, optimizer, lora_rank, lr = RUNS[run]
        predicted = plan(shape, job_for(args, run))
        row = {"run": run, "dtype": dtype, "optimizer": optimizer, "lora_rank": lora_rank, "learning_rate": lr,
               "planned_bytes": int(predicted["total"]),
               "planned_components": {k: int(v) for k, v in predicted.items()}}
        row.update(measure(args, run, config_path))
        if "error" not in row:
            row["measured_over_planned"] = row["peak_bytes"] / row["planned_bytes"]
        rows.append(row)
        print(summary_line(row), file=sys.stderr, flush=True)
    fp32 = next((r for r in rows if r["run"] == "fp32" and "error" not in r), None)
    for row in rows:
        if fp32 is not None and "error" not in row:
            row["surrogate_after_minus_fp32"] = row["surrogate_after"] - fp32["surrogate_after"]
    return rows


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"{row['run']:>15}: failed: {row['error']}"
    return (f"{row['run']:>15}: peak {row['peak_bytes'] / GIB:.2f} GiB, planned {row['planned_bytes'] / GIB:.2f} "
            f"GiB ({row['measured_over_planned']:.2f}x), step {row['median_step_seconds']:.1f} s, losses "
            f"{', '.join(f'{x:.4g}' for x in row['losses'])}, surrogate {row['surrogate_before']:.5f} -> "
            f"{row['surrogate_after']:.5f}")


def versions() -> dict:
    found = {}
    for package in ("torch", "transformers", "peft", "torchao"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def write(rows: list, args, model_name: str, command: str) -> None:
    from grpo_fast.benchmarks.profiling import machine_name

    machine = machine_name("cpu")
    setting = (f"{model_name}, random weights (seed {SEED}); one {PROMPT}-token prompt, {args.group_size} "
               f"completions of {args.completion_length} tokens, advantages +1 / -1, one sequence per micro-batch, "
               f"gradient checkpointing, loss_type dapo, beta 0; {args.steps} steps, lr 1e-5 (LoRA 1e-4), no "
               "weight decay")
    lines = [f"# Real shapes on {machine}", "", setting, "",
             ", ".join(f"{name} {version}" for name, version in versions().items()), "", f"`{command}`", "",
             "Peak: RSS above the process's after its imports, with glibc's mmap threshold at "
             f"{MMAP_THRESHOLD // 1024} KiB (freed tensors go back to the system, so RSS follows the live "
             "tensors). Planned: `grpo-fast plan` for the same job "
             "(device cpu). Surrogate: -sum(A log p) / tokens of the rollout before and after the steps (the "
             "trainer's own loss is -sum(A) / tokens on-policy, whatever the weights). A bf16 weight under AdamW "
             "with fp32 master weights changes once its master has moved half a bf16 step (~6e-5 at magnitude "
             "0.02): at lr 1e-5 few do in a few steps; torchao's stochastic rounding moves them in expectation. "
             "With torchao the first step includes torch.compile of the optimizer step.", "",
             "| run | dtype | optimizer | trained parameters | peak RSS (GiB) | planned (GiB) | measured / planned "
             "| median step (s) | surrogate before | surrogate after | after - fp32's |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        optimizer = row["optimizer"] + (f" (LoRA r={row['lora_rank']})" if row["lora_rank"] else "")
        head = f"| {row['run']} | {row['dtype']} | {optimizer} |"
        if "error" in row:
            lines.append(f"{head} failed: {row['error']} | - | {row['planned_bytes'] / GIB:.2f} | - | - | - | - "
                         "| - |")
            continue
        difference = row.get("surrogate_after_minus_fp32")
        lines.append(f"{head} {row['trained_parameters']:,} | {row['peak_bytes'] / GIB:.2f} | "
                     f"{row['planned_bytes'] / GIB:.2f} | {row['measured_over_planned']:.2f} | "
                     f"{row['median_step_seconds']:.1f} | {row['surrogate_before']:.5f} | "
                     f"{row['surrogate_after']:.5f} | {'-' if difference is None else f'{difference:+.1e}'} |")
    with open(os.path.join(args.out, "real_shapes.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(args.out, "real_shapes.json"), "w") as f:
        json.dump({"machine": machine, "versions": versions(), "setting": setting, "command": command,
                   "model": model_name, "config_file": CONFIG_FILE, "rows": rows}, f, indent=1)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--completion-length", type=int, default=1024)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--small", action="store_true",
                        help="a 2-layer, hidden-128, vocabulary-1024 model of the same architecture (tests)")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds per run")
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--worker-run", choices=list(RUNS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-config", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name, value, least in (("--completion-length", args.completion_length, 1),
                               ("--group-size", args.group_size, 2), ("--steps", args.steps, 1),
                               ("--timeout", args.timeout, 1)):
        if value < least:
            parser.error(f"{name} must be >= {least}, got {value}")
    if args.worker_run:
        print(json.dumps(worker(args)))
        return 0
    if len(set(args.runs)) != len(args.runs):
        parser.error(f"--runs must not repeat a run, got {args.runs}")
    command = "python -m grpo_fast.benchmarks.real_shapes " + " ".join(sys.argv[1:] if argv is None else argv)
    os.makedirs(args.out, exist_ok=True)
    config_path = os.path.join(args.out, CONFIG_FILE)
    with open(config_path, "w") as f:
        json.dump(SMALL if args.small else QWEN25_05B, f, indent=1)
    model_name = ("Qwen2.5-0.5B's architecture, small (2 layers, hidden 128, vocabulary 1024)" if args.small
                  else "Qwen2.5-0.5B (24 layers, hidden 896, vocabulary 151936)")
    rows = run_all(args, config_path)
    write(rows, args, model_name, command)
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
