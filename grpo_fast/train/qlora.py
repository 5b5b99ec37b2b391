"""A 4-bit base under the LoRA adapters (QLoRA): with policy.load_in_4bit the base's linear layers become
bitsandbytes' NF4 layers, quantized as transformers' BitsAndBytesConfig(load_in_4bit=True) quantizes them.

    quantize_base(model, policy, compute_dtype)   # in place: after the model is on its device, before add_adapters
    dequantized_weights(model, state_dict)        # a state dict's 4-bit weights back in their 16-bit form

Every nn.Linear but the LM head is quantized (the loss reads the head's weight as it is, in the compute dtype), to
NF4 in blocks of 64 with an fp32 scale each, or with double quantization (policy.bnb_4bit_double_quant) those
scales in 8 bits: 0.5 byte a weight plus 1/16 (1/63 with double quantization) of a byte. The layer computes
x @ dequantize(W).T in `compute_dtype`: the policy's weight dtype. Quantizing the loaded model in place (rather than
in from_pretrained) gives the tiny model built in code the same path, and keeps the 16-bit base whose fingerprint a
LoRA checkpoint records. An engine or an export gets the dequantized base with the adapters merged
(lora.engine_weights): vLLM then samples from the weights the trainer computes with.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

QUANT_TYPE = "nf4"
BLOCK = 64                    # weights per fp32 scale (bitsandbytes' 4-bit blocksize)
NESTED_BLOCK = 256            # scales per fp32 scale of the scales, with double quantization


def check_4bit(load_in_4bit: bool, double_quant: bool, lora_rank: int, distributed: str, sft_steps: int = 0,
               installed: bool = True) -> None:
    """Raises ValueError, naming the keys, when policy.load_in_4bit cannot hold: without LoRA (a 4-bit base is
    not trained), with a warm start (it trains the whole 16-bit base), under FSDP2 (it shards parameters, and the
    4-bit ones keep their quantization state outside the tensor), or (with `installed`) without bitsandbytes: the
    planner plans jobs for other machines. double_quant (bnb_4bit_double_quant) needs load_in_4bit."""
    if not load_in_4bit:
        if double_quant:
            raise ValueError("bnb_4bit_double_quant quantizes the 4-bit base's scales, but load_in_4bit is false: set "
                             "load_in_4bit: true, or leave bnb_4bit_double_quant false")
        return
    if not lora_rank:
        raise ValueError("load_in_4bit freezes the base in 4 bits and trains LoRA adapters on it, but lora_rank is 0: "
                         "set lora_rank (e.g. 64), or load_in_4bit: false")
    if sft_steps:
        raise ValueError(f"load_in_4bit: the warm start (sft_steps {sft_steps}) trains the whole base, which a 4-bit "
                         "base cannot take: set sft_steps: 0, or load_in_4bit: false")
    if distributed == "fsdp2":
        raise ValueError("load_in_4bit with distributed 'fsdp2': FSDP2 shards parameters, and bitsandbytes' 4-bit "
                         "ones keep their quantization state outside the tensor; use distributed: ddp")
    if installed and importlib.util.find_spec("bitsandbytes") is None:
        raise ValueError("load_in_4bit needs bitsandbytes, which is not installed: pip install 'grpo-fast[qlora]' "
                         "(or bitsandbytes), or set load_in_4bit: false")


def bnb_config(policy, compute_dtype: torch.dtype):
    """transformers' BitsAndBytesConfig of policy.load_in_4bit: NF4, `compute_dtype`, double quantization as
    policy.bnb_4bit_double_quant says; the LM head is not converted."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=QUANT_TYPE, bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=policy.bnb_4bit_double_quant)


def quantize_base(model: nn.Module, policy, compute_dtype: torch.dtype) -> nn.Module:
    """`model` with every nn.Linear but its LM head replaced, in place, by a bitsandbytes Linear4bit holding the
    layer's weight in NF4 on the weight's own device (its bias kept, frozen), as bnb_config(policy, compute_dtype)
    says; each 16-bit weight is freed as its layer is replaced. Returns the model. Its config records no
    quantization: what the trainer saves of it is 16-bit (dequantized_weights)."""
    import bitsandbytes as bnb

    config = bnb_config(policy, compute_dtype)
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is not nn.Linear or child is head:
                continue
            device = child.weight.device
            layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                      compute_dtype=compute_dtype, compress_statistics=config.bnb_4bit_use_double_quant,
                                      quant_type=QUANT_TYPE, device="meta")
            layer.weight = bnb.nn.Params4bit(child.weight.data, requires_grad=False, blocksize=BLOCK,
                                             compress_statistics=config.bnb_4bit_use_double_quant,
                                             quant_type=QUANT_TYPE).to(device)
            if child.bias is not None:
                layer.bias = nn.Parameter(child.bias.data, requires_grad=False)
            # bitsandbytes repacks a CPU layer's weight for its AVX512-BF16 kernel at the first no-grad forward in
            # eval mode (generation); the repacked layer then fails in training and computes other numbers
            layer.support_avx512bf16_for_cpu = False
            setattr(parent, name, layer)
    _own_cpu_storage(model)
    return model


def _own_cpu_storage(model: nn.Module) -> None:
    """The model's remaining CPU parameters and buffers copied into memory of their own. transformers maps a
    checkpoint's file into memory and its CPU tensors are views of it: while one of them lives, the pages of the
    16-bit weights just quantized stay resident through that mapping (SmolLM2: 0.4 GiB of 0.5). The copies let it
    go. Tied parameters stay tied (one Parameter, its data replaced)."""
    for module in model.modules():
        for parameter in module._parameters.values():
            if parameter is not None and parameter.device.type == "cpu" and not hasattr(parameter, "quant_state"):
                parameter.data = parameter.data.clone()
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type == "cpu":
                module._buffers[name] = buffer.clone()


def is_4bit(module: nn.Module) -> bool:
    """Whether `module` is a bitsandbytes Linear4bit whose weight is quantized (it carries its quant_state)."""
    return type(module).__name__ == "Linear4bit" and hasattr(module.weight, "quant_state")


def dequantized(module: nn.Module) -> torch.Tensor:
    """A Linear4bit's weight as its forward computes with it: dequantized to the dtype it was quantized from."""
    import bitsandbytes.functional as F

    return F.dequantize_4bit(module.weight.data, module.weight.quant_state)


def dequantized_weights(model: nn.Module, state_dict: dict) -> dict:
    """`state_dict` (model's, names as model.state_dict() gives them) with each 4-bit layer's packed weight and
    quantization entries (weight.absmax, weight.quant_map, ...) replaced by its dequantized weight; unchanged for a
    model without 4-bit layers."""
    layers = {name: module for name, module in model.named_modules() if is_4bit(module)}
    if not layers:
        return state_dict
    quantized = {f"{name}.weight" for name in layers}
    result = {key: value for key, value in state_dict.items()
              if not any(key.startswith(weight + ".") for weight in quantized)}
    for name, module in layers.items():
        result[f"{name}.weight"] = dequantized(module)
    return result


def quantized_bytes(parameters: int, double_quant: bool) -> float:
    """Bytes of `parameters` weights in NF4 with their scales: 0.5 a weight, plus an fp32 scale a block of 64, or
    with double quantization an 8-bit scale a block and an fp32 scale a block of 256 scales."""
    if double_quant:
        return parameters * (0.5 + 1 / BLOCK + 4 / (BLOCK * NESTED_BLOCK))
    return parameters * (0.5 + 4 / BLOCK)
