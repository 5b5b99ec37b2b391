"""What every layer agrees on about numbers: the dtype sums are accumulated in, and the logit transform.

A leaf (it imports torch only): the chunk loop (`grpo_fast.chunked`), the backends, the argument checks and the
full-logits reference all import it, and it imports none of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class LogitTransform:
    """z = softcap * tanh(y * scale / softcap) / temperature (no tanh when softcap is None)."""

    scale: float = 1.0
    softcap: Optional[float] = None
    temperature: float = 1.0


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every input dtype but fp64 (kept so that float64 gradchecks see float64 math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
