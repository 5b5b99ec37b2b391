"""The run's `dtype` option (one set of names for `grpo-fast train` and `grpo-fast plan`): the torch dtypes it
holds the weights in and computes in.

    dtype          weights   compute
    fp32           fp32      fp32
    bf16-autocast  fp32      bf16 (autocast)
    bf16           bf16      bf16
    auto: fp32 on CPU; on CUDA bf16-autocast, or bf16 with LoRA.

Here `dtype` is always that option (a string); the torch dtypes are `weights_dtype(dtype)` and
`compute_dtype(dtype)`. LoRA adapters are kept in fp32 whatever the dtype; the frozen base is held in the dtype's
weights. The optimizer that goes with each is grpo_fast.train.update.optimizer's.
"""

from __future__ import annotations

import torch

DTYPES = ("auto", "fp32", "bf16-autocast", "bf16")


def resolve(dtype: str, device_type: str, lora_rank: int = 0) -> str:
    """The concrete dtype option: "auto" is fp32 off CUDA; on CUDA bf16-autocast for full training and bf16 with
    LoRA (a frozen base needs no fp32 copy)."""
    if dtype == "auto":
        return "fp32" if device_type != "cuda" else "bf16" if lora_rank else "bf16-autocast"
    return dtype


def weights_dtype(dtype: str):
    """The torch dtype the model's weights are held in (for a resolved dtype option)."""
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def compute_dtype(dtype: str):
    """The torch dtype of the forward pass and of the loss's inputs (for a resolved dtype option)."""
    return torch.float32 if dtype == "fp32" else torch.bfloat16
