"""A TrainConfig's job for the planner, and whether it fits: the shape and Job a config trains, what would make a
job fit a card (fitting_change; fit_advice for a config), and the plan the trainer logs before it loads a model
(log_run_plan).
"""

from __future__ import annotations

import dataclasses
import os
from types import SimpleNamespace
from typing import Optional

import torch

from grpo_fast.train import pretrained, tasks
from grpo_fast.train.plan.memory import (
    CHECKPOINT_PRESETS,
    GIB,
    PRESETS,
    Job,
    ModelShape,
    fits_in,
    least_pool_share,
    load_shape,
    plan,
    pool_shortfall,
)
from grpo_fast.train.plan.report import summary
from grpo_fast.train.policy import (
    TINY_HEADS,
    TINY_HIDDEN,
    TINY_KV_HEADS,
    TINY_LAYERS,
    TINY_VOCAB,
    check_own_rope,
    scaled_rope,
)
from grpo_fast.train.update import precision


def training_shape(policy) -> ModelShape:
    """The shape of the model the policy section trains (policy.model): the built-in tiny model, its folder's
    config.json, or for a hub id the preset its name starts with (Qwen/Qwen2.5-7B-Instruct: qwen2.5-7b), with the
    preset's context for an Instruct checkpoint or a preset of one checkpoint (CHECKPOINT_PRESETS) alone (another's may
    differ: left to the trainer's check). The tiny
    model's context is sized by the trainer to the run's lengths: not checked. Raises ValueError otherwise."""
    if policy.model == "tiny":
        return ModelShape(hidden_size=TINY_HIDDEN, intermediate_size=2 * TINY_HIDDEN, num_layers=TINY_LAYERS,
                          num_heads=TINY_HEADS, num_kv_heads=TINY_KV_HEADS, vocab_size=TINY_VOCAB,
                          tie_word_embeddings=True)
    if policy.model == pretrained.SMOLLM2:
        return load_shape(pretrained.model_folder(policy.model))
    if os.path.isdir(policy.model):
        return load_shape(policy.model)
    name = policy.model.rsplit("/", 1)[-1].lower()
    matches = sorted((preset for preset in PRESETS if name == preset or name.startswith(preset + "-")), key=len)
    if not matches:
        raise ValueError(f"cannot plan model {policy.model!r}: not a local folder with a config.json, and its "
                         f"name matches no preset ({', '.join(PRESETS)})")
    shape = PRESETS[matches[-1]]
    if not name.endswith("-instruct") and name not in CHECKPOINT_PRESETS:   # a family's other checkpoints may differ
        shape = dataclasses.replace(shape, max_position_embeddings=None, rope_parameters=None)
    return shape


def check_plan_context(shape: ModelShape, job: Job, rope_scaling: Optional[dict], model: str, *,
                       length_key: str = "max_completion_length", scaling_key: str = "policy.rope_scaling"):
    """The context in positions of the model of `shape` with `rope_scaling` (policy.rope_scaling's dict, checked)
    applied as the trainer applies it (policy.scaled_rope), or None when its max_position_embeddings is unknown.
    Raises the trainer's own ValueErrors: a dynamic NTK scaling of the model's own config without rope_scaling
    (policy.check_own_rope), and a job whose prompt plus completion do not fit (tasks.check_context, naming
    length_key and scaling_key, with the largest length and the YaRN factor that fit)."""
    if shape.max_position_embeddings is None:
        return None
    model_config = SimpleNamespace(max_position_embeddings=shape.max_position_embeddings,
                                   rope_parameters=dict(shape.rope_parameters or {}))
    if rope_scaling is None:
        check_own_rope(model_config, model)
    scaled_rope(model_config, rope_scaling)
    tasks.check_context(job.prompt_length, job.completion_length, model_config, length_key=length_key,
                        scaling_key=scaling_key)
    return int(tasks.model_context(model_config)[0])


def training_job(config, prompt_length: int, device: str, gpus: int = 1) -> Job:
    """The Job a TrainConfig runs: its lengths, batching, checkpointing and activation offload, loss, KL, engine
    (and vllm_sleep), 4-bit base, staleness, dtype (auto: bf16 autocast over fp32 weights on CUDA, fp32 on CPU),
    optimizer, LoRA rank, steps_per_generation and distribution section (sequence_parallel, distributed) on
    `device`, under torchrun with `gpus` processes. prompt_length: the longest prompt in tokens, which the config
    alone does not know."""
    policy, rollout, batching, optimization = config.policy, config.rollout, config.batching, config.optimization
    device = "cpu" if policy.device == "cpu" else device
    return Job(prompt_length=prompt_length, completion_length=rollout.max_completion_length,
               group_size=rollout.group_size, prompts_per_step=rollout.prompts_per_step,
               micro_batch_size=batching.micro_batch_size, micro_batch_tokens=batching.micro_batch_tokens,
               dtype=precision.resolve(policy.dtype, device, policy.lora_rank), optimizer=optimization.optimizer,
               grad_accum_dtype=optimization.grad_accum_dtype, lora_rank=policy.lora_rank,
               gradient_checkpointing=policy.gradient_checkpointing,
               loss="naive" if optimization.loss_implementation == "naive" else "grpo_fast", beta=config.loss.beta,
               engine=rollout.engine, gpu_memory_utilization=rollout.vllm_gpu_memory_utilization, device=device,
               packing=batching.packing, max_staleness=rollout.max_staleness, top_k=rollout.top_k,
               top_p=rollout.top_p, gpus=gpus, sequence_parallel=config.distribution.sequence_parallel,
               distributed=config.distribution.distributed,
               steps_per_generation=optimization.steps_per_generation,
               offload_activations=policy.offload_activations, vllm_sleep=rollout.vllm_sleep,
               load_in_4bit=policy.load_in_4bit, bnb_4bit_double_quant=policy.bnb_4bit_double_quant)



# single changes of a job that lower its peak without changing what it learns, tried in this order, as trainer keys
FIT_CHANGES = (("gradient_checkpointing", True), ("loss_implementation", "grpo_fast"), ("micro_batch_size", 1),
               ("vllm_gpu_memory_utilization", 0.2))
# then the memory options (grpo_fast.train.update.precision, lora), from the most exact: they change the numerics or
# what is trained
MEMORY_CHANGES = ({"dtype": "bf16", "optimizer": "adamw-bf16"}, {"dtype": "bf16", "optimizer": "adamw8bit"},
                  {"dtype": "bf16", "optimizer": "adamw", "lora_rank": 64})
# the Job field each trainer key of those changes sets (training_job's mapping)
JOB_FIELDS = {"gradient_checkpointing": "gradient_checkpointing", "loss_implementation": "loss",
              "micro_batch_size": "micro_batch_size", "vllm_gpu_memory_utilization": "gpu_memory_utilization",
              "dtype": "dtype", "optimizer": "optimizer", "lora_rank": "lora_rank",
              "max_completion_length": "completion_length"}


def config_words(key: str, value) -> str:
    """A trainer key's value as a config file writes it (`micro_batch_size: 1`)."""
    return f"{key}: {value}"


def fit_advice(config, shape: ModelShape, prompt_length: int, capacity: int, gpus: int = 1):
    """None when the TrainConfig's job on `gpus` processes fits a CUDA card of `capacity` bytes (each); otherwise
    one sentence saying how much it needs and what would make it fit (fitting_change)."""
    job = training_job(config, prompt_length, "cuda", gpus)
    ok, needed = fits_in(shape, job, plan(shape, job, capacity), capacity)
    if ok:
        return None
    message = f"the plan needs {needed / GIB:.1f} GiB on this {capacity / GIB:.1f} GiB card" + (
        f" ({pool_shortfall(shape, job, capacity)})" if needed <= capacity else "")
    return f"{message}; {fitting_change(shape, job, capacity)}"


def _needed(shape: ModelShape, job: Job, change: dict, capacity: int):
    """The bytes `job` with `change` (trainer keys) needs on the card when it fits there, else None (also for a
    combination the trainer refuses: no way to fit)."""
    try:
        changed = dataclasses.replace(job, **{JOB_FIELDS[key]: value for key, value in change.items()})
    except ValueError:
        return None
    ok, needed = fits_in(shape, changed, plan(shape, changed, capacity), capacity)
    return needed if ok else None


def fitting_change(shape: ModelShape, job: Job, capacity: int, words=config_words) -> str:
    """What makes a job that does not fit a CUDA card of `capacity` bytes fit, by the planner's numbers, as "X would
    make it fit (needed GiB)": the first single change of FIT_CHANGES, else of MEMORY_CHANGES, that does; else
    the exact ones together, alone or with a memory option (only those of them it needs); else the longest
    completion that does; else that none does. A vLLM pool too small for its weights and one sequence is offered
    the least share that holds them (least_pool_share) in place of FIT_CHANGES' smaller one. words(key, value):
    how a trainer key's value is named (a config's `key: value`, or `grpo-fast plan`'s option)."""
    exact = {key: value for key, value in FIT_CHANGES if getattr(job, JOB_FIELDS[key]) != value}
    share = least_pool_share(shape, job, capacity)
    if share is not None:           # a pool too small for vLLM's weights and a sequence: a larger share, not 0.2
        exact["vllm_gpu_memory_utilization"] = share
    caveat = "; it changes the numerics or what is trained"
    tries = [({key: value}, "") for key, value in exact.items()] + [(change, caveat) for change in MEMORY_CHANGES]
    tries += [(exact, "")] * (len(exact) > 1) + [({**exact, **change}, caveat) for change in MEMORY_CHANGES
                                                  if exact]
    for change, note in tries:
        if _needed(shape, job, change, capacity) is None:
            continue
        for key in [key for key in exact if key in change and len(change) > 1]:     # drop what it does not need
            fewer = {other: value for other, value in change.items() if other != key}
            change = fewer if _needed(shape, job, fewer, capacity) is not None else change
        named = [words(key, value) for key, value in change.items()]
        named = " and ".join([", ".join(named[:-1]), named[-1]] if len(named) > 1 else named)
        return f"{named} would make it fit ({_needed(shape, job, change, capacity) / GIB:.1f} GiB{note})"
    none = ("no change of checkpointing, the loss, the micro-batch, the vLLM share, the weights' dtype, the optimizer "
            "or LoRA makes it fit")
    low, high = 0, job.completion_length          # the longest completion that fits: low does (0: none), high not
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _needed(shape, job, {"max_completion_length": middle}, capacity) else \
            (low, middle)
    if not low:
        return f"{none}, and no completion length does: a smaller model would"
    needed = _needed(shape, job, {"max_completion_length": low}, capacity)
    return f"{none}; {words('max_completion_length', low)} would ({needed / GIB:.1f} GiB)"


def log_run_plan(config, samples: list, device, log) -> None:
    """The planner's peak for this run and, on CUDA, whether it fits the card, before any
    model is loaded. The longest prompt is bounded by its bytes (+64 for a chat template): tokens <= bytes. Warns
    when top-p runs without a top_k bound (kept sets of up to the whole vocabulary a token)."""
    if config.rollout.top_p < 1 and config.rollout.top_k == 0:
        log(f"warning: top_p={config.rollout.top_p} without top_k: each sampled token's kept set (int64 ids, stored "
            f"for the loss) is bounded only by the vocabulary (an untrained policy keeps most of it: about 9 GB per 8k "
            f"tokens at 152k); set top_k (e.g. 512) to bound it")
    try:
        shape = training_shape(config.policy)
    except ValueError:                            # a hub id that matches no preset: nothing to plan from
        return
    prompt_bytes = max(len((tasks.problem_key(s) + (config.data.system_prompt or "")).encode()) for s in samples) + 64
    gpus = int(os.environ.get("WORLD_SIZE", "1"))                # torchrun's processes: the plan is one GPU's
    job = training_job(config, prompt_bytes, device.type, gpus)   # sized by the largest stage
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    log(f"memory plan (grpo-fast plan for the table): {summary(plan(shape, job, capacity))}")
    stages = config.rollout.stages
    for start, length in stages if len(stages) > 1 else []:     # a line per completion_length_stages stage
        staged = plan(shape, dataclasses.replace(job, completion_length=length), capacity)
        log(f"  stage from step {start + 1}: completions of up to {length} tokens, peak "
            f"{staged['total'] / GIB:.2f} GiB")
    if device.type == "cuda":
        advice = fit_advice(config, shape, prompt_bytes, capacity, gpus)
        if advice:
            log(f"warning: this job may not fit: {advice}")

