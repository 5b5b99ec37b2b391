"""verl 0.9's ActorRolloutRefWorker (verl.workers.engine_workers, role "actor") on a CPU host, in one process over
gloo, without Ray: the worker is built from verl's own hydra config (ppo_trainer.yaml composed with hydra's compose
API and checked by verl's validate_config, as main_ppo does) over an untied tiny Qwen2 saved under OUT_DIR, and its
methods are called as verl's trainer calls them:

- compute_log_prob on a GRPO batch (2 prompts, 4 responses each: left-padded prompts, right-padded responses of 1
  to 6 tokens), its TensorDict built as RayPPOTrainer._compute_old_log_prob builds it, with
  actor.calculate_sum_pi_squared on (verl's fused kernels refuse it; grpo_fast's forward returns it), and from its
  sum p^2 verl's optimal-token-baseline advantages, as RayPPOTrainer computes them under that estimator;
- update_actor on the same batch with those old log-probs, a reference log-prob input (the old ones perturbed,
  one token past verl's low_var_kl clamp of 10) and verl's GRPO advantages of rewards that differ within each
  prompt, its TensorDict built as RayPPOTrainer._update_actor builds it: 2 epochs of 2 mini-batches (one prompt's
  4 responses each, 4 optimizer steps) of 2 micro-batches each; verl's vanilla policy loss (token-mean), the k3
  KL loss and an entropy bonus; SGD, so that each step moves the weights by the clipped gradient itself;
- compute_log_prob again, on the updated weights.

MODE "verl": verl's own path (use_fused_kernels off, no external_lib; grpo_fast's adapter is never imported).
MODE "fused": the README's four keys, grpo_fast.integrations.verl loaded by verl's external_lib hook.

Prints `RESULT {json}`: the log-probs and entropies of the response tokens, the reference log-probs and advantages
given, update_actor's metrics (one entry per mini-batch step), how many micro-batches ran grpo_fast's fused loss
and grpo_fast's head, and the config values the checks need; writes the weights before and after update_actor
and each optimizer step's full gradient (before clipping) to OUT_DIR/MODE.pt. Where verl.workers.engine_workers
cannot be imported it prints `RESULT {"unavailable": why}` instead.

    python tests/integrations/verl_worker_check.py MODE OUT_DIR
"""

import json
import os
import socket
import sys

with socket.socket() as _sock:                  # one process, no Ray: the worker reads its rank from the environment
    _sock.bind(("127.0.0.1", 0))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_sock.getsockname()[1]), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")

try:
    # verl's CPU platform before any verl module: verl resolves its platform while importing its engines
    import grpo_fast.integrations.verl_cpu  # noqa: F401, I001
    from verl.workers import engine_workers
    UNAVAILABLE = None
except ImportError as error:
    UNAVAILABLE = f"{type(error).__name__}: {error}"

# isort: split
import numpy as np  # noqa: E402
import torch  # noqa: E402

PROMPT_LENS = [3, 5, 4, 2, 6, 2, 5, 4]             # 2 prompts' 4 responses each, in the trainer's interleaved order
RESPONSE_LENS = [6, 3, 5, 2, 4, 6, 1, 5]           # the response mask pads all but two of them
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.0, 1.0, 0.3, 0.0]
GROUP, VOCAB, TEMPERATURE = 4, 259, 0.8
GRPO_FAST = [
    "actor_rollout_ref.model.external_lib=grpo_fast.integrations.verl",
    "actor_rollout_ref.model.use_fused_kernels=True",
    "actor_rollout_ref.model.fused_kernel_options.impl_backend=torch",
    "actor_rollout_ref.model.use_remove_padding=True",
]


def overrides(model_path: str, mode: str) -> list:
    """ppo_trainer.yaml's overrides: GRPO with verl's vanilla policy loss, the k3 (low_var_kl) KL loss and an
    entropy bonus; examples/verl_grpo.py's CPU settings that concern the actor (FSDP2 over gloo, fp32, sdpa); SGD
    at a rate that makes the second epoch's ratios pass the clip (AdamW's first steps, about lr * sign(g), would
    turn the fp32 rounding of near-zero gradient entries into a share of the step, hiding the gradients' agreement
    in the weights')."""
    model = GRPO_FAST if mode == "fused" else ["actor_rollout_ref.model.use_fused_kernels=False",
                                               "actor_rollout_ref.model.use_remove_padding=True"]
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"actor_rollout_ref.model.path={model_path}", *model,
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
        "+actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.actor.optim.optimizer=SGD", "actor_rollout_ref.actor.optim.lr=1.0",
        "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.actor.ppo_epochs=2",
        "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla", "actor_rollout_ref.actor.loss_agg_mode=token-mean",
        "actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28",
        "actor_rollout_ref.actor.calculate_sum_pi_squared=True",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0.01",
        f"actor_rollout_ref.rollout.n={GROUP}", f"actor_rollout_ref.rollout.temperature={TEMPERATURE}",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        f"data.train_batch_size={len(PROMPT_LENS) // GROUP}", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
    ]


def compose_config(model_path: str, mode: str):
    """verl's ppo_trainer config with `overrides`, validated and resolved as main_ppo's task runner does."""
    import warnings

    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config

    with initialize_config_dir(os.path.join(os.path.dirname(verl.__file__), "trainer", "config"), version_base=None):
        config = compose("ppo_trainer", overrides=overrides(model_path, mode))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # "Disabled critic as algorithm.adv_estimator != gae"
        validate_config(config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    OmegaConf.resolve(config)
    return config


def rollout_batch():
    """The batch as verl's trainer holds it after generation and reward: a DataProto of prompts (left-padded),
    responses (right-padded), input_ids, attention_mask, position_ids, response_mask and the rewards at each
    response's last token, each response's prompt uid, and the meta info the trainer sets."""
    from verl import DataProto

    g = torch.Generator().manual_seed(0)
    batch, prompt, response = len(PROMPT_LENS), max(PROMPT_LENS), max(RESPONSE_LENS)
    input_ids = torch.randint(VOCAB, (batch, prompt + response), generator=g)
    attention = torch.zeros(batch, prompt + response, dtype=torch.long)
    scores = torch.zeros(batch, response)
    for i, (p, r) in enumerate(zip(PROMPT_LENS, RESPONSE_LENS)):
        attention[i, prompt - p:prompt + r] = 1
        scores[i, r - 1] = REWARDS[i]
    input_ids[attention == 0] = 0
    return DataProto.from_dict(
        tensors=dict(prompts=input_ids[:, :prompt], responses=input_ids[:, prompt:], input_ids=input_ids,
                     attention_mask=attention, position_ids=(attention.cumsum(-1) - 1).clamp(min=0),
                     response_mask=attention[:, prompt:].clone(), token_level_scores=scores),
        non_tensors={"uid": np.array([f"prompt{i // GROUP}" for i in range(batch)], dtype=object)},
        meta_info={"temperature": TEMPERATURE, "global_token_num": attention.sum(-1).tolist(), "images_seqlens": []})


def old_log_prob_td(batch, config):
    """RayPPOTrainer._compute_old_log_prob's steps 1-3: to_tensordict, left_right_2_no_padding, its meta keys."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    batch_td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(batch_td, calculate_entropy=True, compute_loss=False,
                         calculate_sum_pi_squared=config.actor_rollout_ref.actor.get("calculate_sum_pi_squared", False))
    return batch_td


def update_actor_td(batch, config):
    """RayPPOTrainer._update_actor's steps up to the worker call (distillation off)."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    actor, rollout = config.actor_rollout_ref.actor, config.actor_rollout_ref.rollout
    batch.meta_info["multi_turn"] = rollout.multi_turn.enable
    batch.meta_info["temperature"] = rollout.temperature
    batch_td = left_right_2_no_padding(batch.to_tensordict())
    mini_batch_size = actor.ppo_mini_batch_size * rollout.n
    tu.assign_non_tensor(batch_td, calculate_entropy=actor.calculate_entropy or actor.entropy_coeff != 0.0,
                         distillation_use_topk=False, distillation_only=False, global_batch_size=mini_batch_size,
                         mini_batch_size=mini_batch_size, epochs=actor.ppo_epochs, seed=actor.data_loader_seed,
                         dataloader_kwargs={"shuffle": actor.shuffle}, compute_loss=True)
    return batch_td


def full(tensor):
    """A parameter's or gradient's full tensor (FSDP2 holds DTensors)."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().clone()


def log_probs_of(worker, config):
    """compute_log_prob of rollout_batch, as the trainer calls it: (B, response) log-probs, entropies and sum p^2."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import no_padding_2_padding

    batch_td = old_log_prob_td(rollout_batch(), config)
    output = worker.compute_log_prob(batch_td)
    return tuple(no_padding_2_padding(tu.get(output, key), batch_td).float()
                 for key in ("log_probs", "entropy", "sum_pi_squared"))


def main(mode: str, out_dir: str) -> dict:
    from contextlib import nullcontext

    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage, compute_optimal_token_baseline_advantage
    from verl.utils import tensordict_utils as tu

    from tests.helpers import counting_calls, tiny_model, tiny_tokenizer

    torch.set_num_threads(1)                          # the two modes run side by side
    model_path = os.path.join(out_dir, mode, "tiny_qwen2")
    tiny_model(VOCAB).save_pretrained(model_path)      # untied head; the same seed, the same weights in both modes
    tiny_tokenizer().save_pretrained(model_path)
    config = compose_config(model_path, mode)
    worker = engine_workers.ActorRolloutRefWorker(config=config.actor_rollout_ref, role="actor",
                                                  distillation_config=config.get("distillation"))
    worker.init_model()
    gf_verl = sys.modules.get("grpo_fast.integrations.verl")       # loaded by verl's external_lib hook, or not
    engine = worker.actor.engine
    before = {name: full(p) for name, p in engine.module.named_parameters()}

    def counting(name):
        return counting_calls(gf_verl, name) if gf_verl is not None else nullcontext({"calls": 0})

    # old log-probs, as _compute_old_log_prob
    with counting("token_logprobs") as head:
        old_log_probs, entropy, sum_pi_squared = log_probs_of(worker, config)
    # the reference log-probs (given here) and verl's GRPO advantages, added to the batch as the trainer adds them
    batch = rollout_batch()
    mask = batch.batch["response_mask"].bool()
    ref = old_log_probs + 0.3 * torch.randn(old_log_probs.shape, generator=torch.Generator().manual_seed(1))
    ref[0, 0] = old_log_probs[0, 0] - 15.0       # its low_var_kl, exp(-15) + 15 - 1 = 14, passes verl's clamp of 10
    batch.batch.update({"old_log_probs": old_log_probs, "ref_log_prob": ref,
                        "token_level_rewards": batch.batch["token_level_scores"]})
    advantages, returns = compute_grpo_outcome_advantage(batch.batch["token_level_rewards"], mask.long(),
                                                         batch.non_tensor_batch["uid"])
    batch.batch.update({"advantages": advantages, "returns": returns})
    otb_advantages, _ = compute_optimal_token_baseline_advantage(
        batch.batch["token_level_rewards"], mask.float(), batch.non_tensor_batch["uid"], old_log_probs, sum_pi_squared)

    grads, optimizer_step = [], engine.optimizer_step

    def recording_step():                            # each step's full gradient, before verl's clip
        grads.append({name: full(p.grad) for name, p in engine.module.named_parameters()})
        return optimizer_step()

    engine.optimizer_step = recording_step
    with counting("fused_ppo_loss") as fused:
        output = worker.update_actor(update_actor_td(batch, config))
    engine.optimizer_step = optimizer_step
    metrics = {key: [float(v) for v in (value if isinstance(value, list) else [value])]
               for key, value in tu.get(output, "metrics").items()}
    after = {name: full(p) for name, p in engine.module.named_parameters()}
    new_log_probs, *_ = log_probs_of(worker, config)
    torch.save({"before": before, "after": after, "grads": grads}, os.path.join(out_dir, f"{mode}.pt"))
    actor = config.actor_rollout_ref.actor
    return {
        "mode": mode, "grpo_fast_loaded": gf_verl is not None,
        "forward": type(engine.module).forward.__module__,
        "fused_loss_calls": fused["calls"], "head_calls": head["calls"], "optimizer_steps": len(grads),
        "response_lengths": mask.sum(-1).tolist(), "max_response_length": mask.shape[1],
        "old_log_probs": old_log_probs[mask].tolist(), "entropy": entropy[mask].tolist(),
        "sum_pi_squared": sum_pi_squared[mask].tolist(), "otb_advantages": otb_advantages[mask].tolist(),
        "new_log_probs": new_log_probs[mask].tolist(), "ref_log_prob": ref[mask].tolist(),
        "advantages": advantages[mask].tolist(), "metrics": metrics,
        "config": {"entropy_coeff": actor.entropy_coeff, "kl_loss_coef": actor.kl_loss_coef,
                   "clip_grad": actor.optim.clip_grad, "ppo_epochs": actor.ppo_epochs, "group": GROUP,
                   "micro_batch": actor.ppo_micro_batch_size_per_gpu,
                   "use_fused_kernels": config.actor_rollout_ref.model.use_fused_kernels},
    }


if __name__ == "__main__":
    if UNAVAILABLE is not None:
        print("RESULT " + json.dumps({"unavailable": UNAVAILABLE}), flush=True)
        sys.exit(0)
    print("RESULT " + json.dumps(main(sys.argv[1], sys.argv[2])), flush=True)
    torch.distributed.destroy_process_group()
    os._exit(0)                  # skip the teardown of gloo's native threads once the result is out
