"""flash_attn.bert_padding's helpers in plain torch, with its signatures (see ../README.md)."""

import torch
from einops import rearrange  # noqa: F401  (re-exported, as flash-attn does)


def index_first_axis(tensor, indices):
    return tensor[indices]


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    mask = attention_mask if unused_mask is None else attention_mask + unused_mask
    lengths = mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, int(lengths.max()), attention_mask.sum(dim=-1, dtype=torch.int32)


def pad_input(hidden_states, indices, batch, seqlen):
    output = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])
