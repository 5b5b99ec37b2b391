"""grpo_fast.integrations.openrlhf against OpenRLHF 0.11's own training_step: the patched step (its actor call
and loss call served by one fused pass) gives the same parameter gradients, loss and logged metrics as
OpenRLHF's own step through its Actor (full logits) and PolicyLoss, for its policy-loss options, KL
estimators and IS corrections, on a float64 model (to 1e-6 of each gradient's largest entry: OpenRLHF's Actor
casts its logits to fp32, and compute_approx_kl its log-ratios). Run in OpenRLHF's own environment (.ci/run
builds it); skipped where OpenRLHF is not installed. OpenRLHF imports flash-attn's padding helpers at module
level: openrlhf_support/ holds a plain-torch stand-in for them (see its README), on sys.path for these tests
only."""

import os
import sys
import types

import pytest
import torch

SUPPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "openrlhf_support")
pytest.importorskip("openrlhf")
if SUPPORT not in sys.path:
    sys.path.insert(0, SUPPORT)

from openrlhf.models import Actor, PolicyLoss  # noqa: E402
from openrlhf.trainer.ppo_utils.experience import Experience  # noqa: E402
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer  # noqa: E402

from grpo_fast.integrations import openrlhf as gf_openrlhf  # noqa: E402
from tests.helpers import counting_calls, tiny_model  # noqa: E402

VOCAB = 53


class RecordingStrategy:
    """The three calls training_step makes of OpenRLHF's strategy, on one process without DeepSpeed: backward,
    an optimizer step that records the gradients instead of stepping, and the gradient norm."""

    ring_attn_group = None

    def __init__(self):
        self.grads = None

    def backward(self, loss, model, optimizer, **kwargs):
        loss.backward()

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        self.grads = {n: p.grad.clone() for n, p in model.model.named_parameters() if p.grad is not None}

    def get_grad_norm(self, model):
        return float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.model.parameters()
                                    if p.grad is not None)))


def trainer_for(model, policy_loss: dict, entropy_coef=0.01, kl_coef=0.05, estimator="k3", unbiased=False):
    """OpenRLHF's ActorPPOTrainer around `model` with the attributes training_step reads (its constructor also
    builds a replay buffer and vLLM weight-sync groups, which a training step does not use)."""
    actor = Actor(model, temperature=0.7)
    actor.packing_samples = False
    trainer = object.__new__(ActorPPOTrainer)
    trainer.strategy = RecordingStrategy()
    trainer.actor, trainer.ema_model, trainer.replay_buffer = actor, None, None
    trainer.actor_optim = None
    trainer.actor_scheduler = types.SimpleNamespace(get_last_lr=lambda: [1e-6])
    trainer.actor_loss_fn = PolicyLoss(**policy_loss)
    trainer.aux_loss = False
    trainer.args = types.SimpleNamespace(
        actor=types.SimpleNamespace(entropy_coef=entropy_coef, aux_loss_coef=0.0),
        algo=types.SimpleNamespace(kl=types.SimpleNamespace(use_loss=kl_coef is not None, init_coef=kl_coef or 0.0,
                                                            estimator=estimator, unbiased_gradient=unbiased)),
        train=types.SimpleNamespace(dynamic_batch_enable=False))
    return trainer


def experience(seed=0, batch=3, prompt=5, actions=7):
    """Left-padded prompts and right-padded actions, as OpenRLHF's experience maker lays them out."""
    g = torch.Generator().manual_seed(seed)
    sequences = torch.randint(VOCAB, (batch, prompt + actions), generator=g)
    attention = torch.ones(batch, prompt + actions, dtype=torch.long)
    attention[0, :2] = 0                                   # a shorter prompt
    action_mask = torch.ones(batch, actions, dtype=torch.bool)
    action_mask[1, 4:] = False                             # shorter responses
    action_mask[2, 2:] = False
    attention[1, prompt + 4:] = 0
    attention[2, prompt + 2:] = 0
    old = (-torch.rand(batch, actions, generator=g, dtype=torch.float64) * 3) * action_mask
    old[0, 0] = -40.0                                      # past PolicyLoss's +-20 log-ratio clamp
    return Experience(sequences=sequences, attention_mask=attention, action_mask=action_mask,
                      action_log_probs=old, base_action_log_probs=-torch.rand(batch, actions, generator=g,
                                                                               dtype=torch.float64) * 3,
                      rollout_log_probs=old + 0.1 * torch.randn(batch, actions, generator=g, dtype=torch.float64),
                      advantages=torch.randn(batch, 1, generator=g, dtype=torch.float64).expand(batch, actions).clone(),
                      info={})


def run(step, options, **trainer_options):
    model = tiny_model(VOCAB).double()
    trainer = trainer_for(model, options, **trainer_options)
    status = step(trainer, experience(), 1.0, 0)
    return status, trainer.strategy.grads


CASES = {
    "ppo_token_mean": dict(clip_eps_low=0.2, clip_eps_high=0.28),
    "dual_clip_sample_mean": dict(clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0, token_level_loss=False),
    "token_is_correction": dict(is_correction_level="token", is_correction_mode="clip",
                                is_correction_threshold=(0.8, 1.2)),
    "seq_is_mask": dict(is_correction_level="seq", is_correction_threshold=(0.5, 2.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kl", [("k3", False), ("k1", True), None])
def test_fused_step_equals_openrlhf_step(name, kl):
    trainer_options = {} if kl is None else dict(estimator=kl[0], unbiased=kl[1])
    if kl is None:
        trainer_options["kl_coef"] = None
    expected_status, expected = run(gf_openrlhf._original_training_step, CASES[name], **trainer_options)
    assert ActorPPOTrainer.training_step is gf_openrlhf.training_step          # installed at import
    with counting_calls(gf_openrlhf, "_FusedPass") as fused:
        actual_status, actual = run(ActorPPOTrainer.training_step, CASES[name], **trainer_options)
    assert fused["calls"] == 1
    assert actual.keys() == expected.keys() and len(expected) > 10
    for key, grad in expected.items():
        scale = grad.abs().max().item()
        assert scale > 0, key
        torch.testing.assert_close(actual[key], grad, rtol=1e-6, atol=1e-6 * scale, msg=key)
    metrics, expected_metrics = actual_status["metrics"], expected_status["metrics"]
    assert metrics.keys() == expected_metrics.keys()
    for key, value in expected_metrics.items():
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            torch.testing.assert_close(metrics[key].double(), value.double(), rtol=1e-6, atol=1e-7, msg=key)
        else:
            assert metrics[key] == pytest.approx(value, rel=1e-6), key


def test_gspo_is_left_to_openrlhf_with_a_warning():
    gf_openrlhf._warned.clear()
    with pytest.warns(UserWarning, match="policy_loss_type 'gspo' is not token-separable"):
        status, grads = run(ActorPPOTrainer.training_step, dict(policy_loss_type="gspo"))
    expected_status, expected = run(gf_openrlhf._original_training_step, dict(policy_loss_type="gspo"))
    for key, grad in expected.items():
        torch.testing.assert_close(grads[key], grad, rtol=0, atol=0, msg=key)


def test_version_outside_the_tested_range_is_refused(monkeypatch):
    import importlib

    import openrlhf

    monkeypatch.setattr(openrlhf, "__version__", "0.12.0", raising=False)
    monkeypatch.delitem(sys.modules, "grpo_fast.integrations.openrlhf")
    with pytest.raises(ImportError, match=r"tested with OpenRLHF 0\.11\.x, got 0\.12\.0"):
        importlib.import_module("grpo_fast.integrations.openrlhf")


def test_ray_workers_get_the_patch():
    """`python -m grpo_fast.integrations.openrlhf`'s runtime_env: a Ray worker process (a real local Ray) finds
    OpenRLHF's training_step patched before it runs anything, as OpenRLHF's actor workers would."""
    import ray

    ray.init(num_cpus=1, include_dashboard=False, runtime_env=gf_openrlhf.ray_runtime_env({"PYTHONPATH": SUPPORT}))
    try:
        @ray.remote
        def patched():
            from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer

            return ActorPPOTrainer.training_step.__module__

        assert ray.get(patched.remote(), timeout=300) == "grpo_fast.integrations.openrlhf"
    finally:
        ray.shutdown()


def test_zero3_on_two_ranks():
    """Under DeepSpeed ZeRO-3 on 2 gloo ranks, the actor a DeepSpeed engine with its LM head partitioned (see
    openrlhf_zero3_check.py): the patched step, its sweep inside the engine's forward with the head gathered,
    gives OpenRLHF's own step's full gradients (to 1e-5 of each one's largest entry, fp32) and metrics, with
    dp_size 2 and the all-reduced counts in its normalizers."""
    from tests.helpers import torchrun_json

    result = torchrun_json("tests.integrations.openrlhf_zero3_check")
    assert result["world_size"] == 2
    for case in ("ppo_token_mean", "dual_clip_sample_mean"):
        actual, expected = result[case]["grpo_fast"], result[case]["openrlhf"]
        assert actual["partitioned"] and expected["partitioned"], "the head was not partitioned: the test shows nothing"
        for name, grad in expected["grads"].items():
            grad = torch.tensor(grad)
            assert grad.abs().max() > 0, name
            torch.testing.assert_close(torch.tensor(actual["grads"][name]), grad, rtol=1e-5,
                                       atol=1e-5 * grad.abs().max().item(), msg=f"{case} {name}")
        for key, value in expected["metrics"].items():
            assert actual["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (case, key)
