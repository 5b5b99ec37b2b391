"""`grpo-fast generate`: a trained run's model answers with the run's prompt rendering and sampling, the same
tokens as sampling the exported model by hand, one token at a time, from plain transformers."""

import shutil

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.cli import main as cli  # noqa: E402
from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.rollout.engines import HFEngine  # noqa: E402
from grpo_fast.train.saved import generate  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

SYSTEM, PROMPT = "Answer with one number.", "max(3,8,2,7)="
SAMPLING = dict(temperature=0.7, top_k=20, top_p=0.9)
RUN = dict(max_steps=1, save_every=1, sft_steps=0, eval_every=0, group_size=2, prompts_per_step=2, log_completions=0,
           prompt_format="chat", system_prompt=SYSTEM, max_completion_length=8, seed=3, **SAMPLING)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A one-step chat run with a system prompt and its own sampling settings; its model/ is that step's export."""
    folder = tmp_path_factory.mktemp("generate") / "run"
    T.train(flat_config(**RUN, output_dir=str(folder)), log=lambda *_: None)
    return folder


@pytest.fixture(scope="module")
def exported(run):
    """(model, tokenizer) of the run's model/ through plain transformers: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(run / "model").eval(), AutoTokenizer.from_pretrained(run / "model")


def chat_ids(tokenizer, prompt=PROMPT, system=SYSTEM) -> list:
    """The run's prompt as the chat template renders it: the system turn, the user turn, the assistant's opening."""
    text = tokenizer.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": prompt}],
                                         tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.no_grad()
def sample_by_hand(model, prompt_ids, n, seed, max_tokens, eos, temperature=1.0, top_k=0, top_p=1.0) -> list:
    """The n completions the run's sampling defines, from full forward passes: at each step one uniform per row from
    a generator seeded with `seed` (drawn for every row while any is unfinished), the softmax at the temperature
    cut to the top_k most likely tokens, then to the most likely ones whose renormalized mass reaches top_p, and
    the first token (by id) whose cumulative kept probability reaches (1 - u) x the kept total."""
    generator = torch.Generator().manual_seed(seed)
    completions = [[] for _ in range(n)]
    for _ in range(max_tokens):
        unfinished = [row for row in range(n) if eos not in completions[row]]
        if not unfinished:
            break
        uniforms = torch.rand(n, generator=generator)
        for row in unfinished:
            logits = model(torch.tensor([prompt_ids + completions[row]])).logits[0, -1].double()
            probs = torch.softmax(logits / temperature, -1)
            if top_k:
                probs[probs < probs.topk(top_k).values[-1]] = 0
            if top_p < 1:
                order = probs.argsort(descending=True)
                before = (probs[order] / probs.sum()).cumsum(0) - probs[order] / probs.sum()   # mass more likely
                kept = torch.zeros_like(probs, dtype=torch.bool)
                kept[order[before < top_p]] = True
                probs = probs * kept
            cumulative = probs.cumsum(0)
            completions[row].append(int((cumulative < (1 - uniforms[row]) * cumulative[-1]).sum()))
    return completions


@torch.no_grad()
def argmax_by_hand(model, prompt_ids, max_tokens, eos) -> list:
    completion = []
    while len(completion) < max_tokens and eos not in completion:
        completion.append(int(model(torch.tensor([prompt_ids + completion])).logits[0, -1].argmax()))
    return completion


def fed_prompts(monkeypatch) -> list:
    """The prompt ids every HFEngine.generate call of the test gets, filled as the calls come."""
    fed, original = [], HFEngine.generate

    def recording(engine, prompt_ids, *args, **kwargs):
        fed.extend(prompt_ids)
        return original(engine, prompt_ids, *args, **kwargs)

    monkeypatch.setattr(HFEngine, "generate", recording)
    return fed


def blocks(tokenizer, completions) -> str:
    """What the command prints for these completions: each one's text, headed when there are several."""
    texts = [tokenizer.decode(tokens, skip_special_tokens=True) for tokens in completions]
    if len(texts) == 1:
        return texts[0] + "\n"
    return "".join(f"--- sample {i + 1} of {len(texts)} ---\n{text}\n" for i, text in enumerate(texts))


def test_a_run_answers_with_its_chat_template_and_sampling(run, exported, capsys, monkeypatch):
    model, tokenizer = exported
    fed = fed_prompts(monkeypatch)
    assert cli(["generate", str(run), PROMPT, "--num-samples", "2", "--seed", "11"]) == 0
    assert fed == [chat_ids(tokenizer)]                             # the system turn and the template, as trained
    expected = sample_by_hand(model, chat_ids(tokenizer), 2, 11, RUN["max_completion_length"],
                              tokenizer.eos_token_id, **SAMPLING)
    assert expected[0] != expected[1]                                # two draws, not one copied
    assert capsys.readouterr().out == blocks(tokenizer, expected)
    # the same tokens, not only the same text; the run's own seed by default
    tokens = generate.main(str(run), PROMPT, {}, log=lambda *_: None)
    assert tokens == sample_by_hand(model, chat_ids(tokenizer), 1, RUN["seed"], RUN["max_completion_length"],
                                    tokenizer.eos_token_id, **SAMPLING)


def test_greedy_is_the_argmax_continuation(run, exported, capsys):
    model, tokenizer = exported
    assert cli(["generate", str(run), PROMPT, "--greedy", "--max-new-tokens", "5"]) == 0
    expected = argmax_by_hand(model, chat_ids(tokenizer), 5, tokenizer.eos_token_id)
    assert capsys.readouterr().out == blocks(tokenizer, [expected])


def test_flags_and_a_model_folder_render_and_sample_as_they_say(run, exported, capsys, monkeypatch):
    model, tokenizer = exported
    fed = fed_prompts(monkeypatch)
    # the run's system prompt as the line before a plain prompt, at another temperature
    assert cli(["generate", str(run), PROMPT, "--prompt-format", "plain", "--temperature", "1.5", "--top-k", "0",
                "--seed", "2"]) == 0
    plain = tokenizer(SYSTEM + "\n" + PROMPT, add_special_tokens=False)["input_ids"]
    assert fed[-1] == plain
    assert capsys.readouterr().out == blocks(tokenizer, sample_by_hand(
        model, plain, 1, 2, RUN["max_completion_length"], tokenizer.eos_token_id, temperature=1.5, top_p=0.9))
    # a model folder: the trainer's defaults (plain prompt, no system prompt, temperature 1, every token, seed 0,
    # max_completion_length 6)
    assert cli(["generate", str(run / "model"), PROMPT]) == 0
    bare = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    assert fed[-1] == bare
    assert capsys.readouterr().out == blocks(tokenizer, sample_by_hand(model, bare, 1, 0, 6, tokenizer.eos_token_id))


def test_a_run_without_its_export_answers_from_its_newest_checkpoint(run, tmp_path, capsys):
    assert cli(["generate", str(run), PROMPT, "--seed", "4"]) == 0
    from_export = capsys.readouterr().out
    shutil.copytree(run, tmp_path / "run", ignore=shutil.ignore_patterns("model"))
    assert cli(["generate", str(tmp_path / "run"), PROMPT, "--seed", "4"]) == 0
    out, err = capsys.readouterr()
    assert out == from_export and f"checkpoint {tmp_path / 'run' / 'checkpoint-1'} (step 1)" in err


def one_line_error(capsys, arguments) -> str:
    assert cli(["generate", *arguments]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    return err.strip()


def test_errors_are_one_line(run, exported, tmp_path, capsys):
    assert one_line_error(capsys, [str(tmp_path / "missing"), PROMPT]) == (
        f"grpo-fast generate: {str(tmp_path / 'missing')!r} is neither a run folder nor a model folder (no such "
        "folder)")
    (tmp_path / "empty").mkdir()
    assert one_line_error(capsys, [str(tmp_path / "empty"), PROMPT]) == (
        f"grpo-fast generate: generate: no checkpoint in {str(tmp_path / 'empty')!r} (and no model, config.json, "
        "either: nothing to generate with; a run writes a checkpoint every save_every steps and at its end)")
    # the tiny model's context: 1024 positions + max_completion_length (8)
    prompt_tokens = len(chat_ids(exported[1]))
    assert one_line_error(capsys, [str(run), PROMPT, "--max-new-tokens", "1000"]) == (
        f"grpo-fast generate: the prompt ({prompt_tokens} tokens) plus --max-new-tokens (1000) is "
        f"{prompt_tokens + 1000} tokens, beyond the model's context of 1032 (max_position_embeddings; "
        f"policy.rope_scaling extends it): set --max-new-tokens to at most {1032 - prompt_tokens}, or shorten the "
        "prompt")
    assert "shorten the prompt" in one_line_error(capsys, [str(run), "9," * 2000])
    assert one_line_error(capsys, [str(run / "model"), ""]) == (
        "grpo-fast generate: the prompt is empty (no tokens): give the text to answer")
    assert one_line_error(capsys, [str(run), PROMPT, "--num-samples", "0"]) == (
        "grpo-fast generate: --num-samples must be >= 1, got 0")
    assert one_line_error(capsys, [str(run), PROMPT, "--greedy", "--top-k", "5"]) == (
        "grpo-fast generate: --greedy samples with top_k 1, and --top-k 5 was given too: give one of them")
    assert one_line_error(capsys, [str(run), PROMPT, "--temperature", "0"]) == (
        "grpo-fast generate: temperature must be a finite number > 0, got 0.0")
