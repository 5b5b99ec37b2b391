"""Argument checks of the public API: every error names the argument, what was expected and what came."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.numerics import accumulation_dtype

# What the loss computes in (fp64 for gradchecks, on backend="torch"); float8 and the other narrow formats are
# storage formats with per-tensor scales the loss cannot see, so they are refused rather than silently upcast.
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FLOAT_NAMES = "float16, bfloat16, float32 or float64"


def _shape(t) -> str:
    return f"{tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__


def check_tensor(name: str, value, *, floating: bool = False, integer: bool = False):
    """`value` itself when it is a tensor (of a dtype the loss computes in when `floating`, of integers when
    `integer`); else a TypeError naming `name`, the dtypes accepted and the one given."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if floating and value.dtype not in _FLOAT_DTYPES:
        hint = " (upcast it first, e.g. .to(torch.bfloat16))" if value.dtype.is_floating_point else ""
        raise TypeError(f"{name} must have dtype {_FLOAT_NAMES}, got {value.dtype}{hint}")
    if integer and (value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool):
        raise TypeError(f"{name} must be an integer tensor (token ids), got dtype {value.dtype}")
    return value


def check_lm_head(hidden, weight, bias, targets) -> None:
    """hidden (..., H), weight (V, H), bias (V,) or None, targets hidden.shape[:-1] of integers."""
    check_tensor("hidden", hidden, floating=True)
    check_tensor("weight", weight, floating=True)
    check_tensor("targets", targets, integer=True)
    if hidden.ndim not in (2, 3):
        raise ValueError(f"hidden must be (N, H) or (B, T, H), got shape {_shape(hidden)}")
    if weight.ndim != 2:
        raise ValueError(f"weight must be (V, H), got shape {_shape(weight)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, H) with H = hidden.shape[-1] = {hidden.shape[-1]}, got shape {_shape(weight)}"
        )
    if hidden.dtype != weight.dtype:
        raise TypeError(f"hidden and weight must share a dtype, got hidden {hidden.dtype} and weight {weight.dtype}")
    if hidden.device != weight.device:
        raise ValueError(f"hidden and weight must be on one device, got {hidden.device} and {weight.device}")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(
            f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {_shape(targets)}"
        )
    if targets.device != hidden.device:
        raise ValueError(f"targets must be on {hidden.device} like hidden, got {targets.device}")
    if bias is not None:
        check_tensor("bias", bias, floating=True)
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias must have shape (V,) = ({weight.shape[0]},), got {_shape(bias)}")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise TypeError(
                f"bias must match weight's dtype and device ({weight.dtype}, {weight.device}), "
                f"got ({bias.dtype}, {bias.device})"
            )


def check_target_range(targets, vocab_size, valid=None) -> None:
    """Token ids must lie in [0, V) wherever valid (everywhere when valid is None). One device sync."""
    selected = targets if valid is None else targets[valid]
    if selected.numel() == 0:
        return
    low, high = int(selected.min()), int(selected.max())
    if low < 0 or high >= vocab_size:
        where = "" if valid is None else " where mask is 1"
        raise ValueError(f"targets must lie in [0, V) = [0, {vocab_size}){where}, got values in [{low}, {high}]")


def check_entropy_weights(entropy_coef, entropy_weights) -> None:
    """entropy_weights replace entropy_coef's masked mean: the two together would leave unclear which holds."""
    if entropy_weights is not None and entropy_coef != 0.0:
        raise ValueError(f"entropy_weights replace entropy_coef's masked mean of the entropy: pass entropy_coef=0.0 "
                         f"with them, got entropy_coef={entropy_coef!r}")


@dataclass
class PolicyBatch:
    """The per-token inputs of the loss in (B, T) layout: mask bool, the rest fp32."""

    hidden: torch.Tensor                  # (B, T, H)
    targets: torch.Tensor                 # (B, T)
    mask: torch.Tensor                    # (B, T) bool
    advantages: torch.Tensor              # (B, 1) or (B, T) fp32 (fp64 for fp64 hidden)
    old_logps: Optional[torch.Tensor]     # (B, T) like advantages
    ref_logps: Optional[torch.Tensor]
    is_ratio: Optional[torch.Tensor]
    loss_weights: Optional[torch.Tensor] = None          # (B, T): the caller's reduction of the loss terms
    entropy_weights: Optional[torch.Tensor] = None       # (B, T): the caller's weights of the entropy bonus


def check_mask(mask, hidden: torch.Tensor) -> None:
    """mask must be a tensor of hidden.shape[:-1] on hidden's device; every error names it."""
    check_tensor("mask", mask)
    if tuple(mask.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"mask must have shape {tuple(hidden.shape[:-1])} (hidden.shape[:-1]), got {_shape(mask)}")
    if mask.device != hidden.device:
        raise ValueError(f"mask must be on {hidden.device} like hidden, got {mask.device}")


def policy_batch(hidden, targets, advantages, mask, old_logps, ref_logps, is_ratio, loss_weights=None,
                 entropy_weights=None) -> PolicyBatch:
    """Checks the loss inputs and brings them to (B, T) layout; (N, ...) inputs are one sequence (B = 1)."""
    token_shape = tuple(hidden.shape[:-1])
    check_mask(mask, hidden)
    if mask.dtype != torch.bool:
        if bool(((mask != 0) & (mask != 1)).any()):
            raise ValueError("mask must hold only 0 and 1 (or be bool)")
        mask = mask != 0

    def per_token(name, value):
        if value is None:
            return None
        check_tensor(name, value, floating=True)
        if tuple(value.shape) != token_shape:
            raise ValueError(f"{name} must have shape {token_shape} (like targets), got {_shape(value)}")
        if value.device != hidden.device:
            raise ValueError(f"{name} must be on {hidden.device} like hidden, got {value.device}")
        return value.to(dtype)

    dtype = accumulation_dtype(hidden.dtype)
    old_logps = per_token("old_logps", old_logps)
    ref_logps = per_token("ref_logps", ref_logps)
    is_ratio = per_token("is_ratio", is_ratio)
    loss_weights = per_token("loss_weights", loss_weights)
    entropy_weights = per_token("entropy_weights", entropy_weights)

    check_tensor("advantages", advantages, floating=True)
    if advantages.device != hidden.device:
        raise ValueError(f"advantages must be on {hidden.device} like hidden, got {advantages.device}")
    if hidden.ndim == 2:  # (N, H): one sequence
        if advantages.numel() == 1:
            advantages = advantages.reshape(1, 1)
        elif tuple(advantages.shape) == token_shape:
            advantages = advantages[None]
        else:
            raise ValueError(
                f"advantages must be a single value or (N,) = {token_shape} for (N, H) hidden, "
                f"got {_shape(advantages)}"
            )
        add_batch = lambda t: None if t is None else t[None]  # noqa: E731
        hidden, targets, mask = hidden[None], targets[None], mask[None]
        old_logps, ref_logps, is_ratio = add_batch(old_logps), add_batch(ref_logps), add_batch(is_ratio)
        loss_weights, entropy_weights = add_batch(loss_weights), add_batch(entropy_weights)
    else:
        batch_size = token_shape[0]
        if tuple(advantages.shape) == (batch_size,):
            advantages = advantages[:, None]
        elif tuple(advantages.shape) not in ((batch_size, 1), token_shape):
            raise ValueError(
                f"advantages must be (B,) = ({batch_size},) or (B, T) = {token_shape}, got {_shape(advantages)}"
            )
    return PolicyBatch(hidden, targets, mask, advantages.to(dtype), old_logps, ref_logps, is_ratio, loss_weights,
                       entropy_weights)
