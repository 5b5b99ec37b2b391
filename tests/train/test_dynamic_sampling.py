"""DAPO's dynamic sampling (rollout.dynamic_sampling, max_sampling_rounds): groups whose rewards are all equal are
dropped and further training prompts sampled until the step has its informative groups, or the rounds run out
(then it trains on what it has, filled with dropped groups, and says so in one line); metrics.jsonl gains
frac_filtered_groups, sampling_rounds and reward_kept, its reward the mean over every completion generated.
Checked on scripted rollouts (which groups are kept, in what order, from which prompts), on the trainer with both
engines, a rollout process (max_staleness 1) and two processes, and across a resume."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")

from grpo_fast.train import distributed, tasks  # noqa: E402
from grpo_fast.train import loop as T  # noqa: E402
from grpo_fast.train.policy import train_tokenizer  # noqa: E402
from grpo_fast.train.rollout import dynamic_sampling  # noqa: E402
from grpo_fast.train.rollout.generation import pack, select_rows, unpack  # noqa: E402
from grpo_fast.train.run.record import StageClock  # noqa: E402
from tests import helpers  # noqa: E402
from tests.helpers import flat_config, torchrun_command  # noqa: E402

GENERATION_FIELDS = ("input_ids", "attention_mask", "completion_ids", "completion_mask", "truncated", "sampling_logps",
                     "kept_ids", "kept_offsets")


def ragged_generation(seed: int, rows: int = 4, kept: bool = True):
    generator = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 40, (int(n),), generator=generator).tolist()
               for n in torch.randint(1, 6, (rows,), generator=generator)]
    completions = [torch.randint(3, 40, (int(n),), generator=generator).tolist()
                   for n in torch.randint(1, 7, (rows,), generator=generator)]
    logps = [(-torch.rand(len(c), generator=generator)).tolist() for c in completions]
    kept_sets = [(sum(([token, token + 1] for token in c), []), [2] * len(c)) for c in completions] if kept else None
    return pack(prompts, completions, [len(c) == 6 for c in completions], 0, logps, kept_sets=kept_sets)


@pytest.mark.parametrize("kept", [True, False])
def test_rows_selected_from_several_generations_are_packed_as_if_generated_together(kept):
    first, second = ragged_generation(0, kept=kept), ragged_generation(1, kept=kept)
    whole = select_rows([first], [(0, row) for row in range(4)], pad_token_id=0)
    for name in GENERATION_FIELDS:
        want, got = getattr(first, name), getattr(whole, name)
        assert (want is None and got is None) or torch.equal(got, want), name
    picks = [(1, 2), (0, 0), (1, 0)]
    mixed = select_rows([first, second], picks, pad_token_id=0)
    rows = [unpack([first, second][index])[row] for index, row in picks]
    assert unpack(mixed) == rows
    assert rows[0][4] is None if not kept else rows[0][4][1] == [2] * len(rows[0][1])


class ScriptedRollouts:
    """Rollouts whose completion for a prompt is the answer for prompts in `right` and "x" otherwise, except that
    the first completion of each group of a prompt in `mixed` is right: `right` groups all score 1, `mixed` ones
    differ, the rest all score 0."""

    name = "scripted"

    def __init__(self, tokenizer, group_size, right=(), mixed=()):
        self.tokenizer, self.group_size, self.right, self.mixed = tokenizer, group_size, set(right), set(mixed)
        self.calls, self.slept_after = [], []       # slept_after: the calls made when the engine was put to sleep

    def sleep(self):
        self.slept_after.append(len(self.calls))

    def _generation(self, prompt_ids, seed):
        texts = [self.tokenizer.decode(ids) for ids in prompt_ids]
        completions = []
        for text in texts:
            answer = str(eval(text.rstrip("=")))                    # noqa: S307 (our own "a+b=" prompts)
            for sample in range(self.group_size):
                good = text in self.right or (text in self.mixed and sample == 0)
                completions.append(self.tokenizer(answer if good else "x")["input_ids"] +
                                   [self.tokenizer.eos_token_id])
        rows = [ids for ids in prompt_ids for _ in range(self.group_size)]
        self.calls.append((texts, seed))
        return pack(rows, completions, [False] * len(rows), self.tokenizer.pad_token_id)

    def get(self, step):
        return self._generation(self.share.ids(step), seed=step), {}

    def generate(self, prompt_ids, seed, n=None, max_tokens=None):
        assert n == self.group_size
        return self._generation(prompt_ids, seed)


def scripted(samples, right=(), mixed=(), rounds=3, dynamic=True, prompts_per_step=4, seed=0, log=None, **keys):
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples] + ["x"])
    config = flat_config(dynamic_sampling=dynamic, max_sampling_rounds=rounds, group_size=3,
                         prompts_per_step=prompts_per_step, **keys)
    share = tasks.StepShare(samples, tokenizer, config.data, prompts_per_step, seed)
    rollouts = ScriptedRollouts(tokenizer, 3, right, mixed)
    rollouts.share = share
    result = dynamic_sampling.sample_step(0, share, rollouts, tokenizer, [helpers.counting_reward], config.scoring,
                                          config.rollout, StageClock(), distributed.World(),
                                          [].append if log is None else log)
    return share, rollouts, result


def test_uninformative_groups_are_replaced_by_further_prompts_in_order():
    samples = tasks.arithmetic_task(40, seed=1)
    share = tasks.StepShare(samples, None, flat_config().data, 4, 0)
    first = [s["prompt"] for s in share.at(0)[0]]
    extra = [s["prompt"] for s in share.extra(0, 1)[0]]
    # the step's own prompts: one mixed group (kept), two all right and one all wrong (dropped); the next round's
    # prompts are all mixed: the first three fill the step
    logged = []
    share, rollouts, (kept, prompts, generation, completions, rewards, info, trained) = scripted(
        samples, right=first[1:3], mixed=[first[0]] + extra, log=logged.append)
    assert [s["prompt"] for s in kept] == [first[0]] + extra[:3]
    assert prompts == [tasks.prompt_text(s, share.tokenizer, share.data) for s in kept]
    assert len(rollouts.calls) == 2 and rollouts.calls[1][0] == extra            # one further round, then enough
    assert rollouts.slept_after == [2]            # asleep once, after the step's last round (rollout.vllm_sleep)
    # reward: the 24 completions generated, 1 + 3 + 3 + 0 + 4 x 1 right; reward_kept: the 4 groups kept, 1 each
    assert info == {"frac_filtered_groups": 3 / 8, "sampling_rounds": 2, "reward": 11 / 24, "reward_kept": 4 / 12}
    assert logged == [] and trained is None                                      # not short: nothing to say
    assert generation.completion_ids.shape[0] == 12 and len(completions) == 12
    assert torch.equal(rewards, torch.tensor([1.0, 0, 0] * 4))
    texts = share.tokenizer.batch_decode(generation.completion_ids, skip_special_tokens=True)
    assert texts == completions
    # the same draws again (a resumed run), and none of them a held-out problem
    assert [s["prompt"] for s in scripted(samples, right=first[1:3], mixed=[first[0]] + extra)[2][0]] == \
        [s["prompt"] for s in kept]


def test_the_round_cap_trains_on_the_informative_groups_alone():
    samples = tasks.arithmetic_task(40, seed=1)
    first = [s["prompt"] for s in tasks.StepShare(samples, None, flat_config().data, 4, 0).at(0)[0]]
    logged = []
    _, rollouts, (kept, _, generation, _, rewards, info, trained) = scripted(samples, mixed=[first[2]], rounds=2,
                                                                             log=logged.append)
    assert len(rollouts.calls) == 2 and info["sampling_rounds"] == 2
    assert info["frac_filtered_groups"] == pytest.approx(7 / 8)
    assert (info["reward"], info["reward_kept"]) == (1 / 24, 1 / 3)    # one right completion of 24, of 3 trained
    assert logged == ["step 1: dynamic sampling ended short: 1 informative group of the 4 wanted (prompts_per_step) "
                      "after 2 rounds (max_sampling_rounds), 7 of the 8 groups generated dropped for equal "
                      "exact_match; the step trains on that one alone"]
    # the informative group first, then the earliest dropped ones, which fill the batch untrained (every rank
    # runs as many rows) and count in no normalizer
    assert [s["prompt"] for s in kept] == [first[2], first[0], first[1], first[3]]
    assert torch.equal(rewards.view(4, 3).amax(1), torch.tensor([1.0, 0.0, 0.0, 0.0]))
    assert trained.tolist() == [True] * 3 + [False] * 9
    off = scripted(samples, mixed=[first[2]], dynamic=False)
    assert len(off[1].calls) == 1 and off[2].info == {} and off[2].trained is None   # off: one round
    assert off[1].slept_after == [1]


def test_short_step_error_stops_the_run_in_one_line_naming_the_rounds():
    samples = tasks.arithmetic_task(40, seed=1)
    first = [s["prompt"] for s in tasks.StepShare(samples, None, flat_config().data, 4, 0).at(0)[0]]
    with pytest.raises(T.RunError) as error:
        scripted(samples, mixed=[first[2]], rounds=2, short_step="error")
    assert str(error.value) == (
        "step 1: dynamic sampling ended short: 1 informative group of the 4 wanted (prompts_per_step) after 2 "
        "rounds (max_sampling_rounds), 7 of the 8 groups generated dropped for equal exact_match; "
        "raise max_sampling_rounds or sampling_batch_multiplier, or set short_step: train to train on the groups "
        "found")


def test_each_round_generates_the_batch_multiplier_times_the_prompts_wanted():
    """sampling_batch_multiplier 2.5 with 4 prompts a step: the first round is the step's 4 prompts and 6 more
    (10 in all), each further round 10; the informative groups are taken in draw order."""
    samples = tasks.arithmetic_task(60, seed=1)
    share = tasks.StepShare(samples, None, flat_config().data, 4, 0)
    first = [s["prompt"] for s in share.at(0)[0]]
    oversampled = [s["prompt"] for s in share.extra(0, 0, 6)[0]]
    second = [s["prompt"] for s in share.extra(0, 1, 10)[0]]
    _, rollouts, taken = scripted(samples, mixed=[first[1]] + oversampled[4:] + second[:1],
                                  sampling_batch_multiplier=2.5)
    assert [len(texts) for texts, _ in rollouts.calls] == [4, 6, 10]
    assert [s["prompt"] for s in taken.samples] == [first[1]] + oversampled[4:] + second[:1]
    assert taken.info["sampling_rounds"] == 2 and taken.trained is None
    assert len({seed for _, seed in rollouts.calls}) == 3                  # each generation its own seed


def test_groups_are_filtered_on_the_accuracy_not_the_summed_reward():
    """rewards [counting_reward, overlong]: a group all wrong whose completions' lengths differ in the overlong
    penalty differs in the summed reward but not in accuracy: dropped by default (DAPO, verl's metric=acc), kept
    with dynamic_sampling_metric 'reward'."""
    samples = tasks.arithmetic_task(40, seed=1)
    tokenizer = train_tokenizer([s["prompt"] + s["solution"] for s in samples] + ["x"])
    completions = ["x", "x x x", "x", "7", "8", "7"]             # group 1 all wrong, lengths differ; group 2 mixed
    ids = [tokenizer(c)["input_ids"] for c in completions]
    two = [{"prompt": "3+4=", "solution": "9"}, {"prompt": "3+4=", "solution": "7"}]
    config = flat_config(rewards=["tests.helpers:counting_reward", "overlong"], overlong_buffer=2,
                         max_completion_length=4, dynamic_sampling=True, group_size=3)
    from grpo_fast.train.tasks.rewards import load_reward
    fns = [helpers.counting_reward, load_reward("overlong", max_completion_length=4, buffer=2, penalty=1.0)]
    by_accuracy = dynamic_sampling.score(fns, completions, ids, two, 0, config.scoring, 3, 4,
                                         dynamic_sampling.filter_metric(config.rollout, config.scoring.rewards))
    by_reward = dynamic_sampling.score(fns, completions, ids, two, 0, config.scoring, 3, 4, "reward")
    assert torch.equal(by_accuracy.rewards, by_reward.rewards)
    assert len(set(by_reward.rewards[:3].tolist())) > 1                  # the summed reward differs in group 1
    assert dynamic_sampling.informative(by_accuracy.metric, 3) == [False, True]
    assert dynamic_sampling.informative(by_reward.metric, 3) == [True, True]


def test_held_out_problems_are_never_drawn():
    config = flat_config(task="arithmetic", num_prompts=30, eval_fraction=0.5)
    training, held_out = tasks.load_task(config.data, config.evaluation, config.run.seed)
    share = tasks.StepShare(training, None, config.data, 8, 0)
    drawn = {s["prompt"] for step in range(20) for round_ in (1, 2, 3) for s in share.extra(step, round_)[0]}
    assert drawn <= {s["prompt"] for s in training} and not drawn & {s["prompt"] for s in held_out}


# two mini-batches a step, strided: a short step's fillers (last in the batch) share them with informative groups
RUN = dict(sft_steps=20, max_steps=4, save_every=2, group_size=4, prompts_per_step=4, log_completions=0,
           eval_every=0, dynamic_sampling=True, max_sampling_rounds=3, steps_per_generation=2,
           rewards=["tests.helpers:counting_reward"])


def test_a_run_logs_the_filter_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    captured = helpers.saved_models(monkeypatch)
    helpers.CALLS.update(n=0, interrupt_at=None)
    straight = T.train(flat_config(**RUN, output_dir=str(tmp_path / "straight")), log=lambda *_: None)
    calls = helpers.CALLS["n"]
    assert calls > 4                                   # more scoring calls than steps: further rounds were drawn
    assert all(0 <= r["frac_filtered_groups"] <= 1 and 1 <= r["sampling_rounds"] <= 3 for r in straight)
    assert any(r["sampling_rounds"] > 1 for r in straight)
    helpers.CALLS.update(n=0, interrupt_at=calls - 2)  # Ctrl-C while scoring in step 3 or 4
    with pytest.raises(KeyboardInterrupt):
        T.train(flat_config(**RUN, output_dir=str(tmp_path / "resumed")), log=lambda *_: None)
    helpers.CALLS.update(interrupt_at=None)
    T.train(flat_config(**RUN, output_dir=str(tmp_path / "resumed")), resume=True, log=lambda *_: None)
    a, b = captured[str(tmp_path / "straight")], captured[str(tmp_path / "resumed")]
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=0, msg=name)
    lines = [json.loads(line) for line in open(tmp_path / "resumed" / "metrics.jsonl")]
    assert [(r["step"], r["reward"], r["frac_filtered_groups"], r["sampling_rounds"]) for r in lines] == \
        [(r["step"], r["reward"], r["frac_filtered_groups"], r["sampling_rounds"]) for r in straight]


def test_a_step_that_ends_short_is_logged_and_both_reward_means_are_recorded(tmp_path):
    """A step short of informative groups after max_sampling_rounds says so in one line; metrics.jsonl's reward is
    the mean over every completion generated (as in a run without the filter), reward_kept the mean over the
    groups the step trained on, and the progress line shows the share dropped: each against the scores the reward
    gave, counted by hand."""
    helpers.SCORED.clear()
    logged = []
    T.train(flat_config(sft_steps=0, max_steps=3, save_every=3, group_size=4, prompts_per_step=2, log_completions=0,
                        eval_every=0, dynamic_sampling=True, max_sampling_rounds=2,
                        rewards=["tests.helpers:recording_reward"], output_dir=str(tmp_path)), log=logged.append)
    scored, short = iter(helpers.SCORED), []
    for record in [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]:
        groups = []
        for _ in range(record["sampling_rounds"]):                    # one reward call per round
            groups += [scores[i:i + 4] for scores in [next(scored)[1]] for i in range(0, len(scores), 4)]
        informative = [group for group in groups if len(set(group)) > 1]
        dropped = [group for group in groups if len(set(group)) == 1]
        trained = informative[:2]                    # a short step trains on its informative groups alone
        assert record["reward"] == pytest.approx(sum(map(sum, groups)) / (4 * len(groups)))
        if trained:
            assert record["reward_kept"] == pytest.approx(sum(map(sum, trained)) / (4 * len(trained)))
        else:
            assert record["reward_kept"] is None and record["loss"] is None     # nothing trained: NaN, null
        assert record["frac_filtered_groups"] == len(dropped) / len(groups)
        step = record["step"]
        trains = ["no group to train on: the step takes no update", "the step trains on that one alone",
                  ""][min(len(informative), 2)]
        line = (f"step {step}: dynamic sampling ended short: {len(informative)} informative "
                f"group{'' if len(informative) == 1 else 's'} of the 2 wanted "
                f"(prompts_per_step) after 2 rounds (max_sampling_rounds), {len(dropped)} of the {len(groups)} "
                f"groups generated dropped for equal tests.helpers:recording_reward; {trains}")
        assert (line in logged) == (len(informative) < 2), (line, logged)
        short += [step] * (len(informative) < 2)
        progress = [text for text in logged if text.startswith(f"step {step}/3: ")]
        assert f"filtered {record['frac_filtered_groups']:.2f}, " in progress[0]
    assert next(scored, None) is None and short and short != [1, 2, 3], short   # short steps and full ones


def test_a_rollout_process_samples_the_further_rounds(tmp_path):
    """max_staleness 1: the step's own rollouts come from the process a step ahead, the further rounds from it too
    (blocking requests, from the newest weights); the importance correction weighs both."""
    history = T.train(flat_config(**{**RUN, "max_steps": 3}, max_staleness=1, importance_sampling="token_truncate",
                                  output_dir=str(tmp_path / "run")), log=lambda *_: None)
    assert [r["step"] for r in history] == [1, 2, 3]
    assert any(r["sampling_rounds"] > 1 for r in history) and all("staleness" in r for r in history)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm is not installed")
def test_the_vllm_engine_samples_the_further_rounds(tmp_path):
    code = f"""
import json
from grpo_fast.train.loop import train
from tests.helpers import flat_config
history = train(flat_config(**{{**{RUN!r}, "max_steps": 2}}, engine="vllm", output_dir={str(tmp_path / "run")!r}),
                log=lambda *_: None)
print("RESULT " + json.dumps([[r["sampling_rounds"], r["frac_filtered_groups"]] for r in history]))
"""
    env = {**os.environ, "PYTHONPATH": helpers.ROOT}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900, env=env,
                          cwd=helpers.ROOT)
    assert done.returncode == 0, done.stderr[-4000:]
    rows = json.loads(done.stdout.split("RESULT ")[-1])
    assert len(rows) == 2 and any(rounds > 1 for rounds, _ in rows)


def test_two_processes_run_their_rounds_in_lockstep(tmp_path):
    """torchrun, FSDP2: each rank draws its own further prompts, and every rank runs as many rounds as the
    neediest (a sharded policy generates in lockstep: a rank that stopped early would hang the other)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("TRITON_INTERPRET", None)
    out = tmp_path / "two"
    command = torchrun_command(2) + [
        "-m", "grpo_fast.cli", "train", "--sft-steps", "20", "--max-steps", "2", "--group-size", "4",
        "--prompts-per-step", "4", "--log-completions", "0", "--eval-every", "0", "--dynamic-sampling", "true",
        "--steps-per-generation", "2", "--distributed", "fsdp2", "--output-dir", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-5000:]
    rows = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    assert [r["step"] for r in rows] == [1, 2] and all(1 <= r["sampling_rounds"] <= 3 for r in rows)
