"""The option groups of the loss entries beside the loss's own (`LossConfig`, grpo_fast.variants) and the logit
transform (`LogitTransform`, grpo_fast.numerics): how the sweep runs (`Execution`) and the per-token factors of
the policy loss (`TokenWeights`); and the one-line error of a keyword that moved into one of the groups.

A leaf beside numerics: it imports torch and grpo_fast.fields only.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional, ParamSpec, TypeVar

import torch

from grpo_fast.fields import COEFFICIENT_MAX, is_number, plain

# a decorated entry keeps its signature for type checkers and IDEs
P = ParamSpec("P")
R = TypeVar("R")
BACKEND_NAMES = ("auto", "torch", "triton")       # grpo_fast.backends.BACKENDS, which this leaf cannot import
_INTEGER_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


@dataclass(frozen=True)
class Execution:
    """How the sweep over the vocabulary runs: the result is the same up to rounding whatever these are.

    chunk_bytes: memory budget of one chunk's working set (default 256 MiB on CPU; on CUDA 1/16 of the device's
        memory within [1 GiB, 8 GiB]: fewer chunks mean less d(weight) accumulator traffic).
    backend: "auto" (Triton on CUDA when importable, else torch), "torch" or "triton".
    process_group: for a vocabulary-parallel LM head: weight (and bias) hold this rank's rows of the vocabulary
        (ranks in order, any sizes); every rank passes the same hidden, targets and the rest, and gets the full
        log-probs / loss, the full d(hidden) and its own slice's d(weight). Runs the PyTorch backend.
    Validated on construction: an error names the field, the expected and the actual value.
    """

    chunk_bytes: Optional[int] = None
    backend: str = "auto"
    process_group: Any = None

    def __post_init__(self):
        chunk_bytes = plain(self.chunk_bytes)          # np.int64(4096) -> 4096
        if chunk_bytes is not None and (not isinstance(chunk_bytes, int) or isinstance(chunk_bytes, bool)
                                        or chunk_bytes <= 0):
            raise ValueError(f"chunk_bytes must be a positive int or None (Execution.chunk_bytes), got "
                             f"{chunk_bytes!r}")
        if not isinstance(self.backend, str) or self.backend not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES} (Execution.backend), got {self.backend!r}")
        group = self.process_group
        if group is not None and not (torch.distributed.is_available()
                                      and isinstance(group, torch.distributed.ProcessGroup)):
            raise TypeError(f"process_group must be a torch.distributed.ProcessGroup or None "
                            f"(Execution.process_group), got {_shown(group)}")
        object.__setattr__(self, "chunk_bytes", chunk_bytes)


@dataclass(frozen=True, eq=False)
class TokenWeights:
    """Per-token factors of the policy loss and its normalizer; tensors (B, T) or (N,) like targets, fp32 /
    bf16 / fp16, values where the mask is 0 ignored. Each None keeps the loss type's own.

    num_items_in_batch: the dapo / cispo / vespo normalizer (default: the number of mask tokens in this call; pass
        the global count when accumulating gradients over calls), at most 1e18; a number or a 1-element tensor.
    is_ratio: the rollout importance-sampling correction per token (e.g. vLLM's), a constant factor of the policy
        term; vespo multiplies it into each sequence's ratio instead.
    loss_weights: weights of the per-token losses (policy term plus KL) in place of loss_type's reduction: loss =
        sum(loss_weights * per_token) over the mask. Any engine's normalizer linear in the loss matrix (verl's
        agg_loss modes, OpenRLHF's means) is such weights; num_items_in_batch is then unused.
    entropy_weights: weights of the entropy bonus in place of entropy_coef's masked mean: the loss gets
        -sum(entropy_weights * entropy) over the mask (LossConfig.entropy_coef must stay 0).
    """

    num_items_in_batch: Any = None
    is_ratio: Optional[torch.Tensor] = None
    loss_weights: Optional[torch.Tensor] = None
    entropy_weights: Optional[torch.Tensor] = None

    def __post_init__(self):
        items = plain(self.num_items_in_batch)
        if isinstance(items, torch.Tensor):
            # a device tensor's value is not read here (that would wait for the device); a CPU one's is
            if items.numel() != 1 or not (items.is_floating_point() or items.dtype in _INTEGER_DTYPES):
                raise ValueError(f"num_items_in_batch must be a number or a 1-element real tensor "
                                 f"(TokenWeights.num_items_in_batch), got {_shown(items)}")
            if items.device.type == "cpu" and not bool(torch.isfinite(items).all() and (items >= 0).all()):
                raise ValueError(f"num_items_in_batch must be a finite number >= 0 "
                                 f"(TokenWeights.num_items_in_batch), got {items.item()!r}")
            if items.device.type == "cpu" and float(items) > COEFFICIENT_MAX:
                raise ValueError(f"num_items_in_batch must be in [0, {COEFFICIENT_MAX!r}] "
                                 f"(TokenWeights.num_items_in_batch), got {items.item()!r}")
        elif items is not None and not (is_number(items) and math.isfinite(items) and items >= 0):
            raise ValueError(f"num_items_in_batch must be a finite number >= 0 or None "
                             f"(TokenWeights.num_items_in_batch), got {_shown(items)}")
        elif items is not None and items > COEFFICIENT_MAX:
            # the loss divides by it in float32: its reciprocal stays a normal float32 (grpo_fast.fields)
            raise ValueError(f"num_items_in_batch must be a finite number in [0, {COEFFICIENT_MAX!r}] or None "
                             f"(TokenWeights.num_items_in_batch), got {_shown(items)}")
        object.__setattr__(self, "num_items_in_batch", items)
        for name in ("is_ratio", "loss_weights", "entropy_weights"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"{name} must be a tensor like targets or None (TokenWeights.{name}), got "
                                f"{_shown(value)}")


# keyword -> its home, for the keywords the entries took before their options were grouped
TRANSFORM_MOVES = {
    "temperature": "transform=LogitTransform(temperature=...)",
    "logit_scale": "transform=LogitTransform(scale=...)",
    "logit_softcap": "transform=LogitTransform(softcap=...)",
    "kept_ids": "transform=LogitTransform(kept=KeptSet(ids, offsets))",
    "kept_offsets": "transform=LogitTransform(kept=KeptSet(ids, offsets))",
}
EXECUTION_MOVES = {name: f"execution=Execution({name}=...)" for name in ("chunk_bytes", "backend", "process_group")}
WEIGHTS_MOVES = {name: f"weights=TokenWeights({name}=...)"
                 for name in ("num_items_in_batch", "is_ratio", "loss_weights", "entropy_weights")}


def _shown(value) -> str:
    """A value as one short line: a tensor by its shape and dtype, anything else by a clipped repr."""
    if isinstance(value, torch.Tensor):
        return f"<tensor {tuple(value.shape)} {value.dtype}>"
    text = " ".join(repr(value).split())
    return text if len(text) <= 60 else text[:57] + "..."


def moved_keywords(fn_name: str, moves: dict) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """A decorator: fn, except that a call passing a keyword of `moves` (name -> its new home) raises a one-line
    TypeError naming the home, e.g. "grpo_loss() got temperature=0.7: it moved to
    transform=LogitTransform(temperature=...)", and a keyword fn does not take and `moves` does not know raises one
    naming fn's keywords and the close names of both. functools.wraps keeps fn's signature, docstring and name."""
    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        parameters = inspect.signature(fn).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
        keywords = [name for name, p in parameters.items() if name != "self" and p.kind in (
            inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)]

        @functools.wraps(fn)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            if not moves.keys().isdisjoint(kwargs):
                name = next(name for name in kwargs if name in moves)
                raise TypeError(f"{fn_name}() got {name}={_shown(kwargs[name])}: it moved to {moves[name]}")
            if not takes_any and not parameters.keys() >= kwargs.keys():
                name = next(name for name in kwargs if name not in parameters)
                raise TypeError(unknown_keyword(fn_name, name, kwargs[name], keywords, moves))
            return fn(*args, **kwargs)
        return checked
    return decorate


def unknown_keyword(fn_name: str, name: str, value, keywords: list, moves: dict) -> str:
    """The one-line error of a keyword that is neither fn's nor a moved one: fn's keywords, then the close names,
    a moved one's with where it goes now (e.g. "close: epsilon_low, epsilon_high in config=LossConfig(...)")."""
    message = (f"{fn_name}() got an unknown keyword argument {name}={_shown(value)}: expected one of "
               f"{', '.join(keywords)}")
    close = difflib.get_close_matches(name, [*keywords, *moves], n=4, cutoff=0.6)
    close += [other for other in [*keywords, *moves] if name in other and other not in close]
    homes: dict = {}
    for other in close:
        home = moves[other].replace(f"{other}=...", "...") if other in moves else None
        homes.setdefault(home, []).append(other)
    if homes:
        message += "; close: " + "; ".join(", ".join(names) + ("" if home is None else f" in {home}")
                                            for home, names in homes.items())
    return message


def names_moved_keywords(moves: dict) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """`moved_keywords` under the decorated function's own name."""
    def decorate(fn: Callable[P, R]) -> Callable[P, R]:
        return moved_keywords(getattr(fn, "__name__", "function"), moves)(fn)
    return decorate
