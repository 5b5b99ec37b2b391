"""The rollout correction from the update's own forward (one iteration per step): the same ratio and gradients as
the separate no-grad forward that computes old log-probs first, without that forward."""

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from grpo_fast.train.update import step  # noqa: E402
from grpo_fast.train.update.correction import importance_weights  # noqa: E402
from grpo_fast.train.update.step import Policy, UpdateBatch, accumulate_gradients, update_batch  # noqa: E402
from tests.helpers import flat_config, logprob_sections, update_sections  # noqa: E402


def model():
    return tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=0).double()


def generation(policy, config):
    """Ragged rows (one truncated) whose engine log-probs are the policy's own, moved by up to +-3%: enough for a
    cap of 1.02 and a floor of 0.98 to act on some tokens and not others."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in [3, 5, 2, 4, 6, 3]]
    completions = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in [7, 2, 9, 1, 5, 8]]
    rollout = pack(prompts, completions, [len(c) == 9 for c in completions], pad_token_id=0)
    plain = UpdateBatch(rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rollout.completion_ids,
                        rollout.completion_mask, torch.zeros(6, dtype=torch.float64))
    own = step.completion_logprobs(policy, plain, *logprob_sections(config))
    noise = 0.03 * (2 * torch.rand(own.shape, generator=generator, dtype=torch.float64) - 1)
    rollout.sampling_logps = ((own + noise) * rollout.completion_mask).float()
    return rollout


def batch_sections(config) -> tuple:
    return (config.scoring, config.correction, config.optimization, config.batching, config.rollout.temperature)


def gradients(policy, batch, config):
    policy.model.zero_grad(set_to_none=True)
    summed = accumulate_gradients(policy, batch, *update_sections(config))
    return summed, {name: p.grad.clone() for name, p in policy.model.named_parameters()}


@pytest.mark.parametrize("mode", ["sequence_mask", "token_truncate"])
@pytest.mark.parametrize("micro_batch_size", [13, 3])           # one micro-batch, or groups cut in two
def test_own_forward_correction_equals_the_separate_forward_in_float64(mode, micro_batch_size, monkeypatch):
    config = flat_config(loss_type="dapo", importance_sampling=mode, importance_sampling_cap=1.02,
                         importance_sampling_min=0.98, micro_batch_size=micro_batch_size, group_size=2,
                         max_completion_length=9, num_iterations=1, gradient_checkpointing=True)
    policy = Policy.of(model())
    rollout = generation(policy, config)
    advantages = torch.randn(6, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    # before: old log-probs from a forward of their own, then the ratio
    separate = UpdateBatch(rollout.input_ids, rollout.attention_mask, rollout.prompt_length, rollout.completion_ids,
                           rollout.completion_mask, advantages)
    separate.old_logps = step.completion_logprobs(policy, separate, *logprob_sections(config))
    separate.is_ratio = importance_weights(separate.old_logps, rollout.sampling_logps, rollout.completion_mask, mode,
                                           1.02, 0.98)
    # on-policy the PPO ratio is exp(logp - old_logps) = 1 but for the fp32 rounding of the stored old log-probs
    # (about 1e-8), which the own forward does not have: the reference takes the ratio and leaves them out
    separate.old_logps = None
    expected, expected_grads = gradients(policy, separate, config)

    def no_separate_forward(*args, **kwargs):
        raise AssertionError("the update's own forward gives the old log-probs: no separate forward")

    monkeypatch.setattr(step, "completion_logprobs", no_separate_forward)
    batch = update_batch(rollout, advantages, policy, None, *batch_sections(config))
    assert batch.old_logps is None and batch.is_ratio is None and batch.sampling_logps is rollout.sampling_logps
    summed, grads = gradients(policy, batch, config)

    mask = rollout.completion_mask
    ratio = separate.is_ratio[mask]
    if mode == "sequence_mask":               # some sequences kept, some masked
        assert (ratio == 0).any() and (ratio > 0).any()
    else:                                     # both bounds act, and some tokens lie between them
        assert (ratio == 1.02).any() and (ratio == 0.98).any() and ((ratio > 0.98) & (ratio < 1.02)).any()
    # on the loss's tokens (off them the loss never reads it); fp32 ratios, as before
    torch.testing.assert_close(batch.is_ratio[mask], ratio, rtol=0, atol=1e-6)
    for name in expected:
        assert abs(summed[name] - expected[name]) <= 1e-10 * max(1.0, abs(expected[name])), name
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)
    assert any(g.abs().sum() > 0 for g in grads.values())


def test_several_iterations_keep_the_separate_forward():
    """With num_iterations > 1 the later iterations need the sampling policy's log-probs, which only a forward
    before the first update has: the old path stays, and is_ratio is set before the update."""
    config = flat_config(loss_type="dapo", importance_sampling="token_truncate", importance_sampling_cap=1.02,
                         importance_sampling_min=0.98, micro_batch_size=4, group_size=2, max_completion_length=9,
                         num_iterations=2)
    policy = Policy.of(model())
    rollout = generation(policy, config)
    batch = update_batch(rollout, torch.ones(6, dtype=torch.float64), policy, None,
                         *batch_sections(config))
    assert batch.sampling_logps is None and batch.old_logps is not None
    torch.testing.assert_close(batch.is_ratio, importance_weights(batch.old_logps, rollout.sampling_logps,
                                                                  rollout.completion_mask, "token_truncate",
                                                                  1.02, 0.98))
