"""The HF engine's sampler: the right distribution, transformers' top-p set, and draws per prompt that do not
depend on the other prompts of the batched call."""

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train.rollout.sampling import PromptSeededSampler, inverse_cdf_draw, nucleus_mask  # noqa: E402


def test_draws_follow_the_tempered_distribution():
    logits = torch.tensor([[2.0, 0.5, -1.0, 0.0, 1.0, -30.0]])
    rows = 20_000
    sampler = PromptSeededSampler([7], n=rows, temperature=0.7, top_p=1.0)
    scores = sampler(None, logits.expand(rows, -1))
    assert torch.isfinite(scores).sum(1).eq(1).all()              # one choice left for the greedy step
    counts = torch.bincount(scores.argmax(-1), minlength=6).double()
    expected = torch.softmax(logits[0].double() / 0.7, -1) * rows
    chi2 = float(((counts - expected) ** 2 / expected.clamp(min=1e-9)).sum())
    assert chi2 < 25.0, (counts, expected)                           # 5 degrees of freedom: p < 1e-4 by chance
    assert counts[5] == 0


def test_top_p_keeps_transformers_set_and_never_draws_outside_it():
    from transformers.generation.logits_process import TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(64, 50) * 2
    for top_p in (0.3, 0.8, 0.95):
        kept = nucleus_mask(torch.softmax(logits, -1), top_p)
        theirs = torch.isfinite(TopPLogitsWarper(top_p)(None, logits))
        assert torch.equal(kept, theirs)
        sampler = PromptSeededSampler(list(range(8)), n=8, temperature=1.0, top_p=top_p)
        for _ in range(20):
            tokens = sampler(None, logits).argmax(-1)
            assert kept.gather(1, tokens[:, None]).all()


def test_inverse_cdf_never_draws_a_zero_probability_token():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 4)
    tokens = inverse_cdf_draw(probs, torch.tensor([0.0, 0.5, 0.999999, 0.25]))
    assert tokens.tolist() == [3, 1, 1, 3]          # targets 1.0, 0.5, 1e-6, 0.75 of the cumulative sums


def test_a_prompts_completions_do_not_depend_on_the_batch():
    """Prompt a, seeded alike, batched with a shorter and with a longer prompt (so under different left
    padding), in fp64: the same completions; the global random state is left alone."""
    from grpo_fast.train.rollout.engines import HFEngine
    from tests.helpers import arithmetic_policy, flat_config

    model, tokenizer, samples = arithmetic_policy(32)
    model = model.double()
    a, short, long = [5, 9, 3, 7], [4], [6, 2, 8, 1, 1, 3, 5, 2, 9]
    engine = HFEngine(model, tokenizer, flat_config(group_size=3, max_completion_length=10, temperature=1.0).rollout)
    state = torch.get_rng_state()
    first = engine.generate([a, short], seed=100)
    second = engine.generate([long, a], seed=99)                    # a is prompt 1: seed 99 + 1
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(first.completion_ids[:3, :first.completion_mask[:3].sum(1).max()],
                       second.completion_ids[3:, :first.completion_mask[:3].sum(1).max()])
    assert torch.equal(first.completion_mask[:3], second.completion_mask[3:, :first.completion_mask.shape[1]])
    other = engine.generate([a, short], seed=101)
    assert not torch.equal(other.completion_ids[:3], first.completion_ids[:3])     # the seed does move the draws


def test_sampler_checks_its_rows():
    with pytest.raises(ValueError, match="temperature must be > 0"):
        PromptSeededSampler([0], n=2, temperature=0.0, top_p=1.0)
    with pytest.raises(ValueError, match="2 prompts x 2 rows, got 3"):
        PromptSeededSampler([0, 1], n=2, temperature=1.0, top_p=1.0)(None, torch.zeros(3, 5))


def test_top_k_then_top_p_keeps_transformers_set_and_records_it():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from grpo_fast.train.rollout.sampling import kept_mask, top_k_mask

    torch.manual_seed(1)
    logits = torch.randn(64, 50) * 2
    for top_k in (1, 5, 20):
        assert torch.equal(top_k_mask(torch.softmax(logits, -1), top_k),
                           torch.isfinite(TopKLogitsWarper(top_k)(None, logits)))
    for top_k, top_p in ((20, 0.8), (5, 0.95), (0, 0.7)):
        warped = TopPLogitsWarper(top_p)(None, TopKLogitsWarper(top_k)(None, logits) if top_k else logits)
        expected = torch.isfinite(warped)
        assert torch.equal(kept_mask(torch.softmax(logits, -1), top_k, top_p), expected)
        sampler = PromptSeededSampler(list(range(8)), n=8, temperature=1.0, top_p=top_p, top_k=top_k)
        tokens = sampler(None, logits).argmax(-1)
        (pairs,) = sampler.kept_steps                                 # one step: (row, id) of every kept token
        recorded = torch.zeros_like(expected).index_put_((pairs[:, 0], pairs[:, 1]), torch.tensor(True))
        assert torch.equal(recorded, expected)
        assert expected.gather(1, tokens[:, None]).all()
    untruncated = PromptSeededSampler([0], n=2, temperature=1.0, top_p=1.0)
    untruncated(None, logits[:2])
    assert untruncated.kept_steps == []                               # nothing recorded without truncation
