"""One forward per group's prompt (TrainConfig.share_prompts): a packed micro-batch holds each group's prompt once
and every completion attends to it; hidden states, log-probs, the loss and every gradient equal each sequence
computed alone, in float64, on Llama and Qwen2."""

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast import packed_attention as attention  # noqa: E402
from grpo_fast.train.distributed import HiddenStates  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.update import batching  # noqa: E402
from grpo_fast.train.update.step import (  # noqa: E402
    Policy,
    UpdateBatch,
    accumulate_gradients,
    completion_logprobs,
    shares_prompts,  # noqa: E402
)
from tests.helpers import (  # noqa: E402
    flat_config,
    float64_norms,
    grouped_generation,
    logprob_sections,
    update_sections,
)

PROMPTS = [13, 9, 15, 7]                    # three groups of four and a group of one
COMPLETIONS = [[11, 1, 7, 12], [5, 9, 9, 3], [14, 2, 8, 6], [10]]


def grouped_rollout(vocab=64, seed=0) -> UpdateBatch:
    generator = torch.Generator().manual_seed(seed)
    generation = grouped_generation(PROMPTS, COMPLETIONS, vocab, generator)
    return UpdateBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                       prompt_length=generation.prompt_length, completion_ids=generation.completion_ids,
                       loss_mask=generation.completion_mask,
                       advantages=torch.randn(len(generation.input_ids), generator=generator, dtype=torch.float64))


def tiny_llama(vocab=64, seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def slide(model, window: int):
    """Every layer of a Qwen2 model attends within `window` keys."""
    model.config.use_sliding_window, model.config.sliding_window = True, window
    model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
    for layer in model.model.layers:
        layer.self_attn.sliding_window = window
    model.model.has_sliding_layers = True
    return model


MODELS = {"llama": lambda: float64_norms(tiny_llama(seed=2)),
          "qwen2": lambda: float64_norms(tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=2)),
          "qwen2-sliding-5": lambda: float64_norms(slide(tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1,
                                                                    seed=2), 5))}


def alone(model, batch):
    """Each sequence as its own unpadded row under transformers' sdpa: completion hidden states and the gradients
    of their summed squares."""
    model.zero_grad(set_to_none=True)
    hidden = []
    for row in range(batch.input_ids.shape[0]):
        micro = batching.micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, [row], packed=False)
        h = batching.completion_hidden_states(HiddenStates(model), micro)[0, :int(batch.loss_mask[row].sum())]
        h.square().sum().backward()
        hidden.append(h.detach())
    return hidden, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_shared_prompt_hidden_states_and_gradients_equal_each_sequence_alone(name, checkpointing):
    model = MODELS[name]()
    batch = grouped_rollout(seed=3)
    expected_hidden, expected_grads = alone(model, batch)
    attention.use_varlen_attention(model, "cpu")
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    model.zero_grad(set_to_none=True)
    micro = batching.micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, list(range(13)),
                                 packed=True, share_prompts=True)
    # the row holds each prompt once
    assert micro.model_inputs["input_ids"].shape[1] == sum(PROMPTS) + sum(map(sum, COMPLETIONS))
    hidden = batching.completion_hidden_states(HiddenStates(model), micro)
    lengths = batch.loss_mask.sum(1).tolist()
    sum(hidden[row, :n].square().sum() for row, n in enumerate(lengths)).backward()
    for row, n in enumerate(lengths):
        torch.testing.assert_close(hidden[row, :n], expected_hidden[row], rtol=1e-12, atol=1e-12)
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys() and len(grads) > 10
    for param_name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[param_name], rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", ["llama", "qwen2"])
@pytest.mark.parametrize("micro_batch_size", [13, 3], ids=["one-micro-batch", "groups-split"])
def test_update_with_shared_prompts_equals_the_unshared_update(name, micro_batch_size):
    """The trainer's step: old log-probs, the loss, its metrics and the gradients, with share_prompts on and off
    (a group may be cut between micro-batches: its prompt then goes into each)."""
    model = MODELS[name]()
    attention.use_varlen_attention(model, "cpu")
    batch = grouped_rollout(seed=4)
    batch.old_logps = torch.randn(batch.completion_ids.shape, dtype=torch.float64) * 0.1 - 2.0
    results = {}
    for share in (False, True):
        config = flat_config(share_prompts=share, micro_batch_size=micro_batch_size, beta=0.0,
                             max_completion_length=14, loss_type="dapo")
        policy = Policy.of(model)
        assert shares_prompts(config.batching, model) is share
        logps = completion_logprobs(policy, batch, *logprob_sections(config))
        model.zero_grad(set_to_none=True)
        metrics = accumulate_gradients(policy, batch, *update_sections(config))
        results[share] = logps, metrics, {n: p.grad.clone() for n, p in model.named_parameters()
                                          if p.grad is not None}
    (logps, metrics, grads), (shared_logps, shared_metrics, shared_grads) = results[False], results[True]
    torch.testing.assert_close(shared_logps, logps, rtol=1e-12, atol=1e-12)
    assert metrics.keys() == shared_metrics.keys()
    for key in metrics:
        assert shared_metrics[key] == pytest.approx(metrics[key], rel=1e-10, abs=1e-12), key
    assert grads.keys() == shared_grads.keys()
    for param_name in grads:
        torch.testing.assert_close(shared_grads[param_name], grads[param_name], rtol=1e-10, atol=1e-12)


def test_shared_prompts_only_where_the_attention_reads_them():
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1)
    model.set_attn_implementation("sdpa")        # sdpa would let a row's completions attend to each other
    assert not shares_prompts(flat_config().batching, model)
    attention.use_varlen_attention(model, "cpu")
    assert shares_prompts(flat_config().batching, model)
    assert not shares_prompts(flat_config(packing=False).batching, model)
    assert not shares_prompts(flat_config(share_prompts=False).batching, model)


def test_planner_counts_a_shared_prompt_once():
    batch = grouped_rollout()
    shared = attention.shared_prompt_lengths(batch.input_ids, batch.attention_mask, batch.prompt_length)
    assert shared == [0, 13, 13, 13, 0, 9, 9, 9, 0, 15, 15, 15, 0]
    lengths = batch.attention_mask.sum(1).tolist()
    assert lengths == [24, 14, 20, 25, 14, 18, 18, 12, 29, 17, 23, 21, 17]
    # shared, a group costs its first row and then its completions: 24 + 1 + 7 + 12 = 44, 35, 45; a row that
    # starts a micro-batch pays its prompt again (row 11: 21)
    assert batching.plan_micro_batches(lengths, max_tokens=44, max_sequences=12, shared=shared) == [
        [0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10], [11, 12]]
    assert batching.plan_micro_batches(lengths, max_tokens=44, max_sequences=12)[0] == [0, 1]


def test_groups_of_one_compute_exactly_what_unshared_packing_computes():
    """Distinct prompts (every group of one) lay out and attend as the unshared packed row: bit for bit."""
    from tests.train.update.test_attention import rollout

    model = MODELS["qwen2"]()
    attention.use_varlen_attention(model, "cpu")
    batch = rollout(seed=5)
    rows = list(range(batch.input_ids.shape[0]))
    with torch.no_grad():
        hidden = [batching.completion_hidden_states(HiddenStates(model), batching.micro_batch(
            batch.input_ids, batch.attention_mask, batch.prompt_length, rows, packed=True, share_prompts=share))
            for share in (False, True)]
    assert torch.equal(hidden[0], hidden[1])
