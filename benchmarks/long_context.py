"""Long completions: peak memory and step time of the trainer's policy update against completion length, with
grpo_fast's loss and the full-logits (naive) loss, next to what `grpo_fast.train.plan.memory.plan` predicts.

python -m grpo_fast.benchmarks.long_context [--lengths 4096 8192 16384 32768] [--losses grpo_fast naive]
                                            [--vocab 32768] [--hidden 256] [--group-size 2] [--out DIR]
                                            [--carry-over 32768]

Each (loss, length) runs in a fresh process: a tiny Qwen2-style model (random weights, the given vocabulary),
a rollout of group_size random completions of that length after a 32-token prompt, and `steps` optimizer steps of
`grpo_fast.train.update.step.policy_update` (AdamW, one sequence per micro-batch, gradient checkpointing on or off, a
reference model with beta > 0), with the trainer's attention (grpo_fast.packed_attention.use_varlen_attention).
Memory is the peak RSS above the process's RSS before the model was built (on CUDA the allocator's peak); time is
the median step. A run the planner predicts past --max-gib is not started. Writes long_context.md / .json and
memory / time plots to --out (--replan: only recompute the plan's columns of an existing --out/long_context.json
with the current planner, the measurements as they were; --carry-over LENGTH...: take those lengths' rows from it
as they were measured, marked so, instead of running them again).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

GIB = 2**30
PROMPT = 32


def job_for(args, length: int, loss: str):
    from grpo_fast.train.plan.memory import Job

    device = "cuda" if args.device.startswith("cuda") else "cpu"
    return Job(prompt_length=PROMPT, completion_length=length, group_size=args.group_size, prompts_per_step=1,
               micro_batch_size=1, dtype="bf16-autocast" if device == "cuda" else "fp32",
               gradient_checkpointing=not args.no_checkpointing, loss=loss, beta=args.beta, engine="hf",
               device=device)


def shape_for(args):
    from grpo_fast.train.plan.memory import ModelShape

    return ModelShape(args.hidden, 2 * args.hidden, args.layers, args.hidden // 64, max(1, args.hidden // 128),
                      args.vocab, tie_word_embeddings=True, attention_bias=True)


def worker(args) -> dict:
    """One (loss, length) measurement in this process."""
    from transformers import Qwen2ForCausalLM  # noqa: F401  (imported before the baseline: not the job's memory)

    from grpo_fast.benchmarks.profiling import peak_rss_bytes, start_peak_rss
    from grpo_fast.packed_attention import use_varlen_attention
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.policy import tiny_qwen2
    from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs, policy_update

    length, loss = args.worker_length, args.worker_loss
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    baseline = start_peak_rss()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    shape = shape_for(args)
    model = tiny_qwen2(args.vocab, hidden_size=args.hidden, num_layers=args.layers, num_heads=shape.num_heads,
                       num_kv_heads=shape.num_kv_heads, max_positions=PROMPT + length).to(device)
    attention = use_varlen_attention(model, device, "bf16-autocast" if cuda else "fp32")
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    generator = torch.Generator().manual_seed(0)
    rows = args.group_size
    input_ids = torch.randint(0, args.vocab, (rows, PROMPT + length), generator=generator).to(device)
    rollout = UpdateBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids, dtype=torch.bool),
                      prompt_length=PROMPT, completion_ids=input_ids[:, PROMPT:],
                      loss_mask=torch.ones(rows, length, dtype=torch.bool, device=device),
                      advantages=torch.randn(rows, generator=generator).to(device))
    seconds = []
    for _ in range(args.steps):
        started = time.perf_counter()
        if ref_model is not None:
            rollout.ref_logps = completion_logprobs(Policy.of(ref_model), rollout, config.batching,
                                                     config.rollout.temperature)
        policy_update(Policy.of(model), optimizer, rollout, config.loss, config.batching, config.optimization,
                      config.rollout.temperature)
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes() - baseline
    return {"loss": loss, "length": length, "peak_bytes": int(peak), "step_seconds": statistics.median(seconds),
            "attention": attention}


def measure(args, length: int, loss: str) -> dict:
    """worker() in a fresh interpreter."""
    command = [sys.executable, "-m", "grpo_fast.benchmarks.long_context", "--worker-length", str(length),
               "--worker-loss", loss,
               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--layers", str(args.layers),
                "--group-size", str(args.group_size), "--steps", str(args.steps), "--beta", str(args.beta),
                "--device", args.device] + (["--no-checkpointing"] if args.no_checkpointing else [])
    done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        if done.returncode in (-9, 137):
            return {"loss": loss, "length": length, "error": "out of memory: killed"}
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {"loss": loss, "length": length, "error": tail[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def run(args) -> list:
    rows, earlier = [], {}
    if args.carry_over:
        with open(os.path.join(args.out, "long_context.json")) as f:
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
    return rows


def summary_line(row: dict) -> str:
    if "error" in row:
        return f"{row['loss']:>10} {row['length']:>6}: {row['error']}"
    ratio = row["planned_bytes"] / row["peak_bytes"]
    return (f"{row['loss']:>10} {row['length']:>6}: peak {row['peak_bytes'] / GIB:.2f} GiB, planned "
            f"{row['planned_bytes'] / GIB:.2f} GiB ({ratio:.2f}x), step {row['step_seconds']:.1f} s")


def write(rows: list, args, out: str, command: str) -> None:
    from grpo_fast.benchmarks.profiling import machine_name

    os.makedirs(out, exist_ok=True)
    attention = sorted({row["attention"] for row in rows if "attention" in row and "carried_over" not in row})
    setting = (f"tiny Qwen2-style model, hidden {args.hidden}, {args.layers} layers, vocabulary {args.vocab}; "
               f"{args.group_size} completions per step after a {PROMPT}-token prompt, one per micro-batch, "
               f"gradient checkpointing {'off' if args.no_checkpointing else 'on'}, beta {args.beta}, AdamW, "
               f"median of {args.steps} steps" + (f", attention {' / '.join(attention)}" if attention else ""))
    lines = [f"# Long completions on {machine_name(args.device)}", "", setting, ""] + (
        [args.note, ""] if args.note else []) + [
             f"`{command}`" + (" (planned columns recomputed with `--replan`)" if args.replan else ""), "",
             "| completion tokens | loss | peak memory (GiB) | planned (GiB) | planned / measured | step (s) |",
             "|---|---|---|---|---|---|"]
    carried = sorted({row["carried_over"] for row in rows if "carried_over" in row})
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
    for command_before in carried:
        lines += ["", f"\\* carried over as measured by `{command_before}` (one sequence per micro-batch runs the "
                  "same attention either way), planned columns from the current planner"]
    with open(os.path.join(out, "long_context.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "long_context.json"), "w") as f:
        json.dump({"machine": machine_name(args.device), "setting": setting, "command": command, "rows": rows}, f,
                  indent=1)
    plot(rows, out)


def plot(rows: list, out: str) -> None:
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
    fig.savefig(os.path.join(out, "long_context.png"), dpi=100)
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
    parser.add_argument("--no-checkpointing", action="store_true")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--max-gib", type=float, default=18.0, help="skip runs planned above this")
    parser.add_argument("--timeout", type=int, default=3600)
    parser.add_argument("--out", default=None)
    parser.add_argument("--carry-over", type=int, nargs="+", default=None, metavar="LENGTH",
                        help="take these lengths' rows from --out/long_context.json as measured before")
    parser.add_argument("--note", default=None, help="a line for the table's header (how the machine was)")
    parser.add_argument("--replan", action="store_true",
                        help="recompute the planned columns of --out/long_context.json with the current planner")
    parser.add_argument("--worker-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-loss", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_length:
        print(json.dumps(worker(args)))
        return 0
    command = "python -m grpo_fast.benchmarks.long_context " + " ".join(sys.argv[1:])
    if args.replan:
        with open(os.path.join(args.out, "long_context.json")) as f:
            saved = json.load(f)
        rows, command = saved["rows"], saved["command"]
        replan(rows, args)
    else:
        rows = run(args)
    if args.out:
        write(rows, args, args.out, command)
    return 0


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
