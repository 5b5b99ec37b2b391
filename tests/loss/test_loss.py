"""grpo_loss against the full-logits reference evaluated in float64: loss, metrics and gradients."""

import dataclasses
import inspect

import pytest
import torch

import grpo_fast as gf
from grpo_fast import reference
from tests.helpers import as_float64, assert_close, flat, forward_grouped, grouped, make_batch

CASES = {
    "dapo_on_policy": dict(old_logps=None),
    "dapo_kl": dict(beta=0.04),
    "dapo_kl_bias_corrected": dict(beta=0.04, use_bias_correction_kl=True),
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo", max_completion_length=12),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    "sapo": dict(loss_type="sapo"),
    "luspo_sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "gspo_sequence_kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1),
    "two_sided_clip": dict(epsilon_high=0.28, delta=1.5),
    "is_ratio": dict(beta=0.04, use_is_ratio=True),
    "entropy_bonus": dict(entropy_coef=0.05),
    "entropy_bonus_sequence": dict(entropy_coef=0.05, importance_sampling_level="sequence"),
    "per_token_advantages": dict(per_token_adv=True),
    "num_items_in_batch": dict(num_items_in_batch=50),
    # on-policy: the batch's random old log-probs are far from the policy's, and would make every weight ~0
    "vespo_is_ratio_kl": dict(loss_type="vespo", old_logps=None, use_is_ratio=True, beta=0.04),
    "vespo_per_token_advantages": dict(loss_type="vespo", old_logps=None, use_is_ratio=True, per_token_adv=True,
                                       vespo_k_neg=1.5, vespo_lambda_neg=1.0),
}


def run(fn, inputs, options, grads=("hidden", "weight", "bias")):
    inputs = {k: (v.clone().requires_grad_(k in grads) if isinstance(v, torch.Tensor) and k in grads else v)
              for k, v in inputs.items()}
    loss, metrics = flat(fn)(**inputs, **options)
    params = [inputs[k] for k in grads if inputs.get(k) is not None]
    return loss, metrics, dict(zip([k for k in grads if inputs.get(k) is not None],
                                   torch.autograd.grad(loss, params)))


def split_case(case):
    case = dict(case)
    batch_kw = {"per_token_adv": case.pop("per_token_adv", False)}
    use_is_ratio = case.pop("use_is_ratio", False)
    return batch_kw, use_is_ratio, case


def compare(inputs, options, backend, rtol, grad_atol=1e-7):
    loss, metrics, grads = run(gf.grpo_loss, inputs, dict(options, backend=backend))
    ref_loss, ref_metrics, ref_grads = run(reference.grpo_loss, as_float64(inputs), options)
    assert loss.dtype == torch.float32 and loss.ndim == 0
    assert_close(loss, ref_loss, rtol, atol=1e-7, name="loss")
    assert set(metrics) == set(ref_metrics)
    for key in ref_metrics:
        assert not metrics[key].requires_grad
        assert_close(metrics[key], ref_metrics[key], rtol, atol=1e-6, name=key)
    for key in ref_grads:
        assert grads[key].dtype == inputs[key].dtype
        assert_close(grads[key], ref_grads[key], rtol, atol=grad_atol, name=f"d{key}")
    return loss, grads


@pytest.mark.parametrize("case", sorted(CASES))
def test_variants_match_reference(case, backend):
    batch_kw, use_is_ratio, options = split_case(CASES[case])
    inputs = make_batch(**batch_kw)
    if not use_is_ratio:
        inputs.pop("is_ratio")
    if "old_logps" in options:
        inputs.pop("old_logps")
        options.pop("old_logps")
    if options.get("beta", 0) == 0:
        inputs.pop("ref_logps")
    compare(inputs, options, backend, rtol=1e-5)


@pytest.mark.parametrize("transform", [
    dict(temperature=0.7), dict(logit_scale=1.3), dict(logit_softcap=3.0),
    dict(temperature=1.3, logit_scale=0.8, logit_softcap=2.5),
])
@pytest.mark.parametrize("bias", [False, True])
def test_logit_transform_and_bias(transform, bias, backend):
    inputs = make_batch(bias=bias, seed=1)
    compare(inputs, dict(transform, beta=0.04, entropy_coef=0.02), backend, rtol=1e-5)


@pytest.mark.parametrize("vocab", [1, 37, 2048 + 45])
def test_vocab_sizes(vocab, backend):
    """V of 1, below one block, and not a multiple of the 2048-wide kernel block. At V = 1 every gradient is 0 in
    exact arithmetic, but in fp32 p = exp(z - lse) is 1 only to the rounding of the stored lse: on a GPU the
    contracted z log2(e) - lse log2(e) leaves a residual of about ulp(lse) in each 1 - p, which round-to-nearest
    happens to cancel, and d(weight) sums it over the tokens. Hence an absolute tolerance there (1e-5, against
    gradients of order 1 at any other V)."""
    compare(make_batch(vocab=vocab, seed=2), dict(beta=0.04, entropy_coef=0.01), backend, rtol=1e-5,
            grad_atol=1e-5 if vocab == 1 else 1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype, backend):
    inputs = make_batch(dtype=dtype, seed=3, hidden_size=32, vocab=300)
    compare(inputs, dict(beta=0.04, entropy_coef=0.01), backend, rtol=2e-2)


def test_flat_inputs_are_one_sequence(backend):
    """(N, H) inputs give the loss of a (1, N, H) batch."""
    inputs = make_batch(batch=1, seed=4, per_token_adv=True)
    per_token = ("hidden", "targets", "mask", "advantages", "old_logps", "ref_logps", "is_ratio")
    flat = {k: (v[0] if k in per_token else v) for k, v in inputs.items()}
    for loss_type in ("grpo", "dapo"):
        loss, grads = compare(flat, dict(loss_type=loss_type, beta=0.04), backend, rtol=1e-5)
        batched, _, batched_grads = run(gf.grpo_loss, inputs, dict(loss_type=loss_type, beta=0.04,
                                                                   backend=backend))
        assert_close(loss, batched, 1e-6)
        assert_close(grads["hidden"], batched_grads["hidden"][0], 1e-6)


def test_all_masked_row_and_batch(backend):
    inputs = make_batch(seed=5)
    inputs["mask"][1] = False
    compare(inputs, dict(loss_type="grpo", beta=0.04), backend, rtol=1e-5)
    inputs["mask"][:] = False
    for loss_type, level in [("dapo", "token"), ("grpo", "token"), ("luspo", "sequence")]:
        loss, metrics, grads = run(gf.grpo_loss, inputs, dict(
            loss_type=loss_type, importance_sampling_level=level, beta=0.04, backend=backend))
        assert loss.item() == 0.0
        assert all(torch.isfinite(v) for v in metrics.values())
        for g in grads.values():
            assert torch.count_nonzero(g) == 0


def test_chunking_does_not_change_results(backend):
    inputs = make_batch(seed=6, batch=4, seq=16)
    options = dict(beta=0.04, entropy_coef=0.01, backend=backend)
    one, _, one_grads = run(gf.grpo_loss, inputs, dict(options, chunk_bytes=2**30))
    many, _, many_grads = run(gf.grpo_loss, inputs, dict(options, chunk_bytes=1))   # one token per chunk
    assert_close(many, one, 1e-6)
    # one GEMM against per-token products: the same sums in other orders, each within ~6e-7 of float64
    for key in one_grads:
        assert_close(many_grads[key], one_grads[key], 3e-6, name=f"d{key}")


def test_frozen_weight_gets_no_grad(backend):
    inputs = make_batch(seed=7)
    del inputs["is_ratio"], inputs["ref_logps"]
    hidden = inputs["hidden"].clone().requires_grad_()
    weight = inputs["weight"].clone()
    loss, _ = gf.grpo_loss(hidden, weight, inputs["targets"], inputs["advantages"], inputs["mask"],
                           old_logps=inputs["old_logps"], **grouped(backend=backend))
    loss.backward()
    assert weight.grad is None and hidden.grad is not None
    ref_loss, _, ref_grads = run(reference.grpo_loss, as_float64(inputs), {}, grads=("hidden",))
    assert_close(hidden.grad, ref_grads["hidden"], 1e-5, atol=1e-7)


def test_upstream_gradient_scales(backend):
    inputs = make_batch(seed=8)
    hidden = inputs["hidden"].clone().requires_grad_()
    args = (inputs["weight"], inputs["targets"], inputs["advantages"], inputs["mask"])
    loss, _ = gf.grpo_loss(hidden, *args, old_logps=inputs["old_logps"], **grouped(backend=backend))
    (g1,) = torch.autograd.grad(loss, hidden)
    loss, _ = gf.grpo_loss(hidden, *args, old_logps=inputs["old_logps"], **grouped(backend=backend))
    (g3,) = torch.autograd.grad(-3.0 * loss, hidden)
    assert_close(g3, -3.0 * g1, 1e-6)


def test_module_equals_function(backend):
    inputs = make_batch(seed=9)
    options = dict(loss_type="cispo", epsilon_high=4.0, beta=0.02, temperature=0.9)
    module = gf.GRPOLoss(**grouped(**options, backend=backend))
    loss_m, metrics_m = module(inputs["hidden"], inputs["weight"], inputs["targets"], inputs["advantages"],
                               inputs["mask"], old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"])
    loss_f, metrics_f = gf.grpo_loss(**grouped(**{k: v for k, v in inputs.items() if k not in ("is_ratio", "bias")},
                                               **options, backend=backend))
    assert torch.equal(loss_m, loss_f)
    assert metrics_m.keys() == metrics_f.keys()
    assert "cispo" in repr(module)


CONFIG_OPTIONS = dict(loss_type="grpo", epsilon_high=0.28, delta=1.5, beta=0.04, use_bias_correction_kl=True,
                      entropy_coef=0.01)
TRANSFORM = dict(logit_scale=1.2, logit_softcap=4.0, temperature=0.9)


def trainer_call(fn, inputs, **options):
    """fn called as the trainer calls its loss implementations; returns (loss, metrics, d(hidden, weight, bias))."""
    hidden, weight, bias = (inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
    loss, metrics = flat(fn)(hidden, weight, inputs["targets"], inputs["advantages"], inputs["mask"],
                             old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], is_ratio=inputs["is_ratio"],
                             num_items_in_batch=20, bias=bias, **TRANSFORM, **options)
    return loss, metrics, torch.autograd.grad(loss, (hidden, weight, bias))


def assert_same(actual, expected):
    (loss, metrics, grads), (ref_loss, ref_metrics, ref_grads) = actual, expected
    assert torch.equal(loss, ref_loss)
    assert metrics.keys() == ref_metrics.keys() and all(torch.equal(metrics[k], ref_metrics[k]) for k in metrics)
    assert all(torch.equal(g, r) for g, r in zip(grads, ref_grads))


@pytest.mark.parametrize("fn", [gf.grpo_loss, reference.grpo_loss], ids=["grpo_loss", "reference"])
def test_config_equals_keywords(fn):
    """config=LossConfig(...) gives what the same options as keywords give (torch backend)."""
    inputs = make_batch(seed=10, bias=True)
    config = gf.LossConfig(**CONFIG_OPTIONS)
    assert_same(trainer_call(fn, inputs, config=config, backend="torch"),
                trainer_call(fn, inputs, **CONFIG_OPTIONS, backend="torch"))


def test_module_config_equals_keywords():
    inputs = make_batch(seed=11, bias=True)
    config = gf.LossConfig(**CONFIG_OPTIONS)
    module = gf.GRPOLoss(config=config, **grouped(**TRANSFORM, backend="torch"))
    assert module.config is config
    modules = [module, gf.GRPOLoss(**grouped(**CONFIG_OPTIONS, **TRANSFORM, backend="torch"))]
    results = []
    for module in modules:
        hidden, weight, bias = (inputs[k].clone().requires_grad_() for k in ("hidden", "weight", "bias"))
        loss, metrics = module(hidden, weight, inputs["targets"], inputs["advantages"], inputs["mask"],
                               old_logps=inputs["old_logps"], ref_logps=inputs["ref_logps"], bias=bias,
                               **forward_grouped(is_ratio=inputs["is_ratio"], num_items_in_batch=20))
        results.append((loss, metrics, torch.autograd.grad(loss, (hidden, weight, bias))))
    assert_same(*results)


def test_module_takes_vespo_options():
    options = dict(loss_type="vespo", vespo_k_pos=1.5, vespo_lambda_pos=2.5, vespo_k_neg=2.5, vespo_lambda_neg=1.5)
    assert gf.GRPOLoss(**grouped(**options)).config == gf.LossConfig(**options)


def test_signatures_are_the_sources_and_name_no_loss_option():
    """inspect.signature shows each entry's own parameters (no rewritten signature): grpo_loss's 12, none of them a
    LossConfig field (those live in config=); GRPOLoss's constructor and forward alike."""
    option_names = {field.name for field in dataclasses.fields(gf.LossConfig)}
    for entry in (gf.grpo_loss, gf.token_logprobs, gf.fused_token_loss, gf.GRPOLoss.__init__, gf.GRPOLoss.forward):
        shown = inspect.signature(entry)
        assert shown == inspect.signature(entry.__wrapped__), entry.__qualname__
        assert not option_names & set(shown.parameters), entry.__qualname__
    parameters = inspect.signature(gf.grpo_loss).parameters
    assert len(parameters) <= 12 and list(parameters)[-4:] == ["config", "transform", "weights", "execution"]
    assert parameters["config"].default == "dapo"


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_entropy_mask_narrows_the_bonus(level, backend):
    """checked_policy_loss(entropy_mask=m): the bonus is the mean entropy over the mask's tokens where m is 1 (TRL's
    bonus under its high-entropy filter), the policy term unchanged; float64 reference, both paths (fused, two
    phases)."""
    from grpo_fast.loss import checked_policy_loss
    from grpo_fast.numerics import LogitTransform

    inputs = make_batch(bias=True)
    for name in ("is_ratio", "old_logps", "ref_logps"):     # on-policy: the bonus is not drowned by the ratio terms
        inputs.pop(name)
    narrow = torch.rand(inputs["mask"].shape, generator=torch.Generator().manual_seed(3)) > 0.5
    config = gf.LossConfig(importance_sampling_level=level, entropy_coef=0.3)

    def fused(**tensors):
        return checked_policy_loss(**tensors, config=config, transform=LogitTransform(),
                                   execution=gf.Execution(backend=backend),
                                   entropy_mask=narrow.to(inputs["mask"].device))

    def expected(**tensors):
        policy, metrics = flat(reference.grpo_loss)(**tensors, config=dataclasses.replace(config, entropy_coef=0.0))
        _, entropy = reference.token_logprobs(tensors["hidden"], tensors["weight"], tensors["targets"].clamp(min=0),
                                              bias=tensors["bias"], return_entropy=True)
        bonus_mask = (tensors["mask"] & narrow.to(tensors["mask"].device)).to(entropy.dtype)
        return policy - config.entropy_coef * (entropy * bonus_mask).sum() / bonus_mask.sum(), metrics

    loss, _, grads = run(fused, inputs, {})
    ref_loss, _, ref_grads = run(expected, as_float64(inputs), {})
    assert_close(loss, ref_loss, 1e-5, atol=1e-7, name="loss")
    for key in ref_grads:
        assert_close(grads[key], ref_grads[key], 1e-5, atol=1e-7, name=f"d{key}")
    with pytest.raises(ValueError, match=r"entropy_mask must have shape \(3, 9\) like mask, got \(3, 8\)"):
        checked_policy_loss(**inputs, config=config, transform=LogitTransform(), entropy_mask=narrow[:, :8])


@pytest.mark.parametrize("loss_type", ["dapo", "vespo"])
def test_policy_mask_weighs_the_policy_term_alone(loss_type, backend):
    """checked_policy_loss(policy_mask=m) multiplies each token's policy term by m (TRL's off-policy and
    high-entropy masks): for token-level objectives as an is_ratio of m does, for vespo after its sequence
    weight, which m does not enter (float64 reference, gradients included)."""
    from grpo_fast.loss import checked_policy_loss
    from grpo_fast.numerics import LogitTransform
    from grpo_fast.variants import vespo_weights

    inputs = make_batch(bias=True)
    for name in ("is_ratio", "old_logps", "ref_logps"):
        inputs.pop(name)
    keep = (torch.rand(inputs["mask"].shape, generator=torch.Generator().manual_seed(4)) > 0.4).float()
    config = gf.LossConfig(loss_type=loss_type)

    def fused(**tensors):
        return checked_policy_loss(**tensors, config=config, transform=LogitTransform(),
                                   execution=gf.Execution(backend=backend),
                                   policy_mask=keep.to(tensors["hidden"].device))

    def expected(**tensors):
        if loss_type == "dapo":
            return flat(reference.grpo_loss)(**tensors, config=config, is_ratio=keep.double())
        logp = reference.token_logprobs(tensors["hidden"], tensors["weight"], tensors["targets"].clamp(min=0),
                                        bias=tensors["bias"])
        mask = tensors["mask"].double()
        advantages = tensors["advantages"][:, None]
        phi = vespo_weights(logp.detach(), logp.detach(), advantages, mask, None, config)    # on-policy: w = 1
        return (-phi * advantages * logp * keep.double() * mask).sum() / mask.sum(), {}

    loss, _, grads = run(fused, inputs, {})
    ref_loss, _, ref_grads = run(expected, as_float64(inputs), {})
    assert_close(loss, ref_loss, 1e-5, atol=1e-7, name="loss")
    for key in ref_grads:
        assert_close(grads[key], ref_grads[key], 1e-5, atol=1e-7, name=f"d{key}")
