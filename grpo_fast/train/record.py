"""What a run leaves to read: metrics.jsonl (one line per step), completions.jsonl (samples) and curves.png."""

from __future__ import annotations

import json
import os
from typing import Optional

from grpo_fast.train import distributed
from grpo_fast.variants import masked_mean


def step_record(step: int, generation, loss_mask, reward_stats: dict, update: dict, is_ratio, lr: float,
                seconds: float, generation_seconds: float, world, device) -> dict:
    """The metrics line of a finished step, over all ranks: rewards and completion statistics (means over
    ranks), the update's loss metrics and grad norm, and throughput. generation: the engine's Generation;
    loss_mask (B, C): the tokens the loss counted; is_ratio: the rollout correction (B, C) or None."""
    totals = distributed.sum_over_ranks({
        "tokens": float(loss_mask.sum()), "sampled_tokens": float(generation.completion_mask.sum()),
        "rows": float(generation.completion_mask.shape[0]), "truncated": generation.truncated.float().sum().item(),
        "reward_mean": reward_stats["reward_mean"], "reward_std": reward_stats["reward_std"],
        "frac_zero_std_groups": reward_stats["frac_zero_std_groups"],
        "is_ratio_mean": 0.0 if is_ratio is None else masked_mean(is_ratio, loss_mask).item(),
    }, world, device)
    record = {"step": step, "reward": totals["reward_mean"] / world.size,
              "reward_std": totals["reward_std"] / world.size,
              "frac_zero_std_groups": totals["frac_zero_std_groups"] / world.size, "loss": update["loss"],
              "kl": update.get("kl", 0.0), "entropy": update.get("entropy", float("nan")),
              "completion_len": totals["sampled_tokens"] / totals["rows"],
              "truncated": totals["truncated"] / totals["rows"], "grad_norm": update["grad_norm"], "lr": lr,
              "tokens_per_s": totals["tokens"] / seconds, "seconds": seconds,
              "generation_tokens_per_s": totals["sampled_tokens"] / generation_seconds}
    if is_ratio is not None:
        record["is_ratio_mean"] = totals["is_ratio_mean"] / world.size
    return record


class RunFiles:
    """The run's files in output_dir, written by the main process only (the others' calls do nothing)."""

    def __init__(self, output_dir: str, is_main: bool):
        self.output_dir, self.is_main = output_dir, is_main
        self.metrics = os.path.join(output_dir, "metrics.jsonl")
        self.completions = os.path.join(output_dir, "completions.jsonl")

    def start(self, resumed_step: Optional[int]) -> None:
        """A new run empties metrics.jsonl; a resumed one drops the lines past its checkpoint, so the file stays
        one line per step."""
        if not self.is_main:
            return
        if resumed_step is None:
            open(self.metrics, "w").close()
        elif os.path.exists(self.metrics):
            with open(self.metrics) as f:
                kept = [line for line in f if line.strip() and json.loads(line)["step"] <= resumed_step]
            with open(self.metrics, "w") as f:
                f.writelines(kept)

    def append(self, record: dict) -> None:
        if self.is_main:
            with open(self.metrics, "a") as f:
                f.write(json.dumps(record) + "\n")

    def add_completions(self, step: int, prompts: list, completions: list, rewards: list, group_size: int,
                        count: int) -> None:
        """The first completion of each of the first `count` prompts, with its reward."""
        if not (self.is_main and count):
            return
        firsts = list(zip(prompts, completions[::group_size], rewards[::group_size]))[:count]
        with open(self.completions, "a") as f:
            for prompt, completion, reward in firsts:
                f.write(json.dumps({"step": step, "prompt": prompt, "completion": completion, "reward": reward})
                        + "\n")

    def plot(self) -> None:
        if self.is_main:
            plot_curves(self.metrics, os.path.join(self.output_dir, "curves.png"))


def plot_curves(metrics_path: str, out_path: str) -> None:
    """Reward, completion length and KL against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(metrics_path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    steps = [r["step"] for r in records]
    for ax, key in zip(axes, ("reward", "completion_len", "kl")):
        values = [r[key] for r in records]
        ax.plot(steps, values, marker=".", alpha=0.5 if len(values) > 20 else 1.0)
        if len(values) > 20:                   # per-step values are noisy: a 20-step running mean on top
            smooth = [sum(values[max(0, i - 19):i + 1]) / len(values[max(0, i - 19):i + 1])
                      for i in range(len(values))]
            ax.plot(steps, smooth, color="black", label="20-step mean")
            ax.legend()
        ax.set_xlabel("step")
        ax.set_title(key)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
