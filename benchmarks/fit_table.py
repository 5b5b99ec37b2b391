"""Which memory option makes a 16k-token GRPO job fit a card, by the planner: the "Fitting a job on your GPU" table
of docs/long-context-and-planner.md.

    python -m grpo_fast.benchmarks.fit_table [--completion-length 16384] [--margin 0.05]

For each preset model and card (24 GB, 80 GB, H200 141 GB), the first option in OPTIONS, from the most exact to
the leanest, whose training peak plus vLLM's share of the card (0.3) stays `margin` below the card's memory: the
planner is measured to within a few percent (benchmarks/results/cpu/real_shapes.md), so a fit closer than that
is not called a fit.
"""

import argparse

from grpo_fast.train.plan.memory import CARDS, GIB, PRESETS, Job, fits_in, plan

# (dtype, optimizer, grad_accum_dtype, lora_rank, label), most exact first
OPTIONS = (("bf16-autocast", "adamw", "fp32", 0, "default (fp32 weights, bf16 autocast, AdamW)"),
           ("bf16", "adamw", "fp32", 0, "bf16 + adamw (fp32 master)"),
           ("bf16", "adamw-bf16", "fp32", 0, "bf16 + adamw-bf16"),
           ("bf16", "adamw8bit", "fp32", 0, "bf16 + adamw8bit"),
           ("bf16", "adamw-bf16", "bf16", 0, "bf16 + adamw-bf16, bf16 gradient sums"),
           ("bf16", "adamw8bit", "bf16", 0, "bf16 + adamw8bit, bf16 gradient sums"),
           ("bf16", "adamw", "fp32", 64, "LoRA r=64, bf16 base"),
           ("bf16", "adamw", "fp32", 16, "LoRA r=16, bf16 base"))
TABLE_CARDS = {"24 GB": CARDS["24 GB (RTX 4090 / L4)"], "80 GB": CARDS["H100 80GB"],
               "H200 141 GB": CARDS["H200 141GB"]}


def first_fit(shape, capacity: int, completion_length: int, margin: float):
    """(label, training peak bytes, needed bytes with vLLM) of the first option that fits, or None."""
    for dtype, optimizer, grad_sum, rank, label in OPTIONS:
        job = Job(prompt_length=512, completion_length=completion_length, group_size=8, prompts_per_step=4,
                  micro_batch_size=1, dtype=dtype, optimizer=optimizer, grad_accum_dtype=grad_sum, lora_rank=rank,
                  gpu_memory_utilization=0.3)
        estimate = plan(shape, job, capacity)          # the loss's default chunk budget is a share of the card
        ok, needed = fits_in(shape, job, estimate, capacity)
        if ok and needed <= (1 - margin) * capacity:
            return label, estimate["total"], needed
    return None


def table(completion_length: int = 16384, margin: float = 0.05) -> str:
    lines = ["| model | " + " | ".join(TABLE_CARDS) + " |", "|---|" + "---|" * len(TABLE_CARDS)]
    for name, shape in PRESETS.items():
        cells = []
        for capacity in TABLE_CARDS.values():
            fit = first_fit(shape, capacity, completion_length, margin)
            cells.append("does not fit" if fit is None else
                         f"{fit[0]}: {fit[1] / GIB:.1f} GiB, {fit[2] / GIB:.1f} with vLLM")
        lines.append(f"| {name} ({shape.num_parameters() / 1e9:.2f}B) | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--completion-length", type=int, default=16384)
    parser.add_argument("--margin", type=float, default=0.05, help="share of the card kept free")
    args = parser.parse_args()
    print(table(args.completion_length, args.margin))
