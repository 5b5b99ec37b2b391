"""d(loss)/d(logp) of the token-level GRPO-family objectives, per token, in one elementwise kernel.

Reference (what it computes): for logp requiring grad, with r = exp(logp - old) (r = 1 on-policy),
    loss = (grpo_fast.variants.per_token_loss(logp, old, A, ref, is_ratio, r, config)[0] * weights).sum()
    grad = torch.autograd.grad(loss, logp)[0]
grpo_fast.variants.token_loss_grad is that reference; tests compare the two for every objective and option.
It reads O(C) vectors: the chunk's vocabulary has already been reduced by logprob_forward.
"""

import torch
import triton
import triton.language as tl

from grpo_fast.kernels.launch import on_device
from grpo_fast.kernels.transform import nan_max, nan_min
from grpo_fast.kernels.tuning import POLICY_GRAD

CLIP, CISPO, SAPO = 0, 1, 2
OBJECTIVES = {"clip": CLIP, "cispo": CISPO, "sapo": SAPO}


@triton.jit
def _policy_grad_kernel(
    Logp, Old, Ref, Adv, IsRatio, Weights, GradLogp,
    n,
    eps_low, eps_high, delta, beta, sapo_temperature_pos, sapo_temperature_neg, log_ratio_clamp, kl_clamp,
    # Meta-parameters
    BLOCK: tl.constexpr,
    OBJECTIVE: tl.constexpr,
    HAS_OLD: tl.constexpr,
    HAS_DELTA: tl.constexpr,
    HAS_IS_RATIO: tl.constexpr,
    HAS_KL: tl.constexpr,
    BIAS_CORRECTION: tl.constexpr,
    CLAMP_LOG_RATIO: tl.constexpr,
    CLAMP_KL: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    valid = offs < n
    logp = tl.load(Logp + offs, mask=valid, other=0.0)
    adv = tl.load(Adv + offs, mask=valid, other=0.0)
    if HAS_OLD:
        log_ratio = logp - tl.load(Old + offs, mask=valid, other=0.0)
        if CLAMP_LOG_RATIO:            # clamp passes the gradient on its closed interval only
            d_ratio_scale = ((log_ratio >= -log_ratio_clamp) & (log_ratio <= log_ratio_clamp)).to(tl.float32)
            log_ratio = nan_min(nan_max(log_ratio, -log_ratio_clamp), log_ratio_clamp)
        ratio = tl.exp(log_ratio)
    else:
        ratio = tl.full([BLOCK], 1.0, tl.float32)            # old = logp.detach(): r = 1, dr/dlogp = 1
    # dr/dlogp: r, or 0 where the log-ratio was clamped
    if HAS_OLD and CLAMP_LOG_RATIO:
        d_ratio = ratio * d_ratio_scale
    else:
        d_ratio = ratio
    if OBJECTIVE == 0:
        # -min(u A, c A), u = min(r, delta), c = clamp(r, 1 - eps_low, 1 + eps_high). clamp passes the gradient
        # on its closed interval; min sends it to the smaller term and splits ties evenly, as torch does.
        clipped = nan_min(nan_max(ratio, 1.0 - eps_low), 1.0 + eps_high)
        d_clipped = ((ratio >= 1.0 - eps_low) & (ratio <= 1.0 + eps_high)).to(tl.float32)
        if HAS_DELTA:
            unclipped = nan_min(ratio, delta)
            d_unclipped = (ratio <= delta).to(tl.float32)
        else:
            unclipped = ratio
            d_unclipped = tl.full([BLOCK], 1.0, tl.float32)
        a = unclipped * adv
        b = clipped * adv
        d_min = tl.where(a < b, d_unclipped, tl.where(b < a, d_clipped, 0.5 * (d_unclipped + d_clipped)))
        grad = -adv * d_min * d_ratio
    elif OBJECTIVE == 1:
        grad = -nan_min(ratio, eps_high) * adv                # the clamped ratio is detached
    else:
        temperature = tl.where(adv > 0, sapo_temperature_pos, sapo_temperature_neg)
        gate = tl.sigmoid(temperature * (ratio - 1.0))
        grad = -4.0 * gate * (1.0 - gate) * adv * d_ratio
    if HAS_IS_RATIO:
        grad = grad * tl.load(IsRatio + offs, mask=valid, other=0.0)
    if HAS_KL:
        diff = tl.load(Ref + offs, mask=valid, other=0.0) - logp
        d_diff = tl.full([BLOCK], -1.0, tl.float32)              # d(ref - logp)/dlogp
        if CLAMP_LOG_RATIO:
            d_diff = tl.where((diff >= -log_ratio_clamp) & (diff <= log_ratio_clamp), d_diff, 0.0)
            diff = nan_min(nan_max(diff, -log_ratio_clamp), log_ratio_clamp)
        exp_diff = tl.exp(diff)
        kl = exp_diff - diff - 1.0
        d_kl = (exp_diff - 1.0) * d_diff                         # d/dlogp of exp(d) - d - 1
        if CLAMP_KL:
            d_kl = tl.where((kl >= -kl_clamp) & (kl <= kl_clamp), d_kl, 0.0)
            kl = nan_min(nan_max(kl, -kl_clamp), kl_clamp)
        if BIAS_CORRECTION:
            d_kl = d_kl * ratio + kl * d_ratio                   # d/dlogp of kl * r
        grad = grad + beta * d_kl
    grad = grad * tl.load(Weights + offs, mask=valid, other=0.0)
    tl.store(GradLogp + offs, grad, mask=valid)


def policy_grad(logp, terms):
    """logp (C,) fp32 and a grpo_fast.variants.TokenTerms of C tokens -> d(loss)/d(logp), (C,) fp32.

    Every vector may have any stride (they are made contiguous here: O(C) copies at most).
    """
    config = terms.config
    assert config.token_separable, "sequence-level ratios need every token of a sequence: use two phases"
    assert logp.dtype == torch.float32 and logp.ndim == 1
    logp = logp.contiguous()
    n = logp.shape[0]
    grad = torch.empty_like(logp)
    if n == 0:
        return grad
    pick = lambda t: logp if t is None else t.contiguous()  # noqa: E731  (unused pointers point at logp)
    with on_device(logp):
        _policy_grad_kernel[(triton.cdiv(n, POLICY_GRAD["BLOCK"]),)](
            logp, pick(terms.old_logps), pick(terms.ref_logps), terms.advantages.contiguous(), pick(terms.is_ratio),
            terms.weights.contiguous(), grad,
            n,
            float(config.epsilon_low), float(config.epsilon_high), float(config.delta or 0.0), float(config.beta),
            float(config.sapo_temperature_pos), float(config.sapo_temperature_neg),
            float(config.log_ratio_clamp or 0.0), float(config.kl_clamp or 0.0),
            BLOCK=POLICY_GRAD["BLOCK"],
            OBJECTIVE=OBJECTIVES[config.objective],
            HAS_OLD=terms.old_logps is not None,
            HAS_DELTA=config.delta is not None,
            HAS_IS_RATIO=terms.is_ratio is not None,
            HAS_KL=config.beta != 0.0,
            BIAS_CORRECTION=config.use_bias_correction_kl,
            CLAMP_LOG_RATIO=config.log_ratio_clamp is not None,
            CLAMP_KL=config.kl_clamp is not None,
            num_warps=POLICY_GRAD["num_warps"],
        )
    return grad
