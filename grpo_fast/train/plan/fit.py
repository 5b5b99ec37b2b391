"""A TrainConfig's job for the planner, and whether it fits: the shape and Job a config trains, the one change
that makes a job fit a card (fit_advice), and the plan the trainer logs before it loads a model (log_run_plan).
"""

from __future__ import annotations

import dataclasses
import os

import torch

from grpo_fast.train import pretrained, tasks
from grpo_fast.train.plan.memory import GIB, PRESETS, Job, ModelShape, fits_in, load_shape, plan, pool_shortfall
from grpo_fast.train.plan.report import summary
from grpo_fast.train.policy import TINY_HEADS, TINY_HIDDEN, TINY_KV_HEADS, TINY_LAYERS, TINY_VOCAB
from grpo_fast.train.update import precision


def training_shape(policy) -> ModelShape:
    """The shape of the model the policy section trains (policy.model): the built-in tiny model, its folder's
    config.json, or for a hub id the preset its name starts with (Qwen/Qwen2.5-7B-Instruct: qwen2.5-7b). Raises
    ValueError otherwise."""
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
    return PRESETS[matches[-1]]


def training_job(config, prompt_length: int, device: str) -> Job:
    """The Job a TrainConfig runs: its lengths, batching, checkpointing, loss, KL, engine, staleness, dtype (auto: bf16
    autocast over fp32 weights on CUDA, fp32 on CPU), optimizer and LoRA rank on `device`. prompt_length: the
    longest prompt in tokens, which the config alone does not know."""
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
               top_p=rollout.top_p)



# single changes of a training config that lower its peak without changing what it learns, tried in this order
FIT_CHANGES = (("gradient_checkpointing", True), ("loss_implementation", "grpo_fast"), ("micro_batch_size", 1),
               ("vllm_gpu_memory_utilization", 0.2))
# then the memory options (grpo_fast.train.update.precision, lora), from the most exact: they change the numerics or
# what is trained
MEMORY_CHANGES = ({"dtype": "bf16", "optimizer": "adamw-bf16"}, {"dtype": "bf16", "optimizer": "adamw8bit"},
                  {"dtype": "bf16", "optimizer": "adamw", "lora_rank": 64})


def fit_advice(config, shape: ModelShape, prompt_length: int, capacity: int):
    """None when the TrainConfig's job fits a CUDA card of `capacity` bytes; otherwise one sentence saying how
    much it needs and the first change in FIT_CHANGES, else in MEMORY_CHANGES, that makes it fit (or that none
    does)."""
    job = training_job(config, prompt_length, "cuda")
    ok, needed = fits_in(shape, job, plan(shape, job, capacity), capacity)
    if ok:
        return None
    message = f"the plan needs {needed / GIB:.1f} GiB on this {capacity / GIB:.1f} GiB card" + (
        f" ({pool_shortfall(shape, job, capacity)})" if needed <= capacity else "")
    changes = [({key: value}, "") for key, value in FIT_CHANGES] + [
        (change, " (it changes the numerics or what is trained)") for change in MEMORY_CHANGES]
    current = config.flat()
    for change, caveat in changes:
        if all(current[key] == value for key, value in change.items()):
            continue
        changed = training_job(config.replace(**change), prompt_length, "cuda")
        changed_ok, changed_needed = fits_in(shape, changed, plan(shape, changed, capacity), capacity)
        if changed_ok:
            named = " with ".join(f"{key}: {value}" for key, value in change.items())
            return f"{message}; {named} would make it fit ({changed_needed / GIB:.1f} GiB){caveat}"
    return f"{message}, and none of {[key for key, _ in FIT_CHANGES]} or bf16 weights with a low-bit optimizer " \
           f"or LoRA makes it fit (a smaller model or a shorter max_completion_length would)"



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
    job = training_job(config, prompt_bytes, device.type)        # sized by the largest stage
    capacity = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    log(f"memory plan (grpo-fast plan for the table): {summary(plan(shape, job, capacity))}")
    stages = config.rollout.stages()
    for start, length in stages if len(stages) > 1 else []:     # a line per completion_length_stages stage
        staged = plan(shape, dataclasses.replace(job, completion_length=length), capacity)
        log(f"  stage from step {start + 1}: completions of up to {length} tokens, peak "
            f"{staged['total'] / GIB:.2f} GiB")
    if device.type == "cuda":
        advice = fit_advice(config, shape, prompt_bytes, capacity)
        if advice:
            log(f"warning: this job may not fit: {advice}")

