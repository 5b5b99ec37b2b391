"""Sequence parallelism's memory: the peak of one training micro-batch (forward, fused loss, backward) on each rank
of a sequence-parallel group against the same micro-batch in one process.

python -m grpo_fast.benchmarks.sequence_parallel_memory [--model smollm2-135m-instruct] [--tokens 8192]
    [--sequences 4] [--ranks 2] [--threads 1] [--malloc-mmap-threshold 65536] [--out DIR] [--overwrite]

One packed micro-batch of --sequences sequences (a 64-token prompt each, random completions) of --tokens tokens in
all, the trainer's update (grpo_fast.train.update.step.accumulate_gradients: fp32, gradient checkpointing,
grpo_fast's attention and fused dapo loss) in one process, then under torchrun with --ranks processes and
distribution.sequence_parallel = --ranks, each rank holding tokens / ranks of the row. Neither run has a
data-parallel wrapper (its gradient sync moves the transients around the gradients, not the micro-batch's). Each run
first takes a one-sequence micro-batch, so the gradients exist; the measurement is the peak RSS of the full
micro-batch's update above the RSS before it: what the micro-batch itself needs (activations, loss buffers, the
exchanges' buffers, transients), which sequence parallelism divides. glibc's mmap threshold is fixed (as in
benchmarks/long_context.py) so that freed blocks leave the process and RSS follows live memory. Writes
sequence_parallel_memory.md / .json to --out, kept unless --overwrite.
"""

import argparse
import json
import os
import shlex
import subprocess
import sys

import torch

GIB = 2**30
PROMPT = 64
NAME = "sequence_parallel_memory"


def packed_rollout(tokens: int, sequences: int, vocab: int):
    """An UpdateBatch of `sequences` rows, each a PROMPT-token prompt and a completion, tokens in all."""
    from grpo_fast.train.update.step import UpdateBatch

    generator = torch.Generator().manual_seed(0)
    completion = tokens // sequences - PROMPT
    input_ids = torch.randint(1, vocab, (sequences, PROMPT + completion), generator=generator)
    return UpdateBatch(input_ids=input_ids, attention_mask=torch.ones_like(input_ids, dtype=torch.bool),
                       prompt_length=PROMPT, completion_ids=input_ids[:, PROMPT:],
                       loss_mask=torch.ones(sequences, completion, dtype=torch.bool),
                       advantages=torch.randn(sequences, generator=generator))


def worker(args) -> dict:
    """The measurement in this process (one rank of torchrun's, or alone)."""
    from grpo_fast.benchmarks.profiling import peak_rss_bytes, start_peak_rss
    from grpo_fast.packed_attention import use_varlen_attention
    from grpo_fast.train import distributed, pretrained
    from grpo_fast.train.config import TrainConfig
    from grpo_fast.train.policy import from_pretrained
    from grpo_fast.train.update.step import Policy, accumulate_gradients

    torch.set_num_threads(args.threads)
    sequence_parallel = int(os.environ.get("WORLD_SIZE", "1"))
    world = distributed.init("cpu", sequence_parallel)
    model = from_pretrained(pretrained.model_folder(args.model), torch.float32, None)
    use_varlen_attention(model, "cpu", "fp32", flash=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    # no data-parallel wrapper: DDP's gradient sync changes the transients around the gradients, not the
    # micro-batch's, and one process has none
    policy = Policy(model, distributed.wrap(model, "none", world))
    config = TrainConfig.from_keys(model="tiny", max_completion_length=args.tokens, micro_batch_size=args.sequences,
                                   loss_type="dapo", device="cpu", packing=True)
    sections = (config.loss, config.batching, config.optimization, config.rollout.temperature)
    vocab = model.config.vocab_size
    accumulate_gradients(policy, packed_rollout(2 * PROMPT, 1, vocab), *sections, world)    # the gradients exist
    batch = packed_rollout(args.tokens, args.sequences, vocab)
    baseline = start_peak_rss()
    metrics = accumulate_gradients(policy, batch, *sections, world)
    peak = peak_rss_bytes() - baseline
    peaks = distributed.sum_over_ranks({f"peak_{rank}": peak if rank == world.rank else 0
                                        for rank in range(world.size)}, world, torch.device("cpu"))
    return {"ranks": world.size, "peaks": [peaks[f"peak_{rank}"] for rank in range(world.size)],
            "loss": metrics["loss"], "is_main": world.is_main}


def run_variant(args, ranks: int) -> dict:
    """worker() in fresh processes: alone (ranks 1) or under torchrun with `ranks` processes."""
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
    if args.malloc_mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.malloc_mmap_threshold)
    module = ["-m", "grpo_fast.benchmarks.sequence_parallel_memory", "--worker", "--model", args.model,
              "--tokens", str(args.tokens), "--sequences", str(args.sequences), "--threads", str(args.threads)]
    if ranks == 1:
        command = [sys.executable, *module]
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks),
                   *module]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{ranks} rank(s) failed: {done.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def plan_rows(args) -> dict:
    """The planner's micro-batch components for one process and per rank."""
    from grpo_fast.train import pretrained
    from grpo_fast.train.plan.memory import Job, ModelShape, plan

    shape = ModelShape.from_config(os.path.join(pretrained.model_folder(args.model), "config.json"))
    per_sequence = args.tokens // args.sequences
    base = dict(prompt_length=PROMPT, completion_length=per_sequence - PROMPT, group_size=args.sequences,
                prompts_per_step=1, micro_batch_size=args.sequences, dtype="fp32", engine="hf", device="cpu")
    parts = ("activations", "loss_buffers", "attention_mask", "no_grad_pass", "sp_all_to_all", "sp_completion_states")
    rows = {}
    for ranks in (1, args.ranks):
        estimate = plan(shape, Job(**base, gpus=ranks, sequence_parallel=ranks))
        rows[ranks] = sum(estimate.get(part, 0) for part in parts)
    return rows


def markdown(result: dict) -> str:
    one, ranks = result["one_process"], result["sequence_parallel"]
    lines = [f"# Sequence parallelism: a micro-batch's peak per rank on {result['machine']}", "",
             result["setting"], "", f"`{result['command']}`", "",
             "| processes | peak RSS growth of the micro-batch, each rank (GiB) | vs one process | planner (GiB) |",
             "|---|---|---|---|"]
    plan = result["plan"]
    lines.append(f"| 1 | {one['peaks'][0] / GIB:.3f} | 1.000x | {plan['1'] / GIB:.3f} |")
    each = ", ".join(f"{peak / GIB:.3f}" for peak in ranks["peaks"])
    worst = max(ranks["peaks"]) / one["peaks"][0]
    lines.append(f"| {ranks['ranks']} (sequence_parallel {ranks['ranks']}) | {each} | {worst:.3f}x (largest rank) | "
                 f"{plan[str(ranks['ranks'])] / GIB:.3f} |")
    lines += ["", f"Loss: {one['loss']:.6f} in one process, {ranks['loss']:.6f} summed over the ranks."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens of the packed micro-batch")
    parser.add_argument("--sequences", type=int, default=4)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--malloc-mmap-threshold", type=int, default=65536, metavar="BYTES")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--out", default="benchmarks/results/cpu")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.tokens % args.sequences or args.tokens // args.sequences <= PROMPT:
        parser.error(f"--tokens must split into --sequences sequences longer than the {PROMPT}-token prompt, got "
                     f"{args.tokens} over {args.sequences}")
    if args.worker:
        result = worker(args)
        if result.pop("is_main"):
            print("RESULT " + json.dumps(result), flush=True)
        return 0
    paths = [os.path.join(args.out, f"{NAME}.{ext}") for ext in ("md", "json")]
    if any(os.path.exists(path) for path in paths) and not args.overwrite:
        parser.error(f"{paths[0]} exists: pass --overwrite to replace it, or another --out")
    from grpo_fast.benchmarks.profiling import machine_name

    one, ranks = run_variant(args, 1), run_variant(args, args.ranks)
    setting = (f"{args.model} (fp32), one packed micro-batch of {args.sequences} sequences x "
               f"{args.tokens // args.sequences} tokens ({PROMPT}-token prompts), gradient checkpointing, grpo_fast's "
               f"attention and fused dapo loss, {args.threads} thread(s) a process, glibc's mmap threshold fixed at "
               f"{args.malloc_mmap_threshold} bytes; peak RSS of the micro-batch's update above the RSS before it "
               "(the gradients already allocated), no data-parallel wrapper")
    result = {"machine": machine_name("cpu"), "setting": setting, "one_process": one, "sequence_parallel": ranks,
              "plan": {str(k): v for k, v in plan_rows(args).items()},
              "command": shlex.join(["python", "-m", "grpo_fast.benchmarks.sequence_parallel_memory",
                                     *(argv if argv is not None else sys.argv[1:])])}
    os.makedirs(args.out, exist_ok=True)
    with open(paths[1], "w") as f:
        json.dump(result, f, indent=1)
    with open(paths[0], "w") as f:
        f.write(markdown(result))
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
