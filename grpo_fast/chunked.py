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
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from grpo_fast import backends
from grpo_fast.backends.base import ChunkOps
from grpo_fast.kept import KeptSet
from grpo_fast.numerics import LogitTransform, accumulation_dtype

DEFAULT_CHUNK_BYTES_CPU = 256 * 2**20
# On CUDA the budget is a fixed share of the device's total memory, within bounds: a given shape and dtype on a
# given device model always gets the same chunks, so the fp32 d(weight) summation order, and with it every bit of
# the result, does not change from call to call (a budget following free memory did). Fewer, larger chunks mean
# fewer read-modify-writes of the fp32 d(weight) accumulator (none at all when one chunk holds every token).
CUDA_CHUNK_FRACTION = 1 / 16
CUDA_CHUNK_BYTES_MIN = 1024 * 2**20
CUDA_CHUNK_BYTES_MAX = 8 * 2**30
ROW_ALIGN = 16                     # buffer rows padded to 16 elements: 16-byte vectors in the Triton kernels


@dataclass
class PassResult:
    logp: torch.Tensor                       # (N,) fp32 (fp64 for fp64 inputs)
    entropy: Optional[torch.Tensor]          # (N,) like logp, or None
    grad_hidden: Optional[torch.Tensor]      # (N, H) in hidden's dtype
    grad_weight: Optional[torch.Tensor]      # (V, H) in weight's dtype
    grad_bias: Optional[torch.Tensor]        # (V,) in bias's dtype
    sum_pi_squared: Optional[torch.Tensor] = None   # (N,) like logp: sum_v p_v^2, or None


def default_chunk_bytes(device: torch.device) -> int:
    """256 MiB on CPU; on CUDA `cuda_chunk_bytes` of the device's total memory. It depends on the device model
    only, never on what is free at the time, so the chunking of a shape is reproducible; pass chunk_bytes
    explicitly where less is free."""
    if device.type != "cuda":
        return DEFAULT_CHUNK_BYTES_CPU
    return cuda_chunk_bytes(torch.cuda.get_device_properties(device).total_memory)


def cuda_chunk_bytes(total_memory: int) -> int:
    """The default chunk budget on a CUDA device of `total_memory` bytes: 1/16 of it, clamped to [1 GiB, 8 GiB]
    (8 GiB on a 141 GB card, 4.9 GiB on an 80 GB one, 1.4 GiB on a 24 GB one). The planner
    (grpo_fast/train/plan/memory.py) counts the same budget per card."""
    return int(min(max(total_memory * CUDA_CHUNK_FRACTION, CUDA_CHUNK_BYTES_MIN), CUDA_CHUNK_BYTES_MAX))


def chunk_rows(vocab_size: int, dtype: torch.dtype, chunk_bytes: int, ops: ChunkOps) -> int:
    """How many tokens one chunk holds so that the backend's working set stays within chunk_bytes."""
    bytes_per_row = padded_width(vocab_size) * ops.bytes_per_logit(dtype)
    return max(1, chunk_bytes // bytes_per_row)


def balanced_rows(tokens: int, rows: int) -> int:
    """Tokens per chunk when a chunk may hold at most `rows`: as many chunks as that takes, all of one size but the
    last, which is up to chunks - 1 tokens short (913 tokens at 304 rows: four chunks of 229, the last 226). A chunk
    as large as the budget allows would leave a ragged last one and a buffer larger than the tokens need: 2048
    tokens at 682 rows are four chunks either way, and 512 rows a chunk hold them in a buffer a quarter smaller."""
    if tokens <= rows:
        return max(tokens, 1)
    chunks = -(-tokens // rows)
    return -(-tokens // chunks)


def chunk_plan(hidden, weight, chunk_bytes, backend, ops=None) -> tuple[ChunkOps, int, int]:
    """(ops, chunk_bytes, rows) of a chunked pass of hidden (..., H) (its tokens the rows of the pass) against
    weight (V, H): the backend `backend` on hidden's device unless `ops` is given, the default budget when
    chunk_bytes is None, the tokens per chunk (the fewest chunks the budget allows, of equal size:
    balanced_rows)."""
    if ops is None:
        ops = backends.resolve(backend, hidden.device)
    if chunk_bytes is None:
        chunk_bytes = default_chunk_bytes(hidden.device)
    rows = chunk_rows(ops.chunk_vocab(weight.shape[0]), hidden.dtype, chunk_bytes, ops)
    return ops, chunk_bytes, balanced_rows(hidden.numel() // max(hidden.shape[-1], 1), rows)


def padded_width(vocab_size: int) -> int:
    """The row stride of a chunk buffer: V rounded up to ROW_ALIGN elements (grpo_fast.kernels.launch keeps the
    same rule for the kernels, which cannot import this module's layer)."""
    return -(-vocab_size // ROW_ALIGN) * ROW_ALIGN


# How d(weight) = sum over chunks of dlogits^T @ h was computed, counted per chunked pass (see weight_grad_paths).
_WEIGHT_GRAD_PATHS: Counter = Counter()
_FP32_OUT_GEMM = {"available": True}


def weight_grad_paths() -> dict:
    """How many chunked passes in this process computed d(weight) by each path:

    - "direct": one chunk held every token, its GEMM wrote d(weight) in the weight's dtype (fp32 accumulation
      inside the GEMM, no accumulator);
    - "fp32": fp32 (or fp64) inputs, the first chunk's GEMM writes the accumulator, later ones add in place;
    - "fp32-out-gemm": half inputs on CUDA, GEMMs with an fp32 output accumulate in place (no upcast);
    - "half-gemm+fp32-add": half inputs where torch lacks the fp32-output GEMM: each chunk's product in the input
      dtype (tensor cores) into a temporary, added to the fp32 accumulator;
    - "upcast": half inputs on CPU: each chunk upcast to fp32 for the GEMM.
    """
    return dict(_WEIGHT_GRAD_PATHS)


def reset_weight_grad_paths() -> None:
    _WEIGHT_GRAD_PATHS.clear()


def fp32_out_gemm_unsupported(error: BaseException) -> bool:
    """Whether `error`, raised by torch.mm / torch.addmm with out_dtype=float32, means this torch build or device
    has no such GEMM: a TypeError (no out_dtype argument), NotImplementedError (no kernel registered for the
    backend) or a RuntimeError that says the combination is unsupported. Never for out-of-memory errors."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, (TypeError, NotImplementedError)):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and "out of memory" not in message and any(
        words in message for words in ("out_dtype", "not supported", "unsupported", "not implemented"))


class WeightGrad:
    """d(weight) = sum over chunks of dlogits^T @ hidden_chunk, accumulated in fp32 without a zero-fill: the first
    chunk's GEMM writes the accumulator, later chunks add to it, and a pass of one chunk writes the result in
    the weight's dtype directly."""

    def __init__(self, shape, dtype: torch.dtype, device: torch.device, single_chunk: bool):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.acc_dtype = accumulation_dtype(dtype)
        self.value: Optional[torch.Tensor] = None
        if single_chunk:
            self.path = "direct"
        elif dtype == self.acc_dtype:
            self.path = "fp32"
        elif device.type == "cuda":
            self.path = "fp32-out-gemm" if _FP32_OUT_GEMM["available"] else "half-gemm+fp32-add"
        else:
            self.path = "upcast"

    def add(self, dlogits: torch.Tensor, hidden_chunk: torch.Tensor) -> None:
        a, b = dlogits.t(), hidden_chunk
        first = self.value is None
        if self.path in ("direct", "fp32"):
            if first:
                self.value = torch.mm(a, b)
            else:
                self.value.addmm_(a, b)
        elif self.path == "fp32-out-gemm":
            try:
                if first:
                    self.value = torch.mm(a, b, out_dtype=self.acc_dtype)
                else:
                    torch.addmm(self.value, a, b, out_dtype=self.acc_dtype, out=self.value)
            except (RuntimeError, TypeError) as error:
                # Only a build without the out_dtype GEMMs switches the process to the other path: an out-of-memory
                # error or a CUDA fault says nothing about the GEMM's existence and goes to the caller unchanged.
                if not fp32_out_gemm_unsupported(error):
                    raise
                _FP32_OUT_GEMM["available"] = False
                warnings.warn(f"fp32-output GEMM unavailable ({error}); d(weight) adds half-precision chunk "
                              "products to an fp32 accumulator instead")
                self.path = "half-gemm+fp32-add"
                self.add(dlogits, hidden_chunk)
        elif self.path == "half-gemm+fp32-add":
            product = torch.mm(a, b)
            if first:
                self.value = product.to(self.acc_dtype)
            else:
                self.value.add_(product)
        else:                                             # CPU GEMMs have no fp32-output form for half inputs
            if first:
                self.value = torch.mm(a.float(), b.float())
            else:
                self.value.addmm_(a.float(), b.float())

    def result(self) -> torch.Tensor:
        """(V, H) in the weight's dtype; zeros when no chunk was added."""
        _WEIGHT_GRAD_PATHS[self.path] += 1
        if self.value is None:
            return torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return self.value.to(self.dtype)


# what gives higher-order gradients in place of each entry: the full-logits reference (grpo_fast.reference)
HIGHER_ORDER = {"grpo_loss": "grpo_fast.reference.grpo_loss",
                "token_logprobs": "grpo_fast.reference.token_logprobs",
                "fused_token_loss": "grpo_fast.reference.token_logprobs and your loss in torch"}


def forbid_double_backward(fn_name: str) -> None:
    """Called first in a chunked backward. The engine enables grad mode in a backward exactly when create_graph=True;
    the chunked gradient has no graph, so a gradient penalty built on it would silently contribute nothing.
    fn_name: the entry the user called (a key of HIGHER_ORDER)."""
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"{fn_name} does not support double backward (create_graph=True): its gradient is computed chunk by "
            f"chunk without a graph; use {HIGHER_ORDER[fn_name]} for higher-order gradients"
        )


def _version_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor that shares `tensor`'s version counter but not its memory: detach() shares the counter, and
    replacing the detached tensor's data drops the storage (a guard must not keep an (N, H) hidden alive)."""
    alias = tensor.detach()
    try:
        alias.data = tensor.new_empty(0)
    except (RuntimeError, TypeError):     # tensor types that refuse the swap: keep the (shared) storage instead
        pass
    return alias


class VersionGuard:
    """Catches in-place changes, between a forward and its backward, of the tensors a chunked gradient is computed
    from. The fused loss computes its gradient in the forward and the two-phase backward recomputes from a copy
    of hidden, so torch's own check of saved tensors does not see the caller's tensors."""

    def __init__(self, fn_name: str, **tensors: Optional[torch.Tensor]):
        self.fn_name = fn_name
        # Inference tensors have no version counter (and cannot change outside inference mode).
        self.watched = [(name, _version_alias(t), t._version) for name, t in tensors.items()
                        if t is not None and not t.is_inference()]

    def check(self) -> None:
        for name, alias, version in self.watched:
            if alias._version != version:
                raise RuntimeError(
                    f"{name} was modified in place between {self.fn_name}'s forward and backward (version "
                    f"{version} -> {alias._version}): its gradient was computed from the old values; run the "
                    f"backward before changing {name} (e.g. before optimizer.step()), or call {self.fn_name} "
                    "again after the change"
                )


def chunked_pass(hidden: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], targets: torch.Tensor,
                 transform: LogitTransform, ops: ChunkOps, rows: int, *, need_entropy: bool,
                 token_grads: Optional[Callable] = None, grad_hidden: bool = True, grad_weight: bool = True,
                 grad_bias: bool = True, kept: Optional[KeptSet] = None,
                 need_sum_pi_squared: bool = False) -> PassResult:
    """One sweep over the tokens of hidden (N, H) against weight (V, H).

    token_grads(start, end, logp, entropy) -> (g_logp, g_entropy or None), all (end - start,) fp32, is called
    once per chunk; without it only log-probs (and entropies) are computed: one GEMM pass. kept: each token's
    kept set (grpo_fast.kept), over which log-probs, entropies and gradients are then taken; the logits are
    computed whole either way, so the GEMM passes do not change. need_sum_pi_squared: also each token's
    sum_v p_v^2 (over its kept set with one), from the same read of the chunk.
    """
    num_tokens, hidden_size = hidden.shape
    vocab_size = weight.shape[0]
    device = hidden.device
    stat_dtype = accumulation_dtype(hidden.dtype)
    logp = torch.empty(num_tokens, dtype=stat_dtype, device=device)
    entropy = torch.empty(num_tokens, dtype=stat_dtype, device=device) if need_entropy else None
    sum_pi_squared = torch.empty(num_tokens, dtype=stat_dtype, device=device) if need_sum_pi_squared else None
    want_grads = token_grads is not None
    d_hidden = torch.empty(hidden.shape, dtype=hidden.dtype, device=device) if want_grads and grad_hidden else None
    rows = min(rows, max(num_tokens, 1))
    d_weight = (
        WeightGrad((vocab_size, hidden_size), weight.dtype, device, single_chunk=rows >= num_tokens)
        if want_grads and grad_weight else None
    )
    d_bias = (
        torch.zeros(vocab_size, dtype=stat_dtype, device=device)
        if want_grads and grad_bias and bias is not None else None
    )
    # Rows padded to 16 elements: aligned vector loads in the kernels and an aligned leading dimension for cuBLAS.
    # The padding is zeroed: CPU bf16 GEMMs (oneDNN with AMX) read A's columns up to their block size when the
    # leading dimension allows, so GEMM 2 would multiply uninitialized padding (NaN at times) by zero.
    padded = torch.empty(rows, padded_width(vocab_size), dtype=hidden.dtype, device=device)
    padded[:, vocab_size:].zero_()
    buffer = padded[:, :vocab_size]
    weight_t = weight.t()
    for start in range(0, num_tokens, rows):
        end = min(start + rows, num_tokens)
        h = hidden[start:end]
        y = buffer[: end - start]
        if bias is None:
            torch.mm(h, weight_t, out=y)                        # GEMM 1: logits
        else:
            torch.addmm(bias, h, weight_t, out=y)
        chunk_kept = None if kept is None else kept.chunk(start, end)
        state = ops.stats_(y, targets[start:end], transform, need_entropy, kept=chunk_kept,
                           need_sum_pi_squared=need_sum_pi_squared)
        logp[start:end] = state.logp
        if need_entropy:
            entropy[start:end] = state.entropy
        if need_sum_pi_squared:
            sum_pi_squared[start:end] = state.sum_pi_squared
        if not want_grads:
            del state                                           # frees the backend's chunk temporaries
            continue
        g_logp, g_entropy = token_grads(start, end, state.logp, state.entropy)
        ops.dlogits_(y, state, targets[start:end], g_logp, g_entropy, transform)
        del state
        if d_hidden is not None:
            torch.mm(y, weight, out=d_hidden[start:end])        # GEMM 2: d(hidden)
        if d_weight is not None:
            d_weight.add(y, h)                                  # GEMM 3: d(weight)
        if d_bias is not None:
            d_bias += y.sum(0, dtype=stat_dtype)
    if d_hidden is not None:
        ops.all_reduce_grad_hidden(d_hidden)                    # vocabulary-parallel: sum over the slices
    return PassResult(
        logp=logp,
        entropy=entropy,
        grad_hidden=d_hidden,
        grad_weight=None if d_weight is None else d_weight.result(),
        grad_bias=None if d_bias is None else d_bias.to(bias.dtype),
        sum_pi_squared=sum_pi_squared,
    )
