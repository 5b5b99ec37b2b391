"""A step's rollouts, scored, and with dynamic sampling (DAPO) the rounds that replace the groups that teach
nothing.

    step_rollouts = sample_step(step, share, rollouts, tokenizer, reward_fns, config.scoring, config.rollout,
                                clock, world, log)

A group whose completions all score alike has zero advantages and no policy gradient. With rollout.dynamic_sampling
such groups are dropped and further prompts are sampled from the policy as it is, a round at a time, until the step
has prompts_per_step groups that differ in the filter's metric (rollout.dynamic_sampling_metric: by default the first
reward that is not 'overlong', the task's correctness, as DAPO's Eq. 11 and verl's filter_groups.metric=acc) or
max_sampling_rounds rounds are done. Each round generates sampling_batch_multiplier times the prompts the step wants
(verl's gen_batch_size). A step still short trains on its informative groups alone (`StepRollouts.trained`: the
others fill the batch so that every rank runs alike, and count in no normalizer), or stops the run
(short_step: error).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch

from grpo_fast.train import distributed, tasks
from grpo_fast.train.rollout import rollout_seed
from grpo_fast.train.rollout.config import RolloutConfig
from grpo_fast.train.rollout.generation import Generation, select_rows
from grpo_fast.train.run.errors import RunError
from grpo_fast.train.tasks.rewards import weighted_rewards

REWARD = "reward"                      # dynamic_sampling_metric's name of the weighted sum


class StepRollouts(NamedTuple):
    """What a step trains on: group_size consecutive rows per sample.

    samples, prompts: the step's samples and prompt texts; generation: their Generation; completions: the decoded
    completions; rewards (B,) fp32: the weighted rewards; info: the rollouts' metrics (with dynamic sampling also
    frac_filtered_groups, sampling_rounds, reward, reward_kept); trained (B,) bool or None: the rows the step
    trains on, None for all (a short step's filler groups are False)."""

    samples: list
    prompts: list
    generation: Generation
    completions: list
    rewards: torch.Tensor
    info: dict
    trained: Optional[torch.Tensor] = None


class Scores(NamedTuple):
    """A batch's weighted rewards (B,) and the metric dynamic sampling filters on (B,), both fp32, NaN where
    nothing scored a sample."""

    rewards: torch.Tensor
    metric: torch.Tensor


def filter_metric(rollout: RolloutConfig, reward_names: list) -> str:
    """The name dynamic sampling filters on: rollout.dynamic_sampling_metric, or the first of reward_names that is
    not 'overlong' (a length penalty tells nothing of the answer)."""
    if rollout.dynamic_sampling_metric is not None:
        return rollout.dynamic_sampling_metric
    return next(name for name in reward_names if name != "overlong")


def score(reward_fns: list, completions: list, completion_ids: list, samples: list, step: int, scoring,
          group_size: int, max_tokens: Optional[int] = None, metric: str = REWARD) -> Scores:
    """Scores of the completions: the weighted rewards (the scoring section's rewards and reward_weights),
    group_size consecutive ones per sample, and `metric` (a name of scoring.rewards: its own score, or REWARD: the
    weighted sum). Each reward gets the `solution` and `completion_ids` columns, as in TRL, and with max_tokens (the
    step's completion budget) a `max_completion_length` column."""
    solutions = [s["solution"] for s in samples for _ in range(group_size)]
    columns = {} if max_tokens is None else {"max_completion_length": [max_tokens] * len(completions)}
    each = []
    try:
        rewards = weighted_rewards(reward_fns, scoring.reward_weights, completions, scores=each, solution=solutions,
                                   completion_ids=completion_ids, **columns)
    except (RuntimeError, TypeError, ValueError) as error:
        raise RunError(f"step {step + 1}: {error}") from error
    rewards = torch.tensor(rewards, dtype=torch.float32)
    if metric == REWARD:
        return Scores(rewards, rewards)
    values = each[scoring.rewards.index(metric)]
    return Scores(rewards, torch.tensor([math.nan if v is None else v for v in values], dtype=torch.float32))


def informative(metric: torch.Tensor, group_size: int) -> list:
    """Per group of group_size consecutive values: whether they differ (at least two scored and not all equal), so
    that its advantages, and its gradient, are not all zero."""
    flags = []
    for group in metric.view(-1, group_size):
        scored = group[torch.isfinite(group)]
        flags.append(scored.numel() >= 2 and bool(scored.max() > scored.min()))
    return flags


class Round(NamedTuple):
    """One round of a step's rollouts under dynamic sampling: group_size rows per sample, scored."""

    samples: list
    prompts: list
    generation: Generation
    completions: list
    rewards: torch.Tensor
    informative: list          # per group: its metric differs


def sample_step(step: int, share, rollouts, tokenizer, reward_fns: list, scoring, rollout: RolloutConfig, clock,
                world, log) -> StepRollouts:
    """The StepRollouts of `step`: its prompts' rollouts (share: this rank's tasks.StepShare; rollouts: the
    run's), decoded and scored (clock: a run.record.StageClock, lapped at "generation" and "scoring"); with
    rollout.dynamic_sampling, the rounds of the module docstring. Then the rollouts' engine sleeps through the
    update where it can (rollout.vllm_sleep: Rollouts.sleep), its time charged to "generation".

    Every rank runs as many rounds as the neediest (a sharded policy generates in lockstep); the ranks of a
    sequence-parallel group take its first rank's rollouts. info then has
    frac_filtered_groups (dropped / generated), sampling_rounds, reward (the mean over every generated completion:
    the step's reward in its record, the policy's own, comparable with a run without the filter) and reward_kept
    (over the informative groups the step trains on, which the filter pulls toward the middle), each over ranks."""
    samples, prompts = share.at(step)
    generation, info = distributed.same_in_sequence_group(rollouts.get(step), world)
    clock.lap("generation")
    wanted, group_size, max_tokens = len(samples), rollout.group_size, rollout.stages.at(step)
    metric = filter_metric(rollout, scoring.rewards) if rollout.dynamic_sampling else REWARD

    def scored(round_samples, round_prompts, round_generation) -> Round:
        completions = tokenizer.batch_decode(round_generation.completion_ids, skip_special_tokens=True)
        scores = score(reward_fns, completions, round_generation.token_ids(), round_samples, step, scoring,
                       group_size, max_tokens, metric)
        clock.lap("scoring")
        return Round(round_samples, round_prompts, round_generation, completions, scores.rewards,
                     informative(scores.metric, group_size))

    def taken(result: StepRollouts) -> StepRollouts:     # the engine sleeps through the update where it can
        rollouts.sleep()
        clock.lap("generation")
        return result

    first = scored(samples, prompts, generation)
    if not rollout.dynamic_sampling:
        return taken(StepRollouts(samples, prompts, generation, first.completions, first.rewards, info))
    pool, rounds, per_round = [first], 1, math.ceil(rollout.sampling_batch_multiplier * wanted)
    device = generation.input_ids.device

    def more(round_: int, count: int, seed: int) -> None:       # `count` further prompts, generated and scored
        extra_samples, extra_prompts = share.extra(step, round_, count)
        extra = distributed.same_in_sequence_group(rollouts.generate(
            tasks.prompt_ids(extra_prompts, tokenizer), n=group_size, max_tokens=max_tokens, seed=seed), world)
        clock.lap("generation")
        pool.append(scored(extra_samples, extra_prompts, extra))

    if per_round > wanted:                  # the first round's oversampling, beside the step's own prompts
        more(0, per_round - wanted, rollout_seed(step, share.first_row, share.seed) + wanted)
    while rounds < rollout.max_sampling_rounds:
        found = sum(sum(entry.informative) for entry in pool)
        if not distributed.all_reduce_max(int(found < wanted), world, device):
            break
        more(rounds, per_round, rollout_seed(step, share.first_row, share.seed, rounds))
        rounds += 1
    return taken(_kept(pool, rounds, wanted, step, rollout, metric, info, tokenizer.pad_token_id, world, device,
                       log))


def _kept(pool: list, rounds: int, wanted: int, step: int, rollout: RolloutConfig, metric: str, info: dict,
          pad_token_id: int, world, device, log) -> StepRollouts:
    """The StepRollouts of a step's dynamic-sampling `pool` of Rounds: its first `wanted` informative groups in
    draw order, then (a short step) the earliest dropped groups as fillers, which `trained` marks False."""
    group_size = rollout.group_size
    groups = [(index, group) for index, entry in enumerate(pool) for group in range(len(entry.samples))]
    useful = [(index, group) for index, group in groups if pool[index].informative[group]][:wanted]
    fillers = [(index, group) for index, group in groups if not pool[index].informative[group]][:wanted - len(useful)]
    rows = [(index, group * group_size + row) for index, group in useful + fillers for row in range(group_size)]
    rewards = torch.stack([pool[index].rewards[row] for index, row in rows])
    generated = torch.cat([entry.rewards for entry in pool])
    trained_rewards = rewards[:len(useful) * group_size]
    totals = distributed.sum_over_groups({
        "groups": float(len(groups)), "informative": float(sum(sum(entry.informative) for entry in pool)),
        "wanted": float(wanted), "useful": float(len(useful)), "generated_sum": float(generated.nansum()),
        "generated": float(generated.isfinite().sum()), "kept_sum": float(trained_rewards.nansum()),
        "kept": float(trained_rewards.isfinite().sum())}, world, device)
    info.update(frac_filtered_groups=1.0 - totals["informative"] / totals["groups"], sampling_rounds=rounds,
                reward=_mean(totals["generated_sum"], totals["generated"]),
                reward_kept=_mean(totals["kept_sum"], totals["kept"]))
    counts = {name: round(totals[name]) for name in ("groups", "informative", "wanted", "useful")}
    if counts["useful"] < counts["wanted"]:
        found = (f"{counts['useful']} informative group{'' if counts['useful'] == 1 else 's'} of the "
                 f"{counts['wanted']} wanted (prompts_per_step) after {rounds} round{'' if rounds == 1 else 's'} "
                 f"(max_sampling_rounds), {counts['groups'] - counts['informative']} of the {counts['groups']} "
                 f"groups generated dropped for equal {metric}")
        if rollout.short_step == "error":
            raise RunError(f"step {step + 1}: dynamic sampling ended short: {found}; raise max_sampling_rounds or "
                           "sampling_batch_multiplier, or set short_step: train to train on the groups found")
        found_count = counts["useful"]
        trains = ("no group to train on: the step takes no update" if found_count == 0 else
                  f"the step trains on {'that one' if found_count == 1 else f'those {found_count}'} alone")
        log(f"step {step + 1}: dynamic sampling ended short: {found}; {trains}")
    trained = None
    if fillers:
        trained = torch.arange(len(rows), device=device) < len(useful) * group_size
    return StepRollouts([pool[index].samples[group] for index, group in useful + fillers],
                        [pool[index].prompts[group] for index, group in useful + fillers],
                        select_rows([entry.generation for entry in pool], rows, pad_token_id),
                        [pool[index].completions[row] for index, row in rows], rewards, info, trained)


def _mean(total: float, count: float) -> float:
    """total / count, NaN where no reward scored a sample."""
    return total / count if count else float("nan")
