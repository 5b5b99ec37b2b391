"""Advantages from rewards: group-normalized (GRPO), leave-one-out (RLOO), with group / batch / no scaling.

Rewards come grouped: `group_size` consecutive completions of the same prompt (the layout of TRL's sampler).
"""

from __future__ import annotations

import torch

SCALES = ("group", "batch", "none")
ESTIMATORS = ("grpo", "rloo")


def group_advantages(rewards: torch.Tensor, group_size: int, *, scale: str = "group", estimator: str = "grpo",
                     eps: float = 1e-4):
    """Per-completion advantages and statistics of the rewards.

    Equals, for rewards viewed as (num_groups, group_size)::

        baseline = rewards.mean(1, keepdim=True)                       # grpo
        baseline = (rewards.sum(1, keepdim=True) - rewards) / (group_size - 1)   # rloo: the others' mean
        advantages = rewards - baseline
        advantages /= rewards.std(1, keepdim=True) + eps               # scale="group" (Bessel-corrected std)
        advantages /= rewards.std() + eps                              # scale="batch"

    rewards: (N,) float, N a multiple of group_size >= 2; NaN marks a skipped sample (e.g. a reward whose gold
    answer could not be parsed): it is left out of means and stds and gets advantage 0.
    Returns (advantages (N,) fp32, stats) with stats the detached floats "reward_mean", "reward_std" (mean of the
    group stds) and "frac_zero_std_groups" (groups whose completions all scored alike: no learning signal).
    """
    if not isinstance(rewards, torch.Tensor) or rewards.ndim != 1 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a 1-D float tensor, got {getattr(rewards, 'shape', type(rewards))}")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (advantages compare completions), got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(f"rewards must hold whole groups: {rewards.numel()} is not a positive multiple of "
                         f"group_size={group_size}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")

    grouped = rewards.float().view(-1, group_size)
    valid = ~torch.isnan(grouped)
    count = valid.sum(1, keepdim=True)
    values = torch.where(valid, grouped, torch.zeros_like(grouped))
    total = values.sum(1, keepdim=True)
    if estimator == "grpo":
        baseline = total / count.clamp(min=1)
    else:
        baseline = (total - values) / (count - 1).clamp(min=1)
    advantages = values - baseline
    group_std = _nanstd(grouped, valid, count, dim=1)
    if scale == "group":
        advantages = advantages / (group_std + eps)
    elif scale == "batch":
        flat_valid = valid.view(-1)
        advantages = advantages / (_nanstd(rewards.float(), flat_valid, flat_valid.sum(), dim=0) + eps)
    advantages = torch.where(valid, advantages, torch.zeros_like(advantages)).view(-1)
    zero_std = (group_std.squeeze(1) == 0) | (count.squeeze(1) < 2)
    stats = {
        "reward_mean": torch.nanmean(rewards.float()).item() if bool(valid.any()) else float("nan"),
        "reward_std": group_std.nan_to_num(0.0).mean().item(),
        "frac_zero_std_groups": zero_std.float().mean().item(),
    }
    return advantages, stats


def _nanstd(values, valid, count, dim):
    """Bessel-corrected std over `dim` of the valid entries (0 where fewer than two)."""
    filled = torch.where(valid, values, torch.zeros_like(values))
    mean = filled.sum(dim, keepdim=True) / torch.as_tensor(count).clamp(min=1)
    squares = torch.where(valid, (values - mean) ** 2, torch.zeros_like(values)).sum(dim, keepdim=True)
    return (squares / (torch.as_tensor(count) - 1).clamp(min=1)).sqrt()
