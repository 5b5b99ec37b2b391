"""examples/verl_grpo.py's own choices, without verl: the reward it learns with by default, the reproducible sampling
its CPU job sets itself, and verl's optimal token baseline, refused in one line on verl's default V1 trainer (which
never asks the actor for the sum of p^2 the baseline reads) and completed with the actor's
calculate_sum_pi_squared on the legacy one. That the overrides compose against verl's own config is
tests/integrations/test_verl.py's (verl's environment); that the job learns, test_verl_main_ppo.py's."""

import importlib.util
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT

EXAMPLE = os.path.join(ROOT, "examples", "verl_grpo.py")
SEED = "GRPO_FAST_VLLM_SEED_BY_PROMPT"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("verl_grpo", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def launched(example, monkeypatch, tmp_path, *argv) -> dict:
    """What main() would start: the command and its environment (nothing is built or run)."""
    calls = {}
    monkeypatch.setattr(example, "build_inputs", lambda out_dir: calls.setdefault("built", out_dir))
    monkeypatch.setattr(example.subprocess, "call", lambda command, env: calls.update(command=command, env=env) or 0)
    assert example.main([str(tmp_path / "out"), *argv]) == 0
    return calls


def test_the_default_reward_gives_a_random_policy_a_gradient(example, tmp_path):
    """partial_score by default: exact answers 1, others partial credit, so a random model's group differs (with
    exact match alone every completion of a random model scores 0: advantages and gradient 0)."""
    names = [item for item in example.overrides(str(tmp_path), example.input_paths(str(tmp_path)))
             if item.startswith("reward.custom_reward_function.name=")]
    assert names == ["reward.custom_reward_function.name=partial_score"]
    answer = "17"
    group = ["17", "1", "71", "x", ""]                 # what a random policy's samples of "9+8=" may look like
    assert len({example.partial_score("s", text, answer) for text in group}) == 4
    assert {example.compute_score("s", text, answer) for text in group[1:]} == {0.0}


def test_the_cpu_job_seeds_its_rollouts_by_prompt_unless_the_environment_does(example, monkeypatch, tmp_path):
    monkeypatch.delenv(SEED, raising=False)
    cpu = launched(example, monkeypatch, tmp_path, "--cpu")
    assert cpu["env"][SEED] == "0" and cpu["env"]["GRPO_FAST_VLLM_CPU_PLAIN_LINEAR"] == "1"
    monkeypatch.setenv(SEED, "7")
    assert launched(example, monkeypatch, tmp_path, "--cpu")["env"][SEED] == "7"
    monkeypatch.delenv(SEED)
    assert SEED not in launched(example, monkeypatch, tmp_path)["env"]          # a GPU job: the plugin is CPU-only


def test_optimal_token_baseline_asks_the_actor_for_the_sum_on_the_legacy_trainer(example, monkeypatch, tmp_path):
    for estimator in example.OPTIMAL_TOKEN_BASELINES:
        command = launched(example, monkeypatch, tmp_path, f"algorithm.adv_estimator={estimator}",
                           "trainer.use_v1=False")["command"]
        assert command[-3:] == [f"algorithm.adv_estimator={estimator}", "trainer.use_v1=False",
                                "actor_rollout_ref.actor.calculate_sum_pi_squared=True"]
    given = launched(example, monkeypatch, tmp_path, "algorithm.adv_estimator=optimal_token_baseline",
                     "+trainer.use_v1=false", "actor_rollout_ref.actor.calculate_sum_pi_squared=True")["command"]
    assert sum("calculate_sum_pi_squared" in item for item in given) == 1
    assert not any("calculate_sum_pi_squared" in item for item in launched(example, monkeypatch, tmp_path)["command"])


@pytest.mark.parametrize("extra", [["algorithm.adv_estimator=optimal_token_baseline"],
                                   ["algorithm.adv_estimator=tir_optimal_token_baseline", "trainer.use_v1=True"]])
def test_optimal_token_baseline_on_the_v1_trainer_is_one_line_before_anything_starts(tmp_path, extra):
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, EXAMPLE, str(out), "--cpu", *extra], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "needs trainer.use_v1=False" in result.stderr and extra[0] in result.stderr
    assert not out.exists()                                  # nothing built, nothing started
