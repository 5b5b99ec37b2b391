"""The interface every backend implements (see `grpo_fast.backends`): a leaf, so that the backends import it and
the package's `resolve` imports the backends, never the other way round."""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class ChunkOps(ABC):
    """What a backend provides (see grpo_fast.backends); the defaults are those of a single-device head."""

    @abstractmethod
    def bytes_per_logit(self, dtype: torch.dtype) -> int: ...

    @abstractmethod
    def stats_(self, buffer, targets, transform, need_entropy, kept=None, need_sum_pi_squared=False): ...

    @abstractmethod
    def policy_grad(self, logp, terms) -> torch.Tensor: ...

    @abstractmethod
    def dlogits_(self, buffer, state, targets, g_logp, g_entropy, transform) -> None: ...

    def chunk_vocab(self, vocab_rows: int) -> int:
        return vocab_rows

    def all_reduce_grad_hidden(self, grad_hidden: torch.Tensor) -> None:
        pass                  # one device holds the whole head, so d(hidden) is already complete
