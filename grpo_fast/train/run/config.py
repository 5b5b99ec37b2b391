"""The config section `run`: how long, which seed, and what the output folder gets (metrics, checkpoints,
trackers). The `evaluation` section, the held-out problems, is the task's: grpo_fast.train.tasks.config."""

from __future__ import annotations

import os
from dataclasses import dataclass

from grpo_fast.fields import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Rule, check_keys, key
from grpo_fast.train.run import tracking


@dataclass
class RunConfig:
    """The config section `run`: output_dir gets metrics.jsonl, eval.jsonl, curves.png, completions.jsonl,
    checkpoints, model/ (the export) and what the report_to trackers write. A step whose loss or gradient norm is
    not finite is skipped (the weights stay as they were); max_bad_steps such steps in a row stop the run."""

    max_steps: int = key(300, "GRPO steps", POSITIVE)
    seed: int = key(0, "seed of the task, the model's initialization and the sampling",
                    Rule("in [0, 2**32)", lambda v: 0 <= v < 2**32))     # the engines' and numpy's seed range
    output_dir: str = key("runs/default", "metrics.jsonl, curves.png, completions.jsonl and checkpoints go here")
    overwrite_output_dir: bool = key(False, "train into a folder that already holds a run (else refused unless "
                                            "resuming)")
    save_every: int = key(20, "steps between checkpoints", POSITIVE)
    accept_changed_data: bool = key(False, "--resume with training data that differs from the checkpoint's (a label "
                                           "fix, rows added): accepted and named in the log (else refused); the "
                                           "held-out problems must stay the same")
    log_completions: int = key(4, "prompts per step whose first completion goes to completions.jsonl", NON_NEGATIVE)
    report_to: list[str] = key([], "experiment trackers for the metrics: tensorboard, wandb, trackio "
                                   "(comma-separated; none by default)")
    max_bad_steps: int = key(3, "non-finite steps in a row (each skipped) that stop the run", AT_LEAST_ONE)

    def __post_init__(self):
        if isinstance(self.output_dir, str):             # a path: "~" is the home folder, as in a shell
            self.output_dir = os.path.expanduser(self.output_dir)
        check_keys(self)
        if not self.output_dir.strip():
            raise ValueError(f"output_dir must not be empty, got {self.output_dir!r}")
        tracking.check_report_to(self.report_to)
