"""Group advantages against a per-group loop of TRL's formulas (and RLOO's leave-one-out baseline)."""

import math

import pytest
import torch

from grpo_fast.train.update.advantages import group_advantages


def loop_reference(rewards, group_size, scale, estimator, eps=1e-4):
    groups = [rewards[i:i + group_size] for i in range(0, len(rewards), group_size)]
    batch_std = torch.tensor(rewards).std().item()
    out = []
    for group in groups:
        t = torch.tensor(group, dtype=torch.float64)
        for i, r in enumerate(group):
            baseline = t.mean().item() if estimator == "grpo" else (t.sum().item() - r) / (group_size - 1)
            a = r - baseline
            if scale == "group":
                a /= t.std().item() + eps
            elif scale == "batch":
                a /= batch_std + eps
            out.append(a)
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_matches_loop_reference(scale, estimator):
    rewards = [1.0, 0.0, 0.5, 0.25, 2.0, 2.0, 2.0, 2.0, -1.0, 3.0, 0.0, 1.0]
    advantages, stats = group_advantages(torch.tensor(rewards), 4, scale=scale, estimator=estimator)
    torch.testing.assert_close(advantages.double(), loop_reference(rewards, 4, scale, estimator), rtol=1e-5,
                               atol=1e-6)
    assert stats["frac_zero_std_groups"] == pytest.approx(1 / 3)
    assert stats["reward_mean"] == pytest.approx(sum(rewards) / len(rewards))
    assert advantages[4:8].abs().max() == 0                         # a zero-variance group teaches nothing


def test_nan_rewards_are_skipped():
    rewards = torch.tensor([1.0, float("nan"), 0.0, 2.0])
    advantages, stats = group_advantages(rewards, 4, scale="none")
    assert advantages[1] == 0 and torch.isfinite(advantages).all()
    torch.testing.assert_close(advantages[[0, 2, 3]], torch.tensor([0.0, -1.0, 1.0]))
    assert stats["reward_mean"] == pytest.approx(1.0) and not math.isnan(stats["reward_std"])


@pytest.mark.parametrize("kwargs,words", [
    (dict(rewards=torch.ones(6), group_size=4), "not a positive multiple of group_size=4"),
    (dict(rewards=torch.ones(4), group_size=1), "group_size must be an int >= 2"),
    (dict(rewards=torch.ones(4, 1), group_size=2), "rewards must be a 1-D float tensor"),
    (dict(rewards=torch.ones(4), group_size=2, scale="global"), "scale must be one of"),
    (dict(rewards=torch.ones(4), group_size=2, estimator="ppo"), "estimator must be one of"),
])
def test_bad_input(kwargs, words):
    with pytest.raises(ValueError, match=words):
        group_advantages(**kwargs)
