"""The rollout correction: the engine samples with its own numerics (vLLM's kernels, another dtype), so the
trainer's log-probs of the sampled tokens differ from the sampler's; the loss weighs each token by the ratio of
the two, truncated or masked (TRL's vllm_importance_sampling_correction, IcePop's masking).

A leaf module: the config checks its modes (IS_MODES), the update applies it (importance_weights).
"""

from __future__ import annotations

import torch

IS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                       cap: float, floor: float = 0.0) -> torch.Tensor:
    """The rollout correction for sampling with the engine's numerics instead of the trainer's: per token
    `exp(old_logps - sampling_logps)` (mode token_*) or per sequence the exp of the masked sum (sequence_*), then
    clamped to [floor, cap] (*_truncate) or zeroed outside it (*_mask: both-sided, as IcePop masks tokens whose
    ratio is too low as well as too high). floor 0 bounds nothing from below. (B, C) fp32, a constant factor of
    the loss."""
    log_ratio = (old_logps.float() - sampling_logps.float()) * mask
    if mode.startswith("sequence"):
        log_ratio = log_ratio.sum(-1, keepdim=True).expand_as(mask)
    ratio = torch.exp(log_ratio)
    if mode.endswith("truncate"):
        return ratio.clamp(min=floor, max=cap)
    return ratio.masked_fill((ratio > cap) | (ratio < floor), 0.0)
