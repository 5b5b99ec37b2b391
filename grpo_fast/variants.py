"""The loss variants: one registry, the per-token objective, the reductions and the metrics.

Everything here works on small per-token tensors (log-probs, entropies, advantages), never on logits, so the
same functions serve the plain full-logits reference (`grpo_fast.reference`), the two-phase path
(`token_logprobs` followed by this math) and the fused path (which calls `per_token_loss` on each chunk of
tokens to get d(loss)/d(logp) while the chunk's logits are still in memory).

Formulas and reductions follow TRL 1.16's `GRPOTrainer._compute_loss`, without its division by the number of
gradient-accumulation steps (divide the returned loss yourself if you accumulate).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Optional

import torch

from grpo_fast.fields import (
    COEFFICIENT,
    COEFFICIENT_MAX,
    LENGTH,
    NON_NEGATIVE_COEFFICIENT,
    NON_NEGATIVE_FP32,
    POSITIVE,
    POSITIVE_FP32,
    bounded,
    check_keys,
    key,
    one_of,
)
from grpo_fast.sequence_parallel import batch_sum, sequence_sum

# name -> how the per-token losses are reduced (see `token_weights`) and which per-token objective is used.
#   sequence_mean: mean over each sequence's tokens, then over sequences          (grpo, sapo)
#   token_mean:    sum over the batch's tokens / number of tokens in this batch   (bnpo)
#   constant:      sum / (B * max_completion_length)                              (dr_grpo)
#   num_items:     sum / num_items_in_batch (default: this batch's token count)   (dapo, cispo, vespo)
#   sequence_sum:  sum over each sequence's tokens, mean over sequences           (luspo)
LOSS_TYPES = {
    "grpo": ("sequence_mean", "clip"),      # DeepSeekMath, arXiv:2402.03300
    "bnpo": ("token_mean", "clip"),
    "dr_grpo": ("constant", "clip"),        # Dr. GRPO, arXiv:2503.20783
    "dapo": ("num_items", "clip"),          # DAPO, arXiv:2503.14476
    "cispo": ("num_items", "cispo"),        # MiniMax-M1, arXiv:2506.13585
    "sapo": ("sequence_mean", "sapo"),      # SAPO, arXiv:2511.20347
    "luspo": ("sequence_sum", "clip"),      # LUSPO, arXiv:2602.05261 (its paper: sequence level; TRL: either)
    "vespo": ("num_items", "vespo"),        # VESPO, arXiv:2602.10693 (a weight per sequence: two phases)
}
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")
# SAPO's gate sigmoid(tau * (r - 1)) * 4 / tau: both tau and 4 / tau multiply per-token terms (grpo_fast.fields)
SAPO_TEMPERATURE = bounded(POSITIVE, 1 / COEFFICIENT_MAX, COEFFICIENT_MAX)


@dataclass(frozen=True)
class LossConfig:
    """The options of the policy loss, validated once: each field's type, finiteness, range and choices, with an
    error naming the field (`grpo_fast.fields`). The trainer's `loss` section is this class, with these defaults.

    loss_type: one of `LOSS_TYPES` (default "dapo").
    importance_sampling_level: "token" (PPO/GRPO) or "sequence" (GSPO: one ratio per sequence, the exp of the
        masked mean log-ratio). LUSPO's paper uses "sequence"; at "token" (TRL 1.16 allows it, and it is TRL's
        default level) luspo clips each token's ratio and keeps its reduction.
    epsilon_low / epsilon_high: clip range [1 - epsilon_low, 1 + epsilon_high]; epsilon_high defaults to 0.28,
        DAPO's clip-higher (the default loss_type's recipe), and None means epsilon_low (TRL's default, symmetric).
        For cispo, epsilon_high is the absolute cap on the ratio (5.0 is the usual value).
    delta: optional upper cap on the unclipped ratio (two-sided clipping, INTELLECT-2).
    beta: weight of the k3 KL to the reference policy; needs ref_logps.
    use_bias_correction_kl: multiply the KL by the importance ratio.
    sapo_temperature_pos / sapo_temperature_neg: SAPO's gate temperatures for A > 0 / A <= 0.
    vespo_k_pos / vespo_lambda_pos, vespo_k_neg / vespo_lambda_neg: VESPO's gamma weight
        e^lambda * w^k * e^(-lambda * w) of the sequence ratio w, for A >= 0 / A < 0 (see `vespo_weights`).
    entropy_coef: subtract entropy_coef * (masked mean entropy) from the loss.
    max_completion_length: the dr_grpo normalizer (required for dr_grpo).
    log_ratio_clamp: clamp every log-ratio the loss exponentiates, logp - old and the KL's ref - logp, to
        [-log_ratio_clamp, log_ratio_clamp] (verl: 20), so that no exp overflows; None: no clamp.
    kl_clamp: clamp the per-token k3 KL to [-kl_clamp, kl_clamp] (verl's low_var_kl: 10); None: no clamp. A
        clamped term passes no gradient, as torch.clamp outside its interval.

    Bounds, where the float32 math takes each number (grpo_fast.fields): clamp bounds and exponents (epsilon_*,
    delta, log_ratio_clamp, kl_clamp, vespo_*) up to float32's largest, 3.4028234663852886e+38; the coefficients
    beta and |entropy_coef| up to 1e18, sapo_temperature_* within [1e-18, 1e18] (the gate divides by it);
    max_completion_length up to 2**31 - 1.
    """

    loss_type: str = key("dapo", f"one of {one_of(LOSS_TYPES)}", choices=tuple(LOSS_TYPES))
    importance_sampling_level: str = key(
        "token", '"token" (a ratio per token: PPO, GRPO) or "sequence" (GSPO: one ratio per sequence, the exp of '
        "its mean log-ratio)", choices=IMPORTANCE_SAMPLING_LEVELS)
    epsilon_low: float = key(0.2, "clip range [1 - epsilon_low, 1 + epsilon_high]", NON_NEGATIVE_FP32)
    epsilon_high: Optional[float] = key(0.28, "clip range [1 - epsilon_low, 1 + epsilon_high] (DAPO's clip-higher; "
                                              "cispo: the cap of the ratio; None: epsilon_low)", NON_NEGATIVE_FP32)
    delta: Optional[float] = key(None, "upper cap on the unclipped ratio (two-sided clipping, INTELLECT-2; None: "
                                       "none)", POSITIVE_FP32)
    beta: float = key(0.0, "weight of the k3 KL to the reference policy", NON_NEGATIVE_COEFFICIENT)
    use_bias_correction_kl: bool = key(False, "multiply the KL by the importance ratio")
    sapo_temperature_pos: float = key(1.0, "SAPO's gate temperature for A > 0", SAPO_TEMPERATURE)
    sapo_temperature_neg: float = key(1.05, "SAPO's gate temperature for A <= 0", SAPO_TEMPERATURE)
    # k < 0 would weigh sequences the more the less likely they became; lambda <= 0 removes the decay that bounds
    # the weight of large ratios (TRL raises such a lambda to 1e-4 without a word)
    vespo_k_pos: float = key(2.0, "VESPO's weight e^lambda * w^k * e^(-lambda * w) of the sequence ratio w: k for "
                                  "A >= 0", NON_NEGATIVE_FP32)
    vespo_lambda_pos: float = key(3.0, "VESPO's lambda for A >= 0", POSITIVE_FP32)
    vespo_k_neg: float = key(3.0, "VESPO's k for A < 0", NON_NEGATIVE_FP32)
    vespo_lambda_neg: float = key(2.0, "VESPO's lambda for A < 0", POSITIVE_FP32)
    entropy_coef: float = key(0.0, "subtracts entropy_coef * the mean entropy from the loss", COEFFICIENT)
    max_completion_length: Optional[int] = key(None, "the dr_grpo normalizer (the trainer: None follows the "
                                                     "rollout's max_completion_length)", LENGTH)
    log_ratio_clamp: Optional[float] = key(None, "clamp of every log-ratio the loss exponentiates, to [-c, c] "
                                                 "(verl: 20; None: none)", POSITIVE_FP32)
    kl_clamp: Optional[float] = key(None, "clamp of the per-token k3 KL to [-c, c] (verl's low_var_kl: 10; None: "
                                          "none)", POSITIVE_FP32)

    def __post_init__(self):
        check_keys(self, "LossConfig")            # each field's type, finiteness, range and choices
        if self.loss_type == "dr_grpo" and self.max_completion_length is None:
            raise ValueError("loss_type='dr_grpo' requires max_completion_length (its normalizer), got None")
        if self.epsilon_high is None:
            object.__setattr__(self, "epsilon_high", self.epsilon_low)

    @property
    def reduction(self) -> str:
        return LOSS_TYPES[self.loss_type][0]

    @property
    def objective(self) -> str:
        return LOSS_TYPES[self.loss_type][1]

    @property
    def token_separable(self) -> bool:
        """True when d(loss)/d(logp_t) depends on token t alone, so the fused path can produce it per chunk.

        Not for sequence-level ratios, nor for vespo, whose weight of a token depends on its whole sequence.
        """
        return self.importance_sampling_level == "token" and self.objective != "vespo"


# keyword -> its home, for the loss options the entries took as keywords before LossConfig held them
CONFIG_MOVES = {field.name: f"config=LossConfig({field.name}=...)" for field in fields(LossConfig)}


def as_loss_config(config) -> LossConfig:
    """The `config=` of the loss entries as a LossConfig: a LossConfig as it is, a loss-type name (a key of
    `LOSS_TYPES`) as `LossConfig(loss_type=config)`, None as `LossConfig()`; anything else is a TypeError."""
    if isinstance(config, LossConfig):
        return config
    if config is None:
        return LossConfig()
    if isinstance(config, str):
        return LossConfig(loss_type=config)
    raise TypeError(f"config must be a grpo_fast.LossConfig, a loss type name ({', '.join(LOSS_TYPES)}) or None, "
                    f"got {type(config).__name__}")


def token_weights(mask: torch.Tensor, config: LossConfig, num_items_in_batch=None) -> torch.Tensor:
    """Per-token weights w such that the policy loss equals (per_token_loss * w).sum(), mask (B, T) float.

    The single definition of every loss type's reduction; it is zero wherever the mask is zero.
    """
    batch_size = mask.shape[0]
    if config.reduction == "sequence_mean":
        return mask / sequence_sum(mask).clamp(min=1.0) / batch_size
    if config.reduction == "token_mean":
        return mask / batch_sum(mask).clamp(min=1.0)
    if config.reduction == "constant":
        return mask / (batch_size * config.max_completion_length)
    if config.reduction == "num_items":
        if num_items_in_batch is None:
            num_items_in_batch = batch_sum(mask)
        num_items = torch.as_tensor(num_items_in_batch, dtype=mask.dtype, device=mask.device)
        return mask / num_items.clamp(min=1.0)
    if config.reduction == "sequence_sum":
        return mask / batch_size
    raise AssertionError(config.reduction)


def micro_batch_share(mask: torch.Tensor, config: LossConfig, total_sequences: int, total_tokens) -> float:
    """The factor that makes micro-batch losses add up to the loss of the whole batch:
    sum over micro-batches of share * loss(micro-batch) == loss(all rows at once), when num_items_in_batch is the
    whole batch's token count (num_items reductions already divide by it, so their share is 1).

    mask: the micro-batch's (b, C) completion mask; total_sequences / total_tokens: the whole batch's rows and
    masked tokens. Follows `token_weights`: per-sequence reductions weigh b / B, token_mean its tokens' share.
    """
    if config.reduction in ("sequence_mean", "constant", "sequence_sum"):
        return mask.shape[0] / total_sequences
    if config.reduction == "token_mean":
        return float(mask.sum()) / max(1.0, float(total_tokens))
    if config.reduction == "num_items":
        return 1.0
    raise AssertionError(config.reduction)


def importance_ratio(logp, old_logps, mask, config: LossConfig) -> torch.Tensor:
    """exp(logp - old) per token, or per sequence (B, 1) as exp of the masked mean log-ratio (GSPO)."""
    log_ratio = clamp_log_ratio(logp - old_logps, config)
    if config.importance_sampling_level == "sequence":
        log_ratio = sequence_sum(log_ratio * mask) / sequence_sum(mask).clamp(min=1.0)
    return torch.exp(log_ratio)


def clamp_log_ratio(log_ratio, config: LossConfig):
    """log_ratio clamped to [-log_ratio_clamp, log_ratio_clamp] (unchanged without the option)."""
    if config.log_ratio_clamp is None:
        return log_ratio
    return torch.clamp(log_ratio, -config.log_ratio_clamp, config.log_ratio_clamp)


def per_token_loss(logp, old_logps, advantages, ref_logps, is_ratio, ratio, config: LossConfig, *, mask=None,
                   policy_mask=None):
    """The per-token loss before reduction, and the per-token k3 KL (None when beta == 0).

    `ratio` is `importance_ratio(...)`: per token, or (B, 1) per sequence. Order of terms as in TRL: clipped
    objective, then times `policy_mask` (TRL's off-policy and high-entropy masks), then times the rollout
    importance-sampling ratio `is_ratio`, then plus beta * KL. vespo needs the (B, T) mask (its weight sums over
    each sequence) and takes is_ratio into that weight instead of the product; policy_mask stays out of it.
    """
    if config.objective == "clip":
        clipped = torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high)
        unclipped = ratio if config.delta is None else torch.clamp(ratio, max=config.delta)
        loss = -torch.min(unclipped * advantages, clipped * advantages)
    elif config.objective == "cispo":
        loss = -torch.clamp(ratio, max=config.epsilon_high).detach() * advantages * logp
    elif config.objective == "sapo":
        temperature = torch.where(
            advantages > 0,
            torch.full_like(advantages, config.sapo_temperature_pos),
            torch.full_like(advantages, config.sapo_temperature_neg),
        )
        loss = -(torch.sigmoid(temperature * (ratio - 1)) * 4 / temperature) * advantages
    elif config.objective == "vespo":
        if mask is None:
            raise ValueError("loss_type='vespo' needs the mask: its weight sums log-ratios over each sequence")
        loss = -vespo_weights(logp, old_logps, advantages, mask, is_ratio, config) * advantages * logp
    else:
        raise AssertionError(config.objective)
    if policy_mask is not None:
        loss = loss * policy_mask
    if is_ratio is not None and config.objective != "vespo":
        loss = loss * is_ratio
    kl = None
    if config.beta != 0.0:
        kl = k3_kl(ref_logps, logp, config)
        if config.use_bias_correction_kl:
            kl = kl * ratio
        loss = loss + config.beta * kl
    return loss, kl


def vespo_weights(logp, old_logps, advantages, mask, is_ratio, config: LossConfig) -> torch.Tensor:
    """`torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(0.0, 0.0, 0.0)`, detached: VESPO's gamma
    weight phi(w) = e^lam * w^k * e^(-lam * w) (phi(1) = 1) of each sequence's importance ratio w, where::

        log_w = clamp(sum(clamp(logp - old_logps, -20, 20) * mask, -1, keepdim=True)
                      + sum(clamp(log(is_ratio), log(1e-8), 20) where mask, -1, keepdim=True), log(1e-8), 20)
        k, lam = (vespo_k_pos, vespo_lambda_pos) where advantages >= 0 else (vespo_k_neg, vespo_lambda_neg)

    with lam at least 1e-4, as TRL 1.16's `GRPOTrainer.get_gamma_weights`. (B, 1) for (B, 1) advantages, (B, T)
    for per-token ones. is_ratio (optional) is the per-token rollout correction, summed in log space over the
    mask only: off it grpo_fast zeroes the ratio, where TRL's is 1 (log 1 = 0, so both sum the same).
    """
    with torch.no_grad():
        log_floor = math.log(1e-8)
        keep = mask > 0
        log_ratio = torch.clamp(logp - old_logps, -20.0, 20.0)
        seq_log_ratio = sequence_sum(log_ratio * mask)
        if is_ratio is not None:
            log_is_ratio = torch.clamp(torch.log(is_ratio), log_floor, 20.0)
            seq_log_ratio = seq_log_ratio + sequence_sum(torch.where(keep, log_is_ratio, 0.0))
        log_w = torch.clamp(seq_log_ratio, log_floor, 20.0)
        non_negative = advantages >= 0
        k = torch.where(non_negative, torch.full_like(advantages, config.vespo_k_pos),
                        torch.full_like(advantages, config.vespo_k_neg))
        lam = torch.where(non_negative, torch.full_like(advantages, config.vespo_lambda_pos),
                          torch.full_like(advantages, config.vespo_lambda_neg)).clamp(min=1e-4)
        return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def k3_kl(ref_logps, logp, config: Optional[LossConfig] = None) -> torch.Tensor:
    """`torch.exp(d) - d - 1` with d = ref_logps - logp: the per-token k3 estimate of KL(policy || ref); with a
    config's clamps, d clamped to +-log_ratio_clamp and the result to +-kl_clamp."""
    diff = ref_logps - logp if config is None else clamp_log_ratio(ref_logps - logp, config)
    kl = torch.exp(diff) - diff - 1
    if config is not None and config.kl_clamp is not None:
        kl = torch.clamp(kl, -config.kl_clamp, config.kl_clamp)
    return kl


def clip_flags(ratio, advantages, config: LossConfig) -> dict:
    """Where the objective clipped, as bool tensors keyed by metric name; for "clip", with r = ratio, A = advantages::

        low = (r < 1 - epsilon_low) & (A < 0);  high = (r > 1 + epsilon_high) & (A > 0);  region = low | high

    for "cispo" (r > epsilon_high) & (A > 0); none for "sapo" and "vespo" (they do not clip).
    """
    if config.objective == "clip":
        low = (ratio < 1 - config.epsilon_low) & (advantages < 0)
        high = (ratio > 1 + config.epsilon_high) & (advantages > 0)
        return {"clip_ratio/low_mean": low, "clip_ratio/high_mean": high, "clip_ratio/region_mean": low | high}
    if config.objective == "cispo":
        return {"cispo_clip_ratio": (ratio > config.epsilon_high) & (advantages > 0)}
    return {}


@dataclass
class TokenTerms:
    """What a token-level loss needs per token besides logp: compacted (N,) fp32 vectors and the config.

    weights are `token_weights` at those tokens; entropy_grad is d(loss)/d(entropy) (None without a bonus).
    """

    config: LossConfig
    advantages: torch.Tensor
    weights: torch.Tensor
    old_logps: Optional[torch.Tensor] = None
    ref_logps: Optional[torch.Tensor] = None
    is_ratio: Optional[torch.Tensor] = None
    entropy_grad: Optional[torch.Tensor] = None

    def slice(self, start: int, end: int) -> "TokenTerms":
        cut = lambda t: None if t is None else t[start:end]  # noqa: E731
        return TokenTerms(self.config, self.advantages[start:end], self.weights[start:end], cut(self.old_logps),
                          cut(self.ref_logps), cut(self.is_ratio), cut(self.entropy_grad))


def token_loss_grad(logp: torch.Tensor, terms: TokenTerms) -> torch.Tensor:
    """d/d(logp) of (per_token_loss(logp, ...) * weights).sum() for token-level variants, by autograd.

    The fused path calls this (or its Triton twin, grpo_fast.kernels.policy_grad) per chunk of tokens.
    """
    assert terms.config.token_separable
    with torch.enable_grad():
        logp = logp.detach().requires_grad_()
        old = logp.detach() if terms.old_logps is None else terms.old_logps
        ratio = importance_ratio(logp, old, None, terms.config)
        losses, _ = per_token_loss(logp, old, terms.advantages, terms.ref_logps, terms.is_ratio, ratio,
                                   terms.config)
        (grad,) = torch.autograd.grad((losses * terms.weights).sum(), logp)
    return grad


def entropy_bonus_weights(mask: torch.Tensor, config: LossConfig) -> torch.Tensor:
    """Per-token weights of the entropy bonus: the loss gets -(entropy * these).sum()."""
    return config.entropy_coef * mask / batch_sum(mask).clamp(min=1.0)


def policy_loss(logp, entropy, mask, advantages, *, old_logps=None, ref_logps=None, is_ratio=None,
                num_items_in_batch=None, config: LossConfig, entropy_mask=None, policy_mask=None, loss_weights=None,
                entropy_weights=None):
    """The policy loss and its metrics from per-token log-probs: logp, mask etc. (B, T), advantages (B, 1) or (B, T).

    Values where mask == 0 are ignored (and may be anything, even inf). old_logps None means on-policy:
    old = logp.detach(). entropy may be None when entropy_coef == 0. entropy_mask: the 0/1 tokens (within the
    mask) the entropy bonus averages over, default the mask (TRL narrows it to its high-entropy tokens when it
    filters them). policy_mask: an optional (B, T) factor of the policy term alone (see `per_token_loss`).
    loss_weights: (B, T) weights of the per-token losses in place of the loss type's reduction (`token_weights`):
    loss = (per_token * loss_weights * mask).sum(). entropy_weights: (B, T) weights of the entropy bonus in place
    of entropy_coef's masked mean: the loss gets -(entropy * entropy_weights * mask).sum(). Returns (loss, metrics).
    """
    mask = mask.to(logp.dtype)
    keep = mask > 0
    zeros = torch.zeros_like(logp)
    # Neutral values off the mask, so that 0 * inf never makes a NaN in the sums below.
    logp = torch.where(keep, logp, zeros)
    old_logps = logp.detach() if old_logps is None else torch.where(keep, old_logps, zeros)
    if advantages.shape == logp.shape:  # per-token advantages; (B, 1) per-sequence ones stay as TRL has them
        advantages = torch.where(keep, advantages, zeros)
    if ref_logps is not None:
        ref_logps = torch.where(keep, ref_logps, zeros)
    if is_ratio is not None:
        is_ratio = torch.where(keep, is_ratio, zeros)
    if policy_mask is not None:
        policy_mask = torch.where(keep, policy_mask.to(logp.dtype), zeros)

    ratio = importance_ratio(logp, old_logps, mask, config)
    losses, kl = per_token_loss(logp, old_logps, advantages, ref_logps, is_ratio, ratio, config, mask=mask,
                                policy_mask=policy_mask)
    weights = token_weights(mask, config, num_items_in_batch) if loss_weights is None \
        else torch.where(keep, loss_weights, zeros)
    loss = (losses * weights).sum()
    if entropy is not None:
        entropy = torch.where(keep, entropy, zeros)
        if entropy_weights is not None:
            loss = loss - (entropy * torch.where(keep, entropy_weights, zeros)).sum()
        elif config.entropy_coef != 0.0:
            bonus_mask = mask if entropy_mask is None else entropy_mask.to(mask.dtype) * mask
            loss = loss - (entropy * entropy_bonus_weights(bonus_mask, config)).sum()
    with torch.no_grad():
        phi = None
        if config.objective == "vespo":
            phi = vespo_weights(logp, old_logps, advantages, mask, is_ratio, config)
        metrics = loss_metrics(ratio, kl, entropy, advantages, mask, config, phi=phi)
    return loss, metrics


def masked_mean(x, mask):
    """(x * mask).sum() / mask.sum(), as TRL's global_masked_mean: per-sequence values (B, 1) average over all B."""
    if x.shape[-1] == 1 and mask.shape[-1] != 1:
        return x.sum() / max(x.shape[0], 1)
    return batch_sum(x * mask) / batch_sum(mask).clamp(min=1.0)


def loss_metrics(ratio, kl, entropy, advantages, mask, config: LossConfig, phi=None) -> dict:
    """Detached scalar metrics named as TRL logs them, plus the mean importance ratio.

    phi: vespo's `vespo_weights`, logged as "vespo/phi_seq_mean" (per sequence: a mean over all B rows, as TRL).
    """
    metrics = {"ratio/mean": masked_mean(ratio, mask)}
    if phi is not None:
        metrics["vespo/phi_seq_mean"] = masked_mean(phi, mask)
    if kl is not None:
        metrics["kl"] = masked_mean(kl, mask)
    if entropy is not None:
        metrics["entropy"] = masked_mean(entropy, mask)
    for name, flag in clip_flags(ratio, advantages, config).items():
        metrics[name] = masked_mean(flag.to(mask.dtype), mask)
    return {name: value.detach() for name, value in metrics.items()}
