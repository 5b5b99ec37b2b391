"""The HF engine's sampler: temperature, top-p and a draw per row from that row's prompt's own random stream.

    sampler = PromptSeededSampler(seeds=[step_seed + i for i in range(prompts)], n=group_size, temperature=1.0,
                                  top_p=1.0)
    model.generate(input_ids, do_sample=False, logits_processor=[sampler], ...)   # one call for every prompt

`generate` samples a whole batch from one random stream, so a row's draws would depend on every other row of the
call: on which prompts share the step and on the rank that got them. This processor draws instead: prompt i's n
rows take their uniforms from a generator seeded with seeds[i], one per row and token, and pick the token whose
cumulative probability first reaches it (inverse-CDF sampling), then hand `generate` scores whose only finite
entry is that token, which its greedy step takes. A prompt's completions therefore depend on its seed, the
weights and its own tokens only, whichever prompts are batched with it (up to the float rounding that a
different amount of left padding brings into the logits, which moves a draw only when a uniform falls within that
rounding of a boundary of the cumulative probabilities).
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


def inverse_cdf_draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """(rows,) token ids: for each row of `probs` (rows, V) (unnormalized, >= 0) the first token whose cumulative
    probability reaches (1 - u) x the row's total, u in [0, 1) from `uniforms` (rows,); never a zero-probability
    token, since the target is > 0 and at most the total."""
    cumulative = probs.double().cumsum(dim=-1)
    target = (1.0 - uniforms.double()) * cumulative[:, -1]
    return torch.searchsorted(cumulative, target[:, None]).squeeze(-1).clamp_(max=probs.shape[-1] - 1)


class PromptSeededSampler:
    """A transformers logits processor (callable on (input_ids, scores)) that samples at `temperature` from the
    top_p nucleus, rows i x n .. i x n + n - 1 from the generator seeded with seeds[i]; run it under
    do_sample=False (its scores leave the greedy step one choice)."""

    def __init__(self, seeds: list, n: int, temperature: float, top_p: float):
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.generators = [torch.Generator().manual_seed(seed) for seed in seeds]
        self.n, self.temperature, self.top_p = n, temperature, top_p

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators) * self.n:
            raise ValueError(f"scores must have {len(self.generators)} prompts x {self.n} rows, got "
                             f"{scores.shape[0]} rows")
        probs = torch.softmax(scores.float() / self.temperature, dim=-1)
        probs = probs * nucleus_mask(probs, self.top_p)
        uniforms = torch.cat([torch.rand(self.n, generator=generator) for generator in self.generators])
        tokens = inverse_cdf_draw(probs, uniforms.to(probs.device))
        chosen = torch.full_like(scores, float("-inf"))
        return chosen.scatter_(-1, tokens[:, None], 0.0)
