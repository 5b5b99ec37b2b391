"""OpenRLHF's training_step under DeepSpeed ZeRO-3 on 2 CPU processes (gloo): the actor's model a DeepSpeed
engine whose LM head stays partitioned between uses, as OpenRLHF's strategy prepares it; OpenRLHF's own step and
the patched one (the fused sweep inside the engine's forward, the head gathered for it) from the same weights and
micro-batch on each rank. Rank 0 prints one JSON line: whether the head was partitioned, and each step's full
gradients (gathered from the partitions after the backward) and logged metrics.

    torchrun --nproc_per_node 2 -m tests.integrations.openrlhf_zero3_check
"""

import json
import os
import sys

for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29537", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
    os.environ.setdefault(key, value)         # one process without torchrun
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "openrlhf_support"))

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402, F401
import torch  # noqa: E402

# gloo carries these collectives; DeepSpeed's shared-memory CPU all-reduce would compile first (g++, ~40 s)
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
deepspeed.init_distributed(dist_backend="gloo")

from deepspeed.utils import safe_get_full_grad  # noqa: E402
from openrlhf.trainer.ray.ppo_actor import ActorPPOTrainer  # noqa: E402

from grpo_fast.integrations import openrlhf as gf_openrlhf  # noqa: E402
from tests.helpers import tiny_model  # noqa: E402
from tests.integrations.test_openrlhf import CASES, VOCAB, experience, trainer_for  # noqa: E402

ZERO3 = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 1, "steps_per_print": 10**9,
         "zero_force_ds_cpu_optimizer": False, "zero_allow_untested_optimizer": True,
         "optimizer": {"type": "SGD", "params": {"lr": 0.0}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}


class ZeroStrategy:
    """OpenRLHF's DeepSpeed strategy's calls in training_step: the engine's backward, and in place of its step
    the full gradients gathered from the ZeRO-3 partitions (then the engine's step, at learning rate 0)."""

    ring_attn_group = None

    def __init__(self):
        self.grads = None

    def backward(self, loss, model, optimizer, **kwargs):
        model.model.backward(loss)

    def optimizer_step(self, optimizer, model, scheduler, name="model", **kwargs):
        self.grads = {n: safe_get_full_grad(p).flatten().tolist() for n, p in model.model.module.named_parameters()}
        model.model.step()

    def get_grad_norm(self, model):
        return 0.0


def run(step, case):
    model = tiny_model(VOCAB)            # the same seed on both ranks and both runs
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ZERO3)
    trainer = trainer_for(model, CASES[case])
    trainer.actor.model = engine         # as OpenRLHF's strategy.prepare leaves the actor
    trainer.strategy = ZeroStrategy()
    head = engine.module.lm_head.weight
    partitioned = hasattr(head, "ds_id") and head.numel() == 0 and head.ds_tensor.numel() < head.ds_numel
    rank = torch.distributed.get_rank()
    data = experience(seed=rank)                      # each rank its own micro-batch, in the model's fp32
    for field in ("action_log_probs", "base_action_log_probs", "rollout_log_probs", "advantages"):
        setattr(data, field, getattr(data, field).float())
    status = step(trainer, data, 1.0, 0)
    metrics = {k: float(v) for k, v in status["metrics"].items() if torch.is_tensor(v) and v.numel() == 1}
    return {"partitioned": partitioned, "grads": trainer.strategy.grads, "metrics": metrics}


def main():
    result = {"world_size": torch.distributed.get_world_size()}
    for case in ("ppo_token_mean", "dual_clip_sample_mean"):
        result[case] = {"openrlhf": run(gf_openrlhf._original_training_step, case),
                        "grpo_fast": run(ActorPPOTrainer.training_step, case)}
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)              # skip the teardown of DeepSpeed's and gloo's native threads once the result is out
