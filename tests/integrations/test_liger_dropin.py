"""grpo_fast.integrations.liger.FusedLinearGRPOLoss against liger-kernel's own LigerFusedLinearGRPOLoss."""

import pytest
import torch

from grpo_fast.integrations.liger import FusedLinearGRPOLoss

liger = pytest.importorskip("liger_kernel.chunked_loss")

B, T, H, V = 3, 10, 16, 50
CASES = {
    "dapo": dict(),
    "dapo_kl_bias_corrected": dict(beta=0.04, use_bias_correction_kl=True),
    "grpo_two_sided": dict(loss_type="grpo", epsilon_high=0.28, delta=1.4),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=12),
    "cispo": dict(loss_type="cispo", epsilon_high=3.0),
    "sapo": dict(loss_type="sapo"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "luspo": dict(loss_type="luspo", importance_sampling_level="sequence", beta=0.0),
    "temperature_vllm_ratio": dict(temperature=0.7, beta=0.04, vllm_is_ratio=True),
    "no_reference_model": dict(beta=0.04, use_ref_model=False, no_ref=True),
    "reference_from_input": dict(beta=0.04, ref_from_input=True),
}


def inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=gen) > 0.2).long()
    mask[0, -3:] = 0
    return dict(
        _input=torch.randn(B, T, H, generator=gen), lin_weight=torch.randn(V, H, generator=gen) * 0.5,
        selected_token_ids=torch.randint(0, V, (B, T), generator=gen), attention_mask=mask,
        advantages=torch.randn(B, generator=gen), bias=torch.randn(V, generator=gen) * 0.1,
        old_per_token_logps=-torch.rand(B, T, generator=gen) * 4 - 2,
        ref_per_token_logps=-torch.rand(B, T, generator=gen) * 4 - 2,
        ref_input=torch.randn(B, T, H, generator=gen),
    )


def run(module_cls, case, data):
    options = dict(case)
    use_ratio = options.pop("vllm_is_ratio", False)
    no_ref = options.pop("no_ref", False)
    ref_from_input = options.pop("ref_from_input", False)
    module = module_cls(compiled=False, **{"beta": 0.0, **options})
    call = {k: v for k, v in data.items() if k != "ref_input"}
    call["_input"] = data["_input"].clone().requires_grad_()
    call["lin_weight"] = data["lin_weight"].clone().requires_grad_()
    call["bias"] = data["bias"].clone().requires_grad_()
    if use_ratio:
        call["vllm_is_ratio"] = 0.5 + torch.rand(B, T, generator=torch.Generator().manual_seed(5))
    if no_ref or ref_from_input:
        call["ref_per_token_logps"] = None
    if ref_from_input:
        call.update(ref_input=data["ref_input"], ref_weight=data["lin_weight"], ref_bias=data["bias"])
    loss, metrics = module(**call)
    grads = torch.autograd.grad(loss, (call["_input"], call["lin_weight"], call["bias"]))
    return loss, metrics, grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_liger(name):
    data = inputs()
    loss, metrics, grads = run(FusedLinearGRPOLoss, CASES[name], data)
    ref_loss, ref_metrics, ref_grads = run(liger.LigerFusedLinearGRPOLoss, CASES[name], data)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)
    assert len(metrics) == len(ref_metrics)
    if len(metrics) == 2:                                       # kl_mean
        torch.testing.assert_close(metrics[0], ref_metrics[0], rtol=1e-5, atol=1e-6)
    if CASES[name].get("importance_sampling_level") != "sequence":
        # clip_ratio; at sequence level Liger weighs sequences by their tokens, TRL (and grpo_fast) do not.
        torch.testing.assert_close(metrics[-1].float(), ref_metrics[-1].float(), rtol=1e-5, atol=1e-6)


def test_rejects_what_it_does_not_support():
    with pytest.raises(ValueError, match="vespo"):
        FusedLinearGRPOLoss(loss_type="vespo")
    with pytest.raises(ValueError, match="sequence"):
        FusedLinearGRPOLoss(loss_type="sapo", importance_sampling_level="sequence")
    with pytest.raises(TypeError, match="unexpected keyword"):
        FusedLinearGRPOLoss(epsilon=0.2)
