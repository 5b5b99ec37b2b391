"""Kept sets: the tokens a sampling engine kept at each position after top-k / top-p truncation.

An engine that samples with top_k > 0 or top_p < 1 draws from softmax(z) renormalized over the kept set S_t of
each position, not from the full softmax. The log-prob of the sampled token under that distribution is
z[target] - logsumexp_{j in S_t} z_j, and an importance ratio between the trainer and the engine is unbiased only
when both sides use the same S_t (otherwise every ratio carries the kept mass of its position).

Format: CSR, as vLLM's own `SamplingMask` hands it over. Token t's kept ids are
kept_ids[kept_offsets[t]:kept_offsets[t + 1]], tokens in the row-major order of targets (N = targets.numel()):

    kept_ids      (K_total,) integer token ids, each in [0, V), no id twice within a token
    kept_offsets  (N + 1,) integer, kept_offsets[0] = 0, non-decreasing, kept_offsets[N] = K_total

CSR rather than a padded (N, K_max) tensor: a top-p set has anywhere from 1 to top_k ids, so padding to the
longest costs N x K_max where CSR costs the ids alone, and it is what engines return without a copy.
`kept_set_from_mask` turns a (N, V) boolean mask into it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True, eq=False, repr=False)
class KeptSet:
    """The kept set of each of N tokens, CSR (see the module docstring): token t's kept ids are
    ids[offsets[t]:offsets[t + 1]], tokens in the row-major order of the targets.

    ids: (K_total,) integer token ids in [0, V), no id twice within a token, each token's target among its own.
    offsets: (N + 1,) integer, from 0, non-decreasing, to K_total; on the tokens' device.
    host_offsets: the same offsets on the CPU (chunk boundaries are sliced without a device sync); None (the
    default) copies them once here.

    `KeptSet(ids, offsets)` is what the loss entries take (in `LogitTransform(kept=...)`); they check it against
    the targets and the vocabulary before any work (`check_kept_set`), with errors naming ids as kept_ids and
    offsets as kept_offsets. `kept_set_from_mask` builds the pair from a (N, V) boolean mask.
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    host_offsets: Optional[torch.Tensor] = None

    def __post_init__(self):
        if self.host_offsets is None and isinstance(self.offsets, torch.Tensor):
            object.__setattr__(self, "host_offsets", self.offsets.cpu())

    def __repr__(self) -> str:
        if not (isinstance(self.ids, torch.Tensor) and isinstance(self.offsets, torch.Tensor)):
            return f"KeptSet(ids={type(self.ids).__name__}, offsets={type(self.offsets).__name__})"
        return f"KeptSet({self.num_tokens} tokens, {self.ids.numel()} ids, {self.ids.device})"

    @classmethod
    def of(cls, ids: torch.Tensor, offsets: torch.Tensor, host_offsets: Optional[torch.Tensor] = None) -> "KeptSet":
        """The set with int64 ids and offsets; host_offsets: the offsets on the CPU when the caller has them."""
        offsets = offsets.long()
        return cls(ids.long(), offsets, offsets.cpu() if host_offsets is None else host_offsets.long())

    @property
    def num_tokens(self) -> int:
        return self.offsets.numel() - 1

    def sizes(self) -> torch.Tensor:
        """(N,) int64: K of each token."""
        return self.offsets.diff()

    def chunk(self, start: int, end: int) -> "KeptChunk":
        """Tokens [start, end) with offsets relative to their first id."""
        first, last = int(self.host_offsets[start]), int(self.host_offsets[end])
        return KeptChunk(self.ids[first:last], self.offsets[start:end + 1] - first)

    def select(self, index: torch.Tensor) -> "KeptSet":
        """The kept sets of tokens `index` (1-D int64), in that order: what the loss keeps of masked batches."""
        sizes = self.sizes().index_select(0, index)
        offsets = torch.zeros(index.numel() + 1, dtype=torch.long, device=self.offsets.device)
        torch.cumsum(sizes, 0, out=offsets[1:])
        total = int(offsets[-1])
        # position of each selected id in self.ids: its token's first id there, plus its rank within the token
        shift = torch.repeat_interleave(self.offsets.index_select(0, index) - offsets[:-1], sizes,
                                        output_size=total)
        positions = shift + torch.arange(total, device=self.ids.device)
        return KeptSet(self.ids.index_select(0, positions), offsets, offsets.cpu())

    def dense(self, vocab_size: int) -> torch.Tensor:
        """(N, V) bool: True at the kept ids (the reference's masked full logits)."""
        mask = torch.zeros(self.num_tokens, vocab_size, dtype=torch.bool, device=self.ids.device)
        mask[token_of_each_id(self.offsets, self.ids.numel()), self.ids] = True
        return mask


@dataclass(frozen=True)
class KeptChunk:
    """The kept sets of one chunk of C tokens: ids (K,) int64 and offsets (C + 1,) int64 from 0."""

    ids: torch.Tensor
    offsets: torch.Tensor

    def rows(self) -> torch.Tensor:
        """(K,) int64: the chunk row each id belongs to."""
        return token_of_each_id(self.offsets, self.ids.numel())


def token_of_each_id(offsets: torch.Tensor, total: int) -> torch.Tensor:
    """(K_total,) int64: the token each CSR entry belongs to."""
    tokens = torch.arange(offsets.numel() - 1, device=offsets.device)
    return torch.repeat_interleave(tokens, offsets.diff(), output_size=total)


def kept_set_from_mask(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept_ids, kept_offsets) of a (N, V) bool mask, True where a token is kept (row-major, ids ascending)."""
    if mask.ndim != 2 or mask.dtype != torch.bool:
        raise ValueError(f"mask must be a (N, V) bool tensor, got shape {tuple(mask.shape)} dtype {mask.dtype}")
    ids = mask.nonzero()[:, 1]
    offsets = torch.zeros(mask.shape[0] + 1, dtype=torch.long, device=mask.device)
    torch.cumsum(mask.sum(1), 0, out=offsets[1:])
    return ids, offsets


def _integer_vector(name: str, value, device) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got dtype {value.dtype}")
    if value.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name} must be on {device} like targets, got {value.device}")


def check_kept_set(kept_ids, kept_offsets, targets: torch.Tensor, vocab_size: int,
                   valid: Optional[torch.Tensor] = None, host_offsets=None) -> Optional[KeptSet]:
    """The KeptSet of (kept_ids, kept_offsets) for `targets` (any shape, N = numel), or None when both are None.
    host_offsets: kept_offsets already on the CPU (a KeptSet's), which saves a device sync.

    valid: (same shape as targets) bool, the tokens that count (the loss's mask); elsewhere a kept set may be
    empty and need not hold its target. Every error names the argument, the expected and the actual value.
    """
    if kept_ids is None and kept_offsets is None:
        return None
    if kept_ids is None or kept_offsets is None:
        given, missing = ("kept_ids", "kept_offsets") if kept_offsets is None else ("kept_offsets", "kept_ids")
        raise ValueError(f"{given} needs {missing} (a kept set is the pair, CSR), got {missing}=None")
    device = targets.device
    _integer_vector("kept_ids", kept_ids, device)
    _integer_vector("kept_offsets", kept_offsets, device)
    num_tokens = targets.numel()
    if kept_offsets.numel() != num_tokens + 1:
        raise ValueError(f"kept_offsets must have shape (N + 1,) = ({num_tokens + 1},) for the N = {num_tokens} "
                         f"tokens of targets, got {tuple(kept_offsets.shape)}")
    kept = KeptSet.of(kept_ids, kept_offsets, host_offsets)
    host = kept.host_offsets
    if int(host[0]) != 0 or int(host[-1]) != kept_ids.numel():
        raise ValueError(f"kept_offsets must run from 0 to kept_ids.numel() = {kept_ids.numel()}, got "
                         f"{int(host[0])} to {int(host[-1])}")
    sizes = host.diff()
    if bool((sizes < 0).any()):
        token = int((sizes < 0).nonzero()[0])
        raise ValueError(f"kept_offsets must not decrease, got kept_offsets[{token + 1}] = {int(host[token + 1])} "
                         f"< kept_offsets[{token}] = {int(host[token])}")
    counted = torch.ones(num_tokens, dtype=torch.bool) if valid is None else valid.reshape(-1).cpu()
    empty = (sizes == 0) & counted
    if bool(empty.any()):
        token = int(empty.nonzero()[0])
        where = "" if valid is None else " where mask is 1"
        raise ValueError(f"every kept set{where} needs K >= 1 ids (at least its sampled token), got K = 0 for token "
                         f"{token} (kept_offsets[{token}] = kept_offsets[{token + 1}] = {int(host[token])})")
    if kept_ids.numel() == 0:
        return kept
    low, high = int(kept.ids.min()), int(kept.ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"kept_ids must lie in [0, V) = [0, {vocab_size}), got values in [{low}, {high}]")
    token_of = token_of_each_id(kept.offsets, kept.ids.numel())
    keys = (token_of * vocab_size + kept.ids).sort().values
    repeated = keys[1:] == keys[:-1]
    if bool(repeated.any()):
        key = int(keys[1:][repeated][0])
        raise ValueError(f"kept_ids must hold each id once per token, got id {key % vocab_size} twice for token "
                         f"{key // vocab_size}")
    flat_targets = targets.reshape(-1).long()
    hits = (kept.ids == flat_targets.index_select(0, token_of)).long()
    holds_target = torch.zeros(num_tokens, dtype=torch.long, device=device).index_add_(0, token_of, hits) > 0
    missing = ~holds_target.cpu() & counted
    if bool(missing.any()):
        token = int(missing.nonzero()[0])
        raise ValueError(f"every token's kept set must hold its target (the sampled token), got token {token} with "
                         f"target {int(flat_targets[token])} not among its {int(sizes[token])} kept_ids")
    return kept
