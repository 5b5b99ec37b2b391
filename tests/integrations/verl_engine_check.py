"""verl 0.9's FSDP2 actor engine (FSDPEngineWithLMHead, built by verl's EngineRegistry from its own configs) on CPU
processes over gloo, an untied tiny Qwen2 sharded across the ranks: the same micro-batches through three model
forwards, each in an engine of its own built from the same saved weights:

- "logits": use_fused_kernels off, verl's logits path (the reference);
- "grpo_fast": use_fused_kernels with grpo_fast.integrations.verl loaded (vanilla fused, gspo two-phase);
- "verl_fused": use_fused_kernels with verl's own torch-backend forward, which reads lm_head.weight outside the
  module (the error it raises is reported, not raised).

Rank 0 prints one JSON line: per engine and loss mode, the loss, verl's metrics and every parameter's full
gradient (gathered from the shards), and the old log-probs of infer_batch.

    torchrun --nproc_per_node 2 -m tests.integrations.verl_engine_check OUTPUT_DIR
"""

import json
import os
import sys
import warnings

for key, value in dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531", RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                       VERL_ENGINE_DEVICE="cuda").items():
    os.environ.setdefault(key, value)          # one process without torchrun; the CPU engine registers as cuda

# verl's CPU platform before any verl module: verl resolves its platform while importing its engines
import grpo_fast.integrations.verl_cpu  # noqa: E402, F401, I001

# isort: split
from functools import partial  # noqa: E402

import torch  # noqa: E402
from verl.models.transformers import dense_common  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

VERL_FORWARD = dense_common.forward_with_torch_backend      # verl's own, before grpo_fast's install replaces it

from grpo_fast.benchmarks.verl_engine import build_engine  # noqa: E402
from grpo_fast.integrations import verl as gf_verl  # noqa: E402
from tests.helpers import counting_calls, tiny_model, tiny_tokenizer  # noqa: E402
from tests.integrations.test_verl import actor_config, metric_values, micro_batch  # noqa: E402

VOCAB = 259
PROMPTS, RESPONSES = [3, 5, 2, 4, 6, 3, 2, 5], [6, 1, 4, 3, 5, 2, 7, 4]


def rank_batch(fused_kernels: bool):
    """This rank's share of the sequences (every world_size-th), with verl's micro-batch settings."""
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    data = micro_batch(PROMPTS[rank::world], RESPONSES[rank::world], VOCAB, dtype=torch.float32, far=False,
                       seed=rank)
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=fused_kernels, calculate_entropy=True,
                         temperature=0.8, micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
    return data


def step(engine, fused_kernels: bool, loss_mode: str):
    """forward_backward_batch as train_batch runs it (without the optimizer step): loss, metrics, full grads."""
    config = actor_config(loss_mode, "seq-mean-token-mean")
    with counting_calls(gf_verl, "fused_ppo_loss") as fused, engine.train_mode():
        engine.optimizer_zero_grad()
        output = engine.forward_backward_batch(rank_batch(fused_kernels), partial(ppo_loss, config=config))
        grads = {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).flatten().tolist()
                 for name, p in engine.module.named_parameters()}
    metrics = {key: [metric_values({key: v})[key] for v in (value if isinstance(value, list) else [value])]
               for key, value in output["metrics"].items()}
    return {"metrics": metrics, "grads": grads, "fused_calls": fused["calls"]}


def old_logprobs(engine, fused_kernels: bool):
    with engine.eval_mode():
        output = engine.infer_batch(rank_batch(fused_kernels))
    return output["model_output"]["log_probs"].values().tolist()


def main(output_dir: str):
    torch.distributed.init_process_group("gloo")
    path = os.path.join(output_dir, "tiny_qwen2")
    if torch.distributed.get_rank() == 0:
        tiny_model(VOCAB).save_pretrained(path)          # untied head: its own FSDP2 unit
        tiny_tokenizer().save_pretrained(path)
    torch.distributed.barrier()
    result = {"world_size": torch.distributed.get_world_size()}
    for name, fused_kernels in (("logits", False), ("grpo_fast", True)):
        engine = build_engine(path, fused_kernels, micro_batch=2)
        result[name] = {mode: step(engine, fused_kernels, mode) for mode in ("vanilla", "gspo")}
        result[name]["infer_log_probs"] = old_logprobs(engine, fused_kernels)
        result[name]["lm_head_is_own_unit"] = type(engine.module.lm_head).__name__.startswith("FSDP")
    dense_common.forward_with_torch_backend = VERL_FORWARD   # verl's own fused forward, as without grpo_fast
    try:
        engine = build_engine(path, True, micro_batch=2)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            step(engine, True, "gspo")                   # gspo: verl's forward_step, verl's forward
        result["verl_fused"] = "ran"
    except Exception as error:                           # noqa: BLE001 - reported to the test
        result["verl_fused"] = f"{type(error).__name__}: {error}"[:300]
    finally:
        gf_verl.install()
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)                  # skip the teardown of gloo's and ray's native threads once the result is out
