"""FastGRPOTrainer and GRPOTrainer under DeepSpeed ZeRO-3 on CPU processes (gloo): the same tiny model and seed,
a few steps each. Run in fresh processes by test_trl_zero3.py (DeepSpeed leaves accelerate's shared state and a
process group behind); rank 0 prints one JSON line: each trainer's logged values, the largest difference between
their updated weights and how far training moved them.

    torchrun --nproc_per_node 2 -m tests.integrations.zero3_parity OUTPUT_DIR '{"beta": 0.04}'
"""

import json
import os
import sys

for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29517", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
    os.environ.setdefault(key, value)         # one process without torchrun

import deepspeed  # noqa: E402
import deepspeed.comm.torch  # noqa: E402, F401
import torch  # noqa: E402

# DeepSpeed compiles a shared-memory collective (g++, ~40 s) when it first sets up communication, for its CPU
# all-reduce within a node; gloo carries these tests' collectives without it.
sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None

import trl  # noqa: E402

# DeepSpeed's own communication must be up before zero.Init reads the world size (accelerate would start only
# torch.distributed).
deepspeed.init_distributed(dist_backend="gloo")

from grpo_fast.integrations import trl as dropin  # noqa: E402
from tests.helpers import counting_calls, run_grpo, tiny_model  # noqa: E402

ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
         "gradient_clipping": "auto", "steps_per_print": 10**9, "zero_force_ds_cpu_optimizer": False,
         # 0: every parameter stays partitioned between uses, however small (the default keeps < 1e5 gathered)
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
KEYS = ("loss", "grad_norm", "entropy", "kl", "clip_ratio/region_mean")


def run(trainer_cls, output_dir, config):
    trainer = run_grpo(trainer_cls, output_dir, steps=3, deepspeed=ZERO3, **config)
    model = trainer.accelerator.unwrap_model(trainer.model)
    head = model.get_output_embeddings().weight
    # a partition between uses, each rank holding its share of the elements
    partitioned = hasattr(head, "ds_id") and head.numel() == 0 and head.ds_tensor.numel() < head.ds_numel
    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    logs = [{k: entry[k] for k in KEYS if k in entry} for entry in trainer.state.log_history
            if "loss" in entry and "train_runtime" not in entry]
    return logs, weights, partitioned, trainer.fallback_reasons({}) if hasattr(trainer, "fallback_reasons") else []


def main(output_dir, config):
    expected, expected_weights, _, _ = run(trl.GRPOTrainer, f"{output_dir}/trl", config)
    with counting_calls(dropin, "checked_policy_loss") as fused_loss:
        actual, weights, partitioned, reasons = run(dropin.FastGRPOTrainer, f"{output_dir}/fast", config)
    initial = tiny_model(len(weights["model.embed_tokens.weight"])).state_dict()
    if torch.distributed.get_rank() != 0:
        return
    print(json.dumps({
        "expected": expected, "actual": actual, "fused_loss_calls": fused_loss["calls"], "fallback_reasons": reasons,
        "head_partitioned": partitioned,
        "weight_diff": max((weights[n] - expected_weights[n]).abs().max().item() for n in weights),
        "moved": max((weights[n] - initial[n]).abs().max().item() for n in weights),
        "head_moved": (weights["lm_head.weight"] - initial["lm_head.weight"]).abs().max().item(),
    }))


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
    # Both ranks leave together: rank 1 used to tear its group down while rank 0 was still reading weights, and
    # once in CI (transformers 5.25, deepspeed 0.19.8) its exit then aborted in a C++ destructor ("terminate called
    # without an active exception") after every check had run. The result is printed by now, so the process skips
    # the interpreter's teardown of DeepSpeed's and gloo's native threads.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
