"""What a run leaves to read: metrics.jsonl (one line per step), eval.jsonl (one line per evaluation),
completions.jsonl (samples) and curves.png."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import time
from typing import Optional

from grpo_fast.train import distributed
from grpo_fast.train.run.atomic import free_gib
from grpo_fast.variants import masked_mean


class StageClock:
    """The seconds of a step's stages: lap(name) charges the time since the previous lap (or the start) to name."""

    def __init__(self):
        self.started = self.last = time.perf_counter()
        self.seconds: dict = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = self.seconds.get(name, 0.0) + now - self.last
        self.last = now

    def total(self) -> float:
        return time.perf_counter() - self.started


def step_record(step: int, generation, batch, rewards, reward_stats: dict, updates: list, lr: float,
                clock: StageClock, world, device) -> dict:
    """The metrics line of a finished step, over all ranks: rewards and completion statistics (means over
    ranks), the loss metrics and grad norm of the step's optimizer steps (`updates`, policy_updates'; their mean:
    loss, kl, entropy, grad_norm and the clip fractions clip_ratio/low_mean, high_mean, region_mean under TRL's
    names; NaN where no step was taken), the updates skipped as not finite and the samples no reward scored (NaN
    rewards), the learning rate the step began with, throughput, and the seconds of each stage (from `clock`:
    generation, scoring, update, sync; this rank's) as {stage}_seconds. generation: the engine's Generation; batch:
    the step's UpdateBatch (grpo_fast.train.update.step), whose loss_mask (B, C) holds the tokens the loss counted
    and is_ratio the rollout correction (B, C) or None."""
    loss_mask, is_ratio, seconds, stages = batch.loss_mask, batch.is_ratio, clock.total(), clock.seconds
    totals = distributed.sum_over_groups({            # a sequence-parallel group's ranks hold the same rollouts
        "skipped_samples": float(rewards.isnan().sum()),
        "tokens": float(loss_mask.sum()), "sampled_tokens": float(generation.completion_mask.sum()),
        "rows": float(generation.completion_mask.shape[0]), "truncated": generation.truncated.float().sum().item(),
        "reward_mean": reward_stats["reward_mean"], "reward_std": reward_stats["reward_std"],
        "frac_zero_std_groups": reward_stats["frac_zero_std_groups"],
        "is_ratio_mean": 0.0 if is_ratio is None else masked_mean(is_ratio, loss_mask).item(),
    }, world, device)
    update = {name: _update_mean(updates, name) for name in ("loss", "kl", "entropy", "grad_norm")}
    record = {"step": step, "reward": totals["reward_mean"] / world.data_size,
              "reward_std": totals["reward_std"] / world.data_size,
              "frac_zero_std_groups": totals["frac_zero_std_groups"] / world.data_size, "loss": update["loss"],
              "kl": update["kl"] if updates and "kl" in updates[0] else 0.0, "entropy": update["entropy"],
              "completion_len": totals["sampled_tokens"] / totals["rows"],
              "truncated": totals["truncated"] / totals["rows"], "grad_norm": update["grad_norm"], "lr": lr,
              "tokens_per_s": totals["tokens"] / seconds, "seconds": seconds,
              "generation_tokens_per_s": totals["sampled_tokens"] / max(stages["generation"], 1e-9),
              "skipped_updates": sum(u["skipped"] for u in updates), "skipped_samples": totals["skipped_samples"]}
    record.update({name: _update_mean(updates, name) for name in (updates[0] if updates else {})
                   if name.startswith("clip_ratio/") or name == "cispo_clip_ratio"})
    record.update({f"{stage}_seconds": value for stage, value in stages.items()})
    if is_ratio is not None:
        record["is_ratio_mean"] = totals["is_ratio_mean"] / world.data_size
    return record


def _update_mean(updates: list, name: str) -> float:
    """The mean of metric `name` over a step's optimizer steps (NaN without any, or where none has it)."""
    values = [update[name] for update in updates if name in update]
    return sum(values) / len(values) if values else float("nan")


# model/: the export; tensorboard/ and wandb/: the trackers' files (grpo_fast.train.run.tracking)
RUN_FILES = ("metrics.jsonl", "eval.jsonl", "completions.jsonl", "curves.png", "model", "tensorboard", "wandb",
             "wandb_run_id.txt")


def run_contents(output_dir: str) -> list:
    """The files and checkpoints of a run in output_dir (empty when there is none)."""
    if not os.path.isdir(output_dir):
        return []
    return sorted(name for name in os.listdir(output_dir) if name in RUN_FILES or name.startswith("checkpoint-"))


def saved_something(found: list) -> bool:
    """Whether a run's files (run_contents) hold what a run leaves once it has saved: a checkpoint (a .tmp one is a
    write cut short), the export model/ or the final curves.png. A run always saves before those, at its end too."""
    return any(name in ("model", "curves.png") or name.startswith("checkpoint-") and not name.endswith(".tmp")
               for name in found)


def check_output_dir(output_dir: str, resume: bool, overwrite: bool) -> list:
    """Refuses, before anything is written, an output_dir that is a file, cannot be written, or holds a run that
    this one would overwrite (unless resuming it, or overwrite is set). A run holds the folder once it has saved
    (saved_something): the files of one that stopped before its first checkpoint (metrics.jsonl, eval.jsonl, a
    tracker's) hold nothing to resume, and a new run may replace them. Returns those leftovers' names ([] if
    none), which RunFiles.start clears."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"output_dir {output_dir!r} is a file, not a folder")
    existing = output_dir
    while not os.path.exists(existing):            # the folder to be created: its nearest existing parent
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"output_dir {output_dir!r} cannot be written ({existing!r} is read-only)")
    found = run_contents(output_dir)
    if saved_something(found):
        if not resume and not overwrite:
            raise ValueError(f"output_dir {output_dir!r} already holds a run ({', '.join(found)}): pass --resume to "
                             f"continue it, --overwrite-output-dir true to replace it, or choose another output_dir")
        return []
    return found


def _lines_up_to(path: str, step: int) -> list:
    """The lines of a JSONL file whose "step" is at most `step`. A torn last line (a write cut short by a full
    disk or a kill) is dropped; a bad line before it, or one that is no record of a step (another file's), is an
    error naming the file and line."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line; fix or remove it to resume") from None
        if not isinstance(record, dict) or isinstance(record.get("step"), bool) or \
                not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{number}: not a line this run wrote (a JSON object with its step); fix or "
                             "remove it to resume")
        if record["step"] <= step:
            kept.append(line if line.endswith("\n") else line + "\n")
    return kept


def json_line(record: dict) -> str:
    """A record as one line of JSON: a non-finite number (a NaN entropy, an inf loss) as null, as JSON has no
    NaN or Infinity (json.dumps would write them, and strict readers refuse the line)."""
    return json.dumps(_finite_or_none(record), allow_nan=False) + "\n"


def _finite_or_none(value):
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_none(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite_or_none(item) for item in value]
    return value


def read_records(path: str) -> list:
    """The records of one of a run's JSONL files, null read back as NaN (json_line wrote a non-finite number so),
    so that means and plots take it as the missing number it is."""
    with open(path, encoding="utf-8") as f:
        return [json.loads(line, object_hook=_none_as_nan) for line in f if line.strip()]


def _none_as_nan(record: dict) -> dict:
    return {key: float("nan") if value is None else value for key, value in record.items()}


@contextlib.contextmanager
def written(path: str):
    """Writes to `path` inside the block; an OSError (a full disk) becomes one naming the file and the free space:
    the run stops there, its last checkpoint intact (a torn line is dropped on --resume)."""
    try:
        yield
    except OSError as error:
        raise OSError(error.errno, f"{path} could not be written ({error.strerror or error}; "
                      f"{free_gib(os.path.dirname(path) or '.'):.2f} GiB free); the run stopped there, its checkpoints "
                      "untouched: free some space, then --resume continues from the last one") from error


class RunFiles:
    """The run's files in output_dir, written by the main process only (the others' calls do nothing)."""

    def __init__(self, output_dir: str, is_main: bool):
        self.output_dir, self.is_main = output_dir, is_main
        self.metrics = os.path.join(output_dir, "metrics.jsonl")
        self.completions = os.path.join(output_dir, "completions.jsonl")
        self.evals = os.path.join(output_dir, "eval.jsonl")

    def start(self, resumed_step: Optional[int]) -> None:
        """The first write of a run. A new run clears what a previous run left (check_output_dir allowed it), a
        resumed one drops the metrics and completions past its checkpoint, so each file holds this run's steps
        once."""
        if not self.is_main:
            return
        os.makedirs(self.output_dir, exist_ok=True)
        if resumed_step is None:
            for name in run_contents(self.output_dir):
                path = os.path.join(self.output_dir, name)
                shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
            open(self.metrics, "w").close()
            return
        for path in (self.metrics, self.completions, self.evals):
            if os.path.exists(path):
                kept = _lines_up_to(path, resumed_step)
                with open(path, "w") as f:
                    f.writelines(kept)

    def append(self, record: dict) -> None:
        if self.is_main:
            with written(self.metrics), open(self.metrics, "a") as f:
                f.write(json_line(record))

    def evaluated_steps(self) -> set:
        """The steps eval.jsonl holds an evaluation of (a resume redoes a due one that an interrupt cut)."""
        return {record["step"] for record in self.evaluations()}

    def evaluations(self) -> list:
        """The records of eval.jsonl (a resumed run's progress bar shows the last one's accuracy from its start)."""
        return read_records(self.evals) if os.path.exists(self.evals) else []

    def add_eval(self, record: dict) -> None:
        if self.is_main:
            with written(self.evals), open(self.evals, "a") as f:
                f.write(json_line(record))

    def add_completions(self, step: int, prompts: list, completions: list, rewards: list, group_size: int,
                        count: int) -> list:
        """Writes the first completion of each of the first `count` prompts, with its reward; returns those rows
        ({step, prompt, completion, reward}) for the trackers."""
        firsts = list(zip(prompts, completions[::group_size], rewards[::group_size]))[:count]
        rows = [{"step": step, "prompt": p, "completion": c, "reward": r} for p, c, r in firsts]
        if self.is_main and rows:
            with written(self.completions), open(self.completions, "a") as f:
                f.writelines(json_line(row) for row in rows)
        return rows

    def plot(self) -> None:
        if self.is_main:
            out = os.path.join(self.output_dir, "curves.png")
            with written(out):
                plot_curves(self.metrics, out, self.evals)


STAGES = ("generation", "scoring", "update", "sync")


def plot_curves(metrics_path: str, out_path: str, eval_path: Optional[str] = None) -> None:
    """The run on one page: reward, held-out accuracy and pass@k (when eval_path has evaluations), completion
    length, entropy, loss, KL (when the run has a KL term) and the seconds of each stage against step; noisy
    per-step values get a 20-step running mean on top."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_records(metrics_path)
    evals = read_records(eval_path) if eval_path and os.path.exists(eval_path) else []
    panels = ["reward"] + (["held-out accuracy"] if evals else []) + ["completion_len", "entropy", "loss"]
    if any(r.get("kl", 0.0) for r in records):
        panels.append("kl")
    columns = 3 if len(panels) < 6 else 4                          # the stage panel takes one more
    fig, axes = plt.subplots(2, columns, figsize=(4.4 * columns, 7))
    steps = [r["step"] for r in records]
    for ax, key in zip(axes.flat, panels):
        if key == "held-out accuracy":
            _plot_evals(ax, evals)
            continue
        values = [r.get(key, float("nan")) for r in records]
        ax.plot(steps, values, marker=".", alpha=0.5 if len(values) > 20 else 1.0)
        if len(values) > 20:
            ax.plot(steps, _running_mean(values), color="black", label="20-step mean")
            ax.legend()
        ax.set_title(key)
    stages_ax = axes.flat[len(panels)]
    for stage in STAGES:
        if any(f"{stage}_seconds" in r for r in records):
            stages_ax.plot(steps, _running_mean([r.get(f"{stage}_seconds", float("nan")) for r in records]),
                           label=stage)
    stages_ax.set_title("seconds per step by stage (20-step mean)")
    stages_ax.legend()
    for ax in axes.flat[len(panels) + 1:]:
        ax.axis("off")
    for ax in axes.flat[:len(panels) + 1]:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    plt.close(fig)


def _plot_evals(ax, evals: list) -> None:
    """Accuracy (the mean over samples) and the largest pass@k of each evaluation against step."""
    steps = [r["step"] for r in evals]
    ax.plot(steps, [r["accuracy"] for r in evals], marker="o", label="accuracy")
    passes = sorted((key for key in evals[-1] if key.startswith("pass@")), key=lambda key: int(key[5:]))
    if passes and passes[-1] != "pass@1":
        ax.plot(steps, [r.get(passes[-1], float("nan")) for r in evals], marker="s", label=passes[-1])
    ax.set_ylim(-0.02, 1.02)
    ax.set_title(f"held-out accuracy ({evals[-1]['problems']} problems)")
    ax.legend()


def _running_mean(values: list, window: int = 20) -> list:
    return [sum(values[max(0, i - window + 1):i + 1]) / len(values[max(0, i - window + 1):i + 1])
            for i in range(len(values))]
