"""Variable-length attention (grpo_fast.packed_attention): a packed micro-batch costs memory linear in its tokens,
computes what each sequence alone computes, and leaves generation and padded batches exactly as sdpa."""

import importlib.util

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

pytest.importorskip("transformers")

from grpo_fast import packed_attention as attention  # noqa: E402
from grpo_fast.train.distributed import HiddenStates  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from grpo_fast.train.update.batching import completion_hidden_states, micro_batch  # noqa: E402
from grpo_fast.train.update.step import Policy, UpdateBatch, accumulate_gradients, shares_prompts  # noqa: E402
from tests.helpers import flat_config, float64_norms, update_sections  # noqa: E402

PROMPTS = [13, 15, 12, 14, 16, 13, 11, 17]
COMPLETIONS = [17, 12, 19, 11, 15, 18, 10, 14]


def rollout(vocab=64, seed=0) -> UpdateBatch:
    """Eight ragged sequences (left-padded prompts, right-padded completions): 227 real tokens."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in PROMPTS]
    completions = [torch.randint(1, vocab, (n,), generator=generator).tolist() for n in COMPLETIONS]
    generation = pack(prompts, completions, [False] * len(prompts), pad_token_id=0)
    return UpdateBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                   prompt_length=generation.prompt_length, completion_ids=generation.completion_ids,
                   loss_mask=generation.completion_mask,
                   advantages=torch.randn(len(prompts), generator=generator, dtype=torch.float64))


class LargestOutput(TorchDispatchMode):
    """Records the largest number of elements of any op's output (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.numel() > self.largest:
                self.largest, self.op = tensor.numel(), func
        return out


def test_packed_update_builds_no_square_tensor_over_the_packed_tokens():
    # the trainer's path: the tiny model with the trainer's attention, gradient checkpointing (the recompute must
    # get the boundaries too), forward, loss and backward of one packed micro-batch of 8 sequences
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=0)
    assert attention.use_varlen_attention(model, "cpu") == attention.NAME
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    batch = rollout()
    tokens = int(batch.attention_mask.sum())
    config = flat_config(packing=True, micro_batch_size=32, max_completion_length=19, gradient_checkpointing=True)
    with LargestOutput() as recorder:
        accumulate_gradients(Policy.of(model), batch, *update_sections(config))
    assert tokens == 227 and recorder.largest < tokens * tokens, (recorder.op, recorder.largest, tokens * tokens)


def per_row_reference(model, batch):
    """Each sequence alone (one unpadded row, sdpa): its completion's hidden states and the summed gradients."""
    model.zero_grad(set_to_none=True)
    hidden = []
    for row in range(batch.input_ids.shape[0]):
        micro = micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, [row], packed=False)
        h = completion_hidden_states(HiddenStates(model), micro)[0, :int(batch.loss_mask[row].sum())]
        h.square().sum().backward()
        hidden.append(h.detach())
    return hidden, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("shape", [dict(num_heads=2, num_kv_heads=1), dict(num_heads=4, num_kv_heads=4)],
                         ids=["gqa", "mha"])
@pytest.mark.parametrize("sliding_window", [None, 5])
def test_packed_hidden_states_and_gradients_equal_each_sequence_alone(shape, sliding_window):
    model = tiny_qwen2(64, hidden_size=128, **shape, seed=1).double()
    if sliding_window:               # every layer slides (transformers masks a key within `window` of the query)
        model.config.use_sliding_window, model.config.sliding_window = True, sliding_window
        model.config.layer_types = ["sliding_attention"] * model.config.num_hidden_layers
        for layer in model.model.layers:
            layer.self_attn.sliding_window = sliding_window
        model.model.has_sliding_layers = True
    batch = rollout(seed=1)
    expected_hidden, expected_grads = per_row_reference(model, batch)       # sdpa
    attention.use_varlen_attention(model, "cpu")
    model.zero_grad(set_to_none=True)
    micro = micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, list(range(8)), packed=True)
    hidden = completion_hidden_states(HiddenStates(model), micro)
    lengths = batch.loss_mask.sum(1).tolist()
    sum(hidden[row, :n].square().sum() for row, n in enumerate(lengths)).backward()
    for row, n in enumerate(lengths):
        torch.testing.assert_close(hidden[row, :n], expected_hidden[row], rtol=1e-12, atol=1e-12)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected_grads[name], rtol=1e-10, atol=1e-12, msg=name)


def test_generation_is_sdpa_exactly():
    # greedy generation of a left-padded batch with a KV cache, and the HF engine's sampled rollouts
    from grpo_fast.train.rollout.engines import HFEngine

    prompts = [[5, 9, 3], [7, 2, 8, 4, 6, 1], [11]]
    width = max(map(len, prompts))
    input_ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    outputs = {}
    for name in ("sdpa", attention.NAME):
        model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1, seed=2, pad_token_id=0,
                           eos_token_id=63).eval()
        if name != "sdpa":
            attention.use_varlen_attention(model, "cpu")
        greedy = model.generate(input_ids=input_ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
                                pad_token_id=0, output_logits=True, return_dict_in_generate=True)
        tokenizer = type("Tokenizer", (), {"pad_token_id": 0, "eos_token_id": 63})()
        config = flat_config(group_size=3, max_completion_length=8, temperature=1.0)
        sampled = HFEngine(model, tokenizer, config.rollout).generate([[5, 9, 3], [4, 4]], seed=3)
        outputs[name] = (greedy.sequences, torch.stack(greedy.logits), sampled.completion_ids)
    (tokens, logits, sampled), (tokens_varlen, logits_varlen, sampled_varlen) = outputs.values()
    assert torch.equal(tokens, tokens_varlen) and torch.equal(sampled, sampled_varlen)
    torch.testing.assert_close(logits_varlen, logits, rtol=0, atol=0)


def test_flash_attention_on_cuda_with_flash_attn_else_per_sequence(monkeypatch):
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.choose_attention("cuda", "bf16-autocast") == "flash_attention_2"
    assert attention.choose_attention(torch.device("cuda", 1), torch.bfloat16) == "flash_attention_2"
    assert attention.choose_attention("cuda", "fp32") == attention.NAME          # flash-attention has no fp32
    assert attention.choose_attention("cpu", "bf16") == attention.NAME
    monkeypatch.setattr(attention, "flash_attn_available", lambda: False)
    assert attention.choose_attention("cuda", "bf16-autocast") == attention.NAME
    # flash_attn "available" but transformers cannot load it here: the per-sequence attention, named
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1)
    if importlib.util.find_spec("flash_attn") is None:
        assert attention.use_varlen_attention(model, "cuda", "bf16") == attention.NAME
        assert attention.attention_name(model) == attention.NAME


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_set_through_peft_and_checkpointing_and_the_boundaries_reach_the_attention(monkeypatch):
    from grpo_fast.train import lora

    calls = []
    original = attention.varlen_attention_forward

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append(kwargs.get("cu_seq_lens_q"))
        return original(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(attention, "varlen_attention_forward", spy)
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1)
    model = lora.add_adapters(model, flat_config(lora_rank=4).policy)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert attention.use_varlen_attention(model, "cpu") == attention.NAME           # after both, on the wrapper
    assert model.get_base_model().config._attn_implementation == attention.NAME
    batch = rollout()
    micro = micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, [0, 1, 2], packed=True)
    completion_hidden_states(HiddenStates(model), micro).sum().backward()
    # two layers, forward and checkpoint recompute, each with the micro-batch's boundaries
    assert len(calls) == 4 and all(c is micro.model_inputs["cu_seq_lens_q"] for c in calls)
    assert micro.model_inputs["cu_seq_lens_q"].tolist() == [0, 30, 57, 88]
    assert micro.model_inputs["max_length_q"] == 31


def test_bad_boundaries_name_the_argument():
    with pytest.raises(ValueError, match=r"cu_seq_lens_q must run from 0 to the packed length 10, got \[0, 4, 9\]"):
        attention.segments(torch.tensor([0, 4, 9]), 10)
    with pytest.raises(ValueError, match="cu_seq_lens_q must be strictly increasing"):
        attention.segments(torch.tensor([0, 4, 4, 10]), 10)
    assert attention.segments(torch.tensor([0, 4, 10]), 10) == [(0, 4), (4, 10)]
    assert attention.segments_from_positions(torch.tensor([[0, 1, 2, 0, 1]]), 5) == [(0, 3), (3, 5)]


def test_similar_lengths_share_a_call_within_the_padding_slack():
    sizes = [400, 100, 390, 380, 50, 5]
    groups = attention.length_groups(sizes, slack=0.25)
    assert sorted(i for group in groups for i in group) == list(range(6))
    for group in groups:
        longest = max(sizes[i] for i in group)
        assert sizes[group[0]] == longest and len(group) * longest <= 1.25 * sum(sizes[i] for i in group)
    assert groups[0] == [0, 2, 3] and attention.length_groups([7]) == [[0]]


def tiny_gemma2(softcap=1.0, seed=3):
    """A random two-layer Gemma 2 (a sliding-window layer, then a global one) in float64, with a soft-cap that
    its attention scores reach, so that dropping it changes the outputs far beyond rounding. Its RMSNorms compute
    in the model's dtype: transformers' compute in float32, whose sum of a norm weight's gradient over the tokens
    rounds by their order (one packed row or a row at a time), a float32-level difference, not the attention's."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    def norm_forward(norm, hidden):
        return hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.eps) * (1.0 + norm.weight)

    torch.manual_seed(seed)
    config = Gemma2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, query_pre_attn_scalar=32,
                          attn_logit_softcapping=softcap, sliding_window=6, pad_token_id=0)
    model = Gemma2ForCausalLM(config).double()
    for module in model.modules():
        if type(module).__name__ == "Gemma2RMSNorm":
            module.forward = norm_forward.__get__(module)
    with torch.no_grad():                   # scores of a few units, where tanh bends (a fresh init's are ~0.01)
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
            layer.self_attn.k_proj.weight.mul_(8)
    return model


def tiny_gpt_oss(seed=4):
    """A random two-layer GPT-OSS (attention sinks, a sliding-window layer, four experts) in float64 (the experts'
    eager loop: the grouped matmul has no float64), its RMSNorms computed in float64 (float64_norms)."""
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    config = GptOssConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=6, pad_token_id=0, experts_implementation="eager")
    model = float64_norms(GptOssForCausalLM(config))
    with torch.no_grad():                   # sinks large enough to matter (a fresh init draws them near 0)
        for layer in model.model.layers:
            layer.self_attn.sinks.copy_(torch.tensor([1.5, -0.5]))
    return model


def completion_states(model, batch, packed: bool) -> list:
    """[(completion tokens, H)] of each of the 8 rows, as one packed row or as a padded batch."""
    micro = micro_batch(batch.input_ids, batch.attention_mask, batch.prompt_length, list(range(8)), packed=packed)
    hidden = completion_hidden_states(HiddenStates(model), micro)
    return [hidden[row, :n] for row, n in enumerate(batch.loss_mask.sum(1).tolist())]


@pytest.mark.parametrize("build", [tiny_gemma2, tiny_gpt_oss], ids=["gemma2-softcap", "gpt_oss-sinks"])
def test_soft_capping_and_sinks_equal_eager_per_sequence(build):
    # the packed row and a padded micro-batch under grpo_fast_varlen against transformers' eager attention on each
    # sequence alone: sdpa drops Gemma 2's soft-capping and GPT-OSS's sinks, eager applies them, as vLLM does
    model = build()
    batch = rollout(seed=3)
    model.set_attn_implementation("eager")
    expected_hidden, expected_grads = per_row_reference(model, batch)
    assert attention.use_varlen_attention(model, "cpu") == attention.NAME
    model.zero_grad(set_to_none=True)
    packed = completion_states(model, batch, packed=True)
    sum(h.square().sum() for h in packed).backward()
    for row, expected in enumerate(expected_hidden):
        torch.testing.assert_close(packed[row], expected, rtol=1e-12, atol=1e-12, msg=f"row {row}")
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():        # float64 rounding, grown through the saturated tanh and the softmax
        torch.testing.assert_close(grad, expected_grads[name], rtol=1e-9, atol=1e-11, msg=name)
    # a padded micro-batch is eager's own computation, bit for bit (in float32: Gemma 2's eager softmax runs in
    # float32, where float64's lowest value, on a left-padding query's masked row, becomes -inf and NaN)
    model.float()
    with torch.no_grad():
        padded = completion_states(model, batch, packed=False)
        model.set_attn_implementation("eager")
        expected_padded = completion_states(model, batch, packed=False)
    for row, expected in enumerate(expected_padded):
        torch.testing.assert_close(padded[row], expected, rtol=0, atol=0, msg=f"padded row {row}")
    attention.use_varlen_attention(model, "cpu")
    # generation runs eager too (sdpa would drop them; GPT-OSS refuses sdpa), and the packed attention comes back
    with attention.sdpa_while_generating(model):
        assert attention.attention_name(model) == "eager"
        model.generate(input_ids=batch.input_ids[:2, :batch.prompt_length],
                       attention_mask=batch.attention_mask[:2, :batch.prompt_length], max_new_tokens=3,
                       do_sample=False, pad_token_id=0)
    assert attention.attention_name(model) == attention.NAME


def test_gemma2_soft_capping_is_no_rounding_matter():
    # the check above can fail: transformers' sdpa, which the packed attention ran for every model, drops the
    # soft-cap and computes other hidden states
    model = tiny_gemma2(softcap=1.0)
    ids = torch.randint(1, 64, (1, 24), generator=torch.Generator().manual_seed(0))
    states = {}
    for name in ("eager", "sdpa"):
        model.set_attn_implementation(name)
        with torch.no_grad():
            states[name] = model.model(input_ids=ids, use_cache=False).last_hidden_state
    assert (states["eager"] - states["sdpa"]).abs().max() > 0.1


def shared_prompt_rollout(seed=5) -> UpdateBatch:
    """Two prompts with four completions each (so packed micro-batches share each prompt), ragged lengths, and
    old log-probs (so that the loss, not only its gradient, depends on the new ones)."""
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (9, 6)]
    completions = [torch.randint(1, 64, (n,), generator=generator).tolist() for n in (7, 3, 8, 5, 6, 8, 2, 4)]
    generation = pack([prompts[i // 4] for i in range(8)], completions, [False] * 8, pad_token_id=0)
    batch = UpdateBatch(input_ids=generation.input_ids, attention_mask=generation.attention_mask,
                        prompt_length=generation.prompt_length, completion_ids=generation.completion_ids,
                        loss_mask=generation.completion_mask,
                        advantages=torch.randn(8, generator=generator, dtype=torch.float64))
    batch.old_logps = torch.randn(batch.completion_ids.shape, generator=generator) * 0.1 - 4.0
    return batch


def test_gpt_oss_trains_with_the_attention_key_eager_and_auto_alike():
    # the update step (forward, loss, backward) on GPT-OSS: with `attention: eager` (padded micro-batches, as the
    # key requires) and with "auto" (packed rows sharing each prompt, sinks by the eager attention) the same loss
    # and gradients
    results = []
    for choice, packing in (("eager", False), ("auto", True)):
        model = tiny_gpt_oss()
        config = flat_config(attention=choice, packing=packing, micro_batch_size=8, max_completion_length=8,
                             gradient_checkpointing=True)
        name = attention.use_attention(model, config.policy.attention, "cpu")        # as the trainer sets it
        assert name == attention.attention_name(model) == ("eager" if choice == "eager" else attention.NAME)
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        policy = Policy.of(model)
        assert shares_prompts(config.batching, model) == (choice == "auto")
        metrics = accumulate_gradients(policy, shared_prompt_rollout(), *update_sections(config))
        results.append((metrics["loss"], {name: p.grad for name, p in model.named_parameters()}))
    (eager_loss, eager_grads), (auto_loss, auto_grads) = results
    assert all(grad is not None and torch.isfinite(grad).all() for grad in eager_grads.values())
    # to float32 rounding: GPT-OSS computes its rotary angles in float32, and the padded rows' positions start
    # after their left padding
    torch.testing.assert_close(auto_loss, eager_loss, rtol=1e-7, atol=1e-9)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(auto_grads[name], grad, rtol=1e-7, atol=1e-9, msg=name)


def test_the_attention_key_is_checked_in_one_line(monkeypatch):
    with pytest.raises(ValueError, match=r"^attention must be one of \('auto', 'eager', 'sdpa'\), got 'flash'$"):
        flat_config(attention="flash", packing=False)
    # GPT-OSS's eager masks do not see its position ids: a packed row would attend across its sequences
    with pytest.raises(ValueError, match=r"^packing=True needs attention 'auto' \(transformers' eager does not keep a "
                                         r"packed row's sequences apart in every model\), got attention='eager'; set "
                                         r"packing: false to keep it$"):
        flat_config(attention="eager")
    with pytest.raises(ValueError, match=r"^attention='sdpa' would drop the attention sinks of model_type 'gpt_oss', "
                                         r"which its eager attention and vLLM apply; use attention: auto or eager$"):
        attention.use_attention(tiny_gpt_oss(), "sdpa", "cpu")
    with pytest.raises(ValueError, match=r"^attention='sdpa' would drop the attention logit soft-capping "
                                         r"\(attn_logit_softcapping=1.0\) of model_type 'gemma2'"):
        attention.use_attention(tiny_gemma2(), "sdpa", "cpu")
    model = tiny_qwen2(64, hidden_size=64, num_heads=2, num_kv_heads=1)
    assert attention.use_attention(model, "sdpa", "cpu") == attention.attention_name(model) == "sdpa"
    # flash-attention 2 has no sinks: GPT-OSS keeps grpo_fast_varlen on CUDA too
    monkeypatch.setattr(attention, "flash_attn_available", lambda: True)
    assert attention.use_varlen_attention(tiny_gpt_oss(), "cuda", "bf16") == attention.NAME


def test_soft_capping_without_an_eager_attention_is_refused(monkeypatch):
    from transformers.models.gemma2 import modeling_gemma2

    model = tiny_gemma2()
    monkeypatch.delattr(modeling_gemma2, "eager_attention_forward")
    with pytest.raises(ValueError, match=r"^model_type 'gemma2' has attention logit soft-capping "
                                         r"\(attn_logit_softcapping=1.0\), which grpo_fast's packed attention computes "
                                         r"with the model's eager_attention_forward, but .*modeling_gemma2 defines "
                                         r"none; set the trainer's attention: eager \(and packing: false\)$"):
        attention.use_varlen_attention(model, "cpu")
