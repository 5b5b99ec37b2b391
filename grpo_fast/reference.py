"""The plain full-logits implementation of everything grpo_fast computes: the test oracle and the baseline.

It materializes the (N, V) logits, as TRL did before its fused LM head. Pass float64 tensors to get a float64
oracle; other inputs are evaluated in fp32 after the GEMM in the input dtype.
"""

from __future__ import annotations

from typing import Optional

import torch

from grpo_fast.inputs import check_entropy_weights, check_lm_head, check_transform, policy_batch
from grpo_fast.kept import KeptSet
from grpo_fast.numerics import accumulation_dtype
from grpo_fast.variants import LossConfig, loss_config, policy_loss


def logits(hidden, weight, bias=None, *, temperature=1.0, logit_scale=1.0, logit_softcap=None):
    """z = softcap(((hidden @ weight.T + bias) * logit_scale)) / temperature in fp32 (fp64 for fp64 inputs)."""
    z = hidden @ weight.t()
    if bias is not None:
        z = z + bias
    z = z.to(accumulation_dtype(hidden.dtype)) * logit_scale
    if logit_softcap is not None:
        z = logit_softcap * torch.tanh(z / logit_softcap)
    return z / temperature


def token_logprobs(hidden, weight, targets, *, bias=None, temperature=1.0, logit_scale=1.0, logit_softcap=None,
                   return_entropy=False, kept_ids=None, kept_offsets=None, return_sum_pi_squared=False):
    """Full-logits log_softmax(z).gather(targets); targets outside [0, V) give 0 (callers mask them). With a
    CSR kept set, z is -inf off each token's kept ids (tokens with an empty set get the full vocabulary).
    Returns logp, then entropy (return_entropy), then softmax(z).square().sum(-1) (return_sum_pi_squared)."""
    z = logits(hidden, weight, bias, temperature=temperature, logit_scale=logit_scale, logit_softcap=logit_softcap)
    keep = None
    if kept_ids is not None:
        kept = KeptSet.of(kept_ids, kept_offsets)
        keep = (kept.dense(weight.shape[0]) | (kept.sizes() == 0)[:, None]).view(z.shape)
        z = z.masked_fill(~keep, float("-inf"))
    logp_all = torch.log_softmax(z, dim=-1)
    valid = (targets >= 0) & (targets < weight.shape[0])
    logp = logp_all.gather(-1, torch.where(valid, targets, 0).long()[..., None])[..., 0]
    logp = torch.where(valid, logp, torch.zeros_like(logp))
    outputs = (logp,)
    if return_entropy:
        # off the kept set p = 0 and log p = -inf: their terms are 0 (masked before the product, so no 0 * inf)
        outputs += (-(logp_all.exp() * (logp_all if keep is None else logp_all.masked_fill(~keep, 0.0))).sum(-1),)
    if return_sum_pi_squared:
        outputs += (logp_all.exp().square().sum(-1),)
    return outputs if len(outputs) > 1 else logp


def grpo_loss(hidden, weight, targets, advantages, mask, *, old_logps=None, ref_logps=None, bias=None,
              temperature=1.0, logit_scale=1.0, logit_softcap=None, num_items_in_batch=None,
              is_ratio: Optional[torch.Tensor] = None, config: Optional[LossConfig] = None, kept_ids=None,
              kept_offsets=None, loss_weights=None, entropy_weights=None, **options):
    """The same loss as `grpo_fast.grpo_loss` (same keywords) from the full logits; returns (loss, metrics)."""
    options.pop("chunk_bytes", None)
    options.pop("backend", None)
    config = loss_config(config, **options)
    check_lm_head(hidden, weight, bias, targets)
    check_transform(temperature, logit_scale, logit_softcap)
    check_entropy_weights(config.entropy_coef, entropy_weights)
    batch = policy_batch(hidden, targets, advantages, mask, old_logps, ref_logps, is_ratio, loss_weights,
                         entropy_weights)
    dtype = accumulation_dtype(hidden.dtype)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    logp, entropy = token_logprobs(
        batch.hidden, weight, batch.targets, bias=bias, temperature=temperature, logit_scale=logit_scale,
        logit_softcap=logit_softcap, return_entropy=True, kept_ids=kept_ids, kept_offsets=kept_offsets,
    )
    return policy_loss(
        logp, entropy, batch.mask.to(dtype), batch.advantages.to(dtype), old_logps=cast(batch.old_logps),
        ref_logps=cast(batch.ref_logps), is_ratio=cast(batch.is_ratio), num_items_in_batch=num_items_in_batch,
        config=config, loss_weights=batch.loss_weights, entropy_weights=batch.entropy_weights,
    )
