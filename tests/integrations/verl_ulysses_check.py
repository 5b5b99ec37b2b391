"""verl 0.9's FSDP2 actor engine with Ulysses sequence parallelism (ulysses_sequence_parallel_size 2) on 2 CPU
processes over gloo, with grpo_fast's model forward (use_fused_kernels, grpo_fast.integrations.verl loaded) and with
verl's own logits path, each engine built from the same saved weights and given the same batch on both ranks (one
sequence-parallel group: verl's worker hands a group's ranks the same data):

- "sp1": verl's logits path without sequence parallelism (the reference);
- "verl_sp2": verl's logits path, sequence parallel;
- "sdpa_sp2": verl's logits path, sequence parallel, on PyTorch's sdpa attention (the control below);
- "grpo_fast_sp2": grpo_fast's forward, sequence parallel (the actor loss is verl's own on its log-probs);
- "grpo_fast_sdpa_sp2": grpo_fast's forward, sequence parallel on sdpa: the error it raises.

verl's Ulysses exchange lives in its replacement of transformers' `_flash_attention_forward`
(verl/models/transformers/monkey_patch.py, `_ulysses_flash_attention_forward`): only the flash-attention path
exchanges sequence shards for heads. flash-attn needs CUDA, so these engines run transformers' flash-attention
integration under the attention name "cpu_varlen", with the kernel underneath verl's exchange (the
`_flash_attention_forward` verl's wrapper calls) replaced by `cpu_varlen_attention`, causal sdpa within each packed
sequence; everything around it (the all-to-alls, the position-id gather, slicing, padding, the gather of the
log-probs, the gradient's scaling) is verl's. "sdpa_sp2" shows why: on sdpa, verl's Ulysses leaves each rank
attending within its own shard, which grpo_fast's forward refuses.

Per engine: infer_batch's log-probs, entropies and sum p^2, one forward_backward_batch (verl's ppo_loss, vanilla, with
KL and entropy bonus) with its metrics and every parameter's full gradient, the weights after the optimizer step
(SGD) and infer_batch's log-probs on them. Rank 0 prints one JSON line.

    torchrun --nproc_per_node 2 -m tests.integrations.verl_ulysses_check OUTPUT_DIR
"""

import json
import os
import sys
import warnings

os.environ.setdefault("VERL_ENGINE_DEVICE", "cuda")     # the CPU engine registers as cuda (verl_cpu)

# verl's CPU platform before any verl module: verl resolves its platform while importing its engines
import grpo_fast.integrations.verl_cpu  # noqa: E402, F401, I001

# isort: split
from functools import partial  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import AttentionInterface  # noqa: E402
from transformers.integrations.flash_attention import flash_attention_forward  # noqa: E402
from verl.models.transformers import monkey_patch  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

from grpo_fast.integrations import verl as gf_verl  # noqa: E402
from tests.helpers import counting_calls, tiny_model, tiny_tokenizer  # noqa: E402
from tests.integrations.test_verl import actor_config, metric_values, micro_batch  # noqa: E402

VOCAB, TEMPERATURE = 259, 0.8
PROMPTS, RESPONSES = [3, 5, 2, 4], [6, 1, 4, 4]        # micro-batches of 15 and 14 packed tokens: 15 needs verl's pad
ATTENTION = "cpu_varlen"


def cpu_varlen_attention(query_states, key_states, value_states, attention_mask, query_length, *args,
                         position_ids=None, softmax_scale=None, is_causal=True, sliding_window=None, **kwargs):
    """flash-attention's varlen forward on the CPU: causal attention within each packed sequence (one starts where
    position_ids is 0), query (1, T, heads, d), key and value (1, T, kv_heads, d) -> (1, T, heads, d)."""
    if attention_mask is not None or position_ids is None or not is_causal or sliding_window is not None:
        raise ValueError(f"cpu_varlen_attention: packed causal rows only, got attention_mask "
                         f"{attention_mask is not None}, position_ids {position_ids is not None}, is_causal "
                         f"{is_causal}, sliding_window {sliding_window}")
    q, k, v = (t.transpose(1, 2) for t in (query_states, key_states, value_states))
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))   # GQA: head h reads h // group
    starts = (position_ids.reshape(-1) == 0).nonzero().flatten().tolist() + [q.shape[2]]
    out = torch.cat([F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], is_causal=True,
                                                    scale=softmax_scale) for a, b in zip(starts, starts[1:])], dim=2)
    return out.transpose(1, 2)


AttentionInterface.register(ATTENTION, flash_attention_forward)   # transformers' flash path, which verl patches
monkey_patch._flash_attention_forward = cpu_varlen_attention       # the kernel verl's Ulysses wrapper calls


def build_engine(path: str, fused_kernels: bool, sp_size: int, attention: str = ATTENTION):
    """verl's FSDP2 actor engine from its own configs and EngineRegistry (as benchmarks/verl_engine.py's), fp32,
    remove-padding, micro-batches of 2, SGD at lr 0.5, with Ulysses over `sp_size` ranks."""
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine import EngineRegistry

    model_config = HFModelConfig(path=path, load_tokenizer=False, use_remove_padding=True,
                                 enable_gradient_checkpointing=False, use_fused_kernels=fused_kernels,
                                 fused_kernel_options={"impl_backend": "torch"},
                                 override_config={"attn_implementation": attention})
    engine_config = FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", use_torch_compile=False,
                                     micro_batch_size_per_gpu=2, use_dynamic_bsz=False,
                                     ulysses_sequence_parallel_size=sp_size,
                                     mixed_precision={"param_dtype": "fp32", "reduce_dtype": "fp32",
                                                      "buffer_dtype": "fp32"})
    engine = EngineRegistry.new(model_type="language_model", backend="fsdp2", model_config=model_config,
                                engine_config=engine_config,
                                optimizer_config=FSDPOptimizerConfig(optimizer="SGD", lr=0.5, clip_grad=1e6),
                                checkpoint_config=CheckpointConfig())
    engine.initialize()
    return engine


def batch(fused_kernels: bool):
    """The same 4 sequences on every rank, with verl's micro-batch settings."""
    data = micro_batch(PROMPTS, RESPONSES, VOCAB, dtype=torch.float32, far=False, seed=0)
    tu.assign_non_tensor(data, use_remove_padding=True, use_fused_kernels=fused_kernels, calculate_entropy=True,
                         temperature=TEMPERATURE, micro_batch_size_per_gpu=2, use_dynamic_bsz=False)
    return data


def full(tensor):
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().flatten().tolist()


def infer(engine, fused_kernels: bool) -> dict:
    """infer_batch's log-probs, entropies and sum p^2 (verl's optimal token baseline asks for them)."""
    data = batch(fused_kernels)
    tu.assign_non_tensor(data, calculate_sum_pi_squared=True)
    with engine.eval_mode():
        output = engine.infer_batch(data)["model_output"]
    return {key: output[key].values().tolist() for key in ("log_probs", "entropy", "sum_pi_squared")}


def run(engine, fused_kernels: bool) -> dict:
    """infer_batch, one update (forward_backward_batch and the optimizer step), infer_batch again."""
    result = {"before": infer(engine, fused_kernels), "use_ulysses_sp": engine.use_ulysses_sp}
    with counting_calls(gf_verl, "fused_ppo_loss") as fused, counting_calls(gf_verl, "token_logprobs") as head, \
            warnings.catch_warnings(record=True) as caught, engine.train_mode():
        warnings.simplefilter("always")
        engine.optimizer_zero_grad()
        output = engine.forward_backward_batch(batch(fused_kernels), partial(ppo_loss, config=actor_config()))
        result["grads"] = {name: full(p.grad) for name, p in engine.module.named_parameters()}
        engine.optimizer_step()
    result["metrics"] = {key: [metric_values({key: v})[key] for v in (value if isinstance(value, list) else [value])]
                         for key, value in output["metrics"].items()}
    result["weights"] = {name: full(p) for name, p in engine.module.named_parameters()}
    result["after"] = infer(engine, fused_kernels)
    result["fused_calls"], result["head_calls"] = fused["calls"], head["calls"]
    result["warnings"] = sorted({str(w.message) for w in caught if "grpo_fast" in str(w.message)})
    return result


def main(output_dir: str):
    torch.distributed.init_process_group("gloo")
    torch.manual_seed(0)
    path = os.path.join(output_dir, "tiny_qwen2")
    if torch.distributed.get_rank() == 0:
        tiny_model(VOCAB).save_pretrained(path)          # 4 heads, 2 key/value heads: 2 ranks split both
        tiny_tokenizer().save_pretrained(path)
    torch.distributed.barrier()
    result = {"world_size": torch.distributed.get_world_size()}
    initial = None
    # grpo_fast's last: verl installs the fused forward on the model's class, for every later engine
    for name, fused_kernels, sp_size, attention in (("sp1", False, 1, ATTENTION), ("verl_sp2", False, 2, ATTENTION),
                                                    ("sdpa_sp2", False, 2, "sdpa"),
                                                    ("grpo_fast_sp2", True, 2, ATTENTION)):
        engine = build_engine(path, fused_kernels, sp_size, attention)
        weights = {n: full(p) for n, p in engine.module.named_parameters()}
        initial = initial or weights
        result[name] = run(engine, fused_kernels)
        result[name]["same_initial_weights"] = weights == initial
        result[name]["forward"] = type(engine.module).forward.__module__
        del engine
    try:                                                 # grpo_fast's forward refuses sdpa under Ulysses
        infer(build_engine(path, True, 2, "sdpa"), True)
        result["grpo_fast_sdpa_sp2"] = "ran"
    except ValueError as error:
        result["grpo_fast_sdpa_sp2"] = str(error)
    result["initial"] = initial
    if torch.distributed.get_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)                  # skip the teardown of gloo's native threads once the result is out
