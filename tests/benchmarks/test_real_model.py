"""benchmarks/real_model.py's plain `generate` row on a tiny model: what the HF engine's batched call is measured
against must make the same rows and tokens as the engine's call does."""

import tempfile

import torch

from grpo_fast.benchmarks.real_model import plain_generate
from grpo_fast.train.config import TrainConfig
from grpo_fast.train.rollout.engines import HFEngine
from tests.helpers import arithmetic_policy


def test_plain_generate_makes_the_rows_and_tokens_the_engine_makes():
    model, tokenizer, samples = arithmetic_policy(8)
    prompts = [tokenizer(sample["prompt"])["input_ids"] for sample in samples[:3]]
    model.train()
    output = plain_generate(model, tokenizer, prompts, group_size=2, tokens=5)(seed=0)
    assert model.training                                                         # left as it was
    longest = max(map(len, prompts))
    assert output.shape == (6, longest + 5)
    assert torch.equal(output[:, :longest][::2], output[:, :longest][1::2])       # each prompt's two rows
    with tempfile.TemporaryDirectory() as folder:
        config = TrainConfig.from_keys(group_size=2, ignore_eos=True, max_completion_length=5, output_dir=folder,
                                       device="cpu")
        generation = HFEngine(model, tokenizer, config.rollout).generate(prompts, seed=0)
    assert generation.completion_ids.shape == (6, 5)
    assert torch.equal(generation.input_ids[:, :longest], output[:, :longest])   # the same left-padded rows
