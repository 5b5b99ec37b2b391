"""`grpo-fast plan`: its arguments and what it prints (the table of grpo_fast.train.plan.report, or JSON)."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, replace

from grpo_fast.train.config import load_config
from grpo_fast.train.plan.fit import training_job, training_shape
from grpo_fast.train.plan.memory import (
    ATTENTIONS,
    DTYPES,
    ENGINES,
    GIB,
    LOSSES,
    OPTIMIZERS,
    PRESETS,
    Job,
    JobValueError,
    load_shape,
    plan,
)
from grpo_fast.train.plan.report import format_report, report


def add_arguments(parser) -> None:
    defaults = Job()
    parser.add_argument("model", help=f"a preset ({', '.join(PRESETS)}), a Hugging Face config.json / folder, or a "
                        "training config (.yaml: its keys give the job; --prompt-length and --device still apply)")
    parser.add_argument("--prompt-length", type=int, default=defaults.prompt_length)
    parser.add_argument("--completion-length", type=int, default=defaults.completion_length)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--micro-batch-size", type=int, default=defaults.micro_batch_size, help="sequences")
    parser.add_argument("--micro-batch-tokens", type=int, default=None)
    parser.add_argument("--dtype", choices=DTYPES, default=defaults.dtype,
                        help="bf16-autocast: fp32 weights, bf16 compute (the trainer on GPU)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=defaults.optimizer)
    parser.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default=defaults.grad_accum_dtype,
                        help="what bf16 weights' gradients add up in over micro-batches (fp32: an fp32 copy)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true")
    parser.add_argument("--lora-rank", type=int, default=0, help="0: full training")
    parser.add_argument("--loss", choices=LOSSES, default=defaults.loss)
    parser.add_argument("--beta", type=float, default=0.0, help="> 0 keeps a reference model")
    parser.add_argument("--engine", choices=ENGINES, default=defaults.engine)
    parser.add_argument("--gpu-memory-utilization", type=float, default=defaults.gpu_memory_utilization)
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness,
                        help="0: generate, then update; k >= 1: the engine in its own process on the same device")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--no-packing", action="store_true", help="padded micro-batches (the trainer's packing: "
                        "false)")
    parser.add_argument("--attention", choices=ATTENTIONS, default="auto",
                        help="auto: the trainer's (flash_attention_2 on CUDA with flash_attn, else "
                        "grpo_fast_varlen); sdpa: transformers' default, a dense mask over a packed micro-batch")
    parser.add_argument("--top-k", type=int, default=defaults.top_k, help="0: every token; with top-k or top-p each "
                        "sampled token's kept set is stored for the loss")
    parser.add_argument("--top-p", type=float, default=defaults.top_p,
                        help="< 1 without --top-k: kept sets of up to the whole vocabulary")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes per component)")


def main(args) -> int:
    """`grpo-fast plan`: print the table (or JSON) for the arguments of `add_arguments`."""
    try:
        if args.model.endswith((".yaml", ".yml")):           # plan exactly what `grpo-fast train` would run
            config = load_config(args.model)
            config.rollout.check_for_training()
            shape, job = training_shape(config.policy), training_job(config, args.prompt_length, args.device)
            result = report(args.model, shape, job)       # the largest stage of completion_length_stages
            print(json.dumps(asdict(result), indent=1) if args.json else format_report(result))
            stages = config.rollout.stages()
            for start, length in stages if len(stages) > 1 and not args.json else []:
                staged = plan(shape, replace(job, completion_length=length))
                print(f"stage from step {start + 1}: completions of up to {length} tokens, training peak "
                      f"{staged['total'] / GIB:.2f} GiB")
            return 0
        shape = load_shape(args.model)
        job = Job(prompt_length=args.prompt_length, completion_length=args.completion_length,
                  group_size=args.group_size, prompts_per_step=args.prompts_per_step,
                  micro_batch_size=args.micro_batch_size, micro_batch_tokens=args.micro_batch_tokens,
                  dtype=args.dtype, optimizer=args.optimizer, grad_accum_dtype=args.grad_accum_dtype,
                  gradient_checkpointing=not args.no_gradient_checkpointing, lora_rank=args.lora_rank,
                  loss=args.loss, beta=args.beta, engine=args.engine,
                  gpu_memory_utilization=args.gpu_memory_utilization, device=args.device,
                  packing=not args.no_packing, attention=args.attention, max_staleness=args.max_staleness,
                  top_k=args.top_k, top_p=args.top_p)
    except JobValueError as error:       # named by the option the user typed
        option = "--" + error.field.replace("_", "-")
        print(f"grpo-fast plan: {option} must be {error.expected}, got {error.value!r}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        print(f"grpo-fast plan: {error}", file=sys.stderr)
        return 2
    result = report(args.model, shape, job)
    print(json.dumps(asdict(result), indent=1) if args.json else format_report(result))
    return 0
