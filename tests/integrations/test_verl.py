"""grpo_fast.integrations.verl against verl 0.9's own code, in float64: the fused actor loss (verl's ppo_loss
evaluated inside the sweep) equals verl's ppo_loss on full logits, loss, metrics and gradients, for every
token-separable policy loss x every loss_agg_mode, with the ratio and KL clamps active, the KL, the entropy bonus,
rollout IS weights and dp_size normalizers; the patched forward's log-probs equal verl's torch backend's, packed.
Run in verl's own environment (.ci/run builds it); skipped where verl is not installed."""

from contextlib import nullcontext
from functools import partial

import pytest
import torch

pytest.importorskip("verl")

from tensordict import TensorDict  # noqa: E402
from verl.models.transformers import dense_common  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402
from verl.workers.utils.padding import left_right_2_no_padding  # noqa: E402

from grpo_fast import Execution  # noqa: E402
from grpo_fast.integrations import verl as gf_verl  # noqa: E402
from tests.helpers import BACKENDS, counting_calls, tiny_model  # noqa: E402  (sets TRITON_INTERPRET before grpo_fast.kernels)

AGG_MODES = ["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"]
MODE_OPTIONS = {"vanilla": {}, "dppo_tv": {}, "dppo_kl": {}, "sapo": {}, "gpg": {}, "cispo": {},
                "dro": {"dro_beta": 0.3}}


def micro_batch(prompt_lens, response_lens, vocab, *, seed=0, dtype=torch.float64, dp_size=1, far=True):
    """A micro-batch as verl's engine gets it: left-right padded rollouts through verl's left_right_2_no_padding,
    with the global batch info a dp_size-rank step would carry (this rank holding 1 / dp_size of the tokens)."""
    g = torch.Generator().manual_seed(seed)
    batch, prompt, response = len(prompt_lens), max(prompt_lens), max(response_lens)
    input_ids = torch.randint(vocab, (batch, prompt + response), generator=g)
    attention = torch.zeros(batch, prompt + response, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        attention[i, prompt - p:prompt + r] = 1
    response_mask = attention[:, prompt:].clone()
    old = -torch.rand(batch, response, generator=g, dtype=dtype) * 3
    ref = -torch.rand(batch, response, generator=g, dtype=dtype) * 3
    if far:     # tokens whose log-ratio passes verl's +-20 clamp and whose low_var_kl passes its +-10 clamp
        old[0, 0], ref[0, 1], ref[-1, 0] = -40.0, -25.0, 15.0
    fields = dict(input_ids=input_ids, attention_mask=attention, response_mask=response_mask,
                  position_ids=(attention.cumsum(-1) - 1).clamp(min=0), prompts=input_ids[:, :prompt],
                  responses=input_ids[:, prompt:], old_log_probs=old,
                  advantages=torch.randn(batch, 1, generator=g, dtype=dtype).expand(batch, response).clone(),
                  ref_log_prob=ref, rollout_is_weights=0.5 + torch.rand(batch, response, generator=g, dtype=dtype))
    data = left_right_2_no_padding(TensorDict(fields, batch_size=[batch]))
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=int(response_mask.sum()) * dp_size,
                         global_batch_size=batch * dp_size)
    return data


def actor_config(loss_mode="vanilla", loss_agg_mode="token-mean", **overrides):
    options = dict(strategy="fsdp2", rollout_n=1, ppo_micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                   ppo_mini_batch_size=4, loss_agg_mode=loss_agg_mode, use_kl_loss=True, kl_loss_coef=0.1,
                   kl_loss_type="low_var_kl", entropy_coeff=0.01, clip_ratio_low=0.2, clip_ratio_high=0.28)
    options.update(overrides)
    return FSDPActorConfig(policy_loss=PolicyLossConfig(loss_mode=loss_mode, **MODE_OPTIONS.get(loss_mode, {})),
                           **options)


def verl_reference(hidden, weight, bias, labels, data, config, temperature, with_entropy):
    """verl's ppo_loss on log-probs and entropies from the full logits (what verl's logits path computes)."""
    logits = (hidden @ weight.T + bias) / temperature
    logp_all = logits.log_softmax(-1)
    out = {"log_probs": torch.nested.nested_tensor_from_jagged(
        logp_all.gather(-1, labels[:, None]).squeeze(-1), data["input_ids"].offsets())}
    if with_entropy:
        entropy = -(logp_all.exp() * logp_all).sum(-1)
        out["entropy"] = torch.nested.nested_tensor_from_jagged(entropy, data["input_ids"].offsets())
    return ppo_loss(config, out, data)


def packed_inputs(data, hidden_size, vocab, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    num_tokens = int(data["input_ids"].offsets()[-1])
    hidden = torch.randn(num_tokens, hidden_size, generator=g, dtype=dtype)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=dtype) * 0.5
    bias = torch.randn(vocab, generator=g, dtype=dtype) * 0.1
    labels = torch.roll(data["input_ids"].values(), shifts=-1)
    return hidden, weight, bias, labels


def metric_values(metrics):
    return {k: float(v.aggregate() if hasattr(v, "aggregate") else v) for k, v in metrics.items()}


def compare(loss_mode, agg_mode, backend, dtype, rtol, with_entropy=True, dp_size=1, **config_overrides):
    vocab, hidden_size = 37, 16
    data = micro_batch([3, 5, 2], [6, 1, 4], vocab, dtype=dtype, dp_size=dp_size)
    config = actor_config(loss_mode, agg_mode, **config_overrides)
    hidden, weight, bias, labels = packed_inputs(data, hidden_size, vocab, dtype)
    temperature = 0.7

    expected_inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    expected, expected_metrics = verl_reference(*expected_inputs, labels, data, config, temperature, with_entropy)
    expected.backward()

    actual_inputs = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    actual, metrics, logp, _ = gf_verl.fused_ppo_loss(
        actual_inputs[0], actual_inputs[1], labels, data, config, bias=actual_inputs[2], temperature=temperature,
        with_entropy=with_entropy,
        execution=Execution(backend=backend, chunk_bytes=4 * 4 * vocab))   # 4 tokens a chunk: several chunks
    actual.backward()

    torch.testing.assert_close(actual.double(), expected.double(), rtol=rtol, atol=rtol * 1e-2)
    assert metric_values(metrics).keys() == metric_values(expected_metrics).keys()
    for key, value in metric_values(expected_metrics).items():
        assert metric_values(metrics)[key] == pytest.approx(value, rel=rtol, abs=rtol * 1e-2), key
    for name, a, e in zip(("hidden", "weight", "bias"), actual_inputs, expected_inputs):
        torch.testing.assert_close(a.grad.double(), e.grad.double(), rtol=rtol, atol=rtol * 1e-2, msg=name)
    return data, config


@pytest.mark.parametrize("agg_mode", AGG_MODES)
@pytest.mark.parametrize("loss_mode", sorted(MODE_OPTIONS))
def test_fused_loss_equals_verl_ppo_loss(loss_mode, agg_mode):
    compare(loss_mode, agg_mode, "torch", torch.float64, rtol=1e-10)


def test_clamps_are_active_in_the_test_batch():
    """The far tokens of micro_batch pass verl's clamps: without them the loss would move (else the parity above
    would not show the clamps are verl's)."""
    vocab = 37
    data = micro_batch([3, 5, 2], [6, 1, 4], vocab)
    near = micro_batch([3, 5, 2], [6, 1, 4], vocab, far=False)
    assert not torch.equal(data["old_log_probs"], near["old_log_probs"])
    hidden, weight, bias, labels = packed_inputs(data, 16, vocab, torch.float64)
    logp = torch.nested.nested_tensor_from_jagged(
        ((hidden @ weight.T + bias) / 0.7).log_softmax(-1).gather(-1, labels[:, None]).squeeze(-1),
        data["input_ids"].offsets())
    from verl.trainer.ppo.core_algos import kl_penalty
    from verl.workers.utils.padding import no_padding_2_padding

    padded = no_padding_2_padding(logp, data)
    mask = data["response_mask"].bool()
    log_ratio = (padded - data["old_log_probs"])[mask]
    assert (log_ratio.abs() > 20).any()
    kl_raw = (data["ref_log_prob"] - padded).exp() - (data["ref_log_prob"] - padded) - 1
    assert (kl_raw[mask].abs() > 10).any()
    assert torch.allclose(kl_penalty(padded, data["ref_log_prob"], "low_var_kl")[mask].abs().max(),
                          torch.tensor(10.0, dtype=torch.float64))


@pytest.mark.parametrize("agg_mode", ["token-mean", "seq-mean-token-sum"])
def test_dp_size_normalizers(agg_mode):
    """A rank of a 4-rank step: verl's dp_size, global token count and global batch size in its normalizers."""
    compare("vanilla", agg_mode, "torch", torch.float64, rtol=1e-10, dp_size=4)


def test_without_entropy_and_kl():
    compare("vanilla", "token-mean", "torch", torch.float64, rtol=1e-10, with_entropy=False, use_kl_loss=False,
            entropy_coeff=0.0)


@pytest.mark.skipif("triton" not in BACKENDS, reason="Triton is not installed")
@pytest.mark.parametrize("loss_mode", ["vanilla", "cispo"])
def test_fused_loss_on_the_triton_kernels(loss_mode):
    """The same through the Triton kernels (the interpreter on CPU, fp32): to fp32's accuracy."""
    compare(loss_mode, "seq-mean-token-mean", "triton", torch.float32, rtol=2e-4)


def test_two_phase_modes_are_refused_by_the_fused_loss():
    data = micro_batch([3, 5, 2], [6, 1, 4], 37)
    hidden, weight, bias, labels = packed_inputs(data, 16, 37, torch.float64)
    for mode in ("gspo", "geo_mean", "clip_cov", "kl_cov", "bypass_mode"):
        with pytest.raises(ValueError, match=f"token-separable .* got loss_mode '{mode}'"):
            gf_verl.fused_ppo_loss(hidden, weight, labels, data, actor_config(mode))
        assert "not token-separable" in gf_verl.fusable(partial(ppo_loss, config=actor_config(mode)))
    assert gf_verl.fusable(partial(ppo_loss, config=actor_config("vanilla"))) is None


def test_patched_forward_equals_verl_torch_backend_packed():
    """verl's use_fused_kernels forward of a tiny Qwen2 on a packed (1, nnz) row: log-probs and entropies and
    their gradients from grpo_fast's head equal the float64 logits path, and verl's own FusedLinearForPPO
    (which computes in fp32) to fp32's accuracy."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    assert dense_common.forward_with_torch_backend is gf_verl.forward_with_grpo_fast      # installed at import
    model = tiny_model(vocab_size=53).double()
    ids = torch.randint(53, (1, 17))
    positions = torch.cat([torch.arange(6), torch.arange(11)])[None]        # two packed sequences
    labels = torch.roll(ids, -1, -1)

    def logits_path(model):
        hidden = dense_common.forward_base_model(model, input_ids=ids, position_ids=positions)[0]
        logp_all = (model.lm_head(hidden) / 0.8).log_softmax(-1)
        return logp_all.gather(-1, labels[..., None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)

    def grads(logp, entropy):
        model.zero_grad()
        (logp.sum() + 0.1 * entropy.sum()).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    expected_logp, expected_entropy = logits_path(model)
    expected_grads = grads(expected_logp, expected_entropy)
    out = gf_verl.forward_with_grpo_fast(model, input_ids=ids, position_ids=positions, return_dict=True,
                                         temperature=0.8)
    actual_grads = grads(out.log_probs, out.entropy)
    torch.testing.assert_close(out.log_probs, expected_logp, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.entropy, expected_entropy, rtol=1e-10, atol=1e-12)
    for name in expected_grads:
        torch.testing.assert_close(actual_grads[name], expected_grads[name], rtol=1e-9, atol=1e-12, msg=name)

    hidden = dense_common.forward_base_model(model, input_ids=ids, position_ids=positions)[0]
    verl_logp, verl_entropy = FusedLinearForPPO().forward(hidden, model.lm_head.weight, labels, temperature=0.8)
    torch.testing.assert_close(verl_logp.double(), out.log_probs.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(verl_entropy.double(), out.entropy.detach(), rtol=1e-5, atol=1e-5)


def test_patched_forward_equals_the_logits_path_padded():
    """The same forward on a padded (B, T) batch with an attention mask (verl's use_remove_padding off)."""
    model = tiny_model(vocab_size=53).double()
    ids = torch.randint(53, (2, 9))
    attention = torch.ones(2, 9, dtype=torch.long)
    attention[1, :3] = 0                                             # a left-padded row
    out = gf_verl.forward_with_grpo_fast(model, input_ids=ids, attention_mask=attention, return_dict=True,
                                         temperature=1.3)
    hidden = dense_common.forward_base_model(model, input_ids=ids, attention_mask=attention)[0]
    logp_all = (model.lm_head(hidden) / 1.3).log_softmax(-1)
    torch.testing.assert_close(out.log_probs, logp_all.gather(-1, torch.roll(ids, -1, -1)[..., None]).squeeze(-1),
                               rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(out.entropy, -(logp_all.exp() * logp_all).sum(-1), rtol=1e-10, atol=1e-12)


def test_head_runs_as_the_module_forward():
    """The head's work goes through lm_head's __call__ (so FSDP2's and ZeRO-3's module hooks gather it), and the
    module's own forward is back after."""
    model = tiny_model(vocab_size=53).double()
    calls = []
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(module))
    gf_verl.forward_with_grpo_fast(model, input_ids=torch.randint(53, (1, 9)), return_dict=True)
    assert calls == [model.lm_head]
    assert "forward" not in model.lm_head.__dict__
    torch.testing.assert_close(model.lm_head(torch.ones(2, 32, dtype=torch.float64)),
                               torch.ones(2, 32, dtype=torch.float64) @ model.lm_head.weight.T)


def test_version_outside_the_tested_range_is_refused(monkeypatch):
    import importlib
    import sys

    import verl

    monkeypatch.setattr(verl, "__version__", "0.10.0")
    monkeypatch.delitem(sys.modules, "grpo_fast.integrations.verl")
    with pytest.raises(ImportError, match=r"tested with verl 0\.9\.x, got verl 0\.10\.0"):
        importlib.import_module("grpo_fast.integrations.verl")


@pytest.mark.parametrize("frozen_head", [False, True])
def test_fused_loss_gemm_passes(frozen_head):
    """3 GEMM passes over the response tokens that count (2 with a frozen head), where verl's fused torch backend
    makes 4: prompt and padding positions never reach the head."""
    from grpo_fast.benchmarks.profiling import GemmCounter

    vocab, hidden_size = 37, 16
    data = micro_batch([3, 5, 2], [6, 1, 4], vocab)
    hidden, weight, bias, labels = packed_inputs(data, hidden_size, vocab, torch.float64)
    hidden.requires_grad_()
    weight.requires_grad_(not frozen_head)
    with GemmCounter() as counter:
        loss, *_ = gf_verl.fused_ppo_loss(hidden, weight, labels, data, actor_config(), with_entropy=True,
                                          execution=Execution(backend="torch", chunk_bytes=4 * 4 * vocab))
        loss.backward()
    counted = int(data["response_mask"].sum())
    assert counter.flops / (2 * counted * hidden_size * vocab) == (2.0 if frozen_head else 3.0)


def cpu_engine(model):
    """verl's FSDPEngineWithLMHead holding `model` unsharded on the CPU: the engine's own methods, without FSDP's
    wrapping, which a single CPU process cannot build."""
    from types import SimpleNamespace

    from verl.utils import torch_functional as verl_F
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    import grpo_fast.integrations.verl_cpu  # noqa: F401  (verl's device layer on the CPU)

    engine = object.__new__(FSDPEngineWithLMHead)
    engine.__dict__.update(module=model, pad_to_length=False, use_ulysses_sp=False, ulysses_device_mesh=None,
                           ulysses_sequence_parallel_size=1, _autocast_dtype=torch.float32,
                           compute_entropy_from_logits=verl_F.entropy_from_logits,
                           engine_config=SimpleNamespace(entropy_checkpointing=False,
                                                         entropy_from_logits_with_chunking=False))
    return engine


def engine_step(model, micro_batch, config, use_fused_kernels, calculate_entropy=True):
    """verl's FSDPEngineWithLMHead.forward_step (as patched, or verl's own where not fusable) on one micro-batch,
    then the backward, on a CPU engine holding `model` unsharded (`cpu_engine`): the loss, verl's metrics and the
    parameters' gradients."""
    engine = cpu_engine(model)
    micro_batch = micro_batch.clone()
    tu.assign_non_tensor(micro_batch, use_remove_padding=True, use_fused_kernels=use_fused_kernels,
                         calculate_entropy=calculate_entropy, temperature=0.8)
    model.zero_grad()
    loss, output = engine.forward_step(micro_batch, loss_function=partial(ppo_loss, config=config),
                                       forward_only=False)
    loss.backward()
    return loss.detach(), metric_values(output["metrics"]), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("loss_mode", ["vanilla", "gspo"])
def test_engine_forward_step_fused_and_two_phase_equal_the_logits_path(loss_mode):
    """Through verl's engine code: with use_fused_kernels, vanilla runs fused inside grpo_fast's sweep and gspo
    (not token-separable) runs verl's loss on grpo_fast's log-probs, with one warning; both equal verl's own
    logits path (use_fused_kernels off) in loss, metrics and every parameter's gradient (to 1e-6 of each gradient's
    largest entry: verl's logits path computes its log-probs in fp32 even for an fp64 model)."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends

    vocab = 53
    data = micro_batch([3, 5, 2], [6, 1, 4], vocab, far=False)
    config = actor_config(loss_mode, "seq-mean-token-mean")
    model = tiny_model(vocab_size=vocab).double()
    original_forward = type(model).forward
    expected = engine_step(model, data, config, use_fused_kernels=False)
    try:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        assert type(model).forward is gf_verl.forward_with_grpo_fast
        gf_verl._warned.clear()
        with counting_calls(gf_verl, "fused_ppo_loss") as fused, \
                pytest.warns(UserWarning, match="not token-separable") if loss_mode == "gspo" else nullcontext():
            actual = engine_step(model, data, config, use_fused_kernels=True)
    finally:
        type(model).forward = original_forward
    assert fused["calls"] == (1 if loss_mode == "vanilla" else 0)
    torch.testing.assert_close(actual[0].double(), expected[0].double(), rtol=1e-7, atol=1e-9)
    assert actual[1].keys() == expected[1].keys()
    for key, value in expected[1].items():
        assert actual[1][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    for name, grad in expected[2].items():
        scale = grad.abs().max().item()
        assert scale > 0, name
        torch.testing.assert_close(actual[2][name], grad, rtol=1e-6, atol=1e-6 * scale, msg=name)


def old_log_prob_outputs(model, micro_batch, use_fused_kernels, use_remove_padding=True):
    """verl's compute_log_prob forward (forward_step, forward only) with calculate_sum_pi_squared, as verl's
    trainer asks for it under the optimal token baseline: log-probs, entropies and sum p^2, (B, response) each."""
    from verl.workers.utils.padding import no_padding_2_padding

    micro_batch = micro_batch.clone()
    tu.assign_non_tensor(micro_batch, use_remove_padding=use_remove_padding, use_fused_kernels=use_fused_kernels,
                         calculate_entropy=True, calculate_sum_pi_squared=True, temperature=0.8, compute_loss=False)
    with torch.no_grad():
        _, output = cpu_engine(model).forward_step(micro_batch, loss_function=None, forward_only=True)
    return {key: no_padding_2_padding(output["model_output"][key], micro_batch).double()
            for key in ("log_probs", "entropy", "sum_pi_squared")}


@pytest.mark.parametrize("use_remove_padding", [True, False], ids=["packed", "padded"])
def test_optimal_token_baseline_runs_with_fused_kernels_and_equals_verls_logits_path(use_remove_padding):
    """verl's optimal token baseline (OTB) needs each token's sum_v p_v^2 from the old-log-prob forward; verl's own
    fused kernels refuse it ("do not materialize the full logits"). grpo_fast's forward returns it from the same
    sweep: old log-probs, entropies and sum p^2 equal verl's logits path (use_fused_kernels off), and so do the
    OTB advantages verl's `compute_optimal_token_baseline_advantage` builds from them, on a fixed batch of two
    prompt groups. verl's logits path works in fp32 even for an fp64 model: equal to 1e-6."""
    from verl.models.transformers.monkey_patch import patch_forward_with_backends
    from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage

    vocab, responses = 53, [6, 1, 4, 5, 3, 6]
    data = micro_batch([3, 5, 2, 4, 3, 2], responses, vocab, far=False, seed=4)
    model = tiny_model(vocab_size=vocab).double()
    with torch.no_grad():
        model.lm_head.weight.mul_(60.0)             # from near-uniform rows to peaked ones: sum p^2 spreads out
    original_forward = type(model).forward
    expected = old_log_prob_outputs(model, data, use_fused_kernels=False, use_remove_padding=use_remove_padding)
    try:
        patch_forward_with_backends(model, use_fused_kernels=True, fused_kernels_backend="torch")
        assert type(model).forward is gf_verl.forward_with_grpo_fast
        with counting_calls(gf_verl, "token_logprobs") as head:
            actual = old_log_prob_outputs(model, data, use_fused_kernels=True, use_remove_padding=use_remove_padding)
    finally:
        type(model).forward = original_forward
    assert head["calls"] == 1
    response_mask = torch.zeros_like(expected["log_probs"])
    for row, length in enumerate(responses):
        response_mask[row, :length] = 1
    for key, value in expected.items():
        torch.testing.assert_close(actual[key] * response_mask, value * response_mask, rtol=1e-6, atol=1e-7,
                                   msg=key)
    sums = expected["sum_pi_squared"][response_mask.bool()]
    assert sums.max() > 3 * sums.min()

    rewards = torch.zeros_like(response_mask)
    last = response_mask.sum(1).long() - 1
    rewards[torch.arange(len(last)), last] = torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 0.2], dtype=rewards.dtype)
    index = ["a", "a", "a", "b", "b", "b"]

    def otb(outputs, sum_pi_squared=None):
        return compute_optimal_token_baseline_advantage(
            rewards, response_mask, index, outputs["log_probs"],
            outputs["sum_pi_squared"] if sum_pi_squared is None else sum_pi_squared)

    (want, returns), (got, _) = otb(expected), otb(actual)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    baseline = (returns - want) * response_mask
    assert baseline.abs().max() > 0.05                                    # a baseline, not the returns alone
    # the baseline depends on sum p^2: without it (as if fused kernels surfaced none) it differs
    assert (otb(expected, torch.zeros_like(response_mask))[0] - want).abs().max() > 1e-3


def test_fsdp2_engine_on_two_ranks():
    """verl's FSDP2 actor engine on 2 gloo ranks with an untied head sharded as its own unit (see
    verl_engine_check.py): grpo_fast fused (vanilla) and two-phase (gspo) equal verl's logits path in verl's
    metrics and every parameter's gradient (fp32: 1e-5 of each gradient's largest entry), with dp_size 2 in the
    normalizers, and infer_batch's old log-probs equal; verl's own fused forward fails there, reading the
    sharded head's weight outside the module (the reason grpo_fast's head runs as lm_head's forward)."""
    import tempfile

    from tests.helpers import torchrun_json

    with tempfile.TemporaryDirectory() as output_dir:
        result = torchrun_json("tests.integrations.verl_engine_check", output_dir)
    assert result["world_size"] == 2
    assert result["grpo_fast"]["lm_head_is_own_unit"]
    assert "mixed torch.Tensor and DTensor" in result["verl_fused"], result["verl_fused"]
    for mode in ("vanilla", "gspo"):
        actual, expected = result["grpo_fast"][mode], result["logits"][mode]
        assert actual["fused_calls"] == (2 if mode == "vanilla" else 0)        # 2 micro-batches on rank 0
        assert actual["metrics"].keys() == expected["metrics"].keys()
        for key, values in expected["metrics"].items():
            assert actual["metrics"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), (mode, key)
        for name, grad in expected["grads"].items():
            grad = torch.tensor(grad)
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(torch.tensor(actual["grads"][name]), grad, rtol=1e-5,
                                       atol=1e-5 * grad.abs().max().item(), msg=f"{mode} {name}")
    torch.testing.assert_close(torch.tensor(result["grpo_fast"]["infer_log_probs"]),
                               torch.tensor(result["logits"]["infer_log_probs"]), rtol=1e-5, atol=1e-5)


def test_ulysses_runs_verls_own_loss_with_one_warning():
    """With Ulysses sequence parallelism each rank's forward holds a shard of the micro-batch's tokens, and the
    fused loss needs all of them: the engine step is verl's own (its loss on grpo_fast's gathered log-probs)."""
    engine = cpu_engine(tiny_model(vocab_size=53))
    data = micro_batch([3, 5, 2], [6, 1, 4], 53, far=False)
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=True)
    loss_function = partial(ppo_loss, config=actor_config())
    assert "Ulysses" not in gf_verl._unfusable_reason(engine, data, loss_function, forward_only=False)
    engine.use_ulysses_sp = True
    assert gf_verl._unfusable_reason(engine, data, loss_function, forward_only=False) == \
        "Ulysses sequence parallelism (the loss needs the gathered log-probs)"


def test_ulysses_attention_check():
    """Under Ulysses grpo_fast's forward accepts the attentions that run transformers' flash-attention forward
    (where verl's exchange lives) and refuses the others in one line naming the one given."""
    from types import SimpleNamespace

    gf_verl.check_ulysses_attention(SimpleNamespace(_attn_implementation="flash_attention_2"))
    for implementation in ("sdpa", "eager", "flex_attention"):
        with pytest.raises(ValueError, match=f"under Ulysses .* got '{implementation}'$"):
            gf_verl.check_ulysses_attention(SimpleNamespace(_attn_implementation=implementation))


def close_to_verl(actual: dict, expected: dict, initial: dict, label: str):
    """One engine's run of verl_ulysses_check.py against another's: infer_batch's log-probs, entropies and sum p^2
    before and after the update to 1e-5, verl's metrics to 1e-5 relative, every gradient to 1e-5 of its largest
    entry, and the updated weights to 1e-5 of each tensor's change plus one fp32 rounding of its largest entry
    (the norms' weights are near 1)."""
    for when in ("before", "after"):
        for key, values in expected[when].items():
            torch.testing.assert_close(torch.tensor(actual[when][key]), torch.tensor(values), rtol=1e-5, atol=1e-5,
                                       msg=f"{label} {when} {key}")
    assert actual["metrics"].keys() == expected["metrics"].keys()
    for key, values in expected["metrics"].items():
        assert actual["metrics"][key] == pytest.approx(values, rel=1e-5, abs=1e-6), (label, key)
    for name, grad in expected["grads"].items():
        grad = torch.tensor(grad)
        torch.testing.assert_close(torch.tensor(actual["grads"][name]), grad, rtol=0,
                                   atol=1e-5 * grad.abs().max().item(), msg=f"{label} gradient {name}")
        weight, start = torch.tensor(expected["weights"][name]), torch.tensor(initial[name])
        atol = 1e-5 * (weight - start).abs().max().item() + torch.finfo(torch.float32).eps * start.abs().max().item()
        torch.testing.assert_close(torch.tensor(actual["weights"][name]), weight, rtol=0, atol=atol,
                                   msg=f"{label} weight {name}")


def test_fsdp2_engine_ulysses_on_two_ranks():
    """verl's FSDP2 engine with ulysses_sequence_parallel_size 2 on 2 gloo ranks (verl_ulysses_check.py): with
    grpo_fast's forward (use_fused_kernels) each rank's head computes its shard's log-probs, which verl gathers,
    and the actor loss is verl's own with one warning naming Ulysses; infer_batch's log-probs, entropies and sum p^2,
    the update's metrics, gradients and weights, and the log-probs after it equal verl's own logits path under
    Ulysses, which equals verl without sequence parallelism. Ulysses lives in verl's flash-attention wrapper: on sdpa
    each rank attends within its shard and verl's log-probs differ, where grpo_fast's forward refuses sdpa in one
    line (the check runs flash-attention's varlen path on the CPU, see its docstring)."""
    import tempfile

    from tests.helpers import torchrun_json

    with tempfile.TemporaryDirectory() as output_dir:
        result = torchrun_json("tests.integrations.verl_ulysses_check", output_dir)
    assert result["world_size"] == 2
    runs = {name: result[name] for name in ("sp1", "verl_sp2", "sdpa_sp2", "grpo_fast_sp2")}
    for name, run in runs.items():
        assert run["same_initial_weights"], name
        assert run["use_ulysses_sp"] == (name != "sp1"), name
    fused, verl, reference = runs["grpo_fast_sp2"], runs["verl_sp2"], runs["sp1"]
    assert fused["forward"] == gf_verl.__name__ and verl["forward"].startswith("transformers.")
    assert fused["head_calls"] == 2 and fused["fused_calls"] == 0          # 2 micro-batches, verl's loss on each
    assert len(fused["warnings"]) == 1 and "because Ulysses sequence parallelism" in fused["warnings"][0]
    close_to_verl(fused, verl, result["initial"], "grpo_fast under Ulysses against verl's own")
    close_to_verl(verl, reference, result["initial"], "verl under Ulysses against one rank's sequences")
    # live: the update moved the policy, clipped ratios; sdpa under verl's Ulysses attends within each shard
    moved = torch.tensor(reference["after"]["log_probs"]) - torch.tensor(reference["before"]["log_probs"])
    assert moved.abs().max() > 0.1 and reference["metrics"]["actor/pg_clipfrac"][0] > 0
    wrong = torch.tensor(runs["sdpa_sp2"]["before"]["log_probs"]) - torch.tensor(reference["before"]["log_probs"])
    assert wrong.abs().max() > 1e-2
    assert result["grpo_fast_sdpa_sp2"].startswith("attn_implementation must run transformers' flash-attention "
                                                   "forward under Ulysses"), result["grpo_fast_sdpa_sp2"]
    assert result["grpo_fast_sdpa_sp2"].endswith("got 'sdpa'")


def test_bench_row_of_verls_fused_head():
    """`grpo-fast bench`'s verl row (FusedLinearForPPO, then the same loss math as every row) computes the loss
    and gradients the others do, in 4 GEMM passes (its backward recomputes the logits)."""
    from grpo_fast.benchmarks import harness

    result = harness.check("verl", torch.float32, "cpu")
    assert result["loss_error"] < 1e-5 and result["grad_error"] < 1e-5, result
    assert result["gemm_passes"] == 4.0, result


def test_engine_benchmark_rows_agree(tmp_path):
    """benchmarks/verl_engine.py at a tiny shape: the three rows (verl's logits path, verl's fused backend,
    grpo_fast) each ran verl's train_batch and report the same first loss."""
    import json
    import subprocess
    import sys

    from tests.helpers import ROOT

    done = subprocess.run([sys.executable, "-m", "grpo_fast.benchmarks.verl_engine", "--vocab", "512", "--hidden",
                           "64", "--response-tokens", "24", "--prompt-tokens", "8", "--steps", "1", "--out",
                           str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "verl_engine.json").read_text())["rows"]
    assert [row["row"] for row in rows] == ["logits", "verl_fused", "grpo_fast"]
    assert all("error" not in row for row in rows), rows
    assert rows[1]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)
    assert rows[2]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-5)
    assert "| grpo_fast |" in (tmp_path / "verl_engine.md").read_text()


# ------------------------------------------------------------------------------------------- Megatron's head
def full_head_reference(hidden, weight, labels, temperature, dlogp, dentropy):
    """Float64 log-probs, entropies and the gradients of sum(dlogp * logp + dentropy * entropy) on full logits."""
    hidden, weight = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = hidden.reshape(-1, hidden.shape[-1]) @ weight.T / temperature
    log_softmax = logits.log_softmax(-1)
    logp = log_softmax.gather(-1, labels.reshape(-1, 1))[:, 0]
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    ((logp * dlogp).sum() + (entropy * dentropy).sum()).backward()
    return logp.detach(), entropy.detach(), hidden.grad, weight.grad


def test_megatron_fused_forwards_call_grpo_fast():
    """With megatron.core installed, both of verl's Megatron fused forwards call grpo_fast's head."""
    pytest.importorskip("megatron.core")
    from verl.models.mcore import model_forward_1f1b_overlap, model_forward_fused

    assert model_forward_fused.linear_cross_entropy is gf_verl.megatron_linear_cross_entropy
    assert model_forward_1f1b_overlap.linear_cross_entropy is gf_verl.megatron_linear_cross_entropy


def test_megatron_linear_cross_entropy_on_one_rank():
    """verl's call as its Megatron forward makes it without tensor parallelism ((S, 1, H) hidden, (1, S) labels,
    reduction "none", a group of one): flattened fp32 log-probs and entropies and both gradients equal the float64
    full-logits reference."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, 1, 8, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(29, 8, generator=g, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(29, (1, 11), generator=g)
    dlogp, dentropy = (torch.randn(11, generator=g, dtype=torch.float64) for _ in range(2))
    logp, entropy = gf_verl.megatron_linear_cross_entropy(hidden, weight, labels, 0.6, "none", None)
    ((logp * dlogp).sum() + (entropy * dentropy).sum()).backward()
    expected = full_head_reference(hidden, weight, labels, 0.6, dlogp, dentropy)
    assert logp.shape == entropy.shape == (11,)
    for actual, reference in zip((logp, entropy, hidden.grad, weight.grad), expected):
        torch.testing.assert_close(actual.double(), reference, rtol=1e-6, atol=1e-6)


def test_megatron_linear_cross_entropy_refuses_what_it_does_not_compute():
    hidden, weight = torch.randn(4, 1, 8), torch.randn(29, 8)
    with pytest.raises(ValueError, match="reduction must be 'none'.*'mean'"):
        gf_verl.megatron_linear_cross_entropy(hidden, weight, torch.zeros(1, 4, dtype=torch.long), 1.0, "mean")
    with pytest.raises(ValueError, match="one id per hidden row, 4, got 5"):
        gf_verl.megatron_linear_cross_entropy(hidden, weight, torch.zeros(1, 5, dtype=torch.long))


def test_megatron_head_on_two_tensor_parallel_ranks():
    """megatron_head_check.py: megatron.core's parallel_state at tensor-parallel size 2 over gloo, each rank's slice
    of the sequence through megatron's sequence-parallel gather, then verl's Megatron call on an uneven vocabulary
    split (20 / 17 rows): every rank gets the full log-probs and entropies, its own rows of d(weight), and after the
    gather's reduce-scatter backward the full d(hidden) of its slice of the sequence (float64 reference)."""
    pytest.importorskip("megatron.core")
    from tests.helpers import torchrun_json

    result = torchrun_json("tests.integrations.megatron_head_check")
    assert result["world_size"] == 2 and result["patched"] == "grpo_fast.integrations.verl"
    hidden, weight, labels, dlogp, dentropy = (torch.tensor(value, dtype=None if i == 2 else torch.float64)
                                               for i, value in enumerate(result["inputs"]))
    logp, entropy, dhidden, dweight = full_head_reference(hidden, weight, labels, result["temperature"], dlogp,
                                                          dentropy)
    for rank, (mine, rows, sequence) in enumerate(zip(result["ranks"], dweight.split(result["split"]),
                                                      dhidden.chunk(2, dim=0))):
        assert mine["logp_shape"] == [hidden.shape[0]], rank
        torch.testing.assert_close(torch.tensor(mine["logp"], dtype=torch.float64), logp, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine["entropy"], dtype=torch.float64), entropy, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine["dweight"], dtype=torch.float64), rows, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine["dhidden"], dtype=torch.float64), sequence, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------- examples/verl_grpo.py
def test_verl_grpo_example_composes_against_verls_own_config(tmp_path):
    """examples/verl_grpo.py's main_ppo overrides compose against verl's own hydra config (an unknown or misspelt
    key fails here, as it would in main_ppo) and pass verl's validate_config; the composed actor config is one
    grpo_fast fuses; its parquet files load through verl's RLHFDataset with the saved tokenizer, and its reward
    scores what it should."""
    import importlib.util
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from transformers import AutoTokenizer
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("verl_grpo", os.path.join(ROOT, "examples", "verl_grpo.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    paths = example.build_inputs(str(tmp_path), num_train=64, num_val=8)
    assert paths == example.input_paths(str(tmp_path))
    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        config = compose("ppo_trainer", overrides=example.overrides(str(tmp_path), paths))
    model = config.actor_rollout_ref.model
    assert (model.external_lib, model.use_fused_kernels, model.use_remove_padding) == (gf_verl.__name__, True, True)
    assert model.fused_kernel_options.impl_backend == "torch" and config.algorithm.adv_estimator == "grpo"
    validate_config(config, use_reference_policy=True, use_critic=False)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert gf_verl.fusable(partial(ppo_loss, config=actor)) is None

    tokenizer = AutoTokenizer.from_pretrained(paths["model"])
    dataset = RLHFDataset(paths["train"], tokenizer, config.data)
    assert len(dataset) == 64
    row = dataset[0]
    assert row["raw_prompt"][0]["content"].endswith("=") and row["data_source"] == example.DATA_SOURCE
    answer = row["reward_model"]["ground_truth"]
    assert example.compute_score(row["data_source"], f" {answer}\n", answer) == 1.0
    assert example.compute_score(row["data_source"], f"{answer}0", answer) == 0.0
    assert example.partial_score(row["data_source"], f" {answer}\n", answer) == 1.0
    assert 0 < example.partial_score(row["data_source"], f"{answer}0", answer) < 1
    assert example.partial_score(row["data_source"], "", answer) == 0.0
    # the CPU job's overrides and verl's own mode compose too
    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        cpu = compose("ppo_trainer", overrides=example.overrides(str(tmp_path), paths, "verl") + example.CPU_OVERRIDES)
    validate_config(cpu, use_reference_policy=True, use_critic=False)
    assert cpu.actor_rollout_ref.model.get("external_lib") is None and not cpu.actor_rollout_ref.model.use_fused_kernels
    assert cpu.actor_rollout_ref.actor.strategy == "fsdp2" and cpu.ray_kwargs.ray_init.num_gpus == 1


def test_verl_grpo_example_optimal_token_baseline_composes_on_the_legacy_trainer(tmp_path):
    """examples/verl_grpo.py with verl's optimal token baseline and trainer.use_v1=False (the trainer that asks the
    actor for each token's sum of p^2): the overrides it adds compose against verl's config and pass
    validate_config, the actor asks for the sum, and grpo_fast still fuses its loss."""
    import importlib.util
    import os

    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    from tests.helpers import ROOT

    spec = importlib.util.spec_from_file_location("verl_grpo", os.path.join(ROOT, "examples", "verl_grpo.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    extra = ["algorithm.adv_estimator=optimal_token_baseline", "trainer.use_v1=False"]
    extra += example.optimal_token_baseline_overrides(extra)
    paths = example.input_paths(str(tmp_path))
    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        config = compose("ppo_trainer", overrides=example.overrides(str(tmp_path), paths) + extra)
    validate_config(config, use_reference_policy=True, use_critic=False)
    assert config.trainer.use_v1 is False and config.algorithm.adv_estimator == "optimal_token_baseline"
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    assert actor.calculate_sum_pi_squared and gf_verl.fusable(partial(ppo_loss, config=actor)) is None
    with pytest.raises(ValueError, match="needs trainer.use_v1=False"):
        example.optimal_token_baseline_overrides(extra[:1])


def test_cpu_platform_answers_what_verl_asks_of_a_device():
    """verl's workers on a CPU host (grpo_fast.integrations.verl_cpu): Ray places them by its "GPU" resource (verl
    counts no other; "CPU" is refused as a custom resource), the device module answers verl's memory queries,
    process groups are gloo alone (verl's `cpu:gloo,<device>:<backend>` would name the CPU twice) and the
    reference model's CPU offload does not pin memory (which needs a CUDA driver)."""
    import os

    from verl.plugin.platform.platform_manager import get_platform
    from verl.utils import distributed, fsdp_utils
    from verl.utils.device import get_device_name, get_torch_device

    import grpo_fast.integrations.verl_cpu  # noqa: F401

    platform = get_platform()
    assert get_device_name() == "cpu"
    assert platform.ray_resource_name() == "GPU" and platform.ray_resource_options(1) == {"num_gpus": 1}
    device = get_torch_device()
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        assert getattr(device, name)() > 0, name
    free, total = device.mem_get_info()
    assert 0 < free <= total
    assert device.get_device_name() == "cpu" and device.device_count() >= 1
    device.empty_cache(), device.ipc_collect(), device.set_per_process_memory_fraction(0.5)
    state = device.get_rng_state()
    first = torch.rand(3)
    device.set_rng_state(state)
    assert torch.equal(torch.rand(3), first)
    assert fsdp_utils.CPUOffloadPolicy(pin_memory=True).pin_memory is False
    from tests.helpers import free_port

    saved = {key: os.environ.get(key) for key in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    try:
        distributed.initialize_global_process_group_ray()
        assert torch.distributed.get_backend() in ("gloo", "cpu:gloo")
        total_ = torch.ones(2)
        torch.distributed.all_reduce(total_)
        assert torch.equal(total_, torch.ones(2))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
