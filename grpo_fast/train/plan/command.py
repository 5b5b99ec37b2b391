"""`grpo-fast plan`: its arguments and what it prints (the table of grpo_fast.train.plan.report, or JSON)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace

from grpo_fast.train.config import KEYS, load_config, load_config_values
from grpo_fast.train.plan.fit import check_plan_context, fitting_change, training_job, training_shape
from grpo_fast.train.plan.memory import (
    ATTENTIONS,
    DISTRIBUTED,
    DTYPES,
    ENGINES,
    GIB,
    LOSSES,
    OPTIMIZERS,
    PRESETS,
    Job,
    JobValueError,
    check_heads,
    load_shape,
    plan,
)
from grpo_fast.train.plan.report import format_report, report
from grpo_fast.train.policy import check_rope_scaling
from grpo_fast.train.rollout.config import RolloutConfig
from grpo_fast.train.tasks.config import TASKS
from grpo_fast.train.update import precision


def completion_stages(text: str) -> list:
    """--completion-length: a length (Job checks its range), or a schedule FROM_STEP:LENGTH,... as `train
    --max-completion-length` takes it, checked as train checks it; as [(from step, length)]."""
    try:
        return list(RolloutConfig(max_completion_length=text).stages) if ":" in text else [(0, int(text))]
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"a length or a schedule FROM_STEP:LENGTH,... (e.g. 0:8192,200:16384), "
                                         f"got {text!r}" + (f": {error}" if ":" in text else "")) from None


def rope_scaling_json(text: str) -> dict:
    """--rope-scaling: a JSON object, policy.rope_scaling's dict (main checks it as the trainer does)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"a JSON object as policy.rope_scaling takes (e.g. "
                                         f"'{{\"rope_type\": \"yarn\", \"factor\": 4}}'), got {text!r}: "
                                         f"{error.msg}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"a JSON object as policy.rope_scaling takes, got {text!r}")
    return value


# option -> the trainer key whose default it takes: with no option given, the plan is `grpo-fast train`'s own job
# (on a preset or config.json model, with --completion-length and --prompt-length, which have no trainer default)
TRAINER_DEFAULTS = {"group_size": "group_size", "prompts_per_step": "prompts_per_step",
                    "micro_batch_size": "micro_batch_size", "micro_batch_tokens": "micro_batch_tokens",
                    "dtype": "dtype", "optimizer": "optimizer", "grad_accum_dtype": "grad_accum_dtype",
                    "lora_rank": "lora_rank", "loss": "loss_implementation", "beta": "beta", "engine": "engine",
                    "gpu_memory_utilization": "vllm_gpu_memory_utilization", "max_staleness": "max_staleness",
                    "attention": "attention", "top_k": "top_k", "top_p": "top_p",
                    "steps_per_generation": "steps_per_generation"}
# the distribution section's options: a training config gives its own (an option given with one is refused)
DISTRIBUTION_OPTIONS = {"sequence_parallel": ("--sequence-parallel", 1), "distributed": ("--distributed", "ddp")}
# switches a training config sets itself (the config's key, which a switch given beside it would be silently lost to)
CONFIG_FLAGS = {"offload_activations": "policy.offload_activations", "load_in_4bit": "policy.load_in_4bit",
                "bnb_4bit_double_quant": "policy.bnb_4bit_double_quant", "vllm_sleep": "rollout.vllm_sleep"}
# fit advice's trainer keys by this command's options (fit.fitting_change)
OPTIONS = {"loss_implementation": "--loss", "vllm_gpu_memory_utilization": "--gpu-memory-utilization",
           "max_completion_length": "--completion-length"}


def option_words(key: str, value) -> str:
    """A trainer key's value as this command's option (`--micro-batch-size 1`)."""
    if key == "gradient_checkpointing":
        return "gradient checkpointing (no --no-gradient-checkpointing)"
    return f"{OPTIONS.get(key, '--' + key.replace('_', '-'))} {value}"


class DefaultsHelp(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's help with its default, but a flag's (off unless given)."""

    def _get_help_string(self, action):
        return action.help if action.nargs == 0 else super()._get_help_string(action)


def add_arguments(parser) -> None:
    defaults = Job()
    trainer = {option: KEYS[key].default for option, key in TRAINER_DEFAULTS.items()}
    parser.formatter_class = DefaultsHelp
    parser.description = ("Predicted peak GPU memory of a GRPO job, per component, and the cards that hold it. Every "
                          "default but --prompt-length, --completion-length and --device is `grpo-fast train`'s. A "
                          "job whose prompt plus completion is beyond the model's context (its "
                          "max_position_embeddings, scaled by --rope-scaling) is refused as the trainer refuses it.")
    parser.add_argument("model", help=f"a preset ({', '.join(PRESETS)}: the Instruct checkpoint's shape and "
                        "context), a Hugging Face config.json / folder (its max_position_embeddings and rope_scaling "
                        "give the context), or a training config (.yaml: its keys give the job, policy.rope_scaling "
                        "included; --prompt-length and --device still apply)")
    parser.add_argument("--prompt-length", type=int, default=defaults.prompt_length,
                        help="the longest prompt, in tokens (the trainer measures it on its data)")
    parser.add_argument("--completion-length", type=completion_stages, default=str(defaults.completion_length),
                        help="a length, or a schedule FROM_STEP:LENGTH,... as train's --max-completion-length: "
                        "the plan is of its largest stage, with a line per stage")
    parser.add_argument("--rope-scaling", type=rope_scaling_json, default=None, metavar="JSON",
                        help="RoPE scaling past the model's context, the trainer's policy.rope_scaling (e.g. "
                        "'{\"rope_type\": \"yarn\", \"factor\": 4}'; yarn or linear, checked as train checks "
                        "it; dynamic is refused): the context becomes max_position_embeddings x factor; without it, "
                        "the model's own (its config.json's scaling counted)")
    parser.add_argument("--group-size", type=int, default=trainer["group_size"],
                        help="completions per prompt")
    parser.add_argument("--prompts-per-step", type=int, default=trainer["prompts_per_step"],
                        help="prompts per step: the step's batch, rollouts and kept sets, is counted")
    parser.add_argument("--micro-batch-size", type=int, default=trainer["micro_batch_size"],
                        help="sequences per micro-batch at most")
    parser.add_argument("--micro-batch-tokens", type=int, default=trainer["micro_batch_tokens"],
                        help="real tokens per micro-batch at most (None: no limit)")
    parser.add_argument("--dtype", choices=("auto",) + DTYPES, default=trainer["dtype"],
                        help="weights and compute: fp32, bf16-autocast (fp32 weights, bf16 compute), bf16 (bf16 "
                        "weights); auto: the trainer's on --device (fp32 on CPU; on CUDA bf16-autocast, or bf16 with "
                        "LoRA)")
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default=trainer["optimizer"],
                        help="adamw (fp32 states, and an fp32 master copy of bf16 weights), adamw8bit (8-bit "
                        "states), adamw-bf16 (bf16 states; bf16 weights only)")
    parser.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"), default=trainer["grad_accum_dtype"],
                        help="what bf16 weights' gradients add up in over micro-batches (fp32: an fp32 copy)")
    parser.add_argument("--no-gradient-checkpointing", action="store_true",
                        help="keep every layer's activations for backward (the trainer's gradient_checkpointing: "
                        "false)")
    parser.add_argument("--offload-activations", action="store_true",
                        help="keep the activations saved for backward in pinned host memory (the trainer's "
                        "policy.offload_activations; CUDA jobs: a host line beside the card's)")
    parser.add_argument("--lora-rank", type=int, default=trainer["lora_rank"],
                        help="rank of LoRA adapters trained on a frozen base (0: full training)")
    parser.add_argument("--load-in-4bit", action="store_true",
                        help="QLoRA: the frozen base's linear layers in NF4 (the trainer's policy.load_in_4bit; "
                        "needs --lora-rank)")
    parser.add_argument("--bnb-4bit-double-quant", action="store_true",
                        help="with --load-in-4bit, the 4-bit base's scales in 8 bits too")
    parser.add_argument("--loss", choices=LOSSES, default=trainer["loss"],
                        help="whose loss buffers are counted: grpo_fast (its chunk), naive (the full logits), trl "
                        "(TRL 1.16's fused LM head tile); the trainer's loss_implementation")
    parser.add_argument("--beta", type=float, default=trainer["beta"],
                        help="weight of the KL to the reference policy (> 0 keeps a reference model)")
    parser.add_argument("--engine", choices=ENGINES, default=trainer["engine"],
                        help="the rollout engine: hf (model.generate on the trainer's weights) or vllm (its own "
                        "share of the card, --gpu-memory-utilization)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=trainer["gpu_memory_utilization"],
                        help="vLLM's share of the card (the trainer's vllm_gpu_memory_utilization)")
    parser.add_argument("--vllm-sleep", action="store_true",
                        help="vLLM sleeps through each update, its pool free for it (the trainer's "
                        "rollout.vllm_sleep; --engine vllm, --max-staleness 0)")
    parser.add_argument("--max-staleness", type=int, default=trainer["max_staleness"],
                        help="0: generate, then update; k >= 1: the engine in its own process on the same device")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="where the job runs: cuda (the table says which cards hold it) or cpu")
    parser.add_argument("--no-packing", action="store_true", help="padded micro-batches (the trainer's packing: "
                        "false)")
    parser.add_argument("--attention", choices=ATTENTIONS, default=trainer["attention"],
                        help="auto: the trainer's (flash_attention_2 on CUDA with flash_attn, else "
                        "grpo_fast_varlen); sdpa: transformers' default, a dense mask over a packed micro-batch")
    parser.add_argument("--top-k", type=int, default=trainer["top_k"], help="0: every token; with top-k or top-p "
                        "each sampled token's kept set is stored for the loss")
    parser.add_argument("--top-p", type=float, default=trainer["top_p"],
                        help="< 1 without --top-k: kept sets of up to the whole vocabulary")
    add_distribution_arguments(parser, trainer)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (bytes per component)")


def add_distribution_arguments(parser, trainer: dict) -> None:
    """The options of a job under torchrun (`trainer`: the trainer's defaults by option, as add_arguments has them)."""
    parser.add_argument("--steps-per-generation", type=int, default=trainer["steps_per_generation"],
                        help="optimizer steps per step, each on a mini-batch of its groups (must divide each "
                        "data-parallel group's prompts)")
    parser.add_argument("--gpus", type=int, default=1,
                        help="torchrun's processes, one a GPU: the plan is one GPU's, its prompts_per_step / (gpus / "
                        "sequence_parallel) prompts a step")
    parser.add_argument("--sequence-parallel", type=int, default=None,
                        help="ranks that share each packed micro-batch's tokens (Ulysses; the trainer's "
                        "distribution.sequence_parallel): must divide --gpus and the model's heads [default: 1, or "
                        "a training config's]")
    parser.add_argument("--distributed", choices=DISTRIBUTED, default=None,
                        help="the wrapper with --gpus > 1: ddp (full replicas and gradient buckets) or fsdp2 "
                        "(weights, gradients and optimizer states sharded over all --gpus ranks) [default: ddp, or a "
                        "training config's distribution.distributed]")


def plan_config(path: str) -> tuple:
    """(TrainConfig, the missing dataset or None) of a training config: load_config(path), or where its data.task
    or evaluation.eval_task is a dataset on disk not there yet (a job planned before the download) the same config
    on the built-in task: a plan takes its prompt length from --prompt-length, not from the data."""
    try:
        return load_config(path), None
    except ValueError as error:
        placed = {}
        for name in ("task", "eval_task"):
            value = load_config_values(path).get(name)
            if isinstance(value, str) and value not in TASKS and not os.path.exists(os.path.expanduser(value)):
                placed[name] = value
        if not placed:
            raise error
        config = load_config(path, {name: "max" if name == "task" else None for name in placed})
        return config, " and ".join(placed.values())


def main(args) -> int:
    """`grpo-fast plan`: print the table (or JSON) for the arguments of `add_arguments`."""
    try:
        if args.model.endswith((".yaml", ".yml")):           # plan exactly what `grpo-fast train` would run
            if args.rope_scaling is not None:
                raise ValueError(f"--rope-scaling plans a preset or config.json; {args.model} gives its own "
                                 "(policy.rope_scaling): set it there")
            given = [(option, f"distribution.{key}") for key, (option, _) in DISTRIBUTION_OPTIONS.items()
                     if getattr(args, key) is not None]
            given += [("--" + key.replace("_", "-"), name) for key, name in CONFIG_FLAGS.items() if getattr(args, key)]
            if given:
                raise ValueError(f"{given[0][0]} plans a preset or config.json; {args.model} gives its own "
                                 f"({given[0][1]}): set it there")
            config, absent = plan_config(args.model)
            if absent:
                print(f"data: {absent} is not here yet; planned with prompts of --prompt-length "
                      f"{args.prompt_length} tokens")
            config.rollout.check_for_training()
            shape = training_shape(config.policy)
            job = training_job(config, args.prompt_length, args.device, args.gpus)
            check_heads(shape, job)
            context = check_plan_context(shape, job, config.policy.rope_scaling, config.policy.model)
            print_plan(args, shape, job, config.rollout.stages, context,    # the largest stage of the schedule
                       config.policy.rope_scaling)
            return 0
        for key, (_, default) in DISTRIBUTION_OPTIONS.items():
            setattr(args, key, default if getattr(args, key) is None else getattr(args, key))
        shape = load_shape(args.model)
        if args.rope_scaling is not None:
            check_rope_scaling(args.rope_scaling)
        job = Job(prompt_length=args.prompt_length, completion_length=max(length for _, length in
                                                                          args.completion_length),
                  group_size=args.group_size, prompts_per_step=args.prompts_per_step,
                  micro_batch_size=args.micro_batch_size, micro_batch_tokens=args.micro_batch_tokens,
                  dtype=precision.resolve(args.dtype, args.device, args.lora_rank), optimizer=args.optimizer,
                  grad_accum_dtype=args.grad_accum_dtype,
                  gradient_checkpointing=not args.no_gradient_checkpointing, lora_rank=args.lora_rank,
                  loss=args.loss, beta=args.beta, engine=args.engine,
                  gpu_memory_utilization=args.gpu_memory_utilization, device=args.device,
                  packing=not args.no_packing, attention=args.attention, max_staleness=args.max_staleness,
                  top_k=args.top_k, top_p=args.top_p, steps_per_generation=args.steps_per_generation,
                  gpus=args.gpus, sequence_parallel=args.sequence_parallel, distributed=args.distributed,
                  offload_activations=args.offload_activations, vllm_sleep=args.vllm_sleep,
                  load_in_4bit=args.load_in_4bit, bnb_4bit_double_quant=args.bnb_4bit_double_quant)
        check_heads(shape, job)
        context = check_plan_context(shape, job, args.rope_scaling, args.model, length_key="--completion-length",
                                     scaling_key="--rope-scaling")
    except JobValueError as error:       # named by the option the user typed
        option = "--" + error.field.replace("_", "-")
        print(f"grpo-fast plan: {option} must be {error.expected}, got {error.value!r}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as error:
        print(f"grpo-fast plan: {error}", file=sys.stderr)
        return 2
    print_plan(args, shape, job, args.completion_length, context, args.rope_scaling)
    return 0


def print_plan(args, shape, job: Job, stages: list, context=None, rope_scaling=None) -> None:
    """The report of `job` (its completion_length: the largest stage's) on a model of `context` positions with
    `rope_scaling` (see fit.check_plan_context), and with stages [(from step, length)] a line per stage: its
    training peak (the log counts steps from 1)."""
    result = report(args.model, shape, job, advice(shape, job), context=context, rope_scaling=rope_scaling)
    print(json.dumps(asdict(result), indent=1) if args.json else format_report(result))
    for start, length in stages if len(stages) > 1 and not args.json else []:
        staged = plan(shape, replace(job, completion_length=length))
        print(f"stage from step {start + 1}: completions of up to {length} tokens, training peak "
              f"{staged['total'] / GIB:.2f} GiB")


def advice(shape, job: Job):
    """report's advise: for a job on CUDA, what makes it fit a card (fit.fitting_change), in this command's
    options; none on CPU."""
    return (lambda capacity: fitting_change(shape, job, capacity, option_words)) if job.device == "cuda" else None
