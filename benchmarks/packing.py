"""Packed against padded micro-batches: time and peak memory of the trainer's policy update, with transformers'
sdpa (a packed row gets a dense (N, N) block-diagonal mask) and with the trainer's variable-length attention
(grpo_fast.packed_attention: per-sequence sdpa, or flash-attention on CUDA).

python -m grpo_fast.benchmarks.packing [--lengths 400 2000] [--sequences 32 8] [--attention sdpa varlen]
                                       [--steps 3] [--output benchmarks/results/cpu/packing.json]

Each (attention, packing, length) runs in a fresh process: the built-in tiny Qwen2 model (grpo_fast.train.policy:
hidden 128, 2 layers, 4 heads of 32, 2 KV heads, vocabulary 300, fp32), one micro-batch of `sequences` rollouts
whose prompts are 16-48 tokens and completions uniformly L/2 to L tokens (random ids, seeded: every
configuration sees the same rollout), and `steps` policy updates (grpo_fast.train.update.step.policy_update: loss
dapo, AdamW, gradient checkpointing on as the trainer's default) after one warm-up update. Time: the median
update (wall clock, and the process's CPU time, which a busy machine disturbs less); memory: the child's peak
RSS (getrusage ru_maxrss) and its growth above the RSS before the model was built. Writes the JSON and a
Markdown table next to it (default ./packing.json: committed results are only overwritten when --output names
them).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

MIB = 2**20
ATTENTIONS = ("sdpa", "varlen")


def rollout(sequences: int, length: int, vocab: int, seed: int = 0):
    """`sequences` rollout rows: prompts of 16-48 tokens, completions of length // 2 to length tokens."""
    from grpo_fast.train.rollout.generation import pack
    from grpo_fast.train.update.step import UpdateBatch

    generator = torch.Generator().manual_seed(seed)
    prompt_lengths = torch.randint(16, 49, (sequences,), generator=generator).tolist()
    completion_lengths = torch.randint(length // 2, length + 1, (sequences,), generator=generator).tolist()
    prompts = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in prompt_lengths]
    completions = [torch.randint(3, vocab, (n,), generator=generator).tolist() for n in completion_lengths]
    generation = pack(prompts, completions, [False] * sequences, pad_token_id=0)
    return UpdateBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                   prompt_length=generation.prompt_length, completion_ids=generation.completion_ids,
                   loss_mask=generation.completion_mask,
                   advantages=torch.randn(sequences, generator=generator))


def worker(args) -> dict:
    """One (attention, packing, length) measurement in this process."""
    import resource

    from transformers import Qwen2ForCausalLM  # noqa: F401  (imported before the baseline: not the job's memory)

    from grpo_fast import packed_attention as attention
    from grpo_fast.benchmarks.profiling import rss_bytes
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.policy import TINY_VOCAB, tiny_qwen2
    from grpo_fast.train.update.step import Policy, policy_update

    length, packing, sequences = args.worker_length, args.worker_packing == "packed", args.worker_sequences
    batch = rollout(sequences, length, TINY_VOCAB)
    baseline = rss_bytes()
    model = tiny_qwen2(TINY_VOCAB, max_positions=int(batch.input_ids.shape[1]) + 1)
    name = "sdpa" if args.worker_attention == "sdpa" else attention.use_varlen_attention(model, "cpu")
    config = TrainConfig.from_keys(model="tiny", max_completion_length=length, micro_batch_size=sequences,
                                   packing=packing, loss_type="dapo", device="cpu")
    if config.policy.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    seconds, cpu_seconds = [], []
    for step in range(args.steps + 1):                    # the first one warms up
        started, cpu_started = time.perf_counter(), time.process_time()
        policy_update(Policy.of(model), optimizer, batch, config.loss_at(0), config.batching, config.optimization,
                      config.rollout.temperature)
        if step:
            seconds.append(time.perf_counter() - started)
            cpu_seconds.append(time.process_time() - cpu_started)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024         # Linux: KiB
    return {"attention": name, "packing": packing, "length": length, "sequences": sequences,
            "tokens": int(batch.attention_mask.sum()), "padded_tokens": int(batch.attention_mask.numel()),
            "update_seconds": statistics.median(seconds), "seconds": seconds,
            "update_cpu_seconds": statistics.median(cpu_seconds), "peak_rss_bytes": peak,
            "rss_growth_bytes": peak - baseline}


def measure(args, attention: str, packing: bool, length: int, sequences: int) -> dict:
    """worker() in a fresh interpreter, so that each peak RSS is its own."""
    command = [sys.executable, "-m", "grpo_fast.benchmarks.packing", "--worker-attention", attention,
               "--worker-packing", "packed" if packing else "padded", "--worker-length", str(length),
               "--worker-sequences", str(sequences), "--steps", str(args.steps)]
    row = {"attention": attention, "packing": packing, "length": length, "sequences": sequences}
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return {**row, "error": f"not done in {args.timeout} s"}
    if done.returncode != 0:
        if done.returncode in (-9, 137):
            return {**row, "error": "out of memory: killed"}
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        return {**row, "error": tail[:200]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: list) -> list:
    lines = ["| completion tokens (max) | sequences | attention | layout | real / padded tokens | update (s) | "
             "update CPU time (s) | peak RSS (MiB) | RSS growth (MiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        layout = "packed" if row["packing"] else "padded"
        if "error" in row:
            lines.append(f"| {row['length']} | {row['sequences']} | {row['attention']} | {layout} | - | "
                         f"{row['error']} | - | - | - |")
            continue
        lines.append(f"| {row['length']} | {row['sequences']} | {row['attention']} | {layout} | {row['tokens']} / "
                     f"{row['padded_tokens']} | {row['update_seconds']:.2f} | {row['update_cpu_seconds']:.2f} | "
                     f"{row['peak_rss_bytes'] / MIB:.0f} | "
                     f"{row['rss_growth_bytes'] / MIB:.0f} |")
    return lines


def write(rows: list, args, command: str) -> None:
    from grpo_fast.benchmarks.profiling import machine_name

    machine = machine_name("cpu")
    setting = ("built-in tiny Qwen2 (hidden 128, 2 layers, 4 heads of 32, 2 KV heads, vocabulary 300, fp32), one "
               "micro-batch per update: prompts 16-48 tokens, completions uniformly L/2 to L tokens; loss dapo, "
               f"AdamW, gradient checkpointing on; median of {args.steps} updates after a warm-up; each row a "
               f"fresh process, torch {torch.__version__} with {torch.get_num_threads()} threads")
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    with open(args.output, "w") as f:
        json.dump({"machine": machine, "setting": setting, "command": command, "rows": rows}, f, indent=1)
    markdown = os.path.splitext(args.output)[0] + ".md"
    lines = [f"# Packed and padded micro-batches on {machine}", "", setting, "", f"`{command}`", "",
             "sdpa: transformers' default attention (a packed row gets a dense (N, N) block-diagonal mask); "
             "grpo_fast_varlen: grpo_fast.packed_attention (causal sdpa within each packed sequence, "
             "sequences of similar length batched into one call, no mask).", ""]
    with open(markdown, "w") as f:
        f.write("\n".join(lines + table(rows)) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[400, 2000], help="longest completion")
    parser.add_argument("--sequences", type=int, nargs="+", default=[32, 8],
                        help="sequences per micro-batch, one per length (or one for all)")
    parser.add_argument("--attention", nargs="+", default=list(ATTENTIONS), choices=ATTENTIONS,
                        help="sdpa: the old behaviour (dense mask over a packed row); varlen: the trainer's")
    parser.add_argument("--layouts", nargs="+", default=["packed", "padded"], choices=["packed", "padded"])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--timeout", type=int, default=1800)
    parser.add_argument("--output", default="packing.json",
                        help="JSON path (a .md table is written beside it); the committed results are "
                             "benchmarks/results/cpu/packing.json")
    parser.add_argument("--worker-attention", help=argparse.SUPPRESS)
    parser.add_argument("--worker-packing", help=argparse.SUPPRESS)
    parser.add_argument("--worker-length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--worker-sequences", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker_length:
        print(json.dumps(worker(args)))
        return 0
    if len(args.sequences) not in (1, len(args.lengths)):
        parser.error(f"--sequences takes one count or one per length ({len(args.lengths)}), got "
                     f"{len(args.sequences)}")
    counts = args.sequences * len(args.lengths) if len(args.sequences) == 1 else args.sequences
    command = "python -m grpo_fast.benchmarks.packing " + " ".join(sys.argv[1:] if argv is None else argv)
    rows = []
    for length, sequences in zip(args.lengths, counts):
        for attention in args.attention:
            for layout in args.layouts:
                row = measure(args, attention, layout == "packed", length, sequences)
                rows.append(row)
                print(table([row])[-1], file=sys.stderr, flush=True)
    write(rows, args, command.strip())
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
