"""The plan as a report: the components of one job, the cards it fits (`grpo-fast plan`'s table or JSON), and
the one-line summary the trainer logs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Optional

from grpo_fast import chunked
from grpo_fast.train.plan.memory import (
    CARDS,
    GIB,
    VLLM_ASLEEP,
    Job,
    ModelShape,
    fits,
    kv_cache_needed,
    plan,
    pool_shortfall,
)


@dataclass
class PlanReport:
    model: str
    job: dict
    parameters: int
    components: dict
    kv_cache_needed: int
    cards: dict = field(default_factory=dict)
    attention: str = ""
    training_peak: int = 0
    generation_peak: int = 0
    context: Optional[int] = None              # the model's positions, scaled by rope_scaling (None: unknown)
    rope_scaling: Optional[dict] = None
    host_activations: int = 0                  # pinned host memory of offload_activations, beside the card's


def report(model: str, shape: ModelShape, job: Job, advise=None, context: Optional[int] = None,
           rope_scaling: Optional[dict] = None) -> PlanReport:
    """The plan of `job` and each card's verdict; advise(capacity): what would make the job fit a card it does not
    (grpo_fast.train.plan.fit.fitting_change), or None for no advice; context: the model's positions that the job
    fits in (fit.check_plan_context), with rope_scaling (policy.rope_scaling) applied."""
    estimate = plan(shape, job)                   # with no card: the largest chunk budget
    cards = {card: {"fits": ok, "needed_bytes": int(need), "capacity_bytes": CARDS[card],
                    "training_peak_bytes": int(peak),
                    "pool_shortfall": pool_shortfall(shape, job, CARDS[card]),
                    "advice": advise(CARDS[card]) if advise and not ok else None}
             for card, (ok, need, peak) in fits(shape, job).items()}
    return PlanReport(model=model, job=asdict(job), parameters=shape.num_parameters(),
                      components={k: int(v) for k, v in estimate.items()},
                      kv_cache_needed=kv_cache_needed(shape, job), cards=cards, attention=estimate.attention,
                      training_peak=int(estimate.training_peak), generation_peak=int(estimate.generation_peak),
                      context=context, rope_scaling=rope_scaling, host_activations=int(estimate.host_activations))


def format_report(report: PlanReport) -> str:
    job = report.job
    lines = [f"{report.model}: {report.parameters / 1e9:.2f}B parameters; prompt {job['prompt_length']} + completion "
             f"{job['completion_length']} tokens, group {job['group_size']}, micro-batch "
             f"{job['micro_batch_size']} seq, {job['dtype']}, {job['optimizer']}, checkpointing "
             f"{'on' if job['gradient_checkpointing'] else 'off'}, "
             f"{'LoRA r=' + str(job['lora_rank']) if job['lora_rank'] else 'full'}"
             f"{' on a 4-bit base' if job.get('load_in_4bit') else ''}, loss {job['loss']}, "
             f"{'packed' if job.get('packing', True) else 'padded'} micro-batches, attention "
             f"{report.attention or job.get('attention', 'auto')}", context_line(report), gpu_line(job), "",
             f"{'component':<26}{'GiB per GPU':>12}"]
    for name, value in report.components.items():
        if name == "total":
            continue
        lines.append(f"{name:<26}{value / GIB:>12.2f}")
    lines.append(f"{'peak':<26}{report.components['total'] / GIB:>12.2f}")
    if report.host_activations:
        lines.append(f"{'host (pinned) memory':<26}{report.host_activations / GIB:>12.2f}  offload_activations: "
                     "the saved activations of a micro-batch, off the card")
    staleness = job.get("max_staleness", 0)
    if job["engine"] == "vllm":
        where = "in its own process" if staleness else "in this process"
        lines.append(f"vLLM at gpu_memory_utilization={job['gpu_memory_utilization']} {where}: pool = that share of "
                     f"the card; one step's KV cache at full length needs {report.kv_cache_needed / GIB:.2f} GiB "
                     "(less is fine: vLLM queues)")
        if job.get("vllm_sleep"):
            lines.append(f"vllm_sleep: vLLM sleeps through each update, so a card needs the higher of the peak "
                         f"plus {VLLM_ASLEEP / GIB:g} GiB vLLM keeps asleep (an estimate, not yet measured on a "
                         "GPU) and its pool plus the weights, optimizer states and the rest the trainer holds "
                         "between updates")
    elif staleness:
        lines.append(f"max_staleness={staleness}: the HF engine's process holds its own weights, KV cache and "
                     "logits (rollout_*) while the trainer updates")
    else:
        lines.append(f"HF generation peak {report.generation_peak / GIB:.2f} GiB (weights, optimizer, reference, "
                     f"KV cache, one decode step's logits), training peak {report.training_peak / GIB:.2f} GiB: "
                     "the peak is the higher")
    if any(result["training_peak_bytes"] != report.components["total"] for result in report.cards.values()):
        low, high = chunked.CUDA_CHUNK_BYTES_MIN / GIB, chunked.CUDA_CHUNK_BYTES_MAX / GIB
        lines.append(f"loss_buffers counts the largest default chunk budget; a card's is "
                     f"1/{1 / chunked.CUDA_CHUNK_FRACTION:g} of its memory within [{low:g}, {high:g}] GiB, "
                     "and each card below counts its own")
    lines += ["", "GiB = 2^30 bytes; a card holds the total memory CUDA reports for it"]
    for card, result in report.cards.items():
        verdict = "fits" if result["fits"] else "does not fit"
        lines.append(f"{card:<24}{verdict:>14}  ({result['needed_bytes'] / GIB:.1f} GiB needed of "
                     f"{result['capacity_bytes'] / GIB:.1f} GiB)" + (f"; {result['pool_shortfall']}"
                                                                      if result["pool_shortfall"] else ""))
    advised = [card for card, result in report.cards.items() if result.get("advice")]
    for card in dict.fromkeys(advised[:1] + advised[-1:]):         # the smallest and the largest card it misses
        lines.append(f"to fit {card}: {report.cards[card]['advice']}")
    return "\n".join(lines)



def gpu_line(job: dict) -> str:
    """Which GPU the plan is of: the processes, the wrapper and sequence parallelism of `job` (a Job as a dict)."""
    gpus, parallel = job.get("gpus", 1), job.get("sequence_parallel", 1)
    groups, prompts = gpus // parallel, job["prompts_per_step"] // (gpus // parallel)
    if gpus == 1:
        where = "per GPU: gpus 1, one process (no ddp or fsdp2 wrapper)"
    elif job.get("distributed") == "fsdp2":
        where = (f"per GPU: each of gpus {gpus}, fsdp2 (weights, gradients and optimizer states sharded over the "
                 f"{gpus} ranks)")
    else:
        where = f"per GPU: each of gpus {gpus}, ddp (full replicas and gradient buckets)"
    return (f"{where}, sequence_parallel {parallel}: {groups} data-parallel group{'s' if groups > 1 else ''} of "
            f"{prompts} prompts a step" + (f", each micro-batch's tokens split over {parallel} ranks"
                                           if parallel > 1 else ""))


def context_line(report: PlanReport) -> str:
    """The model's context and how much of it the job's prompt and completion take."""
    if report.context is None:
        return "context: unknown (no max_position_embeddings), not checked"
    scaled = f" with rope_scaling {json.dumps(report.rope_scaling)}" if report.rope_scaling else ""
    used = report.job["prompt_length"] + report.job["completion_length"]
    return f"context: {report.context} positions{scaled}; prompt + completion take {used}"


def summary(estimate: dict, largest: int = 3) -> str:
    """'X GiB at the peak, mostly name a GiB, name b GiB, ...' with the `largest` components, and the attention
    counted ('; attention grpo_fast_varlen') for a plan() estimate."""
    parts = sorted(((v, k) for k, v in estimate.items() if k != "total"), reverse=True)[:largest]
    attention = getattr(estimate, "attention", "")
    return (f"{estimate['total'] / GIB:.2f} GiB at the peak, mostly " +
            ", ".join(f"{name} {value / GIB:.2f} GiB" for value, name in parts) +
            (f"; attention {attention}" if attention else ""))

