"""`grpo-fast plan` on bad input: one-line errors with exit status 2, and card sizes in the unit it prints."""

import json
import re

import pytest

from grpo_fast.cli import main
from grpo_fast.train.plan.memory import CARDS, GIB, Job


def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured
    assert captured.err.startswith("grpo-fast plan: "), captured.err
    return captured.err.strip()


def test_cards_are_compared_and_printed_in_gib(capsys):
    # CUDA reports an H200 "141GB" as 139.7 GiB: counting 141e9 bytes (131.3 GiB) refused jobs that fit
    assert 139 * GIB < CARDS["H200 141GB"] < 141 * GIB and 79 * GIB < CARDS["H100 80GB"] < 80 * GIB
    assert main(["plan", "qwen2.5-7b", "--completion-length", "16384", "--engine", "hf"]) == 0
    card_lines = re.findall(r"^(.+?)\s+(fits|does not fit)\s+\(([\d.]+) GiB needed of ([\d.]+) GiB\)$",
                            capsys.readouterr().out, flags=re.MULTILINE)
    assert {name.strip() for name, *_ in card_lines} == set(CARDS)
    for name, verdict, needed, capacity in card_lines:
        assert float(capacity) == round(CARDS[name.strip()] / GIB, 1)
        if abs(float(needed) - float(capacity)) > 0.1:          # the verdict agrees with the numbers printed
            assert (verdict == "fits") == (float(needed) < float(capacity)), (name, verdict, needed, capacity)
    assert main(["plan", "qwen2.5-7b", "--engine", "hf", "--json"]) == 0
    cards = json.loads(capsys.readouterr().out)["cards"]
    for name, card in cards.items():
        assert card["capacity_bytes"] == CARDS[name] and card["fits"] == (card["needed_bytes"] <= CARDS[name])


@pytest.mark.parametrize("option, value, expected", [
    ("--beta", "-1", "--beta must be a finite number >= 0, got -1.0"),
    ("--beta", "nan", "--beta must be a finite number >= 0, got nan"),
    ("--micro-batch-tokens", "0", "--micro-batch-tokens must be > 0 (or unset), got 0"),
    ("--group-size", "1", "--group-size must be >= 2 (advantages compare completions), got 1"),
    ("--group-size", "0", "--group-size must be >= 2 (advantages compare completions), got 0"),
    ("--prompt-length", "0", "--prompt-length must be > 0, got 0"),
    ("--completion-length", "-5", "--completion-length must be > 0, got -5"),
    ("--prompts-per-step", "0", "--prompts-per-step must be > 0, got 0"),
    ("--micro-batch-size", "-1", "--micro-batch-size must be > 0, got -1"),
    ("--lora-rank", "-1", "--lora-rank must be >= 0 (0: full training), got -1"),
    ("--gpu-memory-utilization", "0", "--gpu-memory-utilization must be in (0, 1), got 0.0"),
    ("--gpu-memory-utilization", "1.5", "--gpu-memory-utilization must be in (0, 1), got 1.5"),
])
def test_numeric_options_the_trainer_refuses_are_refused(capsys, option, value, expected):
    assert main(["plan", "qwen2.5-0.5b", option, value]) == 2
    assert one_line_error(capsys) == "grpo-fast plan: " + expected


def test_job_refuses_what_the_trainer_refuses():
    for fields, message in (({"group_size": 1}, "group_size must be >= 2"), ({"beta": -0.1}, "beta must be"),
                            ({"micro_batch_tokens": 0}, "micro_batch_tokens must be > 0"),
                            ({"chunk_bytes": -1}, "chunk_bytes must be > 0")):
        with pytest.raises(ValueError, match=message):
            Job(**fields)


GOOD = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": 1000}


@pytest.mark.parametrize("content, problem", [
    ("{bad", "not valid JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    ("", "not valid JSON (Expecting value at line 1, column 1)"),
    ("[1, 2]", "a config.json must be a JSON object, got a JSON array"),
    (json.dumps({"text_config": 5}), "text_config must be a JSON object, got a JSON number"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "hidden_size"}), "a decoder config needs 'hidden_size'"),
    (json.dumps({**GOOD, "hidden_size": None}), "a decoder config needs 'hidden_size'"),
    (json.dumps({**GOOD, "hidden_size": "64"}), 'hidden_size must be a positive integer, got "64"'),
    (json.dumps({**GOOD, "vocab_size": 0}), "vocab_size must be a positive integer, got 0"),
    (json.dumps({**GOOD, "num_hidden_layers": 2.5}), "num_hidden_layers must be a positive integer, got 2.5"),
    (json.dumps({**GOOD, "num_attention_heads": True}), "num_attention_heads must be a positive integer, got true"),
    (json.dumps({**GOOD, "num_key_value_heads": -2}), "num_key_value_heads must be a positive integer, got -2"),
    (json.dumps({**GOOD, "head_dim": [16]}), "head_dim must be a positive integer, got [16]"),
    (json.dumps({**GOOD, "tie_word_embeddings": "yes"}), 'tie_word_embeddings must be true or false, got "yes"'),
])
def test_malformed_config_json_is_named(tmp_path, capsys, content, problem):
    path = tmp_path / "config.json"
    path.write_text(content)
    for model in (str(path), str(tmp_path)):                   # the file, or the folder holding it
        assert main(["plan", model]) == 2
        assert one_line_error(capsys) == f"grpo-fast plan: {path}: {problem}"


def test_unreadable_or_missing_config_is_named(tmp_path, capsys):
    (tmp_path / "binary.json").write_bytes(b"\xff\xfe\x00\x01")
    assert main(["plan", str(tmp_path / "binary.json")]) == 2
    assert one_line_error(capsys) == f"grpo-fast plan: {tmp_path / 'binary.json'}: not a config.json (not UTF-8 text)"
    (tmp_path / "empty").mkdir()
    assert main(["plan", str(tmp_path / "empty")]) == 2
    assert one_line_error(capsys) == (f"grpo-fast plan: model folder {str(tmp_path / 'empty')!r} must hold a "
                                      "config.json, found none")


def test_nulls_for_defaults_are_accepted(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GOOD, "num_key_value_heads": None, "head_dim": None, "text_config": None}))
    assert main(["plan", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] > 0


def test_a_plan_past_the_models_context_is_refused_in_the_trainers_words(capsys):
    """1024 + 130048 tokens on qwen2.5-7b (Qwen2.5-7B-Instruct: 32768 positions): refused as `grpo-fast train`
    refuses it (tasks.check_context), with the option names, the longest completion that fits and the YaRN factor
    that would; with that factor given, the same job is planned on its 131072 positions."""
    from types import SimpleNamespace

    from grpo_fast.train import tasks

    job = ["plan", "qwen2.5-7b", "--prompt-length", "1024", "--completion-length", "130048"]
    assert main(job) == 2
    with pytest.raises(ValueError) as trainers:
        tasks.check_context(1024, 130048, SimpleNamespace(max_position_embeddings=32768),
                            length_key="--completion-length", scaling_key="--rope-scaling")
    assert one_line_error(capsys) == f"grpo-fast plan: {trainers.value}"
    assert str(trainers.value).endswith(': set --completion-length to at most 31744, or shorten the prompts, or set '
                                        '--rope-scaling to {"rope_type": "yarn", "factor": 4}')
    assert main(job + ["--rope-scaling", '{"rope_type": "yarn", "factor": 4}', "--json"]) == 0
    reported = json.loads(capsys.readouterr().out)
    assert reported["context"] == 131072 and reported["rope_scaling"] == {"rope_type": "yarn", "factor": 4}
    assert main(job + ["--rope-scaling", '{"rope_type": "yarn", "factor": 4}']) == 0
    assert ('context: 131072 positions with rope_scaling {"rope_type": "yarn", "factor": 4}; prompt + completion '
            'take 131072') in capsys.readouterr().out.splitlines()
    assert main(["plan", "llama-3.1-8b", "--prompt-length", "1024", "--completion-length", "130048"]) == 0   # 128k
    capsys.readouterr()


@pytest.mark.parametrize("value, expected", [
    ('{"rope_type": "dynamic", "factor": 4}', "policy.rope_scaling.rope_type 'dynamic' (dynamic NTK) is refused: "
                                              "transformers recomputes it from the longest position of each forward, "
                                              "so a completion generated token by token and the trainer's one "
                                              "forward over it get other frequencies, and vLLM applies it otherwise; "
                                              'use yarn, e.g. {"rope_type": "yarn", "factor": 4}'),
    ('{"rope_type": "yarn"}', "policy.rope_scaling.factor must be given for rope_type 'yarn' (a number in "
                              "[1, 2147483647]: the context's growth), got {'rope_type': 'yarn'}"),
])
def test_a_rope_scaling_the_trainer_refuses_is_refused(capsys, value, expected):
    assert main(["plan", "qwen2.5-7b", "--rope-scaling", value]) == 2
    assert one_line_error(capsys) == "grpo-fast plan: " + expected


def test_rope_scaling_must_be_a_json_object(capsys):
    for value in ("[4]", "{bad"):
        with pytest.raises(SystemExit) as exited:
            main(["plan", "qwen2.5-7b", "--rope-scaling", value])
        assert exited.value.code == 2
        assert "argument --rope-scaling: a JSON object as policy.rope_scaling takes" in capsys.readouterr().err


def test_a_config_json_gives_its_context_and_its_own_scaling(tmp_path, capsys):
    """A config.json's max_position_embeddings bounds the plan, its own rope_scaling counted as the trainer counts
    it (linear x4: 8192); a dynamic one of its own is refused as the trainer refuses it, unless --rope-scaling
    replaces it; without max_position_embeddings nothing is checked."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**GOOD, "max_position_embeddings": 2048}))
    assert main(["plan", str(path), "--prompt-length", "48", "--completion-length", "2000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 2048
    assert main(["plan", str(tmp_path), "--prompt-length", "48", "--completion-length", "2001"]) == 2
    assert one_line_error(capsys) == (
        "grpo-fast plan: the longest prompt (48 tokens) plus --completion-length (2001) is 2049 tokens, beyond the "
        "model's context of 2048 (max_position_embeddings; --rope-scaling extends it): set --completion-length to at "
        'most 2000, or shorten the prompts, or set --rope-scaling to {"rope_type": "yarn", "factor": 2}')
    path.write_text(json.dumps({**GOOD, "max_position_embeddings": 2048,
                                "rope_scaling": {"type": "linear", "factor": 4.0}}))
    assert main(["plan", str(path), "--completion-length", "7680", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 8192
    assert main(["plan", str(path), "--completion-length", "7681"]) == 2
    assert "beyond the model's context of 8192 (max_position_embeddings x the factor of --rope-scaling)" in \
        one_line_error(capsys)
    path.write_text(json.dumps({**GOOD, "max_position_embeddings": 2048,
                                "rope_scaling": {"type": "dynamic", "factor": 2.0}}))
    assert main(["plan", str(path)]) == 2
    assert one_line_error(capsys).startswith(f"grpo-fast plan: model {str(path)!r} has a rope_scaling of rope_type "
                                             "'dynamic' (dynamic NTK) in its config.json, refused: ")
    assert main(["plan", str(path), "--rope-scaling", '{"rope_type": "yarn", "factor": 4}', "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] == 8192
    path.write_text(json.dumps({**GOOD, "rope_scaling": [2]}))
    assert main(["plan", str(path)]) == 2
    assert one_line_error(capsys) == f"grpo-fast plan: {path}: rope_scaling must be a JSON object or null, got [2]"
    path.write_text(json.dumps(GOOD))
    assert main(["plan", str(path), "--completion-length", "100000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["context"] is None
