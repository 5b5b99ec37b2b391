"""Hugging Face causal LMs without their logits: final hidden states and the LM head's parameters.

    head = lm_head(model)                                    # weight, bias, logit_scale, logit_softcap
    hidden = final_hidden_states(model, input_ids, attention_mask)        # (B, L, H), normed, no logits
    logp = token_logprobs(hidden[:, :-1], head.weight, input_ids[:, 1:], bias=head.bias,
                          transform=head.transform(temperature=0.9))

equals `log_softmax(model(input_ids).logits[:, :-1] / 0.9).gather(...)`. Works for PEFT-wrapped models and models
wrapped by DDP / FSDP (`.module`), tied embeddings, Gemma 2's final soft-cap, Cohere's `logit_scale` and
Granite's `logits_scaling`; an FSDP2 (DTensor) head is gathered once per call, a ZeRO-3 head inside
`gathered_lm_head(model)`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from grpo_fast.kept import KeptSet
from grpo_fast.numerics import LogitTransform


@dataclass
class LMHead:
    """What turns final hidden states into logits: z = softcap((h @ weight.T + bias) * logit_scale)."""

    weight: torch.Tensor
    bias: Optional[torch.Tensor] = None
    logit_scale: float = 1.0
    logit_softcap: Optional[float] = None

    def transform(self, temperature: float = 1.0, kept: Optional[KeptSet] = None) -> LogitTransform:
        """LogitTransform(temperature, scale=logit_scale, softcap=logit_softcap, kept=kept): this head's logit
        transform, the `transform=` of `token_logprobs` / `grpo_loss` (its bias goes as `bias=`); kept: the
        tokens' kept sets (top-k / top-p sampling), or None for the whole vocabulary."""
        return LogitTransform(temperature=temperature, scale=self.logit_scale, softcap=self.logit_softcap, kept=kept)


def wrapper_chain(model: nn.Module) -> list:
    """[model, the module it wraps, ..., the transformers model]: the DDP / FSDP / torch.compile / PEFT wrappers
    from the outside in, the model itself last (a list of one when `model` is not wrapped)."""
    chain = [model]
    while True:
        if hasattr(model, "get_base_model") and callable(model.get_base_model):   # PEFT
            model = model.get_base_model()
        elif isinstance(getattr(model, "module", None), nn.Module):                # DDP, FSDP1, DeepSpeed
            model = model.module
        elif isinstance(getattr(model, "_orig_mod", None), nn.Module):             # torch.compile
            model = model._orig_mod
        else:
            return chain
        chain.append(model)


def unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / FSDP / torch.compile / PEFT wrappers."""
    return wrapper_chain(model)[-1]


def _text_config(config):
    return getattr(config, "text_config", None) or config


def lm_head(model: nn.Module) -> LMHead:
    """The LM-head parameters and logit transform of a Hugging Face causal LM (wrappers removed).

    Raises TypeError when the model has no linear output embedding (e.g. a LoRA adapter on the head itself).
    """
    model = unwrap(model)
    head = model.get_output_embeddings()
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor) or head.weight.ndim != 2:
        raise TypeError(f"model must have a linear output embedding (lm_head), got {type(head).__name__}")
    if hasattr(head, "lora_A") or hasattr(head, "base_layer"):
        raise TypeError("a PEFT adapter on the LM head itself is not supported: its logits are not h @ W^T + b")
    config = _text_config(model.config)
    scale = logit_scale(config)
    softcap = getattr(config, "final_logit_softcapping", None)     # Gemma 2: softcap * tanh(logits / softcap)
    weight, bias = _full(head.weight), _full(getattr(head, "bias", None))
    return LMHead(weight, bias, scale, None if softcap is None else float(softcap))


def logit_scale(config) -> float:
    """The factor a model's forward applies to h @ W^T (before any soft-cap), read from its config.

    Cohere: logit_scale; Falcon-H1: lm_head_multiplier; output_multiplier where a family names it so; Granite and
    MiniCPM3 divide by logits_scaling (HyperCLOVA X multiplies by it).
    """
    for name in ("logit_scale", "output_multiplier", "lm_head_multiplier"):
        value = getattr(config, name, None)
        if value is not None:
            return float(value)
    scaling = getattr(config, "logits_scaling", None)
    if scaling is not None:
        return float(scaling) if getattr(config, "model_type", "") == "hyperclovax" else 1.0 / float(scaling)
    return 1.0


def _full(param):
    """A sharded FSDP2 parameter (DTensor) gathered once, differentiably; anything else as it is."""
    if param is not None and hasattr(param, "full_tensor") and hasattr(param, "device_mesh"):
        return param.full_tensor()
    return param


def gathered_lm_head(model: nn.Module):
    """Context in which a DeepSpeed ZeRO-3 LM head is gathered (a no-op otherwise, or when it already is).

    A fused loss reads the head's weight directly rather than through lm_head.forward, so ZeRO-3's gather hook
    never fires: wrap `lm_head(model)` and the loss in this context, as TRL does for its own fused head. Inside
    a forward of the model, ZeRO-3 gathers the head on first access and hands its gradient back to the
    partitions in backward; outside one, this gathers it. Parameters already gathered (by that access, or as a
    tied embedding) are left alone: partitioning them on exit would pull them from under the module using them.
    """
    if not zero3_partitioned(model):
        return contextlib.nullcontext()
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    absent = {id(p): p for p in _head_parameters(model) if p.ds_status != ZeroParamStatus.AVAILABLE}
    if not absent:
        return contextlib.nullcontext()
    return deepspeed.zero.GatheredParameters(list(absent.values()), modifier_rank=None)


def zero3_partitioned(model: nn.Module) -> bool:
    """Whether the LM head's parameters are DeepSpeed ZeRO-3 partitions (DeepSpeed marks them with ds_id)."""
    return any(hasattr(p, "ds_id") for p in _head_parameters(model))


def _head_parameters(model: nn.Module) -> list:
    head = unwrap(model).get_output_embeddings()
    return [p for p in (getattr(head, "weight", None), getattr(head, "bias", None)) if p is not None]


def backbone(model: nn.Module) -> nn.Module:
    """Everything but the LM head (`model.base_model`: `model.model` for most causal LMs, the multimodal stack
    for vision-language models), returning `last_hidden_state`."""
    model = unwrap(model)
    decoder = getattr(model, "base_model", None)
    if not isinstance(decoder, nn.Module) or decoder is model:
        raise TypeError(f"cannot find the backbone of {type(model).__name__} (its base_model_prefix attribute)")
    return decoder


def final_hidden_states(model: nn.Module, input_ids: torch.Tensor, attention_mask=None, **kwargs) -> torch.Tensor:
    """(B, L, H) final normed hidden states, computed by the decoder alone: no logits are formed.

    Wrappers are looked through (the decoder is called directly), so DDP's and FSDP's forward hooks do not run
    here: for data-parallel training wrap `grpo_fast.train.distributed.HiddenStates(model)` instead, whose forward is
    this function.
    """
    outputs = backbone(model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return outputs.last_hidden_state
