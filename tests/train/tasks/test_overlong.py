"""DAPO's soft overlong punishment: the reward 'overlong' and its two keys (scoring.overlong_buffer,
overlong_penalty), equal to TRL's get_soft_overlong_punishment and to verl's overlong_buffer formula on the same
lengths, refused where it cannot mean anything, and added to each completion's reward by the trainer."""

import json

import pytest
import torch

from grpo_fast.train import loop as T
from grpo_fast.train.rollout.dynamic_sampling import score
from grpo_fast.train.tasks.rewards import load_reward, soft_overlong_penalty
from grpo_fast.train.update.advantages import group_advantages
from tests.helpers import flat_config


def verl_overlong_reward(length: int, max_length: int, buffer: int, factor: float) -> float:
    """verl 0.9's reward_model.overlong_buffer (reward_loop/reward_manager/dapo.py), written out: verl's
    responses never pass max_response_length, so its formula has no upper clamp."""
    exceed = length - (max_length - buffer)
    return min(-exceed / buffer * factor, 0)


@pytest.mark.parametrize("max_length, buffer", [(20, 8), (16, 16), (9, 1), (4096, 1024)])
def test_equals_trls_soft_overlong_punishment(max_length, buffer):
    trl_rewards = pytest.importorskip("trl.rewards")
    trl = trl_rewards.get_soft_overlong_punishment(max_completion_len=max_length, soft_punish_cache=buffer)
    ours = load_reward("overlong", max_completion_length=max_length, buffer=buffer, penalty=1.0)
    lengths = sorted({0, 1, max_length - buffer - 1, max_length - buffer, max_length - buffer + 1, max_length // 2,
                      max_length - 1, max_length, max_length + 1, max_length + 7} - {-1})
    ids = [[7] * n for n in lengths]
    assert ours(["x"] * len(ids), completion_ids=ids) == pytest.approx(trl(ids), abs=1e-12)
    assert any(-1 < value < 0 for value in trl(ids)) == (buffer > 1), "the ramp itself is compared"


@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_equals_verls_overlong_buffer_up_to_the_length_cut(factor):
    max_length, buffer = 24, 10
    reward = soft_overlong_penalty(max_length, buffer, factor)
    ids = [[3] * n for n in range(max_length + 1)]
    want = [verl_overlong_reward(n, max_length, buffer, factor) for n in range(max_length + 1)]
    assert reward([""] * len(ids), completion_ids=ids) == pytest.approx(want, abs=1e-12)
    assert want[-1] == -factor and want[max_length - buffer] == 0


@pytest.mark.parametrize("keys, message", [
    (dict(rewards=["exact_match", "overlong"]), "go together"),
    (dict(overlong_buffer=4), "go together"),
    (dict(rewards=["overlong"], overlong_buffer=4), "no reward for the answers"),
    (dict(rewards=["exact_match", "overlong"], overlong_buffer=65, max_completion_length=64), "at most"),
    (dict(rewards=["exact_match", "overlong"], overlong_buffer=4, overlong_penalty=float("nan")), "overlong_penalty"),
    (dict(rewards=["exact_match", "overlong"], overlong_buffer=4, overlong_penalty=-1.0), "overlong_penalty"),
    (dict(rewards=["exact_match", "overlong"], overlong_buffer=-2), "overlong_buffer"),
    (dict(eval_reward="overlong"), "scores lengths"),
    (dict(rewards=["exact_match", "overlong", "overlong"], overlong_buffer=4),       # it would count twice
     r"^rewards names 'overlong' twice \(\['exact_match', 'overlong', 'overlong'\]\): list each reward once and "
     "give it a weight in reward_weights instead$"),
])
def test_meaningless_settings_are_refused_naming_the_keys(keys, message):
    with pytest.raises(ValueError, match=message):
        flat_config(**keys)


def test_the_reward_needs_token_ids():
    with pytest.raises(TypeError, match="completion_ids"):
        soft_overlong_penalty(10, 4)(["text"])


def test_the_trainer_adds_the_penalty_to_each_completions_reward(tmp_path):
    """score() gives every reward the completions' token ids; a short run with rewards [exact_match, overlong] logs
    each completion's reward as its exact-match score plus its length penalty."""
    config = flat_config(rewards=["exact_match", "overlong"], overlong_buffer=6, overlong_penalty=0.5,
                         max_completion_length=8, group_size=2)
    reward_fns = [load_reward("exact_match"), load_reward("overlong", max_completion_length=8, buffer=6, penalty=0.5)]
    samples = [{"solution": "4"}, {"solution": "9"}]
    ids = [[1], [1, 2, 3], [1] * 5, [1] * 8]
    rewards = score(reward_fns, ["4", "5", "9", "9"], ids, samples, 0, config.scoring, 2).rewards
    advantages, _ = group_advantages(rewards, 2)
    penalty = [0.0, -0.5 * 1 / 6, -0.5 * 3 / 6, -0.5]
    torch.testing.assert_close(rewards, torch.tensor([1.0, 0.0, 1.0, 1.0]) + torch.tensor(penalty))
    assert advantages[0] > advantages[1] and advantages[2] > advantages[3]    # the shorter right answer wins

    run = flat_config(rewards=["exact_match", "overlong"], overlong_buffer=4, max_completion_length=8, sft_steps=0,
                      max_steps=2, group_size=4, prompts_per_step=2, eval_every=0, log_completions=8,
                      output_dir=str(tmp_path / "run"))
    T.train(run, log=lambda *_: None)
    rows = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert rows
    for row in rows:                                                        # untrained: no exact answers
        assert row["reward"] <= 0
    assert any(row["reward"] < 0 for row in rows)                           # long completions were penalized
