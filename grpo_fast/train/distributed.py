"""Data-parallel training across processes (torchrun): PyTorch DDP or FSDP2, and the few collectives the trainer
needs. With one process everything here is a no-op.

    torchrun --nproc_per_node 2 -m grpo_fast.cli train --distributed ddp      # or fsdp2

Each rank generates and scores whole groups (its share of the step's prompts), so group advantages need no
communication; the loss's normalizers use the global token and sequence counts, and each rank's loss is scaled by
the world size because DDP and FSDP2 average gradients: the update equals one process's on the whole batch.

The data-parallel wrapper goes around `HiddenStates`, a module whose forward returns the decoder's final hidden
states (no logits), so DDP's and FSDP2's hooks run on the forward the loss actually uses.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from grpo_fast.fields import LENGTH, check_keys, key
from grpo_fast.models import final_hidden_states


@dataclass
class DistributionConfig:
    """The config section `distribution`: under torchrun each data-parallel group takes prompts_per_step / its
    number of groups prompts of each step, and the policy is wrapped as `distributed` says."""

    distributed: str = key("ddp", 'under torchrun: "ddp" (DistributedDataParallel) or "fsdp2" (fully_shard per '
                                  "decoder layer)", choices=("ddp", "fsdp2"))
    sequence_parallel: int = key(1, "processes that share each packed micro-batch's tokens (Ulysses, "
                                    "grpo_fast.sequence_parallel): consecutive ranks of torchrun form a group that "
                                    "trains on the same rollouts; 1: none", LENGTH)

    def __post_init__(self):
        check_keys(self)


@dataclass(frozen=True)
class World:
    """This process among torchrun's: rank of size; with sequence parallelism, consecutive groups of
    `sequence_parallel` ranks share each micro-batch's tokens (`sequence_group`: this rank's torch.distributed group)
    and train on the same rollouts, so the data is split over size / sequence_parallel data-parallel groups."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    sequence_parallel: int = 1
    sequence_group: object = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's data-parallel group: which share of each step's prompts it trains on."""
        return self.rank // self.sequence_parallel

    @property
    def data_size(self) -> int:
        """The number of data-parallel groups (shares of each step's prompts)."""
        return self.size // self.sequence_parallel


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def init(device_name: str, sequence_parallel: int = 1) -> World:
    """Joins the process group torchrun describes (WORLD_SIZE > 1): nccl on GPU, gloo on CPU; with
    sequence_parallel > 1 also the group of this rank's consecutive sequence_parallel ranks. Raises ValueError
    (one line) when sequence_parallel does not divide the number of processes."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    check_processes(size, sequence_parallel)
    if size == 1:
        return World()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and device_name != "cpu"
    if not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl" if cuda else "gloo")
    return World(rank, size, local_rank, sequence_parallel, sequence_group(rank, size, sequence_parallel))


def check_processes(size: int, sequence_parallel: int) -> None:
    """sequence_parallel must divide the `size` processes (ValueError, one line)."""
    if size % sequence_parallel:
        raise ValueError(f"sequence_parallel {sequence_parallel} must divide the number of processes, got {size} "
                         f"(torchrun --nproc_per_node a multiple of {sequence_parallel})")


def check_data_groups(prompts_per_step: int, groups: int, steps_per_generation: int, max_staleness: int) -> None:
    """The step's prompts split over `groups` data-parallel groups (processes, without sequence parallelism): whole
    groups of completions each, in whole mini-batches; a rollout process only for one trainer process. ValueError
    (one line) otherwise."""
    if prompts_per_step % groups:
        raise ValueError(f"prompts_per_step must be a multiple of the number of processes ({groups}) so that each "
                         f"rank scores whole groups, got {prompts_per_step}")
    per_rank = prompts_per_step // groups
    if per_rank % steps_per_generation:
        raise ValueError(f"steps_per_generation ({steps_per_generation}) cuts each process's {per_rank} groups "
                         f"(prompts_per_step {prompts_per_step} over {groups} process{'es' if groups > 1 else ''}) "
                         f"into mini-batches of whole groups: make prompts_per_step a multiple of "
                         f"{steps_per_generation * groups}, or change steps_per_generation")
    if max_staleness and groups > 1:
        raise ValueError(f"max_staleness={max_staleness} runs one rollout process for one trainer process; under "
                         f"torchrun ({groups} processes) use max_staleness: 0")


def check_sequence_parallel(size: int, packing: bool, attention: str, max_staleness: int) -> None:
    """distribution.sequence_parallel (`size`) > 1 cuts packed rows (batching.packing) in grpo_fast's own attention
    (policy.attention auto), with the rollouts in the trainer's processes (rollout.max_staleness 0). ValueError
    (one line) otherwise."""
    if size == 1:
        return
    if not packing:
        raise ValueError(f"sequence_parallel={size} cuts packed micro-batches across processes: set packing: true")
    if attention != "auto":
        raise ValueError(f"sequence_parallel={size} exchanges heads inside grpo_fast's packed attention: set "
                         f"attention: auto, got {attention!r}")
    if max_staleness:
        raise ValueError(f"sequence_parallel={size} runs under torchrun, where max_staleness must be 0, got "
                         f"{max_staleness}")


def sequence_group(rank: int, size: int, sequence_parallel: int):
    """The torch.distributed group of `rank`'s consecutive sequence_parallel ranks (None for 1). Every rank must
    call it: each creates every group, in the same order."""
    if sequence_parallel == 1:
        return None
    mine = None
    for first in range(0, size, sequence_parallel):
        ranks = list(range(first, first + sequence_parallel))
        created = dist.new_group(ranks)
        if rank in ranks:
            mine = created
    return mine


def resolve_device(name: str, world: World = World()) -> torch.device:
    """The device of this rank: "auto" is CUDA (the rank's local GPU) when available."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} was asked for but torch sees no CUDA device")
    if name == "cuda" and world.size > 1:
        return torch.device("cuda", world.local_rank)
    return torch.device(name)


class HiddenStates(nn.Module):
    """forward(**decoder inputs) -> final hidden states of `model` (a causal LM), without the LM head."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask=None, **kwargs):
        return final_hidden_states(self.model, input_ids, attention_mask, **kwargs)


def wrap(model: nn.Module, strategy: str, world: World) -> nn.Module:
    """HiddenStates(model), wrapped for `strategy` when world.size > 1 (each decoder layer and then the whole
    model sharded by FSDP2's fully_shard; or DDP). Gradient checkpointing must be enabled before."""
    module = HiddenStates(model)
    if world.size == 1 or strategy == "none":
        return module
    device = next(model.parameters()).device
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        # no buffer broadcast: the rotary tables are the same everywhere, and a broadcast per forward would make
        # every no-grad forward a collective
        return DistributedDataParallel(module, device_ids=[device.index] if device.type == "cuda" else None,
                                       forward_sync_buffers=False)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world.size,))
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    with torch.no_grad():     # one forward through the root first: generation calls the layers without it
        module(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device))
    module.reshard()          # the root keeps its parameters gathered after a forward: shard them again
    return module


def decoder_layers(model: nn.Module) -> list:
    """The repeated transformer blocks of a Hugging Face causal LM (the units FSDP2 shards one by one)."""
    classes = set(getattr(model, "_no_split_modules", None) or [])      # a PEFT model passes it through
    layers = [m for m in model.modules() if type(m).__name__ in classes]
    if not layers:
        raise TypeError(f"cannot find the decoder layers of {type(model).__name__} to shard")
    return layers


def gradient_sync(wrapped: nn.Module, enabled: bool):
    """Context: gradients of this backward are (enabled) or are not yet (accumulating) reduced across ranks."""
    if hasattr(wrapped, "no_sync") and not enabled:                     # DDP
        return wrapped.no_sync()
    if hasattr(wrapped, "set_requires_gradient_sync"):                   # FSDP2
        wrapped.set_requires_gradient_sync(enabled)
    return contextlib.nullcontext()


def sum_over_ranks(values: dict, world: World, device) -> dict:
    """{name: number} summed over ranks by name (one collective); with one process the values as they are."""
    if world.size == 1:
        return dict(values)
    names = sorted(values)                 # the same order on every rank
    tensor = torch.tensor([float(values[name]) for name in names], dtype=torch.float64, device=device)
    dist.all_reduce(tensor)
    return dict(zip(names, tensor.tolist()))


def sum_over_groups(values: dict, world: World, device) -> dict:
    """{name: number} summed over the data-parallel groups: for values alike on the ranks of a sequence-parallel
    group (each counted once); sum_over_ranks without sequence parallelism."""
    totals = sum_over_ranks(values, world, device)
    return {name: value / world.sequence_parallel for name, value in totals.items()}


def same_in_sequence_group(value, world: World):
    """`value` (any picklable object) as the first rank of this rank's sequence-parallel group has it: the group
    trains on one rollout. As it is without sequence parallelism."""
    if world.sequence_parallel == 1:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=world.rank - world.rank % world.sequence_parallel,
                               group=world.sequence_group)
    return holder[0]


def all_reduce_max(value: int, world: World, device) -> int:
    if world.size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.long, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return int(tensor)


def full_state_dict(model: nn.Module, trainable_only: bool = False) -> dict:
    """The model's full (unsharded) state dict on every rank: for checkpoints and engine weight sync.
    trainable_only: the parameters that require grad alone (a LoRA model's adapters)."""
    trainable = {name for name, param in model.named_parameters() if param.requires_grad}
    if any(hasattr(p, "device_mesh") for p in model.parameters()):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # ignore_frozen_params skips most frozen ones, not all (a tied head came through): filtered below as well
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                     ignore_frozen_params=trainable_only))
    else:
        state = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    return {name: tensor for name, tensor in state.items() if not trainable_only or name in trainable}


def barrier(world: World) -> None:
    if world.size > 1:
        dist.barrier()
