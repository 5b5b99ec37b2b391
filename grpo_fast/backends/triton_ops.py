"""The chunk passes through the Triton kernels of `grpo_fast.kernels` (CUDA, or CPU under TRITON_INTERPRET=1)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.backends.base import ChunkOps
from grpo_fast.kernels import dlogits_ as _dlogits_kernel
from grpo_fast.kernels import kept_dlogits_, kept_logprob_forward, logprob_forward
from grpo_fast.kernels import policy_grad as _policy_grad_kernel
from grpo_fast.kernels.launch import has_padding


@dataclass
class ChunkState:
    lse: torch.Tensor
    logp: torch.Tensor
    entropy: Optional[torch.Tensor]
    kept: Optional[object] = None            # the chunk's grpo_fast.kept.KeptChunk: statistics over it
    sum_pi_squared: Optional[torch.Tensor] = None


def bytes_per_logit(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8   # both passes work in place on the GEMM buffer


# chunked_pass pads the row stride of its buffer to 16 elements and those columns are scratch (see backends):
# `has_padding` tells the kernels they may read and write them, so that their loads and stores stay vectors.
def stats_(buffer, targets, transform, need_entropy, kept=None, need_sum_pi_squared=False) -> ChunkState:
    if buffer.dtype == torch.float64:
        raise TypeError("backend='triton' takes fp32, bf16 or fp16 inputs, got float64 (use backend='torch')")
    if kept is not None:
        stats = kept_logprob_forward(
            buffer, targets, kept.ids, kept.offsets, scale=transform.scale, temperature=transform.temperature,
            softcap=transform.softcap, compute_entropy=need_entropy, compute_sum_pi_squared=need_sum_pi_squared,
        )
    else:
        stats = logprob_forward(
            buffer, targets, scale=transform.scale, temperature=transform.temperature, softcap=transform.softcap,
            compute_entropy=need_entropy, padded=has_padding(buffer), compute_sum_pi_squared=need_sum_pi_squared,
        )
    lse, logp, entropy = stats[:3]
    return ChunkState(lse, logp, entropy, kept, stats[3] if need_sum_pi_squared else None)


def policy_grad(logp, terms):
    return _policy_grad_kernel(logp, terms)


def dlogits_(buffer, state, targets, g_logp, g_entropy, transform) -> None:
    if state.kept is not None:
        kept_dlogits_(
            buffer, targets, state.kept.ids, state.kept.offsets, state.lse, g_logp, entropy=state.entropy,
            g_entropy=g_entropy, scale=transform.scale, temperature=transform.temperature, softcap=transform.softcap,
            padded=has_padding(buffer),
        )
        return
    _dlogits_kernel(
        buffer, targets, state.lse, g_logp, entropy=state.entropy, g_entropy=g_entropy,
        scale=transform.scale, temperature=transform.temperature, softcap=transform.softcap,
        padded=has_padding(buffer),
    )


class TritonOps(ChunkOps):
    """The passes above as a single-device backend."""

    bytes_per_logit = staticmethod(bytes_per_logit)
    stats_ = staticmethod(stats_)
    policy_grad = staticmethod(policy_grad)
    dlogits_ = staticmethod(dlogits_)


OPS = TritonOps()
