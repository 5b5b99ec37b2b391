"""A drop-in for liger-kernel's `LigerFusedLinearGRPOLoss`: same constructor, forward and return structure.

    from grpo_fast.integrations.liger import FusedLinearGRPOLoss as LigerFusedLinearGRPOLoss

The loss and gradients are grpo_fast's fused loss (3 GEMM passes, no logits; vespo, whose weight needs whole
sequences, 4); the formulas are TRL 1.16's, which Liger follows, with known differences:
- luspo with a token-shaped term (beta > 0 or a per-token vLLM ratio): Liger divides by B * T, TRL 1.16 (and
  grpo_fast) by B.
- vespo with a (B, T) vllm_is_ratio: grpo_fast sums its log over the mask, Liger over every position; the same
  where the padding's ratio is 1, as TRL's token-level corrections leave it.
- vespo_lambda_* <= 0 or vespo_k_* < 0 raise a ValueError (Liger raises such a lambda to 1e-4).
- Refusals Liger makes at forward with an AssertionError (use_ref_model=True without ref_per_token_logps or
  ref_input) raise a ValueError.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from grpo_fast.logprobs import token_logprobs
from grpo_fast.loss import GRPOLoss, checked_policy_loss
from grpo_fast.numerics import LogitTransform
from grpo_fast.options import TokenWeights
from grpo_fast.variants import LossConfig, clip_flags, importance_ratio, masked_mean


class FusedLinearGRPOLoss(nn.Module):
    """`LigerFusedLinearGRPOLoss`'s interface over `grpo_fast.grpo_loss`.

    Returns (loss, metrics) with metrics = (kl_mean, clip_ratio) when beta != 0, else (clip_ratio,), as Liger;
    clip_ratio is Liger's: the share of the batch's tokens where the objective clipped, a sequence-level ratio's
    flag counting once per token of its sequence (TRL, and grpo_fast's own metrics, count each sequence once).
    use_ref_model=True needs ref_per_token_logps or ref_input at forward, whatever beta, as Liger.
    `compiled` and `chunk_size` are accepted for compatibility and ignored (grpo_fast sizes its own chunks).
    The vespo_* parameters are VESPO's gamma weight (shape k, rate lambda) for non-negative / negative advantages,
    under Liger 0.8.5's names and defaults.
    """

    def __init__(self, beta: float = 0.04, compiled: bool = True, use_ref_model: bool = True, chunk_size: int = 1,
                 epsilon_low: float = 0.2, epsilon_high: float = 0.2, loss_type: str = "dapo",
                 max_completion_length: Optional[int] = None, importance_sampling_level: str = "token",
                 sapo_temperature_pos: float = 1.0, sapo_temperature_neg: float = 1.05, temperature: float = 1.0,
                 delta: Optional[float] = None, use_bias_correction_kl: bool = False, vespo_k_pos: float = 2.0,
                 vespo_lambda_pos: float = 3.0, vespo_k_neg: float = 3.0, vespo_lambda_neg: float = 2.0):
        super().__init__()
        # Liger refuses these at its first forward; here at construction, with the same rule.
        if importance_sampling_level == "sequence" and loss_type in ("cispo", "sapo", "vespo"):
            raise ValueError(f"importance_sampling_level='sequence' is not supported for loss_type={loss_type!r}; "
                             "expected 'token'")
        self.beta, self.use_ref_model, self.temperature = beta, use_ref_model, temperature
        self.loss_type = loss_type
        options = dict(loss_type=loss_type, importance_sampling_level=importance_sampling_level,
                       epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta,
                       use_bias_correction_kl=use_bias_correction_kl,
                       max_completion_length=max_completion_length, sapo_temperature_pos=sapo_temperature_pos,
                       sapo_temperature_neg=sapo_temperature_neg, vespo_k_pos=vespo_k_pos,
                       vespo_lambda_pos=vespo_lambda_pos, vespo_k_neg=vespo_k_neg, vespo_lambda_neg=vespo_lambda_neg)
        transform = LogitTransform(temperature=temperature)
        self.with_kl = GRPOLoss(LossConfig(beta=beta, **options), transform=transform)
        self.without_kl = GRPOLoss(LossConfig(beta=0.0, **options), transform=transform)

    def forward(self, _input, lin_weight, selected_token_ids, attention_mask, advantages, bias=None,
                ref_per_token_logps=None, old_per_token_logps=None, ref_input=None, ref_weight=None,
                ref_bias=None, vllm_is_ratio=None, num_items_in_batch=None):
        """_input (B, T, H), lin_weight (V, H), selected_token_ids / attention_mask / log-probs (B, T),
        advantages (B,), vllm_is_ratio (B,), (B, 1) or (B, T)."""
        if self.use_ref_model and ref_per_token_logps is None and ref_input is None:
            raise ValueError("use_ref_model=True needs ref_per_token_logps or ref_input, got neither "
                             "(use_ref_model=False runs without a reference model)")
        mask = attention_mask.bool()
        ref = None
        if self.beta != 0.0 and self.use_ref_model:
            ref = ref_per_token_logps
            if ref is None:
                with torch.no_grad():
                    ref = token_logprobs(ref_input, lin_weight if ref_weight is None else ref_weight,
                                         torch.where(mask, selected_token_ids, 0), bias=ref_bias,
                                         transform=self.with_kl.transform)
        if vllm_is_ratio is not None:
            # at least fp32; a float64 ratio stays float64
            vllm_is_ratio = vllm_is_ratio.reshape(mask.shape[0], -1)
            vllm_is_ratio = vllm_is_ratio.to(torch.promote_types(vllm_is_ratio.dtype, torch.float32))
            if self.loss_type == "vespo" and vllm_is_ratio.shape[1] == 1:
                # Liger adds a per-sequence ratio's log to the sequence's log-weight once; grpo_fast sums a
                # per-token ratio's over the mask, so the ratio goes on each row's first kept token, 1 elsewhere.
                first = mask & (mask.cumsum(-1) == 1)
                vllm_is_ratio = torch.where(first, vllm_is_ratio, torch.ones_like(vllm_is_ratio))
            vllm_is_ratio = vllm_is_ratio.expand(mask.shape)
        # Without reference log-probs (use_ref_model=False) Liger takes ref = logp.detach(): a KL of exactly 0 with
        # zero gradient.
        loss_fn = self.with_kl if ref is not None else self.without_kl
        sequence_level = loss_fn.config.importance_sampling_level == "sequence"
        stats = {} if sequence_level else None      # the per-token log-probs, for Liger's sequence-level metric
        loss, metrics = checked_policy_loss(
            _input, lin_weight, selected_token_ids, advantages, mask, config=loss_fn.config,
            transform=loss_fn.transform, old_logps=old_per_token_logps, ref_logps=ref, bias=bias,
            weights=TokenWeights(num_items_in_batch=num_items_in_batch, is_ratio=vllm_is_ratio),
            execution=loss_fn.execution, token_stats=stats)
        if sequence_level:
            clip_ratio = sequence_clip_ratio(stats["logp"], old_per_token_logps, advantages, mask, loss_fn.config)
        else:
            clip_ratio = metrics.get("clip_ratio/region_mean", metrics.get("cispo_clip_ratio"))
        if clip_ratio is None:                       # sapo has no clipping
            clip_ratio = torch.zeros((), device=loss.device)
        if self.beta == 0.0:
            return loss, (clip_ratio,)
        kl = metrics.get("kl", torch.zeros((), device=loss.device))
        return loss, (kl, clip_ratio)


def sequence_clip_ratio(logp, old_logps, advantages, mask, config: LossConfig) -> torch.Tensor:
    """Liger's clip-ratio metric at importance_sampling_level="sequence": each sequence's clip flag (its ratio
    r = exp of the masked mean log-ratio outside [1 - epsilon_low, 1 + epsilon_high], against its advantage's sign)
    counted on each of its tokens, over the batch's tokens: sum_i flag_i * n_i / sum_i n_i, with n_i the tokens of
    sequence i. logp, old_logps (or None: on-policy) and mask (B, T); advantages (B,)."""
    keep = mask.bool()
    logp = torch.where(keep, logp, 0.0)
    old = logp if old_logps is None else torch.where(keep, old_logps, 0.0)   # 0 * inf off the mask would be NaN
    mask_f = keep.to(logp.dtype)
    ratio = importance_ratio(logp, old, mask_f, config)                      # (B, 1)
    flag = clip_flags(ratio, advantages.reshape(mask.shape[0], -1), config)["clip_ratio/region_mean"]
    return masked_mean(flag.expand(mask.shape).to(mask_f.dtype), mask_f).detach()
