"""The chunked algorithm both backends share: per chunk of tokens, one GEMM for the logits, then backend passes.

For a chunk of C tokens the (C, V) buffer holds y = h @ W^T + b. A backend's `stats` pass reads it once and
returns the log-sum-exp, the target log-prob and the entropy of z = softcap(y * logit_scale) / temperature. When
gradients are wanted, the caller turns those into g_logp = dL/dlogp (and g_entropy = dL/dH) for the chunk, and
the backend's `dlogits_` pass overwrites the same buffer with dL/dy. Two more GEMMs then give d(hidden) (exact
rows, no accumulation) and d(weight) (accumulated in fp32 across chunks). The logits of the whole batch never
exist: the buffer is bounded by `chunk_bytes`.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Callable, Optional

import torch

DEFAULT_CHUNK_BYTES_CPU = 256 * 2**20
DEFAULT_CHUNK_BYTES_CUDA = 1024 * 2**20


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap * tanh(y * scale / softcap) / temperature (no tanh when softcap is None)."""

    scale: float = 1.0
    softcap: Optional[float] = None
    temperature: float = 1.0


@dataclass
class PassResult:
    logp: torch.Tensor                       # (N,) fp32 (fp64 for fp64 inputs)
    entropy: Optional[torch.Tensor]          # (N,) like logp, or None
    grad_hidden: Optional[torch.Tensor]      # (N, H) in hidden's dtype
    grad_weight: Optional[torch.Tensor]      # (V, H) in weight's dtype
    grad_bias: Optional[torch.Tensor]        # (V,) in bias's dtype


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every input dtype but fp64 (kept so that float64 gradchecks see float64 math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def default_chunk_bytes(device: torch.device) -> int:
    return DEFAULT_CHUNK_BYTES_CUDA if device.type == "cuda" else DEFAULT_CHUNK_BYTES_CPU


def chunk_rows(vocab_size: int, dtype: torch.dtype, chunk_bytes: int, ops) -> int:
    """How many tokens one chunk holds so that the backend's working set stays within chunk_bytes."""
    bytes_per_row = vocab_size * ops.bytes_per_logit(dtype)
    return max(1, chunk_bytes // bytes_per_row)


_HAS_FP32_OUT_GEMM = [True]


def _accumulate_weight_grad(grad_weight_fp32, dlogits, hidden_chunk):
    """grad_weight_fp32 += dlogits^T @ hidden_chunk, accumulated in fp32 whatever the input dtype."""
    if dlogits.dtype == grad_weight_fp32.dtype:
        grad_weight_fp32.addmm_(dlogits.t(), hidden_chunk)
        return
    if dlogits.is_cuda and _HAS_FP32_OUT_GEMM[0]:
        try:
            torch.addmm(grad_weight_fp32, dlogits.t(), hidden_chunk, out_dtype=torch.float32, out=grad_weight_fp32)
            return
        except (RuntimeError, TypeError) as error:   # torch builds without the out_dtype form of addmm
            _HAS_FP32_OUT_GEMM[0] = False
            warnings.warn(f"fp32-output addmm unavailable ({error}); upcasting each chunk for d(weight) instead")
    # CPU GEMMs have no fp32-output form for half inputs: upcast the chunk.
    grad_weight_fp32.addmm_(dlogits.t().float(), hidden_chunk.float())


def chunked_pass(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    targets: torch.Tensor,
    transform: LogitTransform,
    ops,
    rows: int,
    *,
    need_entropy: bool,
    token_grads: Optional[Callable] = None,
    grad_hidden: bool = True,
    grad_weight: bool = True,
    grad_bias: bool = True,
) -> PassResult:
    """One sweep over the tokens of hidden (N, H) against weight (V, H).

    token_grads(start, end, logp, entropy) -> (g_logp, g_entropy or None), all (end - start,) fp32, is called
    once per chunk; without it only log-probs (and entropies) are computed: one GEMM pass.
    """
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    stat_dtype = accumulation_dtype(hidden.dtype)
    logp = torch.empty(num_tokens, dtype=stat_dtype, device=device)
    entropy = torch.empty(num_tokens, dtype=stat_dtype, device=device) if need_entropy else None
    want_grads = token_grads is not None
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if want_grads and grad_hidden else None
    d_weight = (
        torch.zeros(vocab_size, hidden_size, dtype=stat_dtype, device=device)
        if want_grads and grad_weight else None
    )
    d_bias = (
        torch.zeros(vocab_size, dtype=stat_dtype, device=device)
        if want_grads and grad_bias and bias is not None else None
    )
    rows = min(rows, max(num_tokens, 1))
    buffer = torch.empty(rows, vocab_size, dtype=hidden.dtype, device=device)
    weight_t = weight.t()
    for start in range(0, num_tokens, rows):
        end = min(start + rows, num_tokens)
        h = hidden[start:end]
        y = buffer[: end - start]
        if bias is None:
            torch.mm(h, weight_t, out=y)                        # GEMM 1: logits
        else:
            torch.addmm(bias, h, weight_t, out=y)
        state = ops.stats_(y, targets[start:end], transform, need_entropy)
        logp[start:end] = state.logp
        if need_entropy:
            entropy[start:end] = state.entropy
        if not want_grads:
            del state                                           # frees the backend's chunk temporaries
            continue
        g_logp, g_entropy = token_grads(start, end, state.logp, state.entropy)
        ops.dlogits_(y, state, targets[start:end], g_logp, g_entropy, transform)
        del state
        if d_hidden is not None:
            torch.mm(y, weight, out=d_hidden[start:end])        # GEMM 2: d(hidden)
        if d_weight is not None:
            _accumulate_weight_grad(d_weight, y, h)             # GEMM 3: d(weight)
        if d_bias is not None:
            d_bias += y.sum(0, dtype=stat_dtype)
    if d_hidden is not None and hasattr(ops, "all_reduce_grad_hidden"):
        ops.all_reduce_grad_hidden(d_hidden)                    # vocabulary-parallel: sum over the slices
    return PassResult(
        logp=logp,
        entropy=entropy,
        grad_hidden=d_hidden,
        grad_weight=None if d_weight is None else d_weight.to(weight.dtype),
        grad_bias=None if d_bias is None else d_bias.to(bias.dtype),
    )
