"""TRL's GRPOTrainer with grpo_fast computing every per-token log-prob and entropy (training, old, reference).

    from grpo_fast.integrations.trl import FastGRPOTrainer      # same constructor as trl.GRPOTrainer
    trainer = FastGRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)

or, for a trainer that already exists, `patch_grpo_trainer(trainer)`. TRL 1.16 scores completions through a
fused LM head it patches onto the model (`model(..., labels=..., fused_lm_head=True)`); this replaces that head
with grpo_fast's, keeping the same contract, so every TRL semantic (loss types, normalizers, gradient
accumulation, vLLM importance sampling, off-policy mask, entropy mask and bonus, KL bias correction) stays TRL's
own code. Calls grpo_fast cannot serve (vision-language inputs, MoE router logits) go to TRL's head, with one
warning.
"""

from __future__ import annotations

import functools
import types
import warnings

import torch

from grpo_fast.logprobs import token_logprobs
from grpo_fast.models import backbone, lm_head

try:
    from trl import GRPOTrainer
    from trl.trainer.utils import FusedCausalLMOutput
except ImportError as error:  # pragma: no cover - exercised only without trl
    raise ImportError("grpo_fast.integrations.trl needs trl (pip install 'trl==1.16.0')") from error

_MULTIMODAL_KEYS = ("pixel_values", "image_grid_thw", "pixel_attention_mask", "image_sizes", "spatial_shapes",
                    "image_position_ids", "token_type_ids", "mm_token_type_ids")


def _unsupported(model, kwargs) -> str | None:
    if any(kwargs.get(key) is not None for key in _MULTIMODAL_KEYS):
        return "vision-language inputs"
    if kwargs.get("output_router_logits") or getattr(model.config.get_text_config(), "output_router_logits", False):
        return "MoE router logits (load-balancing loss)"
    return None


def add_grpo_fast_lm_head(model, temperature: float, cast_lm_head_to_fp32: bool = False):
    """Make `model(..., labels=labels, fused_lm_head=True)` return grpo_fast's log-probs and entropies.

    `model` is a transformers causal LM whose forward TRL has already patched (`add_fused_lm_head`); calls
    without `fused_lm_head=True`, and the ones grpo_fast does not serve, go to that forward unchanged.
    """
    trl_forward = model.forward
    warned = set()

    @functools.wraps(type(model).forward)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        reason = _unsupported(self, kwargs) if fused_lm_head else None
        if not fused_lm_head or reason:
            if reason and reason not in warned:
                warned.add(reason)
                warnings.warn(f"grpo_fast: {reason} are scored by TRL's own fused LM head", stacklevel=2)
            return trl_forward(*args, fused_lm_head=fused_lm_head, labels=labels, shift_labels=shift_labels,
                               num_items_in_batch=num_items_in_batch, **kwargs)
        kwargs["use_cache"] = False
        hidden = backbone(self)(*args, **kwargs).last_hidden_state
        if shift_labels is None:
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = lm_head(self)
        weight, bias = head.weight, head.bias
        hidden, labels = hidden.to(weight.device), labels.to(weight.device)
        if cast_lm_head_to_fp32:
            hidden, weight = hidden.float(), weight.float()
            bias = None if bias is None else bias.float()
        elif hidden.dtype != weight.dtype:          # under autocast the head runs in the activations' dtype
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        mask = labels != -100
        with torch.autocast(hidden.device.type, enabled=False):
            logp, entropy = token_logprobs(hidden[mask], weight, labels[mask], bias=bias, temperature=temperature,
                                           logit_scale=head.logit_scale, logit_softcap=head.logit_softcap,
                                           return_entropy=True)
        # masked_scatter keeps an all-masked micro-batch connected to the graph (a differentiable zero).
        log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
        entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        return FusedCausalLMOutput(loss=-log_probs.sum() / count, log_probs=log_probs, entropy=entropy,
                                   label_mask=mask)

    model.forward = types.MethodType(forward, model)
    return model


def _target(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def patch_grpo_trainer(trainer: GRPOTrainer) -> GRPOTrainer:
    """Route an existing GRPOTrainer's log-prob and entropy computations through grpo_fast."""
    if getattr(trainer, "_grpo_fast_patched", False):
        return trainer
    cast = trainer.args.cast_lm_head_to_fp32
    add_grpo_fast_lm_head(_target(trainer.model), trainer.temperature, cast)
    if trainer.ref_model is not None:
        add_grpo_fast_lm_head(_target(trainer.ref_model), trainer.temperature, cast)
    trainer._grpo_fast_patched = True
    return trainer


class FastGRPOTrainer(GRPOTrainer):
    """`trl.GRPOTrainer` (same constructor) whose per-token log-probs and entropies come from grpo_fast."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        patch_grpo_trainer(self)
