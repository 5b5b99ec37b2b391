"""LoRA adapters on the policy through PEFT: what the trainer trains, saves and pushes when lora_rank > 0.

    model = add_adapters(model, config.policy)     # a PeftModel; only the adapters require grad
    with reference(model): ...                     # the base model (adapters off): the KL reference
    engine_weights(model)                          # (name, tensor) of the base with the adapters merged in

The LM head is never adapted (the loss reads its weight directly: two GEMM passes per step, no weight gradient),
the adapters are fp32 whatever the base's dtype, and a checkpoint holds the adapters alone (and the base too when
a warm start trained it: grpo_fast.train.saved.checkpoint.training_state).
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
from torch import nn

from grpo_fast.models import unwrap
from grpo_fast.train import qlora
from grpo_fast.train.distributed import full_state_dict

ADAPTER = "default"        # PEFT's name for the one adapter the trainer adds


def check_target_modules(model: nn.Module, targets: list) -> None:
    """Raises ValueError when one of `targets` (the policy section's lora_target_modules) names no linear layer of
    `model` (PEFT would skip it: a typo would leave those layers unadapted), naming it and the model's linear
    layers, or when one names the LM head. A target is a layer's name (q_proj) or the end of its path
    (self_attn.q_proj), as in PEFT. Needs no PEFT: run it before anything trains (a warm start comes before the
    adapters)."""
    layers = [name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"]     # GPT-2's linear layers

    def matches(target: str, name: str) -> bool:
        return name == target or name.endswith("." + target)

    unknown = [target for target in targets if not any(matches(target, n) for n in layers)]
    if unknown:
        raise ValueError(f"lora_target_modules {unknown} name no linear layer of the model; its linear layers are "
                         f"{sorted({name.rsplit('.', 1)[-1] for name in layers})}")
    head = model.get_output_embeddings()
    adapted_head = [name for name, module in model.named_modules()
                    if module is head and any(matches(target, name) for target in targets)]
    if adapted_head:
        raise ValueError(f"lora_target_modules must not name the LM head ({adapted_head[0]!r}): the loss reads its "
                         "weight directly; drop it from the list")


def add_adapters(model: nn.Module, policy) -> nn.Module:
    """`model` (a Hugging Face causal LM) as a PEFT LoRA model of rank policy.lora_rank on
    policy.lora_target_modules (the policy section), scaled by lora_alpha / lora_rank (alpha defaults to 2 x rank).
    Everything else is frozen. Raises ValueError (check_target_modules) when a target is no linear layer of the
    model or is its LM head."""
    from peft import LoraConfig, get_peft_model

    check_target_modules(model, policy.lora_target_modules)
    alpha = policy.lora_alpha if policy.lora_alpha is not None else 2.0 * policy.lora_rank
    lora_config = LoraConfig(r=policy.lora_rank, lora_alpha=alpha, lora_dropout=policy.lora_dropout,
                             target_modules=list(policy.lora_target_modules), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, lora_config, autocast_adapter_dtype=True)   # adapters in fp32


def adapted(model: nn.Module, policy, compute_dtype: torch.dtype) -> nn.Module:
    """`model` as the policy section trains it: with policy.load_in_4bit its base quantized to NF4 first
    (qlora.quantize_base, computing in `compute_dtype`), then with lora_rank > 0 the adapters (add_adapters);
    `model` itself for full training. The trainer, the export and the benchmarks build the policy so."""
    if policy.load_in_4bit:
        qlora.quantize_base(model, policy, compute_dtype)
    return add_adapters(model, policy) if policy.lora_rank else model


def base_fingerprint(model: nn.Module, samples: int = 4096) -> str:
    """A short SHA-256 of `model`'s weights (its state dict: each tensor's name, shape, dtype and up to `samples`
    of its values at a fixed stride): a base that was fine-tuned, rescaled or replaced by another checkpoint gets
    another one. Reads a few thousand values per tensor, not the weights."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        picked = flat[::max(1, flat.numel() // samples)][:samples].to("cpu", torch.float64)
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode())
        digest.update(picked.numpy().tobytes())
    return digest.hexdigest()[:16]


def check_base(saved_identity, fingerprint: str, model_name: str, accept_change: bool, log) -> None:
    """A LoRA run's resume: its checkpoint holds the adapters alone, trained on a base whose fingerprint it kept
    (saved_identity[BASE_WEIGHTS], see `base_fingerprint`); on another base they are another policy (and the KL
    reference, the base itself, moves). ValueError naming the model and the accept key, unless accept_change
    (the config's accept_changed_data: logged). A checkpoint without a fingerprint is not checked."""
    from grpo_fast.train.tasks import BASE_WEIGHTS

    saved = (saved_identity or {}).get(BASE_WEIGHTS)
    if saved is None or saved == fingerprint:
        return
    change = (f"the base weights of {model_name!r} are not the ones the checkpoint's LoRA adapters were trained on "
              f"(fingerprint {saved} -> {fingerprint})")
    if not accept_change:
        raise ValueError(f"--resume: {change}; restore the model the run started from, pass --accept-changed-data "
                         "true if the change is meant (the adapters then apply to the new base, and the KL reference "
                         "is the new base), or start a new run in a new output_dir")
    log(f"{change}; accepted (accept_changed_data)")


def is_peft(model: nn.Module) -> bool:
    return hasattr(model, "disable_adapter") and hasattr(model, "peft_config")


def adapters_disabled(model: nn.Module):
    """Context in which a PEFT model computes with its adapters off: the base model, the KL reference of a LoRA
    run (no second copy of the weights)."""
    return model.disable_adapter() if is_peft(model) else contextlib.nullcontext()


def merge(state_dict: dict, scalings: dict) -> dict:
    """The base model's state dict with every LoRA layer merged: W + scaling * B @ A (computed in fp32, stored in
    W's dtype), under the base model's own parameter names (`q_proj.base_layer.weight` -> `q_proj.weight`).
    state_dict: the state dict of a PEFT model's base model; scalings: {layer prefix: scaling}."""
    merged = {}
    for name, tensor in state_dict.items():
        if ".lora_" in name:
            continue
        if ".base_layer." in name:
            prefix, _, kind = name.rpartition(".base_layer.")
            if kind == "weight":
                down = state_dict[f"{prefix}.lora_A.{ADAPTER}.weight"].float()
                up = state_dict[f"{prefix}.lora_B.{ADAPTER}.weight"].float()
                tensor = (tensor.float() + scalings[prefix] * (up @ down)).to(tensor.dtype)
            name = f"{prefix}.{kind}"
        merged[name] = tensor
    return merged


@torch.no_grad()
def engine_weights(model: nn.Module) -> dict:
    """{name: tensor} of the policy as the inference engine loads it (Hugging Face names): the model's full state
    dict, with a PEFT model's adapters merged into its base weights (a 4-bit base's dequantized: 16-bit weights
    that compute what the trainer computes)."""
    base = unwrap(model)
    state = qlora.dequantized_weights(base, full_state_dict(base))     # a 4-bit base as the trainer computes with it
    if not is_peft(model):
        return state
    scalings = {name: module.scaling[ADAPTER] for name, module in base.named_modules()
                if hasattr(module, "base_layer") and ADAPTER in getattr(module, "scaling", {})}
    return merge(state, scalings)
