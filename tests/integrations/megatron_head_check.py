"""verl's Megatron fused forward's head on 2 gloo ranks, as verl runs it under tensor parallelism with sequence
parallelism: megatron.core's parallel_state with tensor_model_parallel_size 2, each rank's slice of the sequence
gathered by megatron's `gather_from_sequence_parallel_region`, then the `linear_cross_entropy` that
verl.models.mcore.model_forward_fused calls (grpo_fast's, once grpo_fast.integrations.verl is imported) on this
rank's rows of an uneven vocabulary split, with the tensor-parallel group.

Rank 0 prints one JSON line: the log-probs and entropies (every rank's must be the full ones), each rank's
d(weight) rows, and each rank's d(hidden) for its own slice of the sequence after the gather's reduce-scatter
backward, in float64, with the full-head inputs so the test can build the reference.

    torchrun --nproc_per_node 2 -m tests.integrations.megatron_head_check
"""

import json

# verl's CPU platform before any verl module (verl resolves its platform while importing)
import grpo_fast.integrations.verl_cpu  # noqa: F401, I001

# isort: split
import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from verl.models.mcore import model_forward_fused

import grpo_fast.integrations.verl  # noqa: F401  (patches model_forward_fused.linear_cross_entropy)

# megatron's sequence-parallel gather and its reduce-scatter backward allocate their buffers on
# torch.cuda.current_device(): on a CPU-only torch the process's one device is the CPU
torch.cuda.current_device = lambda: "cpu"

SEQUENCE, HIDDEN, VOCAB, TEMPERATURE = 10, 8, 37, 0.7
SPLIT = [20, 17]                            # uneven rows: Megatron pads its vocabulary, other heads need not


def inputs():
    """The full-head inputs, the same on every rank: hidden (S, 1, H) as Megatron's decoder returns it,
    weight (V, H), labels (1, S), the upstream gradients of log-probs and entropies."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(SEQUENCE, 1, HIDDEN, generator=g, dtype=torch.float64)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, dtype=torch.float64)
    labels = torch.randint(VOCAB, (1, SEQUENCE), generator=g)
    dlogp = torch.randn(SEQUENCE, generator=g, dtype=torch.float64)
    dentropy = torch.randn(SEQUENCE, generator=g, dtype=torch.float64)
    return hidden, weight, labels, dlogp, dentropy


def main():
    dist.init_process_group("gloo")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    rank, size = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()
    hidden, weight, labels, dlogp, dentropy = inputs()
    rows = slice(sum(SPLIT[:rank]), sum(SPLIT[:rank + 1]))
    local_weight = weight[rows].clone().requires_grad_()
    local_hidden = hidden.chunk(size, dim=0)[rank].clone().requires_grad_()    # this rank's sequence slice
    gathered = gather_from_sequence_parallel_region(local_hidden)
    logp, entropy = model_forward_fused.linear_cross_entropy(
        gathered, local_weight, labels, TEMPERATURE, "none", parallel_state.get_tensor_model_parallel_group())
    ((logp * dlogp).sum() + (entropy * dentropy).sum()).backward()
    mine = {"logp": logp.tolist(), "entropy": entropy.tolist(), "dweight": local_weight.grad.tolist(),
            "dhidden": local_hidden.grad.tolist(), "logp_shape": list(logp.shape)}
    every = [None] * size
    dist.all_gather_object(every, mine)
    if rank == 0:
        print(json.dumps({"world_size": size, "patched": model_forward_fused.linear_cross_entropy.__module__,
                          "ranks": every, "split": SPLIT, "temperature": TEMPERATURE,
                          "inputs": [tensor.tolist() for tensor in inputs()]}))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
