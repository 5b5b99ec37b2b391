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
fewer key / value heads than N_sp has each repeated N_sp / kv_heads times, as verl does; heads that N_sp does not
divide are split as evenly as can be, with key / value heads repeated to one per query head.

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
import math
from dataclasses import dataclass, replace
from typing import Optional

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
    """all_to_all(x, shards, scatter_dim, scatter_sizes, gather_dim, gather_sizes); its backward is the exchange
    the other way."""

    @staticmethod
    def forward(ctx, x, shards, scatter_dim, scatter_sizes, gather_dim, gather_sizes):
        ctx.shards, ctx.other_way = shards, (gather_dim, gather_sizes, scatter_dim, scatter_sizes)
        return _exchange(x, shards, scatter_dim, scatter_sizes, gather_dim, gather_sizes)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad.contiguous(), ctx.shards, *ctx.other_way), None, None, None, None, None


def _exchange(x: torch.Tensor, shards: "SequenceShards", scatter_dim: int, scatter_sizes: list, gather_dim: int,
              gather_sizes: list) -> torch.Tensor:
    import torch.distributed as dist

    sent = x.split(scatter_sizes, dim=scatter_dim)                       # piece i goes to rank i
    shape = list(x.shape)
    shape[scatter_dim] = scatter_sizes[shards.rank]
    shapes = []                                                          # what rank j sends this rank
    for size in gather_sizes:
        shape[gather_dim] = size
        shapes.append(tuple(shape))
    send = torch.cat([piece.reshape(-1) for piece in sent])
    received = send.new_empty(sum(math.prod(piece) for piece in shapes))
    dist.all_to_all_single(received, send, output_split_sizes=[math.prod(piece) for piece in shapes],
                           input_split_sizes=[piece.numel() for piece in sent], group=shards.group)
    pieces = received.split([math.prod(piece) for piece in shapes])
    return torch.cat([piece.view(piece_shape) for piece, piece_shape in zip(pieces, shapes)], dim=gather_dim)


def split_sizes(total: int, parts: int) -> list:
    """`total` cut into `parts` sizes as even as can be, the larger first: split_sizes(9, 2) == [5, 4]."""
    return [total // parts + (1 if part < total % parts else 0) for part in range(parts)]


def all_to_all(x: torch.Tensor, shards: SequenceShards, scatter_dim: int, gather_dim: int,
               scatter_sizes: Optional[list] = None) -> torch.Tensor:
    """x cut along scatter_dim into shards.size pieces (scatter_sizes, default even), piece i sent to rank i, the
    pieces received put together along gather_dim in rank order (every rank's x of the same size along it but at
    scatter_dim); differentiable: the backward exchanges the gradient back."""
    scatter_sizes = scatter_sizes or split_sizes(x.shape[scatter_dim], shards.size)
    if sum(scatter_sizes) != x.shape[scatter_dim]:
        raise ValueError(f"scatter_sizes {scatter_sizes} must add up to dimension {scatter_dim}'s "
                         f"{x.shape[scatter_dim]}")
    gather_sizes = [x.shape[gather_dim]] * shards.size
    return _AllToAll.apply(x, shards, scatter_dim, scatter_sizes, gather_dim, gather_sizes)


class _Heads:
    """The attention module as the attention function sees it on one rank: its own attributes, with
    num_key_value_groups that of this rank's share of the heads."""

    def __init__(self, module: torch.nn.Module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def spread_heads(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shards: SequenceShards) -> tuple:
    """(module, query, key, value) of the whole row for this rank's heads: query (1, heads, n, D) of the shard's n
    tokens becomes (1, its share of the heads, N, D), key / value likewise. Heads split evenly where the ranks
    divide them; key / value heads fewer than the ranks are repeated to their number (as verl does); where the
    heads do not split evenly (SmolLM2's 9 over 2 ranks) key / value heads are repeated to one per query head and
    the heads split as evenly as can be (5 and 4). Raises ValueError (one line) for more ranks than heads."""
    heads, kv_heads, size = query.shape[1], key.shape[1], shards.size
    if heads < size:
        raise ValueError(f"sequence_parallel {size} must be at most the model's {heads} attention heads")
    if heads % size == 0 and kv_heads % size and size % kv_heads == 0:
        key, value = key.repeat_interleave(size // kv_heads, 1), value.repeat_interleave(size // kv_heads, 1)
    elif heads % size or kv_heads % size:
        key, value = key.repeat_interleave(heads // kv_heads, 1), value.repeat_interleave(heads // kv_heads, 1)
    head_sizes = split_sizes(heads, size)
    kv_sizes = split_sizes(key.shape[1], size)
    query = all_to_all(query, shards, scatter_dim=1, gather_dim=2, scatter_sizes=head_sizes)
    key, value = (all_to_all(t, shards, scatter_dim=1, gather_dim=2, scatter_sizes=kv_sizes) for t in (key, value))
    return _Heads(module, query.shape[1] // key.shape[1]), query, key, value


def gather_heads(output: torch.Tensor, shards: SequenceShards, heads: int) -> torch.Tensor:
    """(1, n, heads, D): an attention output (1, N, this rank's share of the model's `heads`, D) of the whole row,
    back to this rank's n tokens with every head."""
    return _AllToAll.apply(output, shards, 1, [shards.shard_length] * shards.size, 2, split_sizes(heads, shards.size))


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
