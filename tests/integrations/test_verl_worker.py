"""verl 0.9's ActorRolloutRefWorker (role "actor") built from verl's own ppo_trainer config, on the CPU in one process
without Ray, driven as verl's trainer drives it (verl_worker_check.py): compute_log_prob, then update_actor (GRPO,
verl's vanilla policy loss, the k3 KL loss against a given reference, an entropy bonus; 2 epochs of 2 mini-batches
of 2 micro-batches), then compute_log_prob on the updated weights; once in verl's own mode and once with grpo_fast's
four keys, each in its own process, from the same saved weights and the same batch.

Compared, fused against verl's own: the old log-probs and entropies (to 1e-5), every metric update_actor reports at
every optimizer step (pg_loss, entropy, kl_loss, loss, grad_norm, pg_clipfrac, ppo_kl, ...: 1e-5 relative), each
step's full gradient and the updated weights (1e-5 of each tensor's largest gradient entry or change), and the
updated policy's log-probs; that the fused worker's loss ran inside grpo_fast's sweep (its fused_ppo_loss once per
micro-batch) and verl's never loaded grpo_fast; and that what is compared is live: the first step's pg_loss,
entropy and KL equal verl's formulas on the inputs given, the KL clamp and the ratio clip act, the gradient clip
acts and every tensor moved. Runs in verl's end-to-end environment (requirements-verl-e2e.txt); skipped where verl
is not installed or verl.workers.engine_workers does not import (it needs Ray, hydra and verl's worker stack)."""

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tests.helpers import run_result_script

HERE = os.path.dirname(os.path.abspath(__file__))
MODES = ("verl", "fused")
NEEDS = "verl's end-to-end environment (requirements-verl-e2e.txt) is not installed"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason=NEEDS)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Both modes' results, run side by side (each pins itself to one thread), with their saved tensors."""
    out_dir = str(tmp_path_factory.mktemp("verl_worker"))
    script = os.path.join(HERE, "verl_worker_check.py")
    with ThreadPoolExecutor(len(MODES)) as pool:
        results = dict(zip(MODES, pool.map(lambda mode: run_result_script(script, mode, out_dir, timeout=600),
                                           MODES)))
    for result in results.values():
        if "unavailable" in result:
            pytest.skip(f"verl.workers.engine_workers cannot be imported ({result['unavailable']}): {NEEDS}")
    for mode in MODES:
        results[mode]["tensors"] = torch.load(os.path.join(out_dir, f"{mode}.pt"))
    return results


def close(got: float, want: float) -> bool:
    """Equal to 1e-5 of the value, or to 1e-6 for values under 0.1 (ppo_kl, a mean of differences of log-probs
    near -5, whose fp32 rounding is about 5e-7)."""
    return abs(got - want) <= 1e-5 * max(abs(want), 0.1)


def test_workers_ran_their_own_paths(runs):
    verl, fused = runs["verl"], runs["fused"]
    config = fused["config"]
    mini_batches = len(fused["response_lengths"]) // config["group"]
    steps = config["ppo_epochs"] * mini_batches
    assert verl["optimizer_steps"] == fused["optimizer_steps"] == steps == 4
    assert not verl["grpo_fast_loaded"] and not verl["config"]["use_fused_kernels"]
    assert verl["forward"].startswith("transformers.") and verl["fused_loss_calls"] == verl["head_calls"] == 0
    assert fused["grpo_fast_loaded"] and fused["config"]["use_fused_kernels"]
    assert fused["forward"] == "grpo_fast.integrations.verl"
    # every micro-batch of every step ran its loss inside grpo_fast's sweep; the old log-probs came from its head
    assert fused["fused_loss_calls"] == steps * config["group"] // config["micro_batch"] == 8
    assert fused["head_calls"] == 2                                   # 8 sequences, 4 a log-prob micro-batch


def test_compute_log_prob_equal(runs):
    """Old log-probs and entropies of every response token, and the updated policy's log-probs after 4 steps."""
    verl, fused = runs["verl"], runs["fused"]
    for key in ("old_log_probs", "entropy", "new_log_probs"):
        want, got = torch.tensor(verl[key]), torch.tensor(fused[key])
        assert want.shape == got.shape == (sum(verl["response_lengths"]),)
        assert (got - want).abs().max() <= 1e-5, (key, (got - want).abs().max().item())
    moved = torch.tensor(verl["new_log_probs"]) - torch.tensor(verl["old_log_probs"])
    assert moved.abs().max() > 0.5                                   # the update changed the policy


def test_optimal_token_baseline_inputs_and_advantages_equal(runs):
    """compute_log_prob with actor.calculate_sum_pi_squared: each token's sum p^2 from grpo_fast's sweep (fused
    kernels on) equals verl's from full logits (fused kernels off), and so do the optimal-token-baseline
    advantages verl's estimator builds from them and the old log-probs."""
    verl, fused = runs["verl"], runs["fused"]
    sums = torch.tensor(verl["sum_pi_squared"])
    assert sums.min() >= 1 / 259 and sums.max() <= 1                 # a probability of agreement: 1/V to 1
    assert (torch.tensor(fused["sum_pi_squared"]) - sums).abs().max() <= 1e-6
    want, got = torch.tensor(verl["otb_advantages"]), torch.tensor(fused["otb_advantages"])
    assert want.abs().max() > 0.1                                     # rewards differ within each prompt
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_update_actor_metrics_equal(runs):
    """Each metric verl reports, at each of the 4 optimizer steps (kl_coef once per micro-batch)."""
    verl, fused = runs["verl"]["metrics"], runs["fused"]["metrics"]
    assert verl.keys() == fused.keys()
    compared = [key for key in verl if not key.startswith("perf/")]      # the processes' memory
    for key in ("actor/pg_loss", "actor/entropy_loss", "kl_loss", "loss", "grad_norm", "actor/pg_clipfrac",
                "actor/ppo_kl", "actor/pg_clipfrac_lower"):
        assert key in compared and len(verl[key]) == 4, key
    for key in compared:
        assert len(fused[key]) == len(verl[key]), key
        for step, (want, got) in enumerate(zip(verl[key], fused[key])):
            assert close(got, want), (key, step, want, got)


def test_gradients_and_updated_weights_equal(runs):
    """Both workers started from the same weights; each step's gradient (before verl's clip) and the weights after
    update_actor agree to 1e-5 of each tensor's largest gradient entry or change, and every tensor moved."""
    verl, fused = runs["verl"]["tensors"], runs["fused"]["tensors"]
    assert verl["before"].keys() == fused["before"].keys() and "lm_head.weight" in verl["before"]
    for name, weight in verl["before"].items():
        assert torch.equal(weight, fused["before"][name]), name
    assert len(verl["grads"]) == len(fused["grads"]) == 4
    for step, (want, got) in enumerate(zip(verl["grads"], fused["grads"])):
        for name, grad in want.items():
            scale = grad.abs().max().item()
            assert scale > 0, (step, name)
            torch.testing.assert_close(got[name], grad, rtol=0, atol=1e-5 * scale, msg=f"step {step} {name}")
    changes = {}
    for name, after in verl["after"].items():
        change = changes[name] = (after - verl["before"][name]).abs().max().item()
        assert change > 0, name
        torch.testing.assert_close(fused["after"][name], after, rtol=0, atol=1e-5 * change, msg=name)
    assert max(changes.values()) > 0.05


@pytest.mark.parametrize("mode", MODES)
def test_every_term_is_live(runs, mode):
    """What the comparisons above compare can differ: the batch pads responses and its advantages differ within a
    prompt; at the first step (ratio 1: the old log-probs are the worker's own) pg_loss is -mean(advantage),
    entropy_loss the old entropies' mean and kl_loss the mean of verl's clamped k3 of the given reference, which
    the clamp moves by 0.25; loss combines them with their coefficients; later steps clip ratios and move them
    (ppo_kl), and the gradient clip acts."""
    run = runs[mode]
    metrics, config, lengths = run["metrics"], run["config"], run["response_lengths"]
    assert min(lengths) < run["max_response_length"] == max(lengths)
    first = sum(lengths[:config["group"]])                             # the first mini-batch's response tokens
    advantages = torch.tensor(run["advantages"], dtype=torch.float64)
    assert advantages[:first].unique().numel() == config["group"] and advantages.abs().min() > 0.01
    entropy = torch.tensor(run["entropy"], dtype=torch.float64)[:first]
    kl = (torch.tensor(run["ref_log_prob"], dtype=torch.float64) -
          torch.tensor(run["old_log_probs"], dtype=torch.float64))[:first]
    k3 = kl.exp() - kl - 1                                             # verl's low_var_kl before its clamp
    assert close(metrics["actor/pg_loss"][0], -advantages[:first].mean().item())
    assert close(metrics["actor/entropy_loss"][0], entropy.mean().item())
    assert close(metrics["kl_loss"][0], k3.clamp(-10, 10).mean().item())
    assert k3.mean() - k3.clamp(-10, 10).mean() > 0.2                  # the clamp is active
    assert close(metrics["loss"][0], metrics["actor/pg_loss"][0] - config["entropy_coeff"] *
                 metrics["actor/entropy_loss"][0] + config["kl_loss_coef"] * metrics["kl_loss"][0])
    assert metrics["actor/pg_clipfrac"][0] == 0 and min(metrics["actor/pg_clipfrac"][2:]) > 0.3   # epoch 2 clips
    assert min(abs(value) for value in metrics["actor/ppo_kl"][1:]) > 1e-3
    assert max(metrics["grad_norm"]) > config["clip_grad"]
