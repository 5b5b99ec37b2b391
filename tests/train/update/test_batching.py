"""Micro-batches by tokens, packed or padded: the same loss, gradients and log-probs as one padded batch."""

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from grpo_fast.train.update.batching import micro_batch, plan_micro_batches  # noqa: E402
from grpo_fast.train.update.step import Policy, UpdateBatch, accumulate_gradients, completion_logprobs  # noqa: E402
from tests.helpers import flat_config, logprob_sections, update_sections  # noqa: E402


def test_plan_micro_batches():
    assert plan_micro_batches([3, 4, 2, 9, 1], max_tokens=7, max_sequences=8) == [[0, 1], [2], [3], [4]]
    assert plan_micro_batches([3, 4, 2, 9, 1], max_tokens=None, max_sequences=2) == [[0, 1], [2, 3], [4]]
    assert plan_micro_batches([5, 5], max_tokens=10, max_sequences=1) == [[0], [1]]
    with pytest.raises(ValueError, match="max_tokens must be > 0"):
        plan_micro_batches([1], max_tokens=0, max_sequences=1)


def test_packed_layout_points_at_the_predicting_positions():
    generation = pack([[11, 12], [13]], [[21, 22, 23], [24]], [False, False], pad_token_id=0)
    rollout = dict(input_ids=generation.input_ids, attention_mask=generation.attention_mask)
    packed = micro_batch(rollout["input_ids"], rollout["attention_mask"], generation.prompt_length, [0, 1], True)
    assert packed.model_inputs["input_ids"].tolist() == [[11, 12, 21, 22, 23, 13, 24]]
    assert packed.model_inputs["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1]]
    assert packed.hidden_index.tolist() == [[1, 2, 3], [5, 0, 0]]     # the token before each completion token
    padded = micro_batch(rollout["input_ids"], rollout["attention_mask"], generation.prompt_length, [1], False)
    assert padded.model_inputs["input_ids"].tolist() == [[13, 24]] and padded.hidden_index.tolist() == [[0]]


def rollout(seed=0, rows=6, vocab=64):
    """Ragged prompts and completions (some truncated, one a single token), advantages, old and ref log-probs."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in [3, 5, 2, 4, 6, 3][:rows]]
    completions = [torch.randint(1, vocab, (int(n),), generator=generator).tolist() for n in [7, 2, 9, 1, 5, 8][:rows]]
    generation = pack(prompts, completions, [n == 9 for n in map(len, completions)], pad_token_id=0)
    mask = generation.completion_mask
    return UpdateBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                   prompt_length=generation.prompt_length, completion_ids=generation.completion_ids,
                   loss_mask=mask, advantages=torch.randn(rows, generator=generator, dtype=torch.float64),
                   old_logps=(-4 * torch.rand(mask.shape, generator=generator, dtype=torch.float64) - 0.5) * mask,
                   ref_logps=(-4 * torch.rand(mask.shape, generator=generator, dtype=torch.float64) - 0.5) * mask)


def gradients(model, batch, config):
    model.zero_grad(set_to_none=True)
    summed = accumulate_gradients(Policy.of(model), batch, *update_sections(config))
    return summed["loss"], {name: p.grad.clone() for name, p in model.named_parameters()}


CUTS = [dict(packing=True, micro_batch_size=32, micro_batch_tokens=None),      # everything packed in one row
        dict(packing=True, micro_batch_size=32, micro_batch_tokens=14),        # several packed micro-batches
        dict(packing=False, micro_batch_size=2, micro_batch_tokens=None)]      # padded, two rows at a time


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo"])
@pytest.mark.parametrize("cut", range(len(CUTS)))
def test_packed_and_cut_match_one_padded_batch(loss_type, cut):
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=0).double()
    batch = rollout()
    common = dict(loss_type=loss_type, beta=0.05, max_completion_length=9, epsilon_high=0.28,
                  gradient_checkpointing=False)
    whole = flat_config(**common, packing=False, micro_batch_size=32)
    expected_loss, expected = gradients(model, batch, whole)
    loss, got = gradients(model, batch, flat_config(**common, **CUTS[cut]))
    # float64 model; the loss's log-probs are fp32 by design, hence fp32-level tolerances (a wrong normalizer is
    # off by a factor, not by 1e-7)
    assert abs(loss - expected_loss) < 1e-6 * max(1.0, abs(expected_loss)), (loss, expected_loss)
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("cut", range(len(CUTS)))
def test_packed_logprobs_match_padded(cut):
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=1).double()
    batch = rollout(seed=1)
    expected = completion_logprobs(Policy.of(model), batch, *logprob_sections(flat_config(packing=False,
                                                                                       micro_batch_size=32)))
    got = completion_logprobs(Policy.of(model), batch, *logprob_sections(flat_config(**CUTS[cut])))
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    assert (expected[~batch.loss_mask] == 0).all() and (expected[batch.loss_mask] < 0).all()
