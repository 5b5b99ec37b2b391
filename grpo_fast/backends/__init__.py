"""The executions of the chunk passes: `torch` (any device), `triton` (CUDA, or the CPU interpreter) and a
vocabulary-parallel head (`vocab_parallel`, PyTorch math on one rank's slice).

Every backend is a `ChunkOps` (the interface, in the leaf `grpo_fast.backends.base`) and declares what the chunk
loop (`grpo_fast.chunked`) uses:
    bytes_per_logit(dtype)      working-set bytes per logit, which sizes the chunks
    chunk_vocab(vocab_rows)     the vocabulary size chunks are sized by (the head's rows; the largest slice when
                                the head is split, so that every rank takes the same steps)
    stats_(buffer, targets, transform, need_entropy, kept=None, need_sum_pi_squared=False) -> state with
                                .logp, .entropy, .sum_pi_squared (None unless asked for; and its own fields);
                                with kept (a grpo_fast.kept.KeptChunk) over each row's kept set only
    policy_grad(logp, terms)    d(loss)/d(logp) of token-level variants, see `grpo_fast.variants.TokenTerms`
    dlogits_(buffer, state, targets, g_logp, g_entropy, transform)    buffer <- d(loss)/d(logits)
    all_reduce_grad_hidden(grad_hidden)   sums d(hidden) over the devices that share the head (single device:
                                nothing to do)
`stats_` may rewrite the buffer in a form only its own `dlogits_` reads, so the two are always called as a pair on
the same buffer. The buffer is a (C, V) view of rows `buffer.stride(0)` elements apart; columns past V up to that
stride are scratch a backend may overwrite (grpo_fast.chunked pads rows to 16 elements so that the Triton kernels
move 16-byte vectors). `resolve` returns one shared instance per backend.
"""

from __future__ import annotations

import os

import torch

from grpo_fast.backends import torch_ops
from grpo_fast.backends.base import ChunkOps
from grpo_fast.backends.vocab_parallel import VocabParallelOps, VocabShard

BACKENDS = ("auto", "torch", "triton")


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_name(backend) -> None:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


def resolve(backend: str, device: torch.device) -> ChunkOps:
    """The backend for `backend` on `device`, with a clear error when it cannot run there."""
    check_name(backend)
    if backend == "auto":
        backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton":
        if not triton_available():
            raise ValueError("backend='triton' needs the triton package, which is not importable here")
        if device.type != "cuda" and not interpreting():
            raise ValueError(
                f"backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 for the CPU interpreter), "
                f"got tensors on {device}"
            )
        try:         # deferred: it needs triton and grpo_fast.kernels, which torch-only users may lack
            from grpo_fast.backends import triton_ops
        except ModuleNotFoundError as error:      # a source tree on sys.path without an install
            if error.name != "grpo_fast.kernels":
                raise
            raise ImportError("backend='triton' needs grpo_fast.kernels (the repository's kernels/ folder), which is "
                              "importable only from an install: run `pip install -e .` in the repository") from None
        return triton_ops.OPS
    return torch_ops.OPS


def resolve_head(backend: str, device: torch.device, vocab_rows: int, process_group=None) -> tuple[ChunkOps, int]:
    """(ops, full vocabulary size) for an LM head of vocab_rows rows here: the whole head, or with a
    process_group this rank's slice of a vocabulary-parallel head (see grpo_fast.backends.vocab_parallel)."""
    if process_group is None:
        return resolve(backend, device), vocab_rows
    check_name(backend)
    if backend == "triton":
        raise ValueError("a vocabulary-parallel head (process_group) runs on backend 'torch' or 'auto', got "
                         "'triton'")
    shard = VocabShard.of(vocab_rows, process_group, device)
    return VocabParallelOps(shard), shard.total_size
