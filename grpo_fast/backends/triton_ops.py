"""The chunk passes through the Triton kernels of `grpo_fast.kernels` (CUDA, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.backends.base import ChunkOps
from grpo_fast.kernels import dlogits_ as _dlogits_kernel
from grpo_fast.kernels import kept_dlogits_, kept_logprob_forward, logprob_forward
from grpo_fast.kernels import policy_grad as _policy_grad_kernel
from grpo_fast.kernels.launch import RowStats, has_padding


@dataclass
class ChunkState:
    stats: RowStats                          # lse, logp, entropy, sum p^2 and the max / log_sum dlogits reads
    kept: Optional[object] = None            # the chunk's grpo_fast.kept.KeptChunk: statistics over it

    @property
    def lse(self) -> torch.Tensor:
        return self.stats.lse

    @property
    def logp(self) -> torch.Tensor:
        return self.stats.logp

    @property
    def entropy(self) -> Optional[torch.Tensor]:
        return self.stats.entropy

    @property
    def sum_pi_squared(self) -> Optional[torch.Tensor]:
        return self.stats.sum_pi_squared


def bytes_per_logit(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8   # both passes work in place on the GEMM buffer


# chunked_pass pads the row stride of its buffer to 16 elements and those columns are scratch (see backends):
# `has_padding` tells the kernels they may read and write them, so that their loads and stores stay vectors.
def stats_(buffer, targets, transform, need_entropy, kept=None, need_sum_pi_squared=False) -> ChunkState:
    if buffer.dtype == torch.float64:
        raise TypeError("backend='triton' takes fp32, bf16 or fp16 inputs, got float64 (use backend='torch')")
    options = dict(scale=transform.scale, temperature=transform.temperature, softcap=transform.softcap,
                   compute_entropy=need_entropy, compute_sum_pi_squared=need_sum_pi_squared)
    if kept is not None:
        stats = kept_logprob_forward(buffer, targets, kept.ids, kept.offsets, **options)
    else:
        stats = logprob_forward(buffer, targets, padded=has_padding(buffer), **options)
    return ChunkState(stats, kept)


def policy_grad(logp, terms):
    return _policy_grad_kernel(logp, terms)


def dlogits_(buffer, state, targets, g_logp, g_entropy, transform) -> None:
    options = dict(g_entropy=g_entropy, scale=transform.scale, temperature=transform.temperature,
                   softcap=transform.softcap, padded=has_padding(buffer))
    if state.kept is not None:
        kept_dlogits_(buffer, targets, state.kept.ids, state.kept.offsets, state.stats, g_logp, **options)
    else:
        _dlogits_kernel(buffer, targets, state.stats, g_logp, **options)


class TritonOps(ChunkOps):
    """The passes above as a single-device backend."""

    bytes_per_logit = staticmethod(bytes_per_logit)
    stats_ = staticmethod(stats_)
    policy_grad = staticmethod(policy_grad)
    dlogits_ = staticmethod(dlogits_)


OPS = TritonOps()
