"""Rollouts that overlap training: the engine in its own process, versions, staleness, faults and resume."""

import json
import os
import signal
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.kept import KeptSet  # noqa: E402
from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train import tasks  # noqa: E402
from grpo_fast.train.rollout import start_process  # noqa: E402
from grpo_fast.train.rollout.engines import HFEngine  # noqa: E402
from grpo_fast.train.rollout.generation import EngineError  # noqa: E402
from grpo_fast.train.rollout.process import split_threads  # noqa: E402
from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import flat_config, logprob_sections  # noqa: E402

FAST = dict(sft_steps=20, max_steps=4, save_every=2, group_size=4, prompts_per_step=4, log_completions=0,
            eval_every=0, max_staleness=1)


def tiny_policy():
    model, tokenizer, samples = helpers.arithmetic_policy()
    return model, tokenizer, tasks.prompt_ids([s["prompt"] for s in samples[:3]], tokenizer)


def trainer_logprobs(model, generation, config):
    rollout = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                      generation.completion_ids, loss_mask=generation.completion_mask,
                      advantages=torch.zeros(generation.input_ids.shape[0]))
    if generation.kept_ids is not None:
        rollout.kept = KeptSet.of(generation.kept_ids, generation.kept_offsets)
    return completion_logprobs(Policy.of(model), rollout, *logprob_sections(config))


def perturb(model, seed):
    with torch.no_grad():
        generator = torch.Generator().manual_seed(seed)
        for parameter in model.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3)


def test_config_refuses_what_it_cannot_bound():
    with pytest.raises(ValueError, match="max_staleness must be >= 0, got -1"):
        flat_config(max_staleness=-1)
    with pytest.raises(ValueError, match="max_staleness=1 needs a rollout correction .* importance_sampling is "
                                         "'none'"):
        flat_config(max_staleness=1, importance_sampling="none")
    with pytest.raises(ValueError, match=r"under torchrun \(2 processes\) use max_staleness: 0"):
        flat_config(max_staleness=2).check_world(2)
    flat_config(max_staleness=2).check_world(1)


def test_the_process_serves_versions_in_order_with_the_trainers_numerics(tmp_path):
    """Each rollout comes from the weights pushed before it was asked for, equals the in-process engine's on those
    weights, and its sampling log-probs are the trainer's, top_p 0.9 / top_k 12 included (over the same kept sets
    both: the correction's ratio is 1 on unchanged weights, where the whole vocabulary misses by the kept mass)."""
    model, tokenizer, prompts = tiny_policy()
    config = flat_config(group_size=3, max_completion_length=8, max_staleness=1, top_p=0.9, top_k=12,
                         output_dir=str(tmp_path))
    threads = torch.get_num_threads()
    engine = start_process(config, model, tokenizer, max(map(len, prompts)))      # pushes version 0
    try:
        assert torch.get_num_threads() == split_threads(torch.device("cpu"))[0]
        engine.submit(0, prompts, seed=5)
        v0 = {name: p.detach().clone() for name, p in model.state_dict().items()}
        perturb(model, seed=1)
        engine.sync_weights(model)                                              # version 1
        engine.submit(1, prompts, seed=5)
        second, info1 = engine.take(1)                                          # out of order is fine
        first, info0 = engine.take(0)
        evaluation = engine.generate(prompts[:2], seed=9, n=2)                  # blocking, version 1
    finally:
        engine.close()
    assert torch.get_num_threads() == threads
    assert (info0["policy_version"], info1["policy_version"]) == (0, 1)
    assert info0["engine_generation_seconds"] > 0 and info1["engine_idle_seconds"] >= 0
    local = HFEngine(model, tokenizer, config.rollout, sampling_logps=True)
    expected_second, expected_eval = local.generate(prompts, seed=5), local.generate(prompts[:2], seed=9, n=2)
    model.load_state_dict(v0)
    expected_first = local.generate(prompts, seed=5)
    for got, expected in ((first, expected_first), (second, expected_second), (evaluation, expected_eval)):
        assert torch.equal(got.completion_ids, expected.completion_ids)
        torch.testing.assert_close(got.sampling_logps, expected.sampling_logps, rtol=0, atol=1e-5)
    assert not torch.equal(first.completion_ids, second.completion_ids)          # the push changed the policy
    mask = first.completion_mask
    gap = (first.sampling_logps - trainer_logprobs(model, first, config)).abs()[mask].max()
    assert gap < 1e-4, gap
    assert first.kept_ids is not None and torch.equal(first.kept_offsets, expected_first.kept_offsets)
    whole = replace(first, kept_ids=None, kept_offsets=None)
    assert (first.sampling_logps - trainer_logprobs(model, whole, config)).abs()[mask].max() > 1e-2


def test_engine_failure_and_death_raise_engine_error(tmp_path):
    model, tokenizer, prompts = tiny_policy()
    config = flat_config(group_size=2, max_completion_length=4, max_staleness=1, output_dir=str(tmp_path))
    engine = start_process(config, model, tokenizer, max(map(len, prompts)))
    engine.requests.put(("weights", 1, {"model.not_a_layer.weight": torch.zeros(2)}))
    engine.submit(0, prompts, seed=1)
    with pytest.raises(EngineError, match=r"hf engine in the rollout process failed on request 1: .*do not match "
                                          r"the engine's model: missing \['model.embed_tokens.weight', .*\], "
                                          r"unexpected "
                                          r"\['model.not_a_layer.weight'\]"):
        engine.take(0)
    assert not engine.process.is_alive()

    engine = start_process(config, model, tokenizer, max(map(len, prompts)))
    os.kill(engine.process.pid, signal.SIGKILL)
    engine.process.join(timeout=10)
    with pytest.raises(EngineError, match=r"rollout process \(hf engine\) died with exit code -9 before answering "
                                          "request 0"):
        engine.submit(0, prompts, seed=1)


def test_an_asynchronous_run_resumes_after_an_interrupt(tmp_path):
    """Staleness is at most max_staleness and logged per step; an interrupted run saves its last finished step
    and the resumed one regenerates the rollouts that were in flight (from the resumed weights: staleness 0)."""
    options = {**FAST, "rewards": ["tests.helpers:counting_reward"]}
    helpers.CALLS.update(n=0, interrupt_at=3)                   # Ctrl-C while scoring step 3
    with pytest.raises(KeyboardInterrupt):
        T.train(flat_config(**options, output_dir=str(tmp_path)), log=lambda *_: None)
    assert os.path.isdir(tmp_path / "checkpoint-2")
    helpers.CALLS.update(interrupt_at=None)
    resumed = T.train(flat_config(**options, output_dir=str(tmp_path)), resume=True, log=lambda *_: None)
    lines = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in lines] == [1, 2, 3, 4]
    assert [(r["policy_version"], r["staleness"]) for r in lines] == [(0, 0), (0, 1), (2, 0), (2, 1)]
    assert [r["step"] for r in resumed] == [3, 4]
    for record in lines:
        assert record["engine_generation_seconds"] > 0 and record["engine_idle_seconds"] >= 0
        assert 0 < record["is_ratio_mean"] < 3                # the correction weighs the stale samples


def test_a_dead_rollout_process_names_the_step_and_resume_finishes(tmp_path):
    options = {**FAST, "max_steps": 6, "rewards": ["tests.helpers:rollout_killing_reward"]}
    helpers.CALLS.update(n=0, interrupt_at=None, kill_at=3)    # SIGKILL while scoring step 3
    with pytest.raises(T.RunError, match=r"step [34]: the rollout process \(hf engine\) died with exit code -9 .*"
                                         r"the last checkpoint is intact"):
        T.train(flat_config(**options, output_dir=str(tmp_path)), log=lambda *_: None)
    assert os.path.isdir(tmp_path / "checkpoint-2") and not os.path.isdir(tmp_path / "checkpoint-6")
    helpers.CALLS.update(kill_at=None)
    T.train(flat_config(**options, output_dir=str(tmp_path)), resume=True, log=lambda *_: None)
    steps = [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4, 5, 6]


def test_a_ctrl_c_while_the_rollout_process_starts_leaves_it_quiet(capfd):
    """A Ctrl-C reaches the whole process group, the rollout process too, while it still imports torch and the
    engine: it ignores it from its first instruction (no KeyboardInterrupt traceback of its own; the trainer saves
    and stops it), and the trainer's own handler is back once it is started."""
    import torch.multiprocessing as mp

    from grpo_fast.train.rollout.process import start_without_ctrl_c

    context = mp.get_context("spawn")
    reader, writer = context.Pipe(duplex=False)
    process = context.Process(target=helpers.send_sigint_ignored, args=(writer,), daemon=True)
    handler = signal.getsignal(signal.SIGINT)
    start_without_ctrl_c(process)
    assert signal.getsignal(signal.SIGINT) is handler
    os.kill(process.pid, signal.SIGINT)                   # during the child's imports
    writer.close()
    assert reader.recv() is True
    process.join(60)
    assert process.exitcode == 0
    assert "KeyboardInterrupt" not in capfd.readouterr().err
