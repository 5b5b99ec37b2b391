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
    torch.testing.assert_close(metrics[-1].float(), ref_metrics[-1].float(), rtol=1e-5, atol=1e-6)   # clip_ratio


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "luspo"])
def test_sequence_level_clip_ratio_is_ligers_token_share(loss_type):
    """At importance_sampling_level="sequence" Liger counts a sequence's clip flag once per token of it, over the
    batch's tokens; TRL's per-sequence mean differs where sequences of different lengths differ in their flags.
    Here rows 0 and 2 (8 and 3 tokens) clip, row 1 (5 tokens) does not: Liger's 11 / 16, TRL's 2 / 3."""
    data = inputs()
    mask = torch.zeros(B, T, dtype=torch.long)
    for row, length in enumerate((8, 5, 3)):
        mask[row, :length] = 1
    logits = (data["_input"] @ data["lin_weight"].T + data["bias"])
    current = logits.log_softmax(-1).gather(-1, data["selected_token_ids"][..., None])[..., 0]
    # sequence ratios e^0.5 (A > 0: high clip), e^0.05 (inside the region), e^-0.5 (A < 0: low clip)
    old = current - torch.tensor([0.5, 0.05, -0.5])[:, None]
    old = torch.where(mask.bool(), old, torch.full_like(old, -30.0))      # padding, far off: must not count
    call = {**{k: v for k, v in data.items() if k != "ref_input"}, "attention_mask": mask,
            "old_per_token_logps": old, "advantages": torch.tensor([1.0, 0.5, -1.0])}
    options = dict(loss_type=loss_type, importance_sampling_level="sequence", beta=0.0, compiled=False)
    (clip_ratio,) = FusedLinearGRPOLoss(**options)(**call)[1]
    (liger_clip_ratio,) = liger.LigerFusedLinearGRPOLoss(**options)(**call)[1]
    torch.testing.assert_close(liger_clip_ratio.float(), torch.tensor(11 / 16), rtol=1e-6, atol=0)
    torch.testing.assert_close(clip_ratio.float(), liger_clip_ratio.float(), rtol=1e-6, atol=0)


# VESPO's gamma weights: pos / neg parameters apart from each other and from the defaults, so a swapped or dropped
# mapping changes the weights; vllm_is_ratio: None, per sequence ((B, 1) or (B,)) or per token (1 off the mask,
# where Liger sums it too).
VESPO_CASES = {
    "vespo": dict(vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5),
    "vespo_kl_bias_corrected": dict(beta=0.04, use_bias_correction_kl=True, vespo_k_neg=4.0),
    "vespo_sequence_ratio": dict(beta=0.04, vespo_lambda_pos=2.0, ratio="sequence"),
    "vespo_flat_ratio": dict(vespo_k_pos=3.0, ratio="flat"),
    "vespo_token_ratio_temperature": dict(temperature=0.7, vespo_lambda_neg=3.5, ratio="token"),
}


def vespo_inputs(temperature, seed=1):
    """inputs() in float64, with old and reference log-probs near the current ones (within ~0.1 per token), so each
    sequence's ratio w stays near 1 and its gamma weight phi(w) varies between the sequences instead of
    underflowing to 0."""
    data = {k: v.double() if v.is_floating_point() else v for k, v in inputs(seed).items()}
    gen = torch.Generator().manual_seed(seed + 1)
    logits = (data["_input"] @ data["lin_weight"].T + data["bias"]) / temperature
    current = logits.log_softmax(-1).gather(-1, data["selected_token_ids"][..., None])[..., 0]
    data["old_per_token_logps"] = current + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    data["ref_per_token_logps"] = current + 0.1 * torch.randn(B, T, generator=gen, dtype=torch.float64)
    data["advantages"] = torch.tensor([0.7, -1.3, 0.4], dtype=torch.float64)     # both signs: pos and neg weights
    return data


def vespo_call(case, data):
    """(module options, forward keywords) of a VESPO_CASES entry; the LM head's tensors require grad."""
    options = dict(case)
    shape = options.pop("ratio", None)
    call = {k: v for k, v in data.items() if k != "ref_input"}
    for name in ("_input", "lin_weight", "bias"):
        call[name] = data[name].clone().requires_grad_()
    if shape is not None:
        gen = torch.Generator().manual_seed(7)
        ratio = 0.7 + 0.6 * torch.rand(B, 1 if shape != "token" else T, generator=gen, dtype=torch.float64)
        if shape == "token":
            ratio = torch.where(data["attention_mask"].bool(), ratio, 1.0)
        call["vllm_is_ratio"] = ratio.squeeze(1) if shape == "flat" else ratio
    return {"loss_type": "vespo", "beta": 0.0, **options}, call


def liger_float64(options, call):
    """Liger's own loss function (`LigerFusedLinearGRPOFunction.ppo_loss_fn`, the math its chunked path runs on
    each chunk, there on fp32 logits) over the whole batch, on log-probs from full float64 logits."""
    from liger_kernel.chunked_loss.grpo_loss import LigerFusedLinearGRPOFunction

    options = dict(options)
    temperature = options.pop("temperature", 1.0)
    logits = (call["_input"] @ call["lin_weight"].T + call["bias"]) / temperature
    logp = logits.log_softmax(-1).gather(-1, call["selected_token_ids"][..., None])[..., 0]
    ratio = call.get("vllm_is_ratio")
    mask = call["attention_mask"]
    return LigerFusedLinearGRPOFunction.ppo_loss_fn(
        logp, mask, call["advantages"], mask, ref_per_token_logps=call["ref_per_token_logps"],
        old_per_token_logps=call["old_per_token_logps"],
        vllm_is_ratio=None if ratio is None else ratio.reshape(B, -1), **options)


@pytest.mark.parametrize("name", sorted(VESPO_CASES))
def test_vespo_matches_liger_in_float64(name):
    """vespo through the drop-in on float64 inputs against Liger's loss function in float64 (loss and metrics to
    1e-10, gradients to 1e-9), and against Liger's whole module (compiled=False), whose chunks compute the logits
    in fp32 (1e-5)."""
    case = VESPO_CASES[name]
    data = vespo_inputs(case.get("temperature", 1.0))
    options, call = vespo_call(case, data)
    inputs_ = (call["_input"], call["lin_weight"], call["bias"])
    loss, metrics = FusedLinearGRPOLoss(compiled=False, **options)(**call)
    grads = torch.autograd.grad(loss, inputs_)
    ref_loss, ref_metrics = liger_float64(options, call)
    ref_grads = torch.autograd.grad(ref_loss, inputs_)
    assert loss.dtype == ref_loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-10, atol=1e-12)
    for grad_name, ours, theirs in zip(("_input", "lin_weight", "bias"), grads, ref_grads):
        assert ours.dtype == torch.float64
        torch.testing.assert_close(ours, theirs, rtol=1e-9, atol=1e-12, msg=grad_name)
    assert len(metrics) == len(ref_metrics)
    for ours, theirs in zip(metrics, ref_metrics):                   # (kl_mean,) clip_ratio (0: vespo never clips)
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=1e-10, atol=1e-12)
    module_loss = liger.LigerFusedLinearGRPOLoss(compiled=False, **options)(**call)[0]
    torch.testing.assert_close(loss, module_loss.double(), rtol=1e-5, atol=1e-7)
    # The weights must matter: with every phi = 1 (old log-probs = current ones) the loss differs.
    on_policy = liger_float64(options, {**call, "old_per_token_logps": None, "vllm_is_ratio": None})[0]
    assert (ref_loss - on_policy).abs() > 1e-3 * ref_loss.abs(), "the gamma weights did not change the loss"


def test_rejects_what_it_does_not_support():
    for loss_type in ("cispo", "sapo", "vespo"):
        with pytest.raises(ValueError, match=f"sequence.*{loss_type}"):
            FusedLinearGRPOLoss(loss_type=loss_type, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match=r"vespo_lambda_neg must be a finite number > 0 "
                                         r"\(LossConfig.vespo_lambda_neg\), got 0.0"):
        FusedLinearGRPOLoss(loss_type="vespo", vespo_lambda_neg=0.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        FusedLinearGRPOLoss(epsilon=0.2)


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_reference_model_without_reference_inputs_is_refused_as_liger_refuses_it(beta):
    """use_ref_model=True with neither ref_per_token_logps nor ref_input: Liger's forward refuses it whatever beta
    (an AssertionError); the drop-in refuses the same call with a ValueError naming the arguments."""
    call = {k: v for k, v in inputs().items() if k != "ref_input"}
    call["ref_per_token_logps"] = None
    with pytest.raises(AssertionError, match="If use_ref_model is True, ref_per_token_logps or ref_input must be "
                                             "provided"):
        liger.LigerFusedLinearGRPOLoss(beta=beta, use_ref_model=True, compiled=False)(**call)
    with pytest.raises(ValueError, match=r"^use_ref_model=True needs ref_per_token_logps or ref_input, got neither "
                                         r"\(use_ref_model=False runs without a reference model\)$"):
        FusedLinearGRPOLoss(beta=beta, use_ref_model=True)(**call)
    # without a reference model both run, with a KL of 0 where beta != 0
    loss, metrics = FusedLinearGRPOLoss(beta=beta, use_ref_model=False)(**call)
    ref_loss, ref_metrics = liger.LigerFusedLinearGRPOLoss(beta=beta, use_ref_model=False, compiled=False)(**call)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert len(metrics) == len(ref_metrics) == (2 if beta else 1)
