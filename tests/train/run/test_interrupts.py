"""A stop at any instant loses nothing: a real SIGINT (Ctrl-C) or SIGTERM delivered inside each stage of a step,
then --resume, ends with the weights, metrics and evaluations of a run that was never stopped, bit for bit."""

import json
import os
import signal

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.rollout import Rollouts, dynamic_sampling, engines  # noqa: E402
from grpo_fast.train.run import evaluate, record  # noqa: E402
from grpo_fast.train.saved import checkpoint, export
from grpo_fast.train.update import step as update_step  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import flat_config  # noqa: E402


@pytest.fixture(autouse=True)
def python_default_sigint():
    """Ctrl-C as a user's process has it, Python's default handler (KeyboardInterrupt), whatever an earlier test in
    this pytest process left installed; put back after."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)

# 3 steps of 2 iterations each, evaluations at steps 0, 2 and 3, a checkpoint at step 2 and at the end
OPTIONS = dict(sft_steps=20, max_steps=3, save_every=2, group_size=4, prompts_per_step=2, num_iterations=2,
               log_completions=1, rewards=["tests.helpers:counting_reward"], eval_every=2, eval_prompts=3,
               eval_samples=2)
QUIET = dict(log=lambda *_: None)

# (stage, object, attribute, the call after which the signal arrives): each lands inside step 2 or later, where
# the weights, the optimizer or the run's files have already changed when the signal arrives
STAGES = {
    "generation": (Rollouts, "get", 2),
    "scoring": (dynamic_sampling, "score", 2),
    "old log-probs": (update_step, "completion_logprobs", 2),
    "between iterations": (update_step, "policy_update", 3),
    "after the last iteration": (update_step, "policy_update", 4),
    # once as it is built, then after each optimizer step (2 a step): call 5 ends step 2's
    "learning-rate schedule": (torch.optim.lr_scheduler.LambdaLR, "step", 5),
    "weight push": (engines.HFEngine, "sync_weights", 2),
    "metrics line": (record.RunFiles, "append", 2),
    "evaluation": (evaluate, "evaluate", 2),
    "final evaluation": (evaluate, "evaluate", 3),
    "checkpoint": (checkpoint, "save_checkpoint", 1),
    "export": (export, "save_model_folder", 1),
}


def run(output_dir, resume=False):
    helpers.CALLS.update(n=0, interrupt_at=None)
    return T.train(flat_config(**OPTIONS, output_dir=str(output_dir)), resume=resume, **QUIET)


def final_weights(output_dir):
    state = torch.load(os.path.join(checkpoint.latest_checkpoint(str(output_dir)), "state.pt"), weights_only=False)
    return state["model"], state["optimizer"]


def lines(path, drop=("seconds", "tokens_per_s", "time")):
    """The JSONL rows without their timings (those differ between any two runs)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [{k: v for k, v in row.items() if not any(word in k for word in drop)} for row in rows]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    folder = tmp_path_factory.mktemp("straight")
    history = run(folder)
    assert [r["step"] for r in history] == [1, 2, 3]
    return folder


def interrupt_after(monkeypatch, owner, name, call, signum):
    """Delivers a real `signum` to this process when the `call`-th call of owner.name returns."""
    original = getattr(owner, name)
    count = {"n": 0}

    def wrapped(*args, **kwargs):
        result = original(*args, **kwargs)
        count["n"] += 1
        if count["n"] == call:
            os.kill(os.getpid(), signum)
        return result

    monkeypatch.setattr(owner, name, wrapped)
    return count


# every stage with Ctrl-C; SIGTERM (timeout, docker stop, a scheduler) takes the same path: one stage covers it
CASES = [(stage, signal.SIGINT) for stage in STAGES] + [("between iterations", signal.SIGTERM)]


@pytest.mark.parametrize("stage, signum", CASES, ids=[f"{stage}-{signal.Signals(signum).name}"
                                                      for stage, signum in CASES])
def test_a_stop_inside_any_stage_resumes_bit_for_bit(tmp_path, monkeypatch, straight, stage, signum):
    owner, name, call = STAGES[stage]
    with monkeypatch.context() as patch:
        count = interrupt_after(patch, owner, name, call, signum)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path)
        assert count["n"] >= call, f"{stage}: the signal was never sent"
    run(tmp_path, resume=True)
    weights, optimizer = final_weights(tmp_path)
    expected_weights, expected_optimizer = final_weights(straight)
    for key in expected_weights:
        torch.testing.assert_close(weights[key], expected_weights[key], rtol=0, atol=0, msg=key)
    for index, expected in expected_optimizer["state"].items():
        for key, value in expected.items():
            torch.testing.assert_close(optimizer["state"][index][key], value, rtol=0, atol=0)
    for name in ("metrics.jsonl", "eval.jsonl", "completions.jsonl"):
        assert lines(tmp_path / name) == lines(straight / name), name
    assert (tmp_path / "model" / "config.json").exists()


def test_a_second_stop_inside_the_interrupt_save_keeps_a_checkpoint_that_resumes_bit_for_bit(tmp_path, monkeypatch,
                                                                                            straight):
    """Ctrl-C right after the periodic checkpoint of step 2, then a second Ctrl-C inside the save the first one
    starts (a re-write of checkpoint-2), as the copy it replaces loses its state.pt: the run still holds a complete
    checkpoint-2, and --resume continues from it bit for bit."""
    original_save, unlink, saves, sent_at_state_pt = checkpoint.save_checkpoint, os.unlink, [], []

    def save_checkpoint(*args, **kwargs):
        saves.append(args[1])
        if len(saves) == 1:                  # the periodic save: the first Ctrl-C lands right after it
            path = original_save(*args, **kwargs)
            os.kill(os.getpid(), signal.SIGINT)
            return path
        sent = sent_at_state_pt

        def unlink_with_a_second_stop(*unlink_args, **unlink_kwargs):
            unlink(*unlink_args, **unlink_kwargs)
            if not sent and os.path.basename(str(unlink_args[0])) == "state.pt":
                sent.append(True)
                os.kill(os.getpid(), signal.SIGINT)

        with monkeypatch.context() as patch:
            patch.setattr(os, "unlink", unlink_with_a_second_stop)
            return original_save(*args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(checkpoint, "save_checkpoint", save_checkpoint)
        with pytest.raises(KeyboardInterrupt):
            run(tmp_path)
    assert saves == [2, 2] and sent_at_state_pt
    assert checkpoint.latest_checkpoint(str(tmp_path)) == str(tmp_path / "checkpoint-2")
    run(tmp_path, resume=True)
    weights, optimizer = final_weights(tmp_path)
    expected_weights, expected_optimizer = final_weights(straight)
    for key in expected_weights:
        torch.testing.assert_close(weights[key], expected_weights[key], rtol=0, atol=0, msg=key)
    assert lines(tmp_path / "metrics.jsonl") == lines(straight / "metrics.jsonl")
