"""verl's FSDP2 actor engine, `train_batch` (forward, backward and the optimizer step of one mini-batch) on a
CPU, with its LM head and loss three ways, each row in a fresh process (one gloo rank) for its own peak RSS:

- logits: verl's default path (use_fused_kernels off): the (tokens, vocab) logits, log-softmax, then ppo_loss;
- verl_fused: verl's own fused torch backend (FusedLinearForPPO: chunked log-probs, the logits recomputed in
  backward, 4 GEMM passes over every packed token);
- grpo_fast: grpo_fast.integrations.verl, the actor loss inside the sweep (3 GEMM passes over response tokens).

The model is a Qwen2-style decoder built from a config (tied embeddings: verl's own fused forward fails on an
untied head under FSDP2), sized so that the head matters: V = 65536 by default, 1,024-token responses.

    python -m grpo_fast.benchmarks.verl_engine --out benchmarks/results/cpu/verl_engine
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

ROWS = ("logits", "verl_fused", "grpo_fast")


def build_batch(args, seed=0):
    """verl's engine input for one mini-batch: left-right padded rollouts through verl's left_right_2_no_padding."""
    import torch
    from tensordict import TensorDict
    from verl.workers.utils.padding import left_right_2_no_padding

    g = torch.Generator().manual_seed(seed)
    batch, prompt, response = args.sequences, args.prompt_tokens, args.response_tokens
    input_ids = torch.randint(args.vocab, (batch, prompt + response), generator=g)
    attention = torch.ones(batch, prompt + response, dtype=torch.long)
    fields = dict(input_ids=input_ids, attention_mask=attention, response_mask=attention[:, prompt:].clone(),
                  position_ids=torch.arange(prompt + response).expand(batch, -1).clone(),
                  prompts=input_ids[:, :prompt], responses=input_ids[:, prompt:],
                  old_log_probs=-torch.rand(batch, response, generator=g) * 3 - 9,
                  advantages=torch.randn(batch, 1, generator=g).expand(batch, response).clone(),
                  ref_log_prob=-torch.rand(batch, response, generator=g) * 3 - 9)
    return left_right_2_no_padding(TensorDict(fields, batch_size=[batch]))


def build_engine(path: str, fused_kernels: bool, micro_batch: int, lr: float = 1e-6):
    """verl's FSDP2 actor engine (FSDPEngineWithLMHead, from verl's own configs and EngineRegistry) over the saved
    model at `path`, fp32 with sdpa attention, remove-padding on, initialized. Needs verl's CPU platform
    (grpo_fast.integrations.verl_cpu) on a machine without a GPU, and a process group."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                                 enable_gradient_checkpointing=False, use_fused_kernels=fused_kernels,
                                 fused_kernel_options={"impl_backend": "torch"},
                                 override_config={"attn_implementation": "sdpa"})
    engine_config = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
                                     micro_batch_size_per_gpu=micro_batch, use_dynamic_bsz=False,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"})
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model_config,
                                engine_config=engine_config, optimizer_config=FSDPOptimizerConfig(lr=lr),
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def run_row(args) -> dict:
    """One row in this process: build the engine, one warm-up train_batch, then the timed ones."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    import grpo_fast.integrations.verl_cpu  # noqa: F401, I001  (verl's device layer on the CPU, before its engines)

    # isort: split
    import torch
    from verl.models.transformers import dense_common
    from verl.utils import tensordict_utils as tu
    from verl.workers.config import (
        FSDPActorConfig,
        PolicyLossConfig,
    )
    from verl.workers.utils.losses import ppo_loss

    from grpo_fast.benchmarks.profiling import peak_rss_bytes, start_peak_rss

    verl_forward = dense_common.forward_with_torch_backend
    if args.row == "grpo_fast":
        import grpo_fast.integrations.verl  # noqa: F401  (installs itself)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    torch.distributed.init_process_group("gloo")
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = os.path.join(args.scratch, "model")
    Qwen2ForCausalLM(Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                                 num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=4096, tie_word_embeddings=True)).save_pretrained(path)
    fused = args.row != "logits"
    engine = build_engine(path, fused, args.micro_batch)
    assert (dense_common.forward_with_torch_backend is verl_forward) == (args.row != "grpo_fast")
    actor_config = FSDPActorConfig(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=args.micro_batch,
                                   use_dynamic_bsz=False, ppo_mini_batch_size=args.sequences,
                                   loss_agg_mode="token-mean", use_kl_loss=True, kl_loss_coef=0.01,
                                   kl_loss_type="low_var_kl", entropy_coeff=0.0, clip_ratio_high=0.28,
                                   policy_loss=PolicyLossConfig(loss_mode="vanilla"))
    data = build_batch(args)
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=fused, calculate_entropy=False,
                         temperature=1.0, micro_batch_size_per_gpu=args.micro_batch, use_dynamic_bsz=False,
                         global_batch_size=args.sequences)
    seconds, losses = [], []
    baseline = None
    for step in range(args.steps + 1):
        if step == 1:
            baseline = start_peak_rss()       # the peak of the timed steps, above what the warm-up left
        start = time.perf_counter()
        with engine.train_mode():
            output = engine.train_batch(data.clone(), loss_function=lambda *a, **k: ppo_loss(actor_config, *a, **k))
        elapsed = time.perf_counter() - start
        if step:
            seconds.append(elapsed)
        losses.append(float(sum(output["loss"]) if isinstance(output["loss"], list) else output["loss"]))
    peak = peak_rss_bytes() - baseline
    torch.distributed.destroy_process_group()
    return {"row": args.row, "step_s": statistics.median(seconds), "steps_s": seconds,
            "peak_rss_growth_mib": peak / 2**20, "loss": losses[0]}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--sequences", type=int, default=4, help="sequences in the mini-batch")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences per micro-batch")
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3, help="timed train_batch calls after one warm-up")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=29561)
    parser.add_argument("--out", default=None, help="folder for verl_engine.md / .json (default: print only)")
    parser.add_argument("--overwrite", action="store_true", help="replace results already in --out")
    parser.add_argument("--row", default=None, help=argparse.SUPPRESS)       # one row, in the child process
    parser.add_argument("--scratch", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.row:
        print(json.dumps(run_row(args)), flush=True)
        os._exit(0)              # skip the teardown of gloo's and ray's native threads once the result is out
    from grpo_fast.benchmarks.harness import refuse_to_overwrite, write_results
    from grpo_fast.benchmarks.profiling import machine_name

    refuse_to_overwrite(parser, args.out, "verl_engine", args.overwrite)
    given = sys.argv[1:] if argv is None else argv
    results = []
    for row in args.rows:
        with tempfile.TemporaryDirectory() as scratch:
            done = subprocess.run([sys.executable, "-m", "grpo_fast.benchmarks.verl_engine", *given, "--row", row,
                                   "--scratch", scratch], capture_output=True, text=True)
        if done.returncode != 0:
            results.append({"row": row, "error": done.stderr.strip().splitlines()[-1][:300]})
        else:
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(results[-1], flush=True)
    tokens = args.sequences * (args.prompt_tokens + args.response_tokens)
    reference = next((r for r in results if r["row"] == "verl_fused" and "error" not in r), None)
    lines = [f"# verl's FSDP2 engine train_batch on {machine_name('cpu')}", "",
             f"`python -m grpo_fast.benchmarks.verl_engine {' '.join(given)}`", "",
             f"Qwen2-style, V = {args.vocab}, H = {args.hidden}, {args.layers} layers, tied head, fp32; "
             f"{args.sequences} sequences of {args.prompt_tokens} + {args.response_tokens} tokens ({tokens} packed), "
             f"micro-batches of {args.micro_batch}; vanilla policy loss, token-mean, low_var_kl; one gloo rank, "
             f"{args.threads} threads; median of {args.steps} after a warm-up; peak RSS growth over the timed "
             f"steps.", "",
             "| row | train_batch (s) | vs verl_fused | peak RSS growth (MiB) | loss |", "|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | {r['error']} | | | |")
            continue
        ratio = f"{r['step_s'] / reference['step_s']:.2f}x" if reference else "-"
        lines.append(f"| {r['row']} | {r['step_s']:.2f} | {ratio} | {r['peak_rss_growth_mib']:.0f} | "
                     f"{r['loss']:.6f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.out:
        write_results(args.out, "verl_engine", table, {"command": lines[2], "rows": results})


if __name__ == "__main__":
    main()
