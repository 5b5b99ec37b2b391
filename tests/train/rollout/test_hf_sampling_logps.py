"""The HF engine's sampling log-probs are taken by its sampler as it draws each token: the values transformers'
per-step logits give, without asking `generate` to keep those logits."""

import ctypes
import gc
import types

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.kept import KeptSet  # noqa: E402
from grpo_fast.train.policy import tiny_qwen2  # noqa: E402
from grpo_fast.train.rollout.engines import HFEngine  # noqa: E402
from grpo_fast.train.tasks import prompt_ids  # noqa: E402
from tests.helpers import arithmetic_policy, flat_config  # noqa: E402


def spy_on_generate(model, probe=None) -> list:
    """Replaces model.generate with a wrapper that records each call's keyword arguments and, asking for them
    itself, the per-step fp32 logits transformers returns (calls[i]["logits"], a (B, S, V) tensor); `probe`, when
    given, runs at every decode step (a logits processor after the engine's) and when the call returns."""
    calls, original = [], model.generate

    def generate(*args, **kwargs):
        calls.append(dict(kwargs))
        if probe is None:
            kwargs.update(output_logits=True, return_dict_in_generate=True)
        else:
            kwargs["logits_processor"] = list(kwargs["logits_processor"]) + [lambda ids, scores: probe() or scores]
        output = original(*args, **kwargs)
        if probe is None:
            calls[-1]["logits"] = torch.stack(output.logits, dim=1)
        else:
            probe()
        return output

    model.generate = generate
    return calls


@pytest.mark.parametrize("fields", [dict(temperature=0.7), dict(ignore_eos=True, temperature=1.3),
                                    dict(top_p=0.9, top_k=12, temperature=0.8),
                                    dict(top_p=0.9, top_k=12, ignore_eos=True)],
                         ids=["vocabulary", "ignore_eos", "kept_sets", "kept_sets_ignore_eos"])
def test_recorded_logps_equal_the_logits_without_output_logits(fields):
    """Rows that end early (a likely EOS), ignore_eos (EOS never drawn, yet in the normalizer as in the trainer's
    log-probs) and top-k / top-p kept sets: each sampled token's log-prob equals log_softmax(logits / T) of
    transformers' own per-step logits, over the kept set where there is one, to the bit; and the engine asks
    `generate` for neither its logits nor its scores."""
    model, tokenizer, samples = arithmetic_policy(32)
    eos = tokenizer.eos_token_id
    with torch.no_grad():                                # make EOS likely, so that some rows end early
        model.model.norm.weight.mul_(0.05)
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits.index_add(
        -1, torch.tensor([eos]), torch.full((*logits.shape[:-1], 1), 2.5)))
    prompts = prompt_ids([s["prompt"] for s in samples[:3]], tokenizer)
    config = flat_config(group_size=4, max_completion_length=16, **fields)
    calls = spy_on_generate(model)
    generation = HFEngine(model, tokenizer, config.rollout, sampling_logps=True).generate(prompts, seed=3)
    (call,) = calls
    assert not call.get("output_logits") and not call.get("output_scores"), call
    mask, ids = generation.completion_mask, generation.completion_ids
    lengths = mask.sum(1)
    if fields.get("ignore_eos"):
        assert bool((lengths == 16).all()) and not bool((ids == eos).any())
    else:
        assert int(lengths.min()) < int(lengths.max())        # rows that ended early, padded while others ran
    logits = call["logits"][:, :ids.shape[1]].float() / config.rollout.temperature
    if generation.kept_ids is not None:
        kept = KeptSet.of(generation.kept_ids, generation.kept_offsets).dense(logits.shape[-1]).view(logits.shape)
        logits = logits.masked_fill(~kept, float("-inf"))
    expected = logits.log_softmax(-1).gather(-1, ids[..., None]).squeeze(-1)
    assert torch.equal(generation.sampling_logps[mask], expected[mask])
    assert bool((generation.sampling_logps[~mask] == 0).all())


def heap_in_use() -> int:
    """Bytes the C heap holds for live allocations now (glibc's mallinfo2: arena chunks in use plus mmapped
    blocks), where torch's CPU tensors live."""

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                         "fsmblks", "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def test_recording_memory_does_not_grow_with_tokens_times_vocabulary():
    """A tiny model with a 16384-token vocabulary, 4 rows forced to 32 and to 128 tokens (ignore_eos): the heap's
    peak during a generation with sampling log-probs (sampled at every decode step and when `generate` returns)
    exceeds the same generation's without them by about as much at 128 tokens as at 32 (0.04 MiB apart here), far
    less than the 96 x 4 x 16384 fp32 logits the extra tokens would add if each step's logits were kept (24 MiB:
    `generate`'s output_logits added 23)."""
    try:
        heap_in_use()
    except (AttributeError, OSError):
        pytest.skip("needs glibc's mallinfo2 (glibc >= 2.33)")
    vocab, rows = 16384, 4
    model = tiny_qwen2(vocab, hidden_size=64, num_heads=2, num_kv_heads=1, max_positions=512, seed=0)
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=1)
    prompts = [[5, 6, 7, 8], [9, 10]]
    peak = {}
    calls = spy_on_generate(model, probe=lambda: peak.__setitem__("bytes", max(peak["bytes"], heap_in_use())))

    def extra_bytes(tokens: int, sampling_logps: bool) -> int:
        config = flat_config(group_size=rows // len(prompts), max_completion_length=tokens, ignore_eos=True)
        engine = HFEngine(model, tokenizer, config.rollout, sampling_logps=sampling_logps)
        gc.collect()                                     # earlier tests' garbage is not this generation's
        peak["bytes"] = before = heap_in_use()
        generation = engine.generate(prompts, seed=0)
        peak["bytes"] = max(peak["bytes"], heap_in_use())
        assert int(generation.completion_mask.sum()) == rows * tokens
        return peak["bytes"] - before

    extra_bytes(16, True)                                # warm up: thread pools, caches, lazy imports
    growth = {tokens: extra_bytes(tokens, True) - extra_bytes(tokens, False) for tokens in (32, 128)}
    kept_logits = (128 - 32) * rows * vocab * 4
    print(f"\nheap peak with log-probs minus without: {growth[32] / 2**20:.2f} MiB at 32 tokens, "
          f"{growth[128] / 2**20:.2f} MiB at 128; kept logits would add {kept_logits / 2**20:.0f} MiB")
    assert len(calls) == 5
    assert growth[128] - growth[32] < 0.1 * kept_logits, growth
