"""Long completions: peak memory and step time of the trainer's policy update against completion length, with
grpo_fast's loss and the full-logits (naive) loss, next to what `grpo_fast.train.plan.memory.plan` predicts.

python -m grpo_fast.benchmarks.long_context [--lengths 4096 8192 16384 32768] [--losses grpo_fast naive]
                                            [--vocab 32768] [--hidden 256] [--group-size 2] [--out DIR]
                                            [--carry-over 32768]
python -m grpo_fast.benchmarks.long_context --model smollm2-135m-instruct \
    --rope-scaling '{"rope_type": "yarn", "factor": 2.0}' --lengths 4096 8192 16352 --steps 1 --warmup-tokens 32 \
    --malloc-mmap-threshold 65536 --rollout-tokens 16256 --out DIR
    (SmolLM2's 8192 positions scaled to 16384: 16352 completion tokens after the 32-token prompt, 16256 after the
    rollout's 128-token chat prompt)

Each (loss, length) runs in a fresh process: the model (--model tiny: a tiny Qwen2-style model with random weights
and the given vocabulary; else smollm2-135m-instruct or a local Hugging Face folder, loaded as the trainer loads it,
with --rope-scaling applied as policy.rope_scaling is), group_size random completions of that length after a
32-token prompt (prompt and completion must fit the model's context, scaled), and `steps` optimizer steps of
`grpo_fast.train.update.step.policy_update` (AdamW, one sequence per micro-batch, gradient checkpointing on or off, a
reference model with beta > 0), with the trainer's attention (grpo_fast.packed_attention.use_varlen_attention).
Memory is the peak RSS above the process's RSS before the model was built (on CUDA the allocator's peak); time is
the median step. A run the planner predicts past --max-gib is not started. Writes long_context.md / .json and
memory / time plots to --out (--replan: only recompute the plan's columns of an existing --out/long_context.json
with the current planner, for the job its recorded command ran, the measurements as they were; --carry-over
LENGTH...: take those lengths' rows from it as they were measured, marked so, instead of running them again).
Results are named long_context (tiny) or
long_context_<model> (long_context_smollm2 for smollm2-135m-instruct); existing ones are kept unless --overwrite.

--rollout-tokens N (a pretrained model): also one rollout per engine (--engines hf vllm), each in a fresh process
built as the trainer's rollout process builds it (fp32, the same rope scaling): one GSM8K prompt, group_size
completions of exactly N tokens (ignore_eos), timed; then the trainer's model scores the sampled tokens and the
rows give |engine log-prob - trainer log-prob| (max and mean), i.e. how far the first step's ratio is from 1.
"""

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time

import torch

GIB = 2**30
PROMPT = 32
COMMAND = "python -m grpo_fast.benchmarks.long_context"     # how results record the command that made them


def job_for(args, length: int, loss: str):
    from grpo_fast.train.plan.memory import Job

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    return Job(prompt_length=PROMPT, completion_length=length, group_size=args.group_size, prompts_per_step=1,
               micro_batch_size=1, dtype="bf16-autocast" if device == "cuda" else "fp32",
               gradient_checkpointing=not args.no_checkpointing, loss=loss, beta=args.beta, engine="hf",
               device=device, lora_rank=args.lora_rank, load_in_4bit=args.load_in_4bit)


def model_folder(args):
    """None for the tiny model, else the local folder --model stands for."""
    if args.model == "tiny":
        return None
    from grpo_fast.train import pretrained

    return pretrained.model_folder(args.model)


def results_name(args) -> str:
    """long_context for the tiny model, else long_context_<model> (smollm2 for SmolLM2-135M-Instruct)."""
    from grpo_fast.train import pretrained

    adapters = f"_{'q' if args.load_in_4bit else ''}lora{args.lora_rank}" if args.lora_rank else ""
    if args.model == "tiny":
        return "long_context" + adapters
    return "long_context_" + ("smollm2" if args.model == pretrained.SMOLLM2 else
                              os.path.basename(os.path.normpath(args.model))) + adapters


def check_fits(args, prompt_tokens: int, length: int) -> None:
    """tasks.check_context for a pretrained --model with --rope-scaling applied (ValueError naming the longest
    completion that fits)."""
    if args.model == "tiny":
        return
    from transformers import AutoConfig

    from grpo_fast.train.policy import scaled_rope
    from grpo_fast.train.tasks import check_context

    config = AutoConfig.from_pretrained(model_folder(args))
    scaled_rope(config, args.rope_scaling)
    check_context(prompt_tokens, length, config)


def shape_for(args):
    from grpo_fast.train.plan.memory import ModelShape

    if args.model != "tiny":
        return ModelShape.from_config(os.path.join(model_folder(args), "config.json"))
    return ModelShape(args.hidden, 2 * args.hidden, args.layers, args.hidden // 64, max(1, args.hidden // 128),
                      args.vocab, tie_word_embeddings=True, attention_bias=True)


def worker(args) -> dict:
    """One (loss, length) measurement in this process."""
    from transformers import Qwen2ForCausalLM  # noqa: F401  (imported before the baseline: not the job's memory)

    if args.lora_rank:                 # their libraries too (bitsandbytes, PEFT: about 0.05 GiB)
        import peft  # noqa: F401

        if args.load_in_4bit:
            import bitsandbytes  # noqa: F401

    from grpo_fast.benchmarks.profiling import peak_rss_bytes, start_peak_rss
    from grpo_fast.packed_attention import use_varlen_attention
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.policy import from_pretrained, tiny_qwen2
    from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs, policy_update

    length, loss = args.worker_length, args.worker_loss
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    baseline = start_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    shape = shape_for(args)
    if args.model == "tiny":
        model = tiny_qwen2(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=shape.num_heads,
                           num_kv_heads=shape.num_kv_heads, max_positions=PROMPT + length).to(device)
    else:
        model = from_pretrained(model_folder(args), torch.float32, args.rope_scaling).to(device)
    attention = use_varlen_attention(model, device, "bf16-autocast" if cuda else "fp32")
    if args.lora_rank:                 # as the trainer's load_policy: the base quantized, then the adapters
        from grpo_fast.train import lora

        section = TrainConfig.from_keys(model="tiny", lora_rank=args.lora_rank, load_in_4bit=args.load_in_4bit,
                                        sft_steps=0).policy
        model = lora.adapted(model, section, torch.float32)
    ref_model = None
    if args.beta > 0:
        import copy

        ref_model = copy.deepcopy(model).requires_grad_(False)
    config = TrainConfig.from_keys(model="tiny", group_size=args.group_size, max_completion_length=length,
                                   micro_batch_size=1, gradient_checkpointing=not args.no_checkpointing, beta=args.beta,
                                   loss_implementation=loss, loss_type="dapo", device=args.device)
    if config.policy.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    generator = torch.Generator().manual_seed(0)

    def random_batch(tokens: int) -> UpdateBatch:
        rows = args.group_size
        input_ids = torch.randint(0, shape.vocab_size, (rows, PROMPT + tokens), generator=generator).to(device)
        return UpdateBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids, dtype=torch.bool),
                           prompt_length=PROMPT, completion_ids=input_ids[:, PROMPT:],
                           loss_mask=torch.ones(rows, tokens, dtype=torch.bool, device=device),
                           advantages=torch.randn(rows, generator=generator).to(device))

    def step(rollout: UpdateBatch) -> None:
        if ref_model is not None:
            rollout.ref_logps = completion_logprobs(Policy.of(ref_model), rollout, config.batching,
                                                     config.rollout.temperature)
        policy_update(Policy.of(model), optimizer, rollout, config.loss_at(0), config.batching, config.optimization,
                      config.rollout.temperature)

    if args.warmup_tokens:      # gradients and AdamW's state exist before the first measured step
        step(random_batch(args.warmup_tokens))
    rollout, seconds = random_batch(length), []
    for _ in range(args.steps):
        started = time.perf_counter()
        step(rollout)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - baseline
    return {"loss": loss, "length": length, "peak_bytes": int(peak), "step_seconds": statistics.median(seconds),
            "attention": attention}


def rollout_worker(args) -> dict:
    """One rollout of --rollout-tokens tokens with --worker-engine in this process, timed, and the trainer's
    log-probs of what it sampled against the engine's."""
    from grpo_fast.benchmarks.real_model import gsm8k_prompts
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.policy import load_model
    from grpo_fast.train.rollout.process import _build_engine
    from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs

    engine_name, tokens = args.worker_engine, args.rollout_tokens
    config = TrainConfig.from_keys(model=args.model, engine=engine_name, rope_scaling=args.rope_scaling,
                                   group_size=args.group_size, ignore_eos=True, max_completion_length=tokens,
                                   vllm_dtype="float32", micro_batch_size=1, device="cpu")
    trainer, tokenizer = load_model(config.policy, [], weights_dtype=torch.float32)
    prompts = gsm8k_prompts(tokenizer, 1)
    check_fits(args, len(prompts[0]), tokens)
    started = time.perf_counter()
    engine = _build_engine({"rollout": config.rollout, "seed": 0, "model_dir": model_folder(args),
                            "dtype": torch.float32, "device": "cpu", "max_model_len": len(prompts[0]) + tokens,
                            "rope_scaling": args.rope_scaling})
    engine.sampling_logps = True                      # the HF engine's log-probs of what it sampled (vLLM's always)
    built = time.perf_counter() - started
    started = time.perf_counter()
    generation = engine.generate(prompts, seed=0)
    seconds = time.perf_counter() - started
    del engine
    sampled = int(generation.completion_mask.sum())
    assert sampled == args.group_size * tokens, (sampled, args.group_size, tokens)
    batch = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                        generation.completion_ids, loss_mask=generation.completion_mask,
                        advantages=torch.zeros(generation.input_ids.shape[0]))
    logps = completion_logprobs(Policy.of(trainer), batch, config.batching, config.rollout.temperature)
    gaps = (generation.sampling_logps - logps).abs()[generation.completion_mask]
    return {"engine": engine_name, "prompt_tokens": len(prompts[0]), "completions": args.group_size,
            "completion_tokens": tokens, "start_seconds": built, "seconds": seconds, "tokens_per_s": sampled / seconds,
            "max_logprob_gap": float(gaps.max()), "mean_logprob_gap": float(gaps.mean())}


def worker_command(args, *extra) -> list:
    """This module in a fresh interpreter with the run's settings and `extra`."""
    return [sys.executable, "-m", "grpo_fast.benchmarks.long_context", *extra, "--model", args.model,
            "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers),
            "--group-size", str(args.group_size), "--steps", str(args.steps), "--beta", str(args.beta),
            "--warmup-tokens", str(args.warmup_tokens),
            "--device", args.device] + (["--no-checkpointing"] if args.no_checkpointing else []) + (
        ["--rope-scaling", json.dumps(args.rope_scaling)] if args.rope_scaling else []) + (
        ["--rollout-tokens", str(args.rollout_tokens)] if args.rollout_tokens else []) + (
        ["--lora-rank", str(args.lora_rank)] if args.lora_rank else []) + (
        ["--load-in-4bit"] if args.load_in_4bit else [])


def in_fresh_process(args, command: list, row: dict, env=None) -> dict:
    """The last stdout line of `command` (JSON), or `row` with the error that stopped it."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout, env=env)
    except subprocess.TimeoutExpired:
        return dict(row, error=f"timed out after {args.timeout} s (--timeout)")
    if done.returncode != 0:
        if done.returncode in (-9, 137):
            return dict(row, error="out of memory: killed")
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return dict(row, error=tail[:200])
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(args, length: int, loss: str) -> dict:
    """worker() in a fresh interpreter."""
    command = worker_command(args, "--worker-length", str(length), "--worker-loss", loss)
    env = None
    if args.malloc_mmap_threshold:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(args.malloc_mmap_threshold))
    return in_fresh_process(args, command, {"loss": loss, "length": length}, env)


def rollouts(args, update_rows: list, save) -> list:
    """rollout_worker() per engine, each in a fresh interpreter (vLLM sets process-wide state), `save`d with the
    update's rows as each comes."""
    rows = []
    for engine in args.engines:
        rows.append(in_fresh_process(args, worker_command(args, "--worker-engine", engine),
                                     {"engine": engine, "completion_tokens": args.rollout_tokens}))
        print(rollout_line(rows[-1]), file=sys.stderr, flush=True)
        save(update_rows, rows)
    return rows


def rollout_line(row: dict) -> str:
    if "error" in row:
        return f"{row['engine']:>10} rollout: {row['error']}"
    return (f"{row['engine']:>10} rollout: {row['completions']} x {row['completion_tokens']} tokens in "
            f"{row['seconds']:.0f} s ({row['tokens_per_s']:.1f} tokens/s), log-prob gap max "
            f"{row['max_logprob_gap']:.2e} mean {row['mean_logprob_gap']:.2e}")


def run(args, save) -> list:
    """Each (length, loss) row, measured or carried over, `save`d (rows so far) as it comes."""
    rows, earlier = [], {}
    if args.carry_over:
        with open(os.path.join(args.out, f"{results_name(args)}.json")) as f:
            saved = json.load(f)
        earlier = {(row["loss"], row["length"]): dict(row, carried_over=saved["command"]) for row in saved["rows"]}
    for length in sorted(set(args.lengths) | set(args.carry_over or [])):
        for loss in args.losses:
            if length in (args.carry_over or []):
                if (loss, length) in earlier:
                    rows.append(earlier[(loss, length)])
                    replan(rows[-1:], args)
                continue
            row = {"loss": loss, "length": length}
            replan([row], args)
            if row["planned_bytes"] > args.max_gib * GIB:
                row["error"] = f"not run: planned {row['planned_bytes'] / GIB:.1f} GiB"
            else:
                row.update(measure(args, length, loss))
            rows.append(row)
            print(summary_line(row), file=sys.stderr, flush=True)
            save(rows, [])
    return rows


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"{row['loss']:>10} {row['length']:>6}: {row['error']}"
    ratio = row["planned_bytes"] / row["peak_bytes"]
    return (f"{row['loss']:>10} {row['length']:>6}: peak {row['peak_bytes'] / GIB:.2f} GiB, planned "
            f"{row['planned_bytes'] / GIB:.2f} GiB ({ratio:.2f}x), step {row['step_seconds']:.1f} s")


def setting_line(args, rows: list) -> str:
    attention = sorted({row["attention"] for row in rows if "attention" in row and "carried_over" not in row})
    if args.model == "tiny":
        model = f"tiny Qwen2-style model, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}"
    else:
        shape = shape_for(args)
        model = (f"{args.model} (hidden {shape.hidden_size}, {shape.num_layers} layers, vocabulary "
                 f"{shape.vocab_size}, fp32), rope scaling {json.dumps(args.rope_scaling)}")
    warmup = f" after one on {args.warmup_tokens}-token completions" if args.warmup_tokens else ""
    if args.malloc_mmap_threshold:
        warmup += f", glibc's mmap threshold fixed at {args.malloc_mmap_threshold} bytes (MALLOC_MMAP_THRESHOLD_)"
    return (f"{model}; {args.group_size} completion(s) per step after a {PROMPT}-token prompt, one per micro-batch, "
            f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}, beta {args.beta}, AdamW, "
            + (f"LoRA r={args.lora_rank} on every linear layer of the decoder"
               f"{', the base in NF4 (QLoRA)' if args.load_in_4bit else ', the base in fp32'}, " if args.lora_rank
               else "") +
            f"median of {args.steps} step(s){warmup}" + (f", attention {' / '.join(attention)}" if attention else ""))


def update_table(rows: list) -> list:
    lines = ["| completion tokens | loss | peak memory (GiB) | planned (GiB) | planned / measured | step (s) |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        if "carried_over" in row:
            row = dict(row, loss=f"{row['loss']} *")
        if "error" in row:
            lines.append(f"| {row['length']} | {row['loss']} | {row['error']} | {row['planned_bytes'] / GIB:.2f} "
                         "| - | - |")
        else:
            lines.append(f"| {row['length']} | {row['loss']} | {row['peak_bytes'] / GIB:.2f} | "
                         f"{row['planned_bytes'] / GIB:.2f} | {row['planned_bytes'] / row['peak_bytes']:.2f} | "
                         f"{row['step_seconds']:.1f} |")
    return lines


def rollout_table(rows: list) -> list:
    lines = ["| engine | prompt tokens | completions x tokens | engine start (s) | rollout (s) | tokens/s | "
             "log-prob gap, max | mean |", "|---|---|---|---|---|---|---|---|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['engine']} | - | {row['completion_tokens']} | {row['error']} | - | - | - | - |")
        else:
            lines.append(f"| {row['engine']} | {row['prompt_tokens']} | {row['completions']} x "
                         f"{row['completion_tokens']} | {row['start_seconds']:.0f} | {row['seconds']:.0f} | "
                         f"{row['tokens_per_s']:.1f} | {row['max_logprob_gap']:.2e} | "
                         f"{row['mean_logprob_gap']:.2e} |")
    return lines


def write(rows: list, rollout_rows: list, args, out: str, command: str, replanned: bool = False) -> None:
    """The results (.md, .json, .png) of `command`, run with `args`, in `out`."""
    from grpo_fast.benchmarks.profiling import machine_name

    os.makedirs(out, exist_ok=True)
    name, setting = results_name(args), setting_line(args, rows)
    lines = [f"# Long completions on {machine_name(args.device)}", "", setting, ""] + (
        [args.note, ""] if args.note else []) + [
             f"`{command}`" + (" (planned columns recomputed with `--replan`)" if replanned else ""), ""]
    lines += update_table(rows)
    for command_before in sorted({row["carried_over"] for row in rows if "carried_over" in row}):
        lines += ["", f"\\* carried over as measured by `{command_before}` (one sequence per micro-batch runs the "
                  "same attention either way), planned columns from the current planner"]
    if rollout_rows:
        lines += ["", "One rollout per engine, each built as the trainer's rollout process builds it (fp32, the same "
                  "rope scaling), GSM8K's first problem in the chat template, `ignore_eos`; the log-prob gap is "
                  "|engine - trainer| over every sampled token, the trainer's model scoring them at full length "
                  "(the first step's log-ratio before any update):", ""] + rollout_table(rollout_rows)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump({"machine": machine_name(args.device), "setting": setting, "command": command, "rows": rows,
                   "rollouts": rollout_rows}, f, indent=1)
    plot(rows, os.path.join(out, f"{name}.png"))


def plot(rows: list, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for loss in sorted({r["loss"] for r in rows}):
        done = [r for r in rows if r["loss"] == loss and "error" not in r]
        lengths = [r["length"] for r in done]
        axes[0].plot(lengths, [r["peak_bytes"] / GIB for r in done], marker="o", label=f"{loss} measured")
        planned = [r for r in rows if r["loss"] == loss]
        axes[0].plot([r["length"] for r in planned], [r["planned_bytes"] / GIB for r in planned], ls="--",
                     label=f"{loss} planned")
        axes[1].plot(lengths, [r["step_seconds"] for r in done], marker="o", label=loss)
    for ax, title in zip(axes, ("peak memory (GiB)", "step time (s)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("completion tokens")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768])
    parser.add_argument("--losses", nargs="+", default=["grpo_fast", "naive"], choices=["grpo_fast", "naive"])
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=2)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--beta", type=float, default=0.0)
    parser.add_argument("--warmup-tokens", type=int, default=0,
                        help="one untimed step on completions this long first (its gradients and optimizer state "
                             "are then in place, so one measured step shows the peak)")
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0, help="LoRA adapters of this rank on every linear layer "
                        "of the decoder (the trainer's policy.lora_rank), the base frozen")
    parser.add_argument("--load-in-4bit", action="store_true", help="with --lora-rank: QLoRA, the base in NF4 "
                        "(policy.load_in_4bit)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-gib", type=float, default=18.0, help="skip runs planned above this")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--carry-over", type=int, nargs="+", default=None, metavar="LENGTH",
                        help="take these lengths' rows from the --out folder's results as measured before")
    parser.add_argument("--note", default=None, help="a line for the table's header (how the machine was)")
    parser.add_argument("--replan", action="store_true",
                        help="recompute the planned columns of the --out folder's results (--model, --lora-rank and "
                             "--load-in-4bit name them) with the current planner, for their recorded command's job")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument("--model", default="tiny",
                        help="tiny (random weights, --vocab/--hidden/--layers), smollm2-135m-instruct or a local "
                             "Hugging Face model folder")
    parser.add_argument("--rope-scaling", type=json.loads, default=None, metavar="JSON",
                        help="policy.rope_scaling for a pretrained --model, e.g. "
                             "'{\"rope_type\": \"yarn\", \"factor\": 2.0}'")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=0, metavar="BYTES",
                        help="the update workers' glibc MALLOC_MMAP_THRESHOLD_: fixed, blocks above it go back to the "
                             "system when freed, so peak RSS counts live memory (default: glibc's own, which rises to "
                             "32 MiB and keeps freed blocks below it)")
    parser.add_argument("--rollout-tokens", type=int, default=0,
                        help="also one rollout of completions this long per engine (a pretrained --model)")
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--worker-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-loss", help=argparse.SUPPRESS)
    parser.add_argument("--worker-engine", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    if args.worker_length:
        print(json.dumps(worker(args)))
        return 0
    if args.worker_engine:
        print(json.dumps(rollout_worker(args)))
        return 0
    command = f"{COMMAND} " + shlex.join(sys.argv[1:] if argv is None else argv)

    def save(rows: list, rollout_rows: list) -> None:     # after each row: a later failure keeps what was measured
        if args.out:
            write(rows, rollout_rows, args, args.out, command)

    if args.replan:       # the plan of the job that was measured: its own command's settings, not this one's
        path = os.path.join(args.out, f"{results_name(args)}.json")
        if not os.path.isfile(path):
            parser.error(f"--replan needs results to replan: {path} does not exist (--out, --model, --lora-rank and "
                         "--load-in-4bit name them)")
        with open(path) as f:
            saved = json.load(f)
        command, rows = saved["command"], saved["rows"]
        measured = parser.parse_args(shlex.split(command.removeprefix(COMMAND)))
        replan(rows, measured)
        write(rows, saved.get("rollouts", []), measured, args.out, command, replanned=True)
    else:
        rows = run(args, save)
        if args.rollout_tokens:
            rollouts(args, rows, save)
    return 0


def check_arguments(parser, args) -> None:
    """parser.error for settings that cannot run, before any measurement: a rope scaling or rollout on the tiny
    model, a rope scaling the trainer refuses, a length past the (scaled) context, results that would be
    replaced without --overwrite."""
    from grpo_fast.benchmarks.harness import refuse_to_overwrite
    from grpo_fast.train.policy import check_rope_scaling

    if args.load_in_4bit and not args.lora_rank:
        parser.error("--load-in-4bit trains LoRA adapters on the 4-bit base: give --lora-rank")
    if args.model == "tiny" and (args.rope_scaling or args.rollout_tokens):
        parser.error("--rope-scaling and --rollout-tokens need a pretrained --model (smollm2-135m-instruct or a "
                     "folder), got --model tiny")
    try:
        if args.rope_scaling is not None:
            if not isinstance(args.rope_scaling, dict):
                raise ValueError(f"--rope-scaling must be a JSON object, got {args.rope_scaling!r}")
            check_rope_scaling(args.rope_scaling)
        if args.model != "tiny" and not (args.worker_length or args.worker_engine or args.replan):
            check_fits(args, PROMPT, max(args.lengths + (args.carry_over or [])))
    except ValueError as error:
        parser.error(str(error))
    if not (args.worker_length or args.worker_engine or args.replan or args.carry_over):
        refuse_to_overwrite(parser, args.out, results_name(args), args.overwrite)


def replan(rows: list, args) -> None:
    """The planner's prediction for each measured row, in place (the measurements are kept)."""
    from grpo_fast.train.plan.memory import plan

    for row in rows:
        predicted = plan(shape_for(args), job_for(args, row["length"], row["loss"]))
        row["planned_bytes"] = int(predicted["total"] - (predicted["runtime"] if args.device.startswith("cuda")
                                                          else 0))
        row["planned_components"] = {k: int(v) for k, v in predicted.items()}


if __name__ == "__main__":
    raise SystemExit(main())
