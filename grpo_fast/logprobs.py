"""Per-token log-probs (and entropies, and sum_v p_v^2) straight from hidden states and the LM-head weight."""

from __future__ import annotations

from typing import Optional

import torch

from grpo_fast import sweep
from grpo_fast.numerics import LogitTransform
from grpo_fast.options import EXECUTION_MOVES, TRANSFORM_MOVES, Execution, names_moved_keywords


@names_moved_keywords({**TRANSFORM_MOVES, **EXECUTION_MOVES})
def token_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: Optional[torch.Tensor] = None,
    transform: Optional[LogitTransform] = None,
    execution: Optional[Execution] = None,
    return_entropy: bool = False,
    return_sum_pi_squared: bool = False,
):
    """Per-token log-probability of each target, computed in chunks without the (N, V) logits. Equals::

        z = (hidden @ weight.T + bias).float() * transform.scale
        z = transform.softcap * torch.tanh(z / transform.softcap)      # only when softcap is set
        logp_all = torch.log_softmax(z / transform.temperature, -1)    # over each token's kept set, if any
        logp = logp_all.gather(-1, targets[..., None])[..., 0]
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        sum_pi_squared = logp_all.exp().square().sum(-1)

    hidden: (B, T, H) or (N, H), fp32 / bf16 / fp16 (fp64: backend torch): final (normed) hidden states.
    weight: (V, H), same dtype and device as hidden: the LM-head weight; bias: optional (V,) alike.
    targets: hidden.shape[:-1], integer token ids in [0, V) (each among its token's kept ids with a kept set).
    transform: the logit transform and kept sets (`LogitTransform`; None: the plain softmax of the logits).
    execution: chunk budget, backend and vocabulary-parallel group (`Execution`; None: the defaults).
    return_entropy: also return each position's entropy (differentiable too).
    return_sum_pi_squared: also return each position's sum_v p_v^2 (the probability that two draws agree; verl's
        optimal token baseline weighs tokens by 1 - 2 p_target + sum_v p_v^2), from the same read of each chunk.
        Not differentiable (a statistic of the sampling distribution).

    Returns logp, or a tuple of logp, then entropy, then sum_pi_squared: fp32 (fp64 for fp64 inputs) tensors of
    shape hidden.shape[:-1], differentiable with respect to hidden, weight and bias. Under torch.no_grad() this
    costs one GEMM pass over (N, H, V); with gradients, the backward recomputes each chunk (3 more passes).
    First-order only (create_graph=True raises); hidden, weight and bias must not change in place before the
    backward (it raises).
    """
    inputs = sweep.prepare("token_logprobs", hidden, weight, targets, bias=bias, transform=transform,
                           execution=execution)
    out = sweep.logprobs(inputs, return_entropy, return_sum_pi_squared)
    if isinstance(out, tuple):
        return tuple(sweep.scatter(t, inputs) for t in out)
    return sweep.scatter(out, inputs)
