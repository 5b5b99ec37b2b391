"""The progress of a run as it trains: a tqdm bar on a terminal, else plain lines (StepLines), and what they show
after each step (progress_postfix).

    progress = progress_bar(config.run, start_step, world, log)
    for step in progress:
        ...
        progress.set_postfix(progress_postfix(record, last_eval, config.loss))
"""

from __future__ import annotations

import sys
import time

from grpo_fast.train.run.config import RunConfig
from grpo_fast.variants import LossConfig


class StepLines:
    """The progress bar where no terminal shows it (nohup, a batch scheduler, CI: tqdm's bar then disables itself):
    the steps to run, and after a step (`set_postfix`) one plain line with the bar's fields, every tenth of the run
    or every `every_s` seconds, whichever comes first, and at the last step."""

    def __init__(self, steps: range, total: int, log, every_s: float = 60.0):
        self.steps, self.total, self.log, self.every_s = steps, total, log, every_s
        self.every, self.step, self.last_line = max(1, total // 10), steps.start, time.monotonic()

    def __iter__(self):
        for self.step in self.steps:
            yield self.step

    def set_postfix(self, fields: dict) -> None:
        done, now = self.step + 1, time.monotonic()
        if done % self.every == 0 or done == self.total or now - self.last_line >= self.every_s:
            self.last_line = now
            self.log(f"step {done}/{self.total}: " + ", ".join(f"{name} {value}" for name, value in fields.items()))


def progress_bar(run: RunConfig, start_step: int, world, log):
    """The steps left to run: a tqdm progress bar on rank 0 when stderr is a terminal, else `StepLines`."""
    from tqdm.auto import tqdm

    steps = range(start_step, run.max_steps)
    if world.is_main and not sys.stderr.isatty():
        return StepLines(steps, run.max_steps, log)
    return tqdm(steps, initial=start_step, total=run.max_steps, desc="grpo", disable=None if world.is_main
                else True)


def progress_postfix(record: dict, last_eval: dict, loss: LossConfig, clip_fractions: bool = False) -> dict:
    """What the progress bar shows after a step: reward, the share of groups dynamic sampling dropped, held-out
    accuracy, loss, with clip_fractions (more than one optimizer step a step: the ratio moves) the shares of loss
    tokens clipped below, above and in all (clip_ratio/low_mean, high_mean, region_mean), tokens/s, KL."""
    postfix = {"reward": f"{record['reward']:.3f}"}
    if "frac_filtered_groups" in record:
        postfix["filtered"] = f"{record['frac_filtered_groups']:.2f}"
    if last_eval:
        postfix["eval_acc"] = f"{last_eval['accuracy']:.3f}"
    postfix["loss"] = f"{record['loss']:.4f}"
    if clip_fractions and "clip_ratio/region_mean" in record:
        postfix.update({f"clip_{side}": f"{record[f'clip_ratio/{side}_mean']:.3f}"
                        for side in ("low", "high", "region")})
    postfix["tok_s"] = f"{record['tokens_per_s']:.0f}"
    if loss.beta:
        postfix["kl"] = f"{record['kl']:.4f}"
    return postfix
