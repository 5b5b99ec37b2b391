"""The registry's reductions and per-token math against TRL 1.16's `_compute_loss`, transcribed literally.

`trl_compute_loss` below follows the order and expressions of TRL's source (one gradient-accumulation step,
one process), so a change to `grpo_fast.variants` that drifts from TRL fails here. vespo's weights come from
TRL's own `GRPOTrainer.get_gamma_weights`.
"""

import itertools

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from grpo_fast.variants import LOSS_TYPES, LossConfig, policy_loss
from tests.helpers import DEVICE, assert_close

VESPO_DEFAULTS = dict(vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0)


def trl_gamma_weights(**kwargs):
    """TRL's own VESPO weights (a staticmethod under torch.no_grad)."""
    trl = pytest.importorskip("trl")
    return trl.GRPOTrainer.get_gamma_weights(**kwargs)


def trl_compute_loss(per_token_logps, entropies, mask, advantages, old_per_token_logps, ref_per_token_logps,
                     importance_sampling_ratio, num_items_in_batch, cfg):
    eps_low, eps_high = cfg["epsilon"], cfg.get("epsilon_high") or cfg["epsilon"]
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    old_per_token_logps = per_token_logps.detach() if old_per_token_logps is None else old_per_token_logps
    log_ratio = per_token_logps - old_per_token_logps
    if cfg["importance_sampling_level"] == "token":
        log_importance_weights = log_ratio
    else:
        log_importance_weights = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)
        log_importance_weights = log_importance_weights.unsqueeze(-1)
    coef_1 = torch.exp(log_importance_weights)
    if cfg["beta"] != 0.0:
        per_token_kl = torch.exp(ref_per_token_logps - per_token_logps) - (ref_per_token_logps - per_token_logps) - 1
        if cfg["use_bias_correction_kl"]:
            per_token_kl = per_token_kl * coef_1
    loss_type = cfg["loss_type"]
    if loss_type == "cispo":
        clamped_ratios = torch.clamp(coef_1, max=eps_high).detach()
        per_token_loss = -clamped_ratios * advantages * per_token_logps
    elif loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if cfg["delta"] is not None:
            coef_1 = torch.clamp(coef_1, max=cfg["delta"])
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    elif loss_type == "sapo":
        # TRL writes torch.where(advantages > 0, 1.0, 1.05), whose Python scalars become fp32; exact in fp64 here.
        temperatures = torch.where(advantages > 0, advantages.new_tensor(1.0), advantages.new_tensor(1.05))
        per_token_loss = -(torch.sigmoid(temperatures * (coef_1 - 1)) * 4 / temperatures) * advantages
    elif loss_type == "vespo":
        vespo = {**VESPO_DEFAULTS, **cfg}
        phi_seq = trl_gamma_weights(
            advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
            importance_sampling_ratio=importance_sampling_ratio, k_pos=vespo["vespo_k_pos"],
            lambda_pos=vespo["vespo_lambda_pos"], k_neg=vespo["vespo_k_neg"], lambda_neg=vespo["vespo_lambda_neg"],
        )
        per_token_loss = -phi_seq * advantages * per_token_logps
    if importance_sampling_ratio is not None and loss_type != "vespo":
        per_token_loss = per_token_loss * importance_sampling_ratio
    if cfg["beta"] != 0.0:
        per_token_loss = per_token_loss + cfg["beta"] * per_token_kl
    if loss_type in ["grpo", "sapo"]:
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * cfg["max_completion_length"])
    elif loss_type in ["cispo", "dapo", "vespo"]:
        loss = (per_token_loss * mask).sum() / num_items_in_batch.clamp(min=1.0)
    elif loss_type == "luspo":
        loss = (per_token_loss * mask).sum(-1).mean()
    if cfg["entropy_coef"]:
        loss = loss - cfg["entropy_coef"] * (entropies * mask).sum() / mask.sum().clamp(min=1.0)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    metrics = {"entropy": global_masked_mean(entropies)}
    if cfg["beta"] != 0.0:
        metrics["kl"] = global_masked_mean(per_token_kl)
    if loss_type in ["grpo", "bnpo", "dr_grpo", "dapo", "luspo"]:
        # TRL compares the delta-capped coef_1; the cap is above 1 + epsilon_high, so the flags agree.
        low = (coef_1 < 1 - eps_low) & (advantages < 0)
        high = (coef_1 > 1 + eps_high) & (advantages > 0)
        metrics["clip_ratio/low_mean"] = global_masked_mean(low.double())
        metrics["clip_ratio/high_mean"] = global_masked_mean(high.double())
        metrics["clip_ratio/region_mean"] = global_masked_mean((low | high).double())
    elif loss_type == "cispo":
        metrics["cispo_clip_ratio"] = global_masked_mean(((coef_1 > eps_high) & (advantages > 0)).double())
    elif loss_type == "vespo":
        metrics["vespo/phi_seq_mean"] = global_masked_mean(phi_seq)
    return loss, metrics


def random_inputs(seed, per_token_adv):
    gen = torch.Generator().manual_seed(seed)
    B, T = 4, 7
    mask = (torch.rand(B, T, generator=gen) > 0.3).double()
    mask[2] = 0.0                                   # an empty sequence
    logp = (-torch.rand(B, T, generator=gen, dtype=torch.float64) * 3).requires_grad_()
    entropy = (torch.rand(B, T, generator=gen, dtype=torch.float64) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    is_ratio = 0.5 + torch.rand(B, T, generator=gen, dtype=torch.float64)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64) if per_token_adv else \
        torch.randn(B, generator=gen, dtype=torch.float64)
    return logp, entropy, mask, adv, old, ref, is_ratio


OPTIONS = [
    dict(beta=0.0, use_bias_correction_kl=False, delta=None, entropy_coef=0.0, on_policy=False, is_ratio=False),
    dict(beta=0.04, use_bias_correction_kl=True, delta=None, entropy_coef=0.0, on_policy=False, is_ratio=True),
    dict(beta=0.04, use_bias_correction_kl=False, delta=1.6, entropy_coef=0.03, on_policy=False, is_ratio=False),
    dict(beta=0.0, use_bias_correction_kl=False, delta=None, entropy_coef=0.0, on_policy=True, is_ratio=True),
]


@pytest.mark.parametrize("loss_type,level", [
    (t, lvl) for t, lvl in itertools.product(sorted(LOSS_TYPES), ["token", "sequence"])
])
@pytest.mark.parametrize("option", range(len(OPTIONS)))
@pytest.mark.parametrize("per_token_adv", [False, True])
def test_policy_loss_matches_trl(loss_type, level, option, per_token_adv):
    opts = OPTIONS[option]
    logp, entropy, mask, adv, old, ref, is_ratio = random_inputs(option, per_token_adv)
    old = None if opts["on_policy"] else old
    is_ratio = is_ratio if opts["is_ratio"] else None
    eps_high = 5.0 if loss_type == "cispo" else 0.28
    cfg = dict(loss_type=loss_type, importance_sampling_level=level, epsilon=0.2, epsilon_high=eps_high,
               beta=opts["beta"], use_bias_correction_kl=opts["use_bias_correction_kl"], delta=opts["delta"],
               entropy_coef=opts["entropy_coef"], max_completion_length=11)
    num_items = torch.tensor(13.0, dtype=torch.float64)
    # TRL's rollout correction is 1 off the mask, which vespo's sum over every token relies on; grpo_fast's
    # sum is over the mask, so it gets the random values off the mask as well.
    trl_is_ratio = is_ratio if is_ratio is None or loss_type != "vespo" else torch.where(mask > 0, is_ratio, 1.0)
    expected, expected_metrics = trl_compute_loss(logp, entropy, mask, adv, old, ref if opts["beta"] else None,
                                                  trl_is_ratio, num_items, cfg)
    config = LossConfig(loss_type=loss_type, importance_sampling_level=level, epsilon_low=0.2,
                        epsilon_high=eps_high, delta=opts["delta"], beta=opts["beta"],
                        use_bias_correction_kl=opts["use_bias_correction_kl"], entropy_coef=opts["entropy_coef"],
                        max_completion_length=11)
    actual, metrics = policy_loss(logp, entropy, mask, adv if per_token_adv else adv[:, None], old_logps=old,
                                  ref_logps=ref if opts["beta"] else None, is_ratio=is_ratio,
                                  num_items_in_batch=num_items, config=config)
    torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)
    g_actual = torch.autograd.grad(actual, (logp, entropy), allow_unused=True)
    g_expected = torch.autograd.grad(expected, (logp, entropy), allow_unused=True)
    for a, e in zip(g_actual, g_expected):
        if e is None:
            assert a is None or torch.count_nonzero(a) == 0
        else:
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    for key, value in expected_metrics.items():
        torch.testing.assert_close(metrics[key], value.detach(), rtol=1e-12, atol=1e-12, msg=key)


def vespo_inputs(seed, per_token_adv):
    """A batch whose VESPO weights lie across (0, e^lambda): old log-probs near the policy's, a padding row."""
    gen = torch.Generator().manual_seed(seed)
    B, T, H, V = 4, 6, 16, 37
    hidden = torch.randn(B, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) * (2.0 / H**0.5)
    mask = torch.rand(B, T, generator=gen) > 0.25
    mask[:, 0] = True
    mask[1] = False                                          # a padding row
    targets = torch.where(mask, torch.randint(0, V, (B, T), generator=gen), -100)
    advantages = torch.randn(B, T, generator=gen) if per_token_adv else torch.tensor([0.8, -0.5, -1.2, 0.6])
    logp = reference.token_logprobs(hidden.double(), weight.double(), targets)
    old = logp + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    old[0] += 0.3                   # a sequence the policy moved away from (w < 1) and one it moved toward
    old[3] -= 0.3
    ref = logp + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    is_ratio = torch.exp(0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64))
    return hidden, weight, targets, advantages, mask, old, ref, is_ratio


VESPO_OPTIONS = dict(beta=0.04, vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)


@pytest.mark.parametrize("per_token_adv", [False, True])
def test_vespo_grpo_loss_matches_trl(backend, per_token_adv):
    """grpo_loss(loss_type="vespo") from hidden states against TRL's formula on float64 full-logits log-probs:
    loss, d(hidden), d(weight) and the logged metrics. grpo_fast gets poison (inf) off the mask, TRL the values
    its trainer holds there (a rollout correction of 1)."""
    hidden, weight, targets, advantages, mask, old, ref, is_ratio = vespo_inputs(11 + per_token_adv, per_token_adv)
    mask64 = mask.double()
    hidden64, weight64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    logp64, entropy64 = reference.token_logprobs(hidden64, weight64, targets, return_entropy=True)
    cfg = dict(loss_type="vespo", importance_sampling_level="token", epsilon=0.2, epsilon_high=0.28,
               use_bias_correction_kl=False, delta=None, entropy_coef=0.0, **VESPO_OPTIONS)
    expected, expected_metrics = trl_compute_loss(
        logp64, entropy64, mask64, advantages.double(), old, ref, torch.where(mask, is_ratio, 1.0),
        mask64.sum(), cfg)
    expected_grads = torch.autograd.grad(expected, (hidden64, weight64))
    phi = trl_gamma_weights(advantages=advantages.double().reshape(4, -1), log_ratio_per_token=logp64 - old,
                            mask=mask64, importance_sampling_ratio=torch.where(mask, is_ratio, 1.0), k_pos=1.5,
                            lambda_pos=2.5, k_neg=2.5, lambda_neg=1.5)
    assert phi.max() - phi.min() > 0.5, "weights all alike would not show the formula"

    poison = lambda t: torch.where(mask, t, float("inf")).float().to(DEVICE)  # noqa: E731
    hidden, weight = hidden.to(DEVICE).requires_grad_(), weight.to(DEVICE).requires_grad_()
    loss, metrics = gf.grpo_loss(hidden, weight, targets.to(DEVICE), advantages.to(DEVICE), mask.to(DEVICE),
                                 old_logps=poison(old), ref_logps=poison(ref),
                                 config=LossConfig(loss_type="vespo", **VESPO_OPTIONS),
                                 weights=gf.TokenWeights(is_ratio=poison(is_ratio)),
                                 execution=gf.Execution(backend=backend))
    grads = torch.autograd.grad(loss, (hidden, weight))
    assert_close(loss, expected, 1e-5, atol=1e-7, name="loss")
    for name, actual, reference_grad in zip(("dhidden", "dweight"), grads, expected_grads):
        assert_close(actual, reference_grad, 1e-5, atol=1e-7, name=name)
    for key, value in expected_metrics.items():
        assert_close(metrics[key], value, 1e-5, atol=1e-7, name=key)


def test_vespo_weights_follow_trl_at_the_clamps():
    """Ratios past e^20 and below 1e-8, a rollout correction of 0 (masked by IcePop), lambda under 1e-4."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    log_ratio = torch.tensor([[15.0, 15.0, 0.0], [-30.0, 2.0, 1.0], [0.3, 0.0, 0.0], [-0.2, 0.1, 0.0]],
                             dtype=torch.float64)
    is_ratio = torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.0, 2.0], [3.0, 1.0, 1.0], [1.2, 0.9, 1.0]],
                            dtype=torch.float64)
    advantages = torch.tensor([[1.0], [-1.0], [0.0], [-0.5]], dtype=torch.float64)
    options = dict(vespo_k_pos=2.0, vespo_lambda_pos=0.5**20, vespo_k_neg=0.0, vespo_lambda_neg=2.0)
    config = LossConfig(loss_type="vespo", **options)
    old = torch.zeros_like(log_ratio)
    for correction in (None, is_ratio):
        expected = trl_gamma_weights(advantages=advantages, log_ratio_per_token=log_ratio, mask=mask,
                                     importance_sampling_ratio=correction, k_pos=2.0, lambda_pos=0.5**20,
                                     k_neg=0.0, lambda_neg=2.0)
        fast_correction = None if correction is None else torch.where(mask > 0, correction, 0.0)
        actual = gf.variants.vespo_weights(log_ratio, old, advantages, mask, fast_correction, config)
        # TRL's k and lambda are fp32 tensors (torch.where of Python floats): its 1e-4 floor is 1e-4 rounded to fp32
        torch.testing.assert_close(actual, expected, rtol=1e-9, atol=0.0)
