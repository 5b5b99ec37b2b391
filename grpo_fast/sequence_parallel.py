"""Ulysses sequence parallelism: one packed row's tokens cut across the ranks of a group, the loss on each shard.

    shards = SequenceShards.of(group)                                  # torch.distributed group of N ranks
    local_inputs, local_index, local = shard_row(model_inputs, hidden_index, shards)
    hidden = states_here(model(**local_inputs), local_index)           # (b, C, H), zero where another rank holds it
    with summing_over(group):
        loss, metrics = grpo_loss(hidden, weight, ids, mask & local, advantages, ...)
    loss.backward()                                                    # then sum the gradients over the group

A packed row (grpo_fast.train.update.batching, grpo_fast.packed_attention) of N tokens is padded to a multiple of
the group's size N_sp with one extra sequence and cut into N_sp contiguous shards; each rank runs the decoder on
its shard. Everything in a decoder layer but attention is per token. In attention an all-to-all turns each rank's
(N / N_sp tokens, all heads) into (all N tokens, heads / N_sp), the packed attention computes whole sequences for
those heads, and a second all-to-all turns it back (DeepSpeed-Ulysses; verl's `ulysses_sequence_parallel_size`).
Positions are the row's own (position_ids restart at each sequence), so RoPE takes global positions. A model with
fewer key / value heads than N_sp has each repeated N_sp / kv_heads times, as verl does; other head counts are
refused in one line.

The loss is per token, so it runs where the tokens are: each rank's (b, C) mask keeps the tokens whose predicting
hidden state it holds. Every quantity the loss sums over a sequence or over the batch (a sequence's token count,
GSPO's sequence log-ratio, token-mean normalizers, the metrics' means) goes through `sequence_sum` /
`batch_sum`, which inside `summing_over(group)` all-reduce over the group, differentiably: each rank's loss is then
its tokens' share of the whole loss, the shares add up to it, and the sum over the group of each rank's parameter
gradients is one process's gradient.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, replace

import torch

# the group the loss's reductions sum over (summing_over); None: one process holds every token
_GROUP: contextvars.ContextVar = contextvars.ContextVar("grpo_fast_sequence_group", default=None)


@dataclass(frozen=True)
class SequenceShards:
    """Where a packed row's tokens are: `size` contiguous shards of `length` / size tokens (length: the row padded
    to a multiple of size), shard `rank` on this process, exchanged over `group` (a torch.distributed group, None for
    the default one)."""

    group: object
    size: int
    rank: int
    length: int = 0

    @classmethod
    def of(cls, group=None) -> "SequenceShards":
        import torch.distributed as dist

        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    @property
    def shard_length(self) -> int:
        return self.length // self.size

    @property
    def start(self) -> int:
        return self.rank * self.shard_length


def shard_row(model_inputs: dict, hidden_index: torch.Tensor, shards: SequenceShards) -> tuple:
    """(local_inputs, local_index, local): this rank's part of a packed micro-batch.

    model_inputs: a packed row's decoder inputs (input_ids and position_ids (1, N), attention_mask None, and the
    sequence boundaries cu_seq_lens_q / _k or a SharedPrompts layout `shared_prompts`); hidden_index (b, C): flat
    positions in the row of the hidden state that predicts each completion token. The row is padded to a multiple
    of shards.size with one sequence of its own (token 0, positions from 0), so the pad attends to nothing real.
    local_inputs: input_ids and position_ids of this rank's shard, the boundaries of the whole padded row, and
    `sequence_shards` (the attention reads it); local_index (b, C): positions in the shard's output, shard_length
    (one past its end: states_here's zero row) where another rank holds the state; local (b, C) bool: where this
    rank holds it. Raises ValueError for a row that is not packed."""
    input_ids, positions = model_inputs["input_ids"], model_inputs.get("position_ids")
    if input_ids.dim() != 2 or input_ids.shape[0] != 1 or model_inputs.get("attention_mask") is not None \
            or positions is None:
        raise ValueError(f"sequence parallelism needs a packed row (input_ids (1, N) with position_ids and no "
                         f"attention_mask: batching.packing true), got input_ids {tuple(input_ids.shape)}")
    length = input_ids.shape[1]
    pad = -length % shards.size
    inputs = dict(model_inputs)
    if pad:
        device = input_ids.device
        inputs["input_ids"] = torch.cat([input_ids, input_ids.new_zeros(1, pad)], 1)
        pad_positions = torch.arange(pad, device=device, dtype=positions.dtype)[None]
        inputs["position_ids"] = torch.cat([positions, pad_positions], 1)
        if inputs.get("shared_prompts") is not None:
            layout = inputs["shared_prompts"]
            inputs["shared_prompts"] = type(layout)(layout.groups + [(length, pad, [])])
        for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
            if inputs.get(name) is not None:
                bounds = inputs[name]
                inputs[name] = torch.cat([bounds, bounds.new_full((1,), length + pad)])
        for name in ("max_length_q", "max_length_k"):
            if inputs.get(name) is not None:
                inputs[name] = max(inputs[name], pad)
    shards = replace(shards, length=length + pad)
    start, end = shards.start, shards.start + shards.shard_length
    for name in ("input_ids", "position_ids"):
        inputs[name] = inputs[name][:, start:end]
    inputs["sequence_shards"] = shards
    local = (hidden_index >= start) & (hidden_index < end)
    local_index = torch.where(local, hidden_index - start, shards.shard_length)
    return inputs, local_index, local


def states_here(hidden: torch.Tensor, local_index: torch.Tensor) -> torch.Tensor:
    """(b, C, H): the shard's final hidden states (1, n, H) at local_index (shard_row's), zero at index n (a state
    another rank holds, which the loss's mask leaves out)."""
    flat = torch.cat([hidden.reshape(-1, hidden.shape[-1]), hidden.new_zeros(1, hidden.shape[-1])])
    return flat.index_select(0, local_index.reshape(-1)).view(*local_index.shape, -1)


class _AllToAll(torch.autograd.Function):
    """all_to_all(x, group, scatter_dim, gather_dim); its backward is the exchange the other way."""

    @staticmethod
    def forward(ctx, x, group, size, scatter_dim, gather_dim):
        ctx.group, ctx.size, ctx.dims = group, size, (scatter_dim, gather_dim)
        return _exchange(x, group, size, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _exchange(grad.contiguous(), ctx.group, ctx.size, gather_dim, scatter_dim), None, None, None, None


def _exchange(x: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    import torch.distributed as dist

    send = torch.stack(x.chunk(size, dim=scatter_dim)).contiguous()       # chunk i goes to rank i
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)                 # rank i's chunk i-th along gather_dim


def all_to_all(x: torch.Tensor, shards: SequenceShards, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """x cut into shards.size equal chunks along scatter_dim, chunk i sent to rank i, the chunks received put
    together along gather_dim in rank order; differentiable (the backward exchanges the gradient back)."""
    if x.shape[scatter_dim] % shards.size:
        raise ValueError(f"dimension {scatter_dim} of size {x.shape[scatter_dim]} does not split into "
                         f"{shards.size} shards")
    return _AllToAll.apply(x, shards.group, shards.size, scatter_dim, gather_dim)


class _Heads:
    """The attention module as the attention function sees it on one rank: its own attributes, with
    num_key_value_groups that of this rank's share of the heads."""

    def __init__(self, module: torch.nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def spread_heads(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shards: SequenceShards) -> tuple:
    """(module, query, key, value) of the whole row for this rank's heads: query (1, heads, n, D) of the shard's n
    tokens becomes (1, heads / N_sp, N, D), key / value likewise (their heads repeated to N_sp first when there are
    fewer, as verl does). Raises ValueError (one line) for head counts that do not split."""
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % shards.size:
        raise ValueError(f"sequence_parallel {shards.size} must divide the model's {heads} attention heads")
    if kv_heads % shards.size:
        if shards.size % kv_heads:
            raise ValueError(f"sequence_parallel {shards.size} must divide the model's {kv_heads} key/value heads "
                             f"or be a multiple of them")
        repeats = shards.size // kv_heads
        key, value = key.repeat_interleave(repeats, 1), value.repeat_interleave(repeats, 1)
    query, key, value = (all_to_all(t, shards, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    return _Heads(module, query.shape[1] // key.shape[1]), query, key, value


def gather_heads(output: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """(1, n, heads, D): an attention output (1, N, heads / N_sp, D) of the whole row for this rank's heads, back
    to this rank's n tokens with every head."""
    return all_to_all(output, shards, scatter_dim=1, gather_dim=2)


@contextlib.contextmanager
def summing_over(group):
    """Inside the block the loss's sequence and batch sums (sequence_sum, batch_sum) are all-reduced over `group`
    (a torch.distributed group; None leaves them local): the loss each rank computes is its tokens' share."""
    token = _GROUP.set(_Group(group))
    try:
        yield
    finally:
        _GROUP.reset(token)


@dataclass(frozen=True)
class _Group:
    group: object


def active() -> bool:
    """Whether the loss's sums are all-reduced over a group (inside summing_over)."""
    return _GROUP.get() is not None


class _SumOverGroup(torch.autograd.Function):
    """The sum over the group's ranks of each rank's `total`; each rank's loss is its share of one loss, so the
    gradient of the sum to each rank's part is the sum of the ranks' gradients to the sum."""

    @staticmethod
    def forward(ctx, total, group):
        ctx.group = group
        return _all_reduced(total, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduced(grad, ctx.group), None


def _all_reduced(total: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    total = total.clone()
    dist.all_reduce(total, group=group)
    return total


def _reduced(total: torch.Tensor) -> torch.Tensor:
    state = _GROUP.get()
    if state is None:
        return total
    return _SumOverGroup.apply(total, state.group)


def sequence_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(-1, keepdim=True): a (B, T) tensor's sum over each sequence, over every rank's tokens inside
    summing_over(group)."""
    return _reduced(x.sum(-1, keepdim=True))


def batch_sum(x: torch.Tensor) -> torch.Tensor:
    """x.sum(): over every rank's tokens inside summing_over(group)."""
    return _reduced(x.sum())
