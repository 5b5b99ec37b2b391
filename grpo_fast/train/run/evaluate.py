"""Evaluation on held-out problems: accuracy (the mean over samples), unbiased pass@k and completion length.

During training (eval_every > 0) HeldOut writes the record to output_dir/eval.jsonl before the first step, every
eval_every steps and after the last, so a run shows its gain over the model it started from. `grpo-fast eval`
(grpo_fast.train.saved.eval_command) prints the same record for a run's checkpoint or a model folder.
"""

from __future__ import annotations

import math
import time

from grpo_fast.train import distributed, tasks
from grpo_fast.train.run.config import RunConfig
from grpo_fast.train.run.errors import RunError
from grpo_fast.train.tasks.config import DataConfig, EvaluationConfig
from grpo_fast.train.tasks.rewards import load_reward, weighted_rewards

EVAL_SEED_OFFSET = 7_777_777        # evaluation draws its own seeds: it never shares one with a training step


def pass_at_k(n: int, correct: int, k: int) -> float:
    """1 - C(n - correct, k) / C(n, k): the chance that k of the n sampled completions, drawn without replacement,
    hold at least one correct one; the unbiased estimator of pass@k (Chen et al., 2021, "Evaluating Large
    Language Models Trained on Code")."""
    if not 0 <= correct <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= correct <= n and 1 <= k <= n, got n={n}, correct={correct}, k={k}")
    if n - correct < k:
        return 1.0
    return 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def k_values(n: int) -> list:
    """The k of the pass@k columns for n samples per problem: 1, 2, 4, ... up to n, and n."""
    values = [2 ** i for i in range(n.bit_length()) if 2 ** i <= n]
    return values if values[-1] == n else values + [n]


def eval_due(steps_done: int, eval_every: int, max_steps: int) -> bool:
    """Whether the held-out evaluation runs once `steps_done` steps are done: before the first step, every
    eval_every steps and after the last (max_steps)."""
    return steps_done == 0 or steps_done % eval_every == 0 or steps_done == max_steps


def eval_reward(evaluation: EvaluationConfig, rewards: list) -> str:
    """The reward an evaluation scores with: evaluation.eval_reward, else the first of the run's `rewards` that
    scores answers (not the length penalty 'overlong')."""
    return evaluation.eval_reward or next(name for name in rewards if name != "overlong")


def evaluate(engine, samples: list, tokenizer, evaluation: EvaluationConfig, data: DataConfig, reward: str,
             seed: int, world=distributed.World(), device="cpu") -> dict:
    """The record of one evaluation: evaluation.eval_samples completions of each of `samples` (prompts written as
    `data` says; the engine's temperature and length) scored by the reward named `reward` (eval_reward); a
    completion is correct when that reward gives it 1.0 or more. seed: the run's (the evaluation draws its own
    seeds from it).

    accuracy: the mean of all completions' scores (= pass@1); pass@k for k in k_values(eval_samples), averaged
    over problems; completion_len: mean sampled tokens; truncated: the share cut at max_completion_length;
    problems: how many were scored (one whose gold the reward cannot score, None or NaN, is left out and counted
    in unscored).
    Under torchrun each rank takes an equal share of the problems (the remainder is left out) and the record
    covers them all. The seeds are the same at every evaluation, so two records differ by the model alone."""
    n = evaluation.eval_samples
    share = len(samples) // world.size
    mine = samples[world.rank * share:(world.rank + 1) * share]
    started = time.perf_counter()
    prompts = [tasks.prompt_text(s, tokenizer, data) for s in mine]
    try:
        generation = engine.generate(tasks.prompt_ids(prompts, tokenizer), n=n,
                                     seed=seed * 1_000_003 + EVAL_SEED_OFFSET + world.rank * share)
    except Exception as error:
        raise RuntimeError(f"the {engine.name} engine failed on {len(mine)} held-out problems: {error}") from error
    completions = tokenizer.batch_decode(generation.completion_ids, skip_special_tokens=True)
    scores = weighted_rewards([load_reward(reward)], None, completions,
                              solution=[s["solution"] for s in mine for _ in range(n)])
    ks = k_values(n)
    totals = {"problems": 0.0, "unscored": 0.0, "correct": 0.0, **{f"pass@{k}": 0.0 for k in ks},
              "tokens": float(generation.completion_mask.sum()), "truncated": float(generation.truncated.sum()),
              "rows": float(len(completions))}
    for index in range(len(mine)):
        problem = scores[index * n:(index + 1) * n]
        if any(math.isnan(score) for score in problem):
            totals["unscored"] += 1
            continue
        correct = sum(score >= 1.0 for score in problem)
        totals["problems"] += 1
        totals["correct"] += correct
        for k in ks:
            totals[f"pass@{k}"] += pass_at_k(n, correct, k)
    totals = distributed.sum_over_ranks(totals, world, device)
    problems = max(totals["problems"], 1.0)
    record = {"accuracy": totals["correct"] / (problems * n),
              **{f"pass@{k}": totals[f"pass@{k}"] / problems for k in ks},
              "completion_len": totals["tokens"] / max(totals["rows"], 1.0),
              "truncated": totals["truncated"] / max(totals["rows"], 1.0),
              "problems": int(totals["problems"]), "unscored": int(totals["unscored"]), "samples": n,
              "seconds": time.perf_counter() - started}
    if not totals["problems"]:
        record.update({key: float("nan") for key in ["accuracy"] + [f"pass@{k}" for k in ks]})
    return record


class HeldOut:
    """A run's evaluations on its held-out problems (none: eval_every 0): due before the first step, every
    eval_every steps and after the last (eval_due); each record goes to eval.jsonl and the trackers, the last one
    (`last`) to the progress bar. rollouts: the run's (grpo_fast.train.rollout), which generate the answers;
    reward: eval_reward's; run: the run section (its seed and max_steps)."""

    def __init__(self, problems: list, rollouts, tokenizer, evaluation: EvaluationConfig, data: DataConfig,
                 reward: str, run: RunConfig, world, device, files, trackers):
        self.problems, self.rollouts, self.tokenizer = problems, rollouts, tokenizer
        self.evaluation, self.data, self.reward, self.run_config = evaluation, data, reward, run
        self.world, self.device, self.files, self.trackers = world, device, files, trackers
        self.last: dict = {}

    def due(self, steps_done: int) -> bool:
        return bool(self.problems) and eval_due(steps_done, self.evaluation.eval_every, self.run_config.max_steps)

    def run(self, steps_done: int) -> None:
        """Evaluates the policy once `steps_done` steps are done; RunError names the engine's or the reward's
        failure."""
        try:
            self.last.update(step=steps_done, **evaluate(self.rollouts, self.problems, self.tokenizer,
                                                         self.evaluation, self.data, self.reward,
                                                         self.run_config.seed, self.world, self.device))
        except (RuntimeError, TypeError, ValueError) as error:
            raise RunError(f"evaluation at step {steps_done}: {error}") from error
        self.files.add_eval(dict(self.last))
        self.trackers.log(self.last, steps_done, prefix="eval/")

    def at_start(self, start_step: int, log) -> None:
        """The model as GRPO starts (the gain is measured from there), or the evaluation an interrupt cut (a
        resume redoes it); else a resumed run's last evaluation (eval.jsonl's), which the progress bar shows until
        the next one."""
        if self.due(start_step) and start_step not in self.files.evaluated_steps():
            self.run(start_step)
            if start_step == 0:
                log(f"held-out accuracy before GRPO: {self.last['accuracy']:.3f} ({self.last['problems']} "
                    f"problems x {self.evaluation.eval_samples} samples)")
        elif self.problems and self.files.is_main:     # the main process alone writes eval.jsonl and shows the bar
            self.last.update(next(reversed(self.files.evaluations()), {}))

    def after_step(self, steps_done: int) -> None:
        """The evaluation after a step, when one is due."""
        if self.due(steps_done):
            self.run(steps_done)
