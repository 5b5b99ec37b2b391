"""The chunk passes when the LM head is split by vocabulary across a process group (Megatron-style tensor
parallelism): each rank holds rows [start, start + V_local) of the weight and never sees the others.

Per chunk of tokens, each rank reduces its own slice to a few numbers per token, relative to the max over all
slices: the count of logits at the max, the sum of exp(z - max) below it, the sum of exp(z - max) (z - max), and
the target's z - max when the target is in its slice (and the sum of exp^2 when sum_v p_v^2 is asked for); one
all-reduce of the max and one of the sums give every rank the full log-softmax statistics, as exact for a token
the policy is sure of as on one device.
The gradient pass then runs on each slice alone, and d(hidden), a sum over the vocabulary, is all-reduced once at
the end of the pass. No rank gathers the weight or another rank's logits. The math is the PyTorch backend's
(`torch_ops`), restricted to a slice.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from grpo_fast.backends import torch_ops
from grpo_fast.backends.base import ChunkOps
from grpo_fast.backends.torch_ops import ChunkState, KeptState


@dataclass(frozen=True)
class VocabShard:
    """This rank's slice of the vocabulary: rows [start, start + size) of a vocabulary of total_size."""

    group: object
    start: int
    size: int
    total_size: int
    largest: int            # the largest slice: every rank sizes its chunks by it, so all take the same steps

    @classmethod
    def of(cls, local_rows: int, group, device) -> "VocabShard":
        """The slices of all ranks, in rank order, from each rank's local row count (one all-gather)."""
        sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(sizes, torch.tensor([local_rows], dtype=torch.long, device=device), group=group)
        sizes = [int(s) for s in sizes]
        rank = dist.get_rank(group)
        return cls(group, sum(sizes[:rank]), local_rows, sum(sizes), max(sizes))


@dataclass
class _RowStats:
    lse: torch.Tensor
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    sum_pi_squared: Optional[torch.Tensor]
    sum_exp: torch.Tensor


def _row_stats(row_max, sums, need_entropy, need_sum_pi_squared) -> _RowStats:
    """The rows' statistics from the global max and the all-reduced sums (maxima, the sum of exp(z - max) below
    the max, sum of exp(z - max) (z - max), z_target - max[, sum of exp(z - max)^2]), relative to the max as in
    torch_ops.stats_: s_rest leaves one maximum's own 1 out, so a sure token's logp = -log1p(s_rest) keeps its
    relative accuracy. A row with no logit above the floor (all -inf) gets NaN."""
    count, below, dot, target_shift = sums[:4]
    rest = below + (count - 1)
    log_sum = torch_ops.log_sum_exp_shifted(row_max, rest)
    sum_exp = rest + 1
    return _RowStats(
        lse=row_max + log_sum,
        logp=target_shift - log_sum,
        entropy=log_sum - dot / sum_exp if need_entropy else None,               # H = ln s - sum p (z - max)
        sum_pi_squared=sums[4] / sum_exp.square() if need_sum_pi_squared else None,
        sum_exp=sum_exp,
    )


class VocabParallelOps(ChunkOps):
    """A backend (see grpo_fast.backends) for one rank's vocabulary slice."""

    bytes_per_logit = staticmethod(torch_ops.bytes_per_logit)
    policy_grad = staticmethod(torch_ops.policy_grad)

    def __init__(self, shard: VocabShard):
        self.shard = shard

    def chunk_vocab(self, vocab_rows: int) -> int:
        return self.shard.largest               # chunk rows follow the largest slice (collectives per chunk)

    def _local(self, targets):
        local = targets - self.shard.start
        owned = (local >= 0) & (local < self.shard.size)
        return torch.where(owned, local, 0), owned

    def stats_(self, buffer, targets, transform, need_entropy, kept=None, need_sum_pi_squared=False):
        if kept is not None:
            return self._kept_stats(buffer, targets, transform, need_entropy, kept, need_sum_pi_squared)
        group = self.shard.group
        z = torch_ops.transformed_(buffer, transform)
        row_max = z.amax(dim=-1)
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - row_max[:, None]                                          # z - max over every slice
        probs = shifted.exp()
        # the maxima counted apart from the rest: -sign(z - max) is 1 below the max, 0 at it
        below_max = torch.sign(shifted)
        local, owned = self._local(targets)
        sums = [
            below_max.sum(-1).add_(z.shape[1]),                                 # maxima in this slice
            below_max.mul_(probs).sum(-1).neg_(),                               # sum of exp(z - max) below it
            (probs * shifted).sum(-1) if need_entropy else torch.zeros_like(row_max),
            torch.where(owned, shifted.gather(1, local[:, None]).squeeze(1), 0.0),     # z_target - max
        ]
        if need_sum_pi_squared:
            sums.append(torch.linalg.vecdot(probs, probs))
        sums = torch.stack(sums)
        dist.all_reduce(sums, group=group)
        state = _row_stats(row_max, sums, need_entropy, need_sum_pi_squared)
        probs.div_(state.sum_exp[:, None])
        return ChunkState(z, probs, state.lse, state.logp, state.entropy, state.sum_pi_squared)

    def _kept_stats(self, buffer, targets, transform, need_entropy, kept, need_sum_pi_squared) -> KeptState:
        """stats_ over each row's kept set: this rank reads the kept ids in its slice, and the same collectives
        as the full pass give every rank the kept-set statistics."""
        group = self.shard.group
        rows, local = kept.rows(), kept.ids - self.shard.start
        owned = (local >= 0) & (local < self.shard.size)
        rows, cols, ids = rows[owned], local[owned], kept.ids[owned]
        z = torch_ops.transformed_(buffer[rows, cols], transform)
        num_rows = buffer.shape[0]
        row_max = z.new_full((num_rows,), torch_ops.NEG_BIG).scatter_reduce_(0, rows, z, "amax")
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - row_max.index_select(0, rows)
        probs = shifted.exp()
        is_target = ids == targets.index_select(0, rows)
        sums = z.new_zeros(5 if need_sum_pi_squared else 4, num_rows)
        sums[0].index_add_(0, rows, (shifted == 0).to(z.dtype))
        sums[1].index_add_(0, rows, torch.where(shifted < 0, probs, 0.0))
        if need_entropy:
            sums[2].index_add_(0, rows, probs * shifted)
        sums[3].index_add_(0, rows, torch.where(is_target, shifted, 0.0))
        if need_sum_pi_squared:
            sums[4].index_add_(0, rows, probs * probs)
        dist.all_reduce(sums, group=group)
        state = _row_stats(row_max, sums, need_entropy, need_sum_pi_squared)
        probs.div_(state.sum_exp.index_select(0, rows))
        return KeptState(rows, cols, is_target, z, probs, state.lse, state.logp, state.entropy, state.sum_pi_squared)

    def dlogits_(self, buffer, state, targets, g_logp, g_entropy, transform) -> None:
        if isinstance(state, KeptState):          # the one-hot term is where is_target holds: the owner's
            torch_ops.kept_dlogits_(buffer, state, g_logp, g_entropy, transform)
            return
        local, owned = self._local(targets)
        # the target's own term lives on the rank that owns it: elsewhere column local[r] is an ordinary one
        torch_ops.dlogits_(buffer, state, local, g_logp, g_entropy, transform, owned=owned)

    def all_reduce_grad_hidden(self, grad_hidden: torch.Tensor) -> None:
        dist.all_reduce(grad_hidden, group=self.shard.group)
