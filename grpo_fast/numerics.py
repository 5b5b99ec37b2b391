"""What every layer agrees on about numbers: the dtype sums are accumulated in, and the logit transform.

A leaf (it imports torch, the kept-set format and the field bounds only): the chunk loop (`grpo_fast.chunked`), the
backends, the argument checks and the full-logits reference all import it, and it imports none of them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from grpo_fast.fields import LOGIT_SCALE, SOFTCAP, TEMPERATURE, is_number, plain
from grpo_fast.kept import KeptSet


@dataclass(frozen=True)
class LogitTransform:
    """The distribution each token's log-prob is taken under, from its logits y = hidden @ weight.T + bias::

        z = softcap * tanh(y * scale / softcap) / temperature          # no tanh when softcap is None
        logp = log_softmax(z)[target]                                   # over kept.ids of the token, if kept

    temperature: the sampling temperature (> 0). scale: the head's logit multiplier (Cohere's logit_scale).
    softcap: the head's final soft-cap (Gemma 2), or None. kept: the kept set of each token (`KeptSet`, the ids a
    top-k / top-p sampler kept, CSR), or None for the whole vocabulary; each set must hold its token's target.
    `grpo_fast.models.lm_head(model).transform(temperature)` builds a head's own. Validated on construction: an
    error names the field, the expected and the actual value. temperature and softcap lie within [1e-9, 1e9] and
    |scale| <= 1e9, so that the factors the kernels apply stay finite in float32 (grpo_fast.fields); numpy scalars
    are taken as the Python floats they hold.
    """

    temperature: float = 1.0
    scale: float = 1.0
    softcap: Optional[float] = None
    kept: Optional[KeptSet] = None

    def __post_init__(self):
        temperature, scale, softcap = plain(self.temperature), plain(self.scale), plain(self.softcap)
        for name, field, value in (("temperature", "temperature", temperature), ("logit_scale", "scale", scale)):
            if not is_number(value) or not math.isfinite(value):
                raise TypeError(f"{name} must be a finite float (LogitTransform.{field}), got {value!r}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0 (LogitTransform.temperature), got {temperature!r}")
        if softcap is not None and not (is_number(softcap) and 0 < softcap < math.inf):
            raise ValueError(f"logit_softcap must be a finite float > 0 or None (LogitTransform.softcap), got "
                             f"{softcap!r}")
        # the float32 range of the factors the kernels apply (grpo_fast.fields: LOGIT_FACTOR_MIN / _MAX)
        for name, field, value, rule in (("temperature", "temperature", temperature, TEMPERATURE),
                                         ("logit_scale", "scale", scale, LOGIT_SCALE),
                                         ("logit_softcap", "softcap", softcap, SOFTCAP)):
            if value is not None and not rule.bound.test(value):
                raise ValueError(f"{name} must be {rule.bound.text} (LogitTransform.{field}), got {value!r}")
        if self.kept is not None and not isinstance(self.kept, KeptSet):
            raise TypeError(f"kept must be a grpo_fast.KeptSet(ids, offsets) or None (LogitTransform.kept), got "
                            f"{type(self.kept).__name__}")
        object.__setattr__(self, "temperature", float(temperature))
        object.__setattr__(self, "scale", float(scale))
        object.__setattr__(self, "softcap", None if softcap is None else float(softcap))


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for every input dtype but fp64 (kept so that float64 gradchecks see float64 math)."""
    return torch.float64 if dtype == torch.float64 else torch.float32
