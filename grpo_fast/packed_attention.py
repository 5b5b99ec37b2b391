"""Variable-length attention for packed rows: memory linear in the packed tokens, and each group's prompt once.

    name = use_varlen_attention(model, device, "bf16-autocast")   # "flash_attention_2" or "grpo_fast_varlen"
    model_inputs, predicting = shared_prompt_row(input_ids, attention_mask, prompt_length, completion_length)
    hidden = final_hidden_states(model, **model_inputs)           # (1, N, H); predicting indexes its N positions

A packed row is sequences laid end to end (the trainer's micro-batches, grpo_fast.train.update.batching; the TRL
drop-in's shared-prompt forward). With transformers' default attention (sdpa) `create_causal_mask` turns that row
into a dense (1, 1, N, N) block-diagonal mask: memory and time quadratic in the packed tokens N, where each
sequence only ever attends to itself. Two implementations avoid it, chosen by `choose_attention`:

- "flash_attention_2" (CUDA with the flash_attn package, fp16 / bf16 compute): flash_attn_varlen_func over the
  segments that `cu_seq_lens_q` / `cu_seq_lens_k` (transformers' FlashAttentionKwargs) describe.
- "grpo_fast_varlen" (everywhere else): causal sdpa within each packed sequence, taking the segments from the
  same keyword arguments (sequences of similar length batched into one call, right-padded, no mask). Anything
  that is not a packed row (padded batches, generation with a KV cache, left-padded prompts) goes to
  transformers' own sdpa unchanged, so generation and padded micro-batches compute exactly what sdpa computes.

The decoder hands its keyword arguments down to the attention function (transformers 5's Llama / Qwen2 layers pass
**kwargs through to `attention_interface(...)`), so the micro-batch's cu_seq_lens_* and max_length_* reach it.

Attention that sdpa cannot compute (Gemma 2's tanh soft-capping of the attention scores, `softcap`; GPT-OSS's
per-head attention sinks, `s_aux`) runs the model's own eager attention (its modeling file's
eager_attention_forward) within each packed sequence under the equivalent additive causal mask, so a packed row
computes what eager computes for each sequence alone; such a model also generates with eager
(sdpa_while_generating), never with flash-attention 2 where it has sinks (flash-attention 2 has none). Eager
holds each batch of similar-length sequences' (g, heads, L, L) scores: memory quadratic in the longest sequence
of the batch, still not in the packed row's N tokens.
`use_attention` is the trainer's `attention` key: "auto" (this module) or a transformers implementation kept as
is ("eager", "sdpa").

Limits: causal decoders only (a model that adds its own mask functions, such as bidirectional image spans, must
keep sdpa); a sliding window is a (L, L) band mask shared by each batch of similar-length sequences.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch

from grpo_fast.models import unwrap

NAME = "grpo_fast_varlen"
FLASH = "flash_attention_2"
HALF_PRECISIONS = ("bf16-autocast", "bf16", "fp16", torch.bfloat16, torch.float16)
# sequences of similar length share one causal sdpa call, right-padded, while the padding stays within this share
# of their tokens: PyTorch's CPU kernel runs many small calls at about half the speed of one batched call
PADDING_SLACK = 0.25
# keyword arguments transformers' attention layers pass that its sdpa drops and the model's own eager attention
# applies: Gemma 2's attention-score soft-capping and GPT-OSS's attention sinks
EAGER_ONLY = ("softcap", "s_aux")
SINKS = "attention sinks"
# the trainer's `attention` key: "auto" (use_varlen_attention) or a transformers implementation kept as is
CHOICES = ("auto", "eager", "sdpa")


def segments(cu_seq_lens: torch.Tensor, length: int, name: str = "cu_seq_lens_q") -> list:
    """[(start, end)] of the sequences of a packed row of `length` tokens: cu_seq_lens = [0, L_0, L_0 + L_1, ...,
    length]. Raises ValueError naming `name` when the boundaries do not cover the row in increasing order."""
    bounds = [int(b) for b in cu_seq_lens.reshape(-1).tolist()]
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length:
        raise ValueError(f"{name} must run from 0 to the packed length {length}, got {bounds[:4]}"
                         f"{'...' if len(bounds) > 4 else ''} ending at {bounds[-1] if bounds else None}")
    if any(end <= start for start, end in zip(bounds, bounds[1:])):
        raise ValueError(f"{name} must be strictly increasing (no empty sequence), got {bounds}")
    return list(zip(bounds, bounds[1:]))


def segments_from_positions(position_ids: torch.Tensor, length: int) -> list:
    """[(start, end)] of a packed row from its position ids, which restart at 0 with each sequence."""
    positions = position_ids.reshape(-1)
    if positions.numel() != length:
        return [(0, length)]
    starts = (positions == 0).nonzero().reshape(-1).tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    return list(zip(starts, starts[1:] + [length]))


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, sliding_window: Optional[int] = None,
                             cu_seq_lens_q: Optional[torch.Tensor] = None,
                             cu_seq_lens_k: Optional[torch.Tensor] = None, max_length_q: Optional[int] = None,
                             max_length_k: Optional[int] = None, position_ids: Optional[torch.Tensor] = None,
                             shared_prompts: Optional["SharedPrompts"] = None, **kwargs) -> tuple:
    """torch.cat([sdpa_attention_forward(module, q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], None)[0] for s, e in
    segments], dim=1): causal attention within each sequence of a packed row, without any mask or (N, N)
    tensor. Sequences of similar length run as one right-padded causal batch (length_groups; causality keeps a
    real query off the padding behind its sequence), so there are a few sdpa calls per layer, not one per sequence.

    query (1, heads, N, D), key / value (1, kv_heads, N, D) (grouped-query heads as sdpa takes them); the segments
    come from cu_seq_lens_q (== cu_seq_lens_k), else from position_ids restarting at 0. Returns ((1, N, heads, D),
    None) as transformers' attention functions do. With a mask, a batch of several rows or a KV cache (keys longer
    than queries) it is transformers' sdpa_attention_forward exactly. sliding_window: a query attends to the
    sliding_window latest keys of its own sequence (transformers' convention). shared_prompts: the row holds each
    group's prompt once and its completions after it (SharedPrompts), which shared_prompt_attention computes.
    Soft-capping or sinks in kwargs (EAGER_ONLY): the model's own eager attention in place of sdpa, the same way
    (per sequence, or on the whole padded or cached batch under the additive form of its mask).
    sequence_shards (in kwargs, grpo_fast.sequence_parallel.shard_row's): query, key and value are this rank's
    shard of the row; an all-to-all gives each rank the whole row for its share of the heads, and another the
    output back for its own tokens (Ulysses)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    shards = kwargs.pop("sequence_shards", None)
    if shards is not None:
        # Ulysses: this rank's heads over the whole row, then back to its tokens (grpo_fast.sequence_parallel)
        from grpo_fast import sequence_parallel

        heads = query.shape[1]
        module, query, key, value = sequence_parallel.spread_heads(module, query, key, value, shards)
        output, _ = varlen_attention_forward(module, query, key, value, attention_mask, dropout, scaling,
                                             sliding_window, cu_seq_lens_q, cu_seq_lens_k, max_length_q,
                                             max_length_k, None, shared_prompts, **kwargs)
        return sequence_parallel.gather_heads(output, shards, heads), None
    batch, _, length, _ = query.shape
    extra = eager_only(kwargs)
    packed_row = attention_mask is None and batch == 1 and key.shape[2] == length
    if not packed_row:
        if extra:
            mask = additive_mask(attention_mask, query, key)
            return eager_attention(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                           **extra)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      sliding_window=sliding_window, position_ids=position_ids, **kwargs)
    if shared_prompts is not None:
        return shared_prompt_attention(module, query, key, value, shared_prompts, sliding_window, dropout,
                                       scaling, extra), None
    if cu_seq_lens_q is not None:
        if cu_seq_lens_k is not None and cu_seq_lens_k is not cu_seq_lens_q and not torch.equal(
                cu_seq_lens_k.to(cu_seq_lens_q.device), cu_seq_lens_q):
            raise ValueError(f"cu_seq_lens_k must equal cu_seq_lens_q in self-attention over a packed row, got "
                             f"{cu_seq_lens_k.tolist()} and {cu_seq_lens_q.tolist()}")
        spans = segments(cu_seq_lens_q, length)
    elif position_ids is not None:
        spans = segments_from_positions(position_ids, length)
    else:
        spans = [(0, length)]
    if len(spans) == 1:
        return _causal(module, query, key, value, sliding_window, dropout, scaling, extra), None
    return _grouped(module, query, key, value, spans, sliding_window, dropout, scaling, extra), None


def eager_only(kwargs: dict) -> dict:
    """{name: value} of the EAGER_ONLY keyword arguments an attention layer passed (those not None)."""
    return {name: kwargs[name] for name in EAGER_ONLY if kwargs.get(name) is not None}


def eager_attention(module: torch.nn.Module):
    """The eager_attention_forward of the modeling file that defines `module`'s class: the model's own attention,
    soft-capping and sinks included. Raises ValueError naming the class where there is none."""
    function = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if function is None:
        raise ValueError(f"{type(module).__name__} applies attention soft-capping or sinks, which grpo_fast's packed "
                         f"attention computes with the model's eager_attention_forward, but "
                         f"{type(module).__module__} defines none; set the trainer's attention: eager")
    return function


def _causal(module, query, key, value, sliding_window: Optional[int], dropout: float, scaling,
            extra: dict) -> torch.Tensor:
    """(g, L, heads, D): causal attention (within the sliding window, when one is given) of each of g sequences
    (query (g, heads, L, D), key / value (g, kv_heads, L, D)): transformers' sdpa, or with soft-capping or sinks
    (extra: eager_only's) the model's own eager attention under the same mask, additive."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    length = query.shape[2]
    if extra:
        mask = _additive_window_mask(length, sliding_window, str(query.device), query.dtype)
        return eager_attention(module)(module, query, key, value, mask, dropout=dropout, scaling=scaling,
                                       **extra)[0]
    mask = window_mask(length, sliding_window, query.device)
    return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling)[0]


def additive_mask(attention_mask: Optional[torch.Tensor], query: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """The eager form (0 where a query attends, the dtype's lowest value elsewhere; as transformers' eager_mask) of
    the mask sdpa would get: a bool (b, 1, q, k) mask, a float one (returned as is), or None, which sdpa reads as
    causal with the queries last (a KV cache's new tokens)."""
    if attention_mask is not None and attention_mask.dtype != torch.bool:
        return attention_mask
    if attention_mask is None:
        queries, keys = query.shape[2], key.shape[2]
        steps = torch.arange(keys, device=query.device)
        attention_mask = (steps[None, :] <= steps[-queries:, None])[None, None]
    zero = torch.zeros((), dtype=query.dtype, device=query.device)
    return torch.where(attention_mask, zero, torch.finfo(query.dtype).min)


@functools.lru_cache(maxsize=8)
def _additive_window_mask(size: int, sliding_window: Optional[int], device: str, dtype) -> torch.Tensor:
    """(1, 1, size, size) additive form of window_mask (causal without a window); kept for the next layers."""
    steps = torch.arange(size, device=device)
    behind = steps[:, None] - steps[None, :]                      # query index - key index
    visible = (behind >= 0) & (behind < (sliding_window or size))
    return torch.where(visible, torch.zeros((), dtype=dtype, device=device), torch.finfo(dtype).min)[None, None]


def window_mask(size: int, sliding_window: Optional[int], device) -> Optional[torch.Tensor]:
    """(1, 1, size, size) bool: query i sees key j when 0 <= i - j < sliding_window (causal within the window, as
    transformers counts it), or None (plain causal) without a window or when the window covers the sequence.
    Kept for the next layers, which ask for the same mask."""
    if sliding_window is None or size <= sliding_window:
        return None
    return _window_mask(size, sliding_window, str(device))


@functools.lru_cache(maxsize=8)
def _window_mask(size: int, sliding_window: int, device: str) -> torch.Tensor:
    steps = torch.arange(size, device=device)
    behind = steps[:, None] - steps[None, :]                      # query index - key index
    return ((behind >= 0) & (behind < sliding_window))[None, None]


def length_groups(sizes: list, slack: float = PADDING_SLACK) -> list:
    """Indices of `sizes` in groups of similar length, longest first: a group's count x its longest stays within
    (1 + slack) x its tokens (a sequence alone always fits)."""
    groups, current, tokens = [], [], 0
    for index in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        if current and (len(current) + 1) * sizes[current[0]] > (1 + slack) * (tokens + sizes[index]):
            groups.append(current)
            current, tokens = [], 0
        current.append(index)
        tokens += sizes[index]
    return groups + [current]


def _grouped(module, query, key, value, spans: list, sliding_window: Optional[int], dropout: float,
             scaling, extra: dict) -> torch.Tensor:
    """(1, N, heads, D): each group of similar-length sequences as one right-padded batch under a causal sdpa (a
    real query never reaches the padding after its sequence), the padded rows dropped; no mask is built but a
    sliding window's (or, with extra, the (L, L) causal one eager attention adds)."""
    outputs, positions = _causal_spans(module, _token_rows(query, key, value), query, key, spans, sliding_window,
                                       dropout, scaling, extra)
    return _in_row_order(outputs, positions, query.shape[2])


def _token_rows(query, key, value) -> list:
    """(N, heads x D) rows of query, key and value: the projections' own layout, so a gather is one index_select
    (and its backward one index_add) over whole rows."""
    return [t[0].transpose(0, 1).reshape(t.shape[2], -1) for t in (query, key, value)]


def _gather(rows: list, query, key, query_index: torch.Tensor, key_index: torch.Tensor) -> tuple:
    """(q (g, heads, Lq, D), k, v (g, kv_heads, Lk, D)): the tokens query_index (g, Lq) and key_index (g, Lk)."""
    heads, kv_heads, dim = query.shape[1], key.shape[1], query.shape[3]
    q = rows[0].index_select(0, query_index.reshape(-1)).view(*query_index.shape, heads, dim).transpose(1, 2)
    k, v = (r.index_select(0, key_index.reshape(-1)).view(*key_index.shape, kv_heads, dim).transpose(1, 2)
            for r in rows[1:])
    return q, k, v


def _causal_spans(module, rows: list, query, key, spans: list, sliding_window: Optional[int], dropout: float,
                  scaling, extra: dict) -> tuple:
    """([(tokens, heads, D)], [(tokens,) positions]): causal attention within each span [(start, end)] (and within
    the sliding window, when one is given: every span starts at its batch row's first index, so one window mask
    serves the batch), spans of similar length batched into one right-padded sdpa call (the padding repeats a
    span's last token, which causality hides). extra: eager_only's keyword arguments (_causal)."""
    device = query.device
    sizes = [end - start for start, end in spans]
    outputs, positions = [], []
    for group in length_groups(sizes):
        starts = torch.tensor([spans[i][0] for i in group], device=device)
        lengths = torch.tensor([sizes[i] for i in group], device=device)
        steps = torch.arange(sizes[group[0]], device=device)
        index = starts[:, None] + torch.minimum(steps[None], lengths[:, None] - 1)          # (g, L_max)
        q, k, v = _gather(rows, query, key, index, index)
        out = _causal(module, q, k, v, sliding_window, dropout, scaling, extra)
        real = (steps[None] < lengths[:, None]).reshape(-1).nonzero().reshape(-1)
        outputs.append(out.reshape(-1, *out.shape[2:]).index_select(0, real))         # (tokens, heads, D)
        positions.append(index.reshape(-1)[real])
    return outputs, positions


def _in_row_order(outputs: list, positions: list, length: int) -> torch.Tensor:
    """(1, length, heads, D): the attention outputs of every token of the row, put back at their positions."""
    flat_positions = torch.cat(positions)
    order = torch.empty(length, dtype=torch.long, device=flat_positions.device)
    order[flat_positions] = torch.arange(length, device=flat_positions.device)
    return torch.cat(outputs).index_select(0, order)[None]


@dataclass
class SharedPrompts:
    """A packed row that holds each group's prompt once, followed by the group's completions: groups[i] =
    (prompt_start, prompt_length, [(completion_start, completion_length), ...]) in row positions, covering the
    row. A completion token sits at position prompt_length + its index (position_ids restart there for each
    completion), attends to the whole prompt and causally to its own completion, never to a sibling: the
    attention of the prompt followed by that completion alone, with the prompt's tokens computed once.
    Built by grpo_fast.train.update.batching.micro_batch; read by shared_prompt_attention, which keeps its index
    tensors here between layers (`cache`)."""

    groups: list
    cache: dict = field(default_factory=dict, repr=False, compare=False)

    def completion_sequences(self, device) -> list:
        """[(index (g, L), real (tokens,))], one per group of similar-length sequences of a completion of a larger
        group: index holds each completion's sequence as row positions, its prompt then itself (right-padded with
        its last token, which causality hides); real: the flat indices of the completion's own queries (the
        prompt's outputs come from causal_spans, where the prompt is computed once). Computed once per device."""
        key = str(device)
        if key not in self.cache:
            self.cache[key] = self._completion_sequences(device)
        return self.cache[key]

    def causal_spans(self) -> list:
        """[(start, end)] of what attends causally within itself: a shared prompt, or the whole sequence of a
        group of one (its completion follows its prompt in the row, so it is an ordinary packed sequence)."""
        return [(start, start + length + (spans[0][1] if len(spans) == 1 else 0)) for start, length, spans in
                self.groups]

    def _completion_sequences(self, device) -> list:
        completions = [(prompt_start, prompt_length, start, length) for prompt_start, prompt_length, spans
                       in self.groups if len(spans) > 1 for start, length in spans if length]
        if not completions:
            return []
        batches = []
        for group in length_groups([prompt_length + length for _, prompt_length, _, length in completions]):
            prompt_starts, prompt_lengths, starts, lengths = (torch.tensor(column, device=device)[:, None] for
                                                              column in zip(*(completions[i] for i in group)))
            totals = prompt_lengths + lengths
            steps = torch.arange(int(totals.max()), device=device)[None]
            step = torch.minimum(steps, totals - 1)              # the padding repeats the sequence's last token
            index = torch.where(step < prompt_lengths, prompt_starts + step, starts + step - prompt_lengths)
            real = ((steps >= prompt_lengths) & (steps < totals)).reshape(-1).nonzero().reshape(-1)
            batches.append((index, real))
        return batches


def shared_prompt_attention(module, query, key, value, layout: SharedPrompts, sliding_window: Optional[int],
                            dropout: float, scaling, extra: Optional[dict] = None) -> torch.Tensor:
    """(1, N, heads, D): attention over a SharedPrompts row, equal to the attention of each prompt + completion
    sequence on its own: the prompts causal among themselves (as varlen_attention_forward's sequences; a group of
    one is such a sequence whole, computed exactly as without sharing), each completion of a larger group over its
    prompt and its own earlier tokens. A completion's queries run in the causal sequence [its prompt, itself],
    gathered from the row (the prompt's rows are projected once; only their attention scores are recomputed, and
    their outputs there are dropped), so one unmasked causal sdpa call serves each group of similar-length
    sequences: no (C, P + C) mask, which sent sdpa to its slow path at long completions. extra: eager_only's
    keyword arguments (soft-capping, sinks: the model's eager attention, with the causal mask it adds)."""
    extra = extra or {}
    rows = _token_rows(query, key, value)
    outputs, positions = _causal_spans(module, rows, query, key, layout.causal_spans(), sliding_window, dropout,
                                       scaling, extra)
    for index, real in layout.completion_sequences(query.device):
        q, k, v = _gather(rows, query, key, index, index)
        out = _causal(module, q, k, v, sliding_window, dropout, scaling, extra)
        outputs.append(out.reshape(-1, *out.shape[2:]).index_select(0, real))
        positions.append(index.reshape(-1)[real])
    return _in_row_order(outputs, positions, query.shape[2])


def shared_prompt_lengths(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int) -> list:
    """[tokens] per row: its prompt's length when its prompt is row - 1's (same tokens, same padding), else 0."""
    prompts, mask = input_ids[:, :prompt_length], attention_mask[:, :prompt_length].bool()
    same = ((prompts[1:] == prompts[:-1]) | ~mask[1:]).all(1) & (mask[1:] == mask[:-1]).all(1)
    lengths = mask.sum(1)
    return [0] + torch.where(same, lengths[1:], 0).tolist()


def shared_prompt_row(input_ids: torch.Tensor, attention_mask: torch.Tensor, prompt_length: int,
                      completion_length: int, rows: Optional[list] = None) -> tuple:
    """(model_inputs, predicting (b, completion_length)): the b rows of a rollout (input_ids / attention_mask (b,
    prompt_length + C): left-padded prompts, then right-padded completions) as one packed row in which each run of
    consecutive rows with the same prompt holds it once: [prompt, completion, completion, ...] per run, positions
    restarting at the prompt's length for each completion. model_inputs are the decoder's keyword arguments
    (input_ids and position_ids (1, N), attention_mask None, and the SharedPrompts layout the attention reads,
    `shared_prompts`); predicting[i, t]: the row position of the hidden state that predicts completion token t of
    row i (0 past its end). rows: the rows' names in errors (their rollout indices; default 0..b-1)."""
    device = input_ids.device
    rows = list(range(input_ids.shape[0])) if rows is None else rows
    shared = shared_prompt_lengths(input_ids, attention_mask, prompt_length)
    ids, mask = input_ids.tolist(), attention_mask.bool().tolist()
    tokens, positions, groups, predicting = [], [], [], []
    for row in range(len(rows)):
        prompt = [t for t, real in zip(ids[row][:prompt_length], mask[row][:prompt_length]) if real]
        completion = [t for t, real in zip(ids[row][prompt_length:], mask[row][prompt_length:]) if real]
        if not prompt:
            raise ValueError(f"every rollout row needs a prompt token, row {rows[row]} has none")
        if not shared[row]:
            groups.append((len(tokens), len(prompt), []))
            tokens += prompt
            positions += range(len(prompt))
        prompt_start, prompt_tokens, spans = groups[-1]
        spans.append((len(tokens), len(completion)))
        # token t is predicted by the prompt's last hidden state (t = 0) or by completion token t - 1
        last = [prompt_start + prompt_tokens - 1] + [len(tokens) + t for t in range(len(completion) - 1)]
        predicting.append(last + [0] * (completion_length - len(last)))
        tokens += completion
        positions += range(prompt_tokens, prompt_tokens + len(completion))
    layout = SharedPrompts(groups)
    model_inputs = {"input_ids": torch.tensor([tokens], device=device),
                    "position_ids": torch.tensor([positions], device=device), "attention_mask": None,
                    "shared_prompts": layout}
    return model_inputs, torch.tensor(predicting, device=device)


def states_at(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden.reshape(-1, H)[index]: (*index.shape, H), the decoder's states at flat positions of its (rows x length)
    output, such as shared_prompt_row's `predicting`."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    return flat.index_select(0, index.reshape(-1)).view(*index.shape, -1)


def varlen_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0, attention_mask=None,
                **kwargs) -> Optional[torch.Tensor]:
    """None for a row with no padding and no cache (packed or a single sequence: varlen_attention_forward masks
    within each sequence itself); otherwise transformers' sdpa_mask(...) with the same arguments (padding, KV
    cache, generation)."""
    from transformers.masking_utils import sdpa_mask

    no_cache = kv_length == q_length and isinstance(q_offset, int) and isinstance(kv_offset, int) \
        and q_offset == 0 and kv_offset == 0
    if attention_mask is None and no_cache:
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, attention_mask=attention_mask, **kwargs)


def register() -> str:
    """Registers "grpo_fast_varlen" with transformers' AttentionInterface and AttentionMaskInterface (both are
    needed: a name missing from the mask interface makes create_causal_mask return None for padded batches too).
    Idempotent; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, varlen_attention_forward)
    AttentionMaskInterface.register(NAME, varlen_mask)
    return NAME


def flash_attn_available() -> bool:
    """Whether the flash_attn package (flash-attention 2) can be imported."""
    return importlib.util.find_spec("flash_attn") is not None


def choose_attention(device, dtype=None, flash: bool = True) -> str:
    """"flash_attention_2" on CUDA when flash_attn is importable and the compute dtype is half precision
    (`dtype`: a grpo_fast.train.update.precision name or a torch dtype; flash-attention has no fp32 kernels), else
    "grpo_fast_varlen". flash False: "grpo_fast_varlen" always (sequence parallelism's all-to-all lives there)."""
    device = torch.device(device)
    if flash and device.type == "cuda" and dtype in HALF_PRECISIONS and flash_attn_available():
        return FLASH
    return NAME


def use_varlen_attention(model: torch.nn.Module, device, dtype=None, flash: bool = True) -> str:
    """Sets the attention of `model` (a transformers causal LM, possibly inside PEFT / DDP wrappers; gradient
    checkpointing on or off) to `choose_attention(device, dtype)` and returns its name, for the log.

    dtype: the run's compute dtype (a grpo_fast.train.update.precision name such as "bf16-autocast", or a torch dtype);
    None: the model's parameter dtype. Generation with the same model (left padding, KV cache) is unchanged.
    A model with attention sinks never gets flash-attention 2, which has none (transformers would drop them);
    one whose soft-capping or sinks (sdpa_drops) its modeling file has no eager attention for is refused.
    flash False: never flash-attention 2 (choose_attention)."""
    base = _transformers_model(model)
    drops = sdpa_drops(base)
    if drops and getattr(sys.modules.get(type(base).__module__), "eager_attention_forward", None) is None:
        raise ValueError(f"model_type {base.config.model_type!r} has {drops}, which grpo_fast's packed attention "
                         f"computes with the model's eager_attention_forward, but {type(base).__module__} defines "
                         "none; set the trainer's attention: eager (and packing: false)")
    if dtype is None:
        dtype = next(base.parameters()).dtype
    name = choose_attention(device, dtype, flash)
    if name == FLASH and drops == SINKS:
        name = NAME
    if name == FLASH:
        try:
            base.set_attn_implementation(FLASH)
            return FLASH
        except (ImportError, ValueError):         # flash_attn installed but not loadable here: per-sequence sdpa
            name = NAME
    register()
    base.set_attn_implementation(name)
    return name


def use_attention(model: torch.nn.Module, choice: str, device, dtype=None, flash: bool = True) -> str:
    """The trainer's `attention` key (CHOICES): "auto" is use_varlen_attention(model, device, dtype); "eager" or
    "sdpa" sets that transformers implementation, kept for training and generation alike (it does not keep a
    packed row's sequences apart in every model, so the trainer refuses packing with it). Returns the name, for
    the log. Raises ValueError (one line) for sdpa on a model whose soft-capping or sinks it would drop
    (sdpa_drops), and for an implementation transformers refuses for the model."""
    if choice not in CHOICES:
        raise ValueError(f"attention must be one of {CHOICES}, got {choice!r}")
    if choice == "auto":
        return use_varlen_attention(model, device, dtype, flash)
    base = _transformers_model(model)
    drops = sdpa_drops(base)
    if choice == "sdpa" and drops:
        raise ValueError(f"attention='sdpa' would drop the {drops} of model_type {base.config.model_type!r}, which "
                         "its eager attention and vLLM apply; use attention: auto or eager")
    try:
        base.set_attn_implementation(choice)
    except (ImportError, ValueError) as error:
        reason = str(error).strip().splitlines()[0].split(". ")[0] if str(error).strip() else type(error).__name__
        raise ValueError(f"attention={choice!r} is not available for model_type {base.config.model_type!r} "
                         f"({reason}); use attention: auto or eager") from None
    return choice


def sdpa_drops(model: torch.nn.Module) -> Optional[str]:
    """What of `model`'s attention transformers' sdpa does not compute, in words: its attention logit soft-capping
    (config.attn_logit_softcapping, Gemma 2) or its attention sinks (a `sinks` parameter per attention layer,
    GPT-OSS); None when sdpa computes all of it."""
    base = unwrap(model)
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    softcap = getattr(config, "attn_logit_softcapping", None)
    if softcap is not None:
        return f"attention logit soft-capping (attn_logit_softcapping={softcap})"
    if any(name.rsplit(".", 1)[-1] == "sinks" for name, _ in base.named_parameters()):
        return SINKS
    return None


def _transformers_model(model: torch.nn.Module) -> torch.nn.Module:
    """unwrap(model), which must be a transformers PreTrainedModel; else TypeError naming its type."""
    base = unwrap(model)
    if not hasattr(base, "set_attn_implementation"):
        raise TypeError(f"model must be a transformers PreTrainedModel (with set_attn_implementation), got "
                        f"{type(base).__name__}")
    return base


def attention_name(model: torch.nn.Module) -> str:
    """The attention implementation `model` runs (its config's _attn_implementation)."""
    return getattr(unwrap(model).config, "_attn_implementation", None) or "eager"


@contextlib.contextmanager
def sdpa_while_generating(model: torch.nn.Module):
    """Inside the block `model` runs transformers' own sdpa where it runs grpo_fast_varlen (eager where sdpa would
    drop its soft-capping or sinks: sdpa_drops), and its attention is put back after. For generation: its calls
    are padded or cached, where varlen_attention_forward hands over to sdpa (or eager) anyway, but the
    model-level path then costs more (SmolLM2, 8 rows x 256 sampled tokens on a 2-core CPU: about 7% slower).
    Not for a forward whose backward runs after the block (gradient checkpointing recomputes with the attention
    of the moment)."""
    base = unwrap(model)
    if attention_name(base) != NAME:
        yield
        return
    base.set_attn_implementation("eager" if sdpa_drops(base) else "sdpa")
    try:
        yield
    finally:
        base.set_attn_implementation(NAME)
