"""The offline default's pieces: tokenizer trained in code, tiny model, arithmetic task, JSONL loading."""

import json

import pytest
import torch

from grpo_fast.train import tasks
from grpo_fast.train.policy import tiny_qwen2, train_tokenizer

pytest.importorskip("transformers")


def test_tokenizer_round_trips_and_learns_merges():
    texts = [s["prompt"] + s["solution"] for s in tasks.arithmetic_task(500)]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    assert 256 + 3 < len(tokenizer) <= 300          # bytes + specials + merges (fewer if the corpus runs out)
    for text in ["12+7=19", "héllo wörld ∑", "<|im_start|>user\n3-4=<|im_end|>"]:
        assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert len(tokenizer("12+7=")["input_ids"]) < len("12+7=")          # merges learned from the task
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="vocab_size must be >="):
        train_tokenizer(texts, vocab_size=100)


def test_tiny_model_generates():
    model = tiny_qwen2(300, eos_token_id=0, pad_token_id=0)
    assert model.config.hidden_size // model.config.num_attention_heads >= 32
    assert model.lm_head.weight is model.get_input_embeddings().weight
    out = model.generate(torch.tensor([[5, 6, 7]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)
    with pytest.raises(ValueError, match="head_dim >= 32"):
        tiny_qwen2(300, hidden_size=64, num_heads=4)


def test_arithmetic_task_is_reproducible_and_correct():
    first, again = tasks.arithmetic_task(50, seed=3), tasks.arithmetic_task(50, seed=3)
    assert first == again and first != tasks.arithmetic_task(50, seed=4)
    for sample in tasks.arithmetic_task(200, operations="+-*"):
        assert str(eval(sample["prompt"].rstrip("="))) == sample["solution"]
    with pytest.raises(ValueError, match="operations must be"):
        tasks.arithmetic_task(3, operations="/")


def test_max_task_is_reproducible_and_correct():
    first = tasks.max_task(50, seed=3)
    assert first == tasks.max_task(50, seed=3) and first != tasks.max_task(50, seed=4)
    for sample in tasks.max_task(200, max_operand=12, count=5):
        numbers = [int(n) for n in sample["prompt"].removeprefix("max(").removesuffix(")=").split(",")]
        assert len(numbers) == 5 and all(0 <= n <= 12 for n in numbers)
        assert sample["solution"] == str(max(numbers))
    answers = [int(s["solution"]) for s in tasks.max_task(5000)]
    assert all(400 <= answers.count(value) <= 600 for value in range(10))      # the largest is uniform
    with pytest.raises(ValueError, match="count >= 2"):
        tasks.max_task(3, count=1)


def test_gsm8k_subset():
    from grpo_fast.train.tasks.rewards import accuracy_reward

    samples = tasks.gsm8k()
    assert len(samples) == 200 and samples[0]["solution"] == "18"
    assert all(s["solution"].lstrip("-").replace(".", "").isdigit() for s in samples)
    # every gold answer parses, so accuracy never skips a vendored sample
    scores = accuracy_reward([f"<answer>\n{s['solution']}\n</answer>" for s in samples[:20]],
                             solution=[s["solution"] for s in samples[:20]])
    assert scores == [1.0] * 20


def test_data_identity_names_what_changed_in_the_file(tmp_path):
    from tests.helpers import flat_config

    rows = [json.dumps({"prompt": f"{a}+{a}=", "solution": str(2 * a)}) for a in range(20)]
    path = tmp_path / "data.jsonl"

    def identity(lines, **keys):
        path.write_text("\n".join(lines) + "\n")
        config = flat_config(task=str(path), **keys)
        return tasks.data_identity(*tasks.load_task(config.data, config.evaluation, config.run.seed))

    saved = identity(rows, eval_fraction=0.2)
    assert len(saved["held_out"]) == 4
    tasks.check_data_identity(saved, identity(rows, eval_fraction=0.2), str(path))       # unchanged: no error
    tasks.check_data_identity(None, saved, str(path))                                   # no record: not checked
    shuffled = rows[10:] + rows[:10]
    with pytest.raises(ValueError, match=r"data\.jsonl' is not what the checkpoint trained on: the held-out problems "
                                         r"changed .*restore the file .* new output_dir"):
        tasks.check_data_identity(saved, identity(shuffled, eval_fraction=0.2), str(path))
    with pytest.raises(ValueError, match=r"the order of the rows changed"):
        tasks.check_data_identity(identity(rows, eval_fraction=0.0), identity(shuffled, eval_fraction=0.0), str(path))
    with pytest.raises(ValueError, match=r"training rows added \(20 -> 21 samples\)"):
        tasks.check_data_identity(identity(rows, eval_fraction=0.0),
                                  identity(rows + [json.dumps({"prompt": "x", "solution": "1"})], eval_fraction=0.0),
                                  str(path))


def test_prompt_and_completion_must_fit_the_models_context():
    from types import SimpleNamespace

    tasks.check_context(1000, 24, SimpleNamespace(max_position_embeddings=1024))         # exactly full: fits
    tasks.check_context(5000, 5000, SimpleNamespace())                                   # no limit known
    with pytest.raises(ValueError, match=r"^the longest prompt \(1000 tokens\) plus max_completion_length \(25\) "
                                         r"is 1025 tokens, beyond the model's context of 1024 "
                                         r"\(max_position_embeddings; policy.rope_scaling extends it\): set "
                                         r"max_completion_length to at most 24, or "
                                         r"shorten the prompts, or set policy.rope_scaling to "
                                         r'\{"rope_type": "yarn", "factor": 2\}$'):
        tasks.check_context(1000, 25, SimpleNamespace(max_position_embeddings=1024))
    with pytest.raises(ValueError, match=r"1030 tokens, .*: shorten the prompts"):
        tasks.check_context(1024, 6, tiny_qwen2(64, num_layers=1).config)              # a real config
