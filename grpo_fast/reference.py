"""The plain full-logits implementation of everything grpo_fast computes: the test oracle and the baseline.

It materializes the (N, V) logits, as TRL did before its fused LM head. Pass float64 tensors to get a float64
oracle; other inputs are evaluated in fp32 after the GEMM in the input dtype.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from grpo_fast.inputs import check_entropy_weights, check_lm_head, policy_batch
from grpo_fast.kept import KeptSet
from grpo_fast.numerics import LogitTransform, accumulation_dtype
from grpo_fast.options import (
    EXECUTION_MOVES,
    TRANSFORM_MOVES,
    WEIGHTS_MOVES,
    Execution,
    TokenWeights,
    names_moved_keywords,
)
from grpo_fast.variants import CONFIG_MOVES, LossConfig, as_loss_config, policy_loss


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


@names_moved_keywords({**CONFIG_MOVES, **TRANSFORM_MOVES, **EXECUTION_MOVES, **WEIGHTS_MOVES})
def grpo_loss(hidden, weight, targets, advantages, mask, *, old_logps=None, ref_logps=None, bias=None,
              config: Union[LossConfig, str] = "dapo", transform: Optional[LogitTransform] = None,
              weights: Optional[TokenWeights] = None, execution: Optional[Execution] = None):
    """`grpo_fast.grpo_loss(...)` from the full (N, V) logits: the same signature, option groups and checks;
    returns (loss, metrics). execution is accepted and has no say (there are no chunks)."""
    config = as_loss_config(config)
    transform = LogitTransform() if transform is None else transform
    weights = TokenWeights() if weights is None else weights
    for name, value, kind in (("transform", transform, LogitTransform), ("weights", weights, TokenWeights),
                              ("execution", execution, Execution)):
        if value is not None and not isinstance(value, kind):
            raise TypeError(f"{name} must be a grpo_fast.{kind.__name__} or None, got {type(value).__name__}")
    check_lm_head(hidden, weight, bias, targets)
    if config.beta != 0.0 and ref_logps is None:
        raise ValueError(f"beta = {config.beta} > 0 needs ref_logps (the reference policy's log-probs), got None")
    check_entropy_weights(config.entropy_coef, weights.entropy_weights)
    batch = policy_batch(hidden, targets, advantages, mask, old_logps, ref_logps, weights.is_ratio,
                         weights.loss_weights, weights.entropy_weights)
    dtype = accumulation_dtype(hidden.dtype)
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    kept = transform.kept
    logp, entropy = token_logprobs(
        batch.hidden, weight, batch.targets, bias=bias, temperature=transform.temperature,
        logit_scale=transform.scale, logit_softcap=transform.softcap, return_entropy=True,
        kept_ids=None if kept is None else kept.ids, kept_offsets=None if kept is None else kept.offsets,
    )
    return policy_loss(
        logp, entropy, batch.mask.to(dtype), batch.advantages.to(dtype), old_logps=cast(batch.old_logps),
        ref_logps=cast(batch.ref_logps), is_ratio=cast(batch.is_ratio), num_items_in_batch=weights.num_items_in_batch,
        config=config, loss_weights=batch.loss_weights, entropy_weights=batch.entropy_weights,
    )
