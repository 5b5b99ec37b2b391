"""The HF engine's sampler: temperature, top-p and a draw per row from that row's prompt's own random stream.

    sampler = PromptSeededSampler(seeds=[step_seed + i for i in range(prompts)], n=group_size, temperature=1.0,
                                  top_p=1.0, top_k=0, record_logps=True)
    model.generate(input_ids, do_sample=False, logits_processor=[sampler], ...)   # one call for every prompt
    sampler.kept_steps            # with top_k > 0 or top_p < 1: each step's kept set, the tokens drawn from
    sampler.token_logps           # with record_logps: (rows, steps) log-probs of the tokens drawn

`generate` samples a whole batch from one random stream, so a row's draws would depend on every other row of the
call: on which prompts share the step and on the rank that got them. This processor draws instead: prompt i's n
rows take their uniforms from a generator seeded with seeds[i], one per row and token, and pick the token whose
cumulative probability first reaches it (inverse-CDF sampling), then hand `generate` scores whose only finite
entry is that token, which its greedy step takes. A prompt's completions therefore depend on its seed, the
weights and its own tokens only, whichever prompts are batched with it (up to the float rounding that a
different amount of left padding brings into the logits, which moves a draw only when a uniform falls within that
rounding of a boundary of the cumulative probabilities).

The sampler draws each token itself, so it can also take that token's log-prob on the spot: (rows,) floats a step,
where keeping `generate`'s logits (output_logits) for the same numbers after the call holds rows x V fp32 values
for every sampled position. It is the last processor `generate` runs (transformers appends the caller's
processors after its own, and adds no warpers under do_sample=False), so the scores it gets are the model's fp32
logits as `output_logits` returns them, provided no processor of `generate`'s own runs: the stop token that
ignore_eos forbids is banned here (banned_ids), not through min_new_tokens, whose processor would run first and
take the token out of the log-prob's normalizer.
"""

from __future__ import annotations

import torch


def nucleus_mask(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """(rows, V) bool: the tokens top-p keeps, the smallest set of the most likely ones whose probability reaches
    top_p (at least the most likely token; transformers' TopPLogitsWarper keeps the same set)."""
    if top_p >= 1.0:
        return torch.ones_like(probs, dtype=torch.bool)
    sorted_probs, order = probs.sort(dim=-1, descending=False)
    removed = sorted_probs.cumsum(dim=-1) <= 1 - top_p
    removed[..., -1] = False
    return ~removed.scatter(-1, order, removed)


def top_k_mask(probs: torch.Tensor, top_k: int) -> torch.Tensor:
    """(rows, V) bool: the top_k most likely tokens of each row (every token when top_k is 0 or >= V; ties at the
    boundary are kept, as transformers' TopKLogitsWarper and vLLM keep them)."""
    if top_k <= 0 or top_k >= probs.shape[-1]:
        return torch.ones_like(probs, dtype=torch.bool)
    return probs >= probs.topk(top_k, dim=-1).values[..., -1:]


def kept_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """(rows, V) bool: the tokens that survive top-k, then top-p over the top-k renormalized (the order of
    transformers' warpers and of vLLM's sampler)."""
    kept = top_k_mask(probs, top_k)
    if top_p < 1.0:
        truncated = probs * kept
        kept = kept & nucleus_mask(truncated / truncated.sum(-1, keepdim=True), top_p)
    return kept


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(rows,) token ids: for each row of `probs` (rows, V) (unnormalized, >= 0) the first token whose cumulative
    probability reaches (1 - u) x the row's total, u in [0, 1) from `uniforms` (rows,); never a zero-probability
    token, since the target is > 0 and at most the total."""
    cumulative = probs.double().cumsum(dim=-1)
    target = (1.0 - uniforms.double()) * cumulative[:, -1]
    return torch.searchsorted(cumulative, target[:, None]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class PromptSeededSampler:
    """A transformers logits processor (callable on (input_ids, scores)) that samples at `temperature` from the
    top_k, then top_p, kept set, rows i x n .. i x n + n - 1 from the generator seeded with seeds[i]; run it under
    do_sample=False (its scores leave the greedy step one choice).

    banned_ids: tokens never drawn (the stop token under ignore_eos); they stay in the normalizer of the recorded
    whole-vocabulary log-prob, as in the trainer's.
    kept_steps: with top_k > 0 or top_p < 1, one entry per generated position: the kept set of every row as
    `kept_mask(...).nonzero()`, (K, 2) int64 pairs (row, token id), ids ascending within a row.
    token_logps: with record_logps, (rows, generated positions) fp32: each row's drawn token's log-prob at
    `temperature`, over its kept set under top-k / top-p, else over the whole vocabulary."""

    def __init__(self, seeds: list, n: int, temperature: float, top_p: float, top_k: int = 0,
                 banned_ids: tuple = (), record_logps: bool = False):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.n, self.temperature, self.top_p, self.top_k = n, temperature, top_p, top_k
        self.banned_ids, self.record_logps = list(banned_ids), record_logps
        self.kept_steps: list = []
        # one buffer for every step's log-probs, doubled when full: per-step tensors kept for the whole generation
        # would sit between the KV cache's blocks in the C heap and keep freed ones from being returned
        self._logps, self._steps = None, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators) * self.n:
            raise ValueError(f"scores must have {len(self.generators)} prompts x {self.n} rows, got "
                             f"{scores.shape[0]} rows")
        logits = scores.float() / self.temperature
        allowed = logits
        if self.banned_ids:
            banned = torch.tensor(self.banned_ids, device=logits.device)
            allowed = logits.index_fill(-1, banned, float("-inf"))
        probs = torch.softmax(allowed, dim=-1)
        kept = None
        if self.top_k > 0 or self.top_p < 1.0:
            kept = kept_mask(probs, self.top_k, self.top_p) & (probs > 0)    # banned tokens (p = 0) are not kept
            self.kept_steps.append(kept.nonzero())
            probs = probs * kept
        uniforms = torch.cat([torch.rand(self.n, generator=generator) for generator in self.generators])
        tokens = inverse_cdf_draw(probs, uniforms.to(probs.device))
        if self.record_logps:
            # written over this step's logits and probabilities, which the draw has finished with: the record
            # allocates no (rows, V) tensor of its own
            if kept is not None:
                logits.masked_fill_(kept.logical_not_(), float("-inf"))
            logps = torch.log_softmax(logits, dim=-1, out=probs)
            self._record(logps.gather(-1, tokens[:, None]).squeeze(-1))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens[:, None], 0.0)

    @property
    def token_logps(self) -> torch.Tensor:
        if self._logps is None:
            return torch.zeros(len(self.generators) * self.n, 0)
        return self._logps[:, :self._steps]

    def _record(self, step_logps: torch.Tensor) -> None:
        """Appends one step's (rows,) log-probs as the next column of the buffer."""
        if self._logps is None or self._steps == self._logps.shape[1]:
            grown = step_logps.new_zeros(step_logps.shape[0], max(64, 2 * self._steps))
            if self._logps is not None:
                grown[:, :self._steps] = self._logps
            self._logps = grown
        self._logps[:, self._steps] = step_logps
        self._steps += 1
