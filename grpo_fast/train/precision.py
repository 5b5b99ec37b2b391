"""The memory options of a run: the weights' dtype, the compute dtype and the optimizer (one set of names for
`grpo-fast train` and `grpo-fast plan`).

    dtype          weights   compute                   optimizer's own memory per trained parameter
    fp32           fp32      fp32                      adamw 8 B (fp32 m, v)    adamw8bit 2 B
    bf16-autocast  fp32      bf16 (autocast)           adamw 8 B                adamw8bit 2 B
    bf16           bf16      bf16                      adamw 12 B (fp32 master weights, m, v)
                                                       adamw8bit 2 B, adamw-bf16 4 B (stochastic rounding)
    auto: fp32 on CPU; on CUDA bf16-autocast, or bf16 with LoRA.

With bf16 weights an update smaller than a weight's rounding step would be lost. `adamw` keeps an fp32 master copy
of each bf16 weight in its state (the classic mixed-precision recipe); `adamw8bit` (8-bit block-quantized states)
and `adamw-bf16` (bf16 states) round each updated weight to bf16 stochastically, so that small updates survive
on average without a master copy. Both come from torchao's low-bit optimizers (`pip install torchao`), which
run on CPU and CUDA. LoRA adapters are kept in fp32 whatever the dtype; the frozen base is held in the dtype's
weights.
"""

from __future__ import annotations

import importlib.util

import torch
from torch.optim.adam import adam

DTYPES = ("auto", "fp32", "bf16-autocast", "bf16")
OPTIMIZERS = ("adamw", "adamw8bit", "adamw-bf16")
LOW_BIT = ("adamw8bit", "adamw-bf16")          # torchao's


def resolve(dtype: str, device_type: str, lora_rank: int = 0) -> str:
    """The concrete dtype option: "auto" is fp32 off CUDA; on CUDA bf16-autocast for full training and bf16 with
    LoRA (a frozen base needs no fp32 copy)."""
    if dtype == "auto":
        return "fp32" if device_type != "cuda" else "bf16" if lora_rank else "bf16-autocast"
    return dtype


def check(dtype: str, optimizer: str, lora_rank: int, installed: bool = True) -> None:
    """Raises ValueError, naming both keys and the way out, for options that do not combine (and with
    `installed`, for an optimizer whose library is missing: the planner plans jobs for other machines)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {OPTIMIZERS}, got {optimizer!r}")
    if optimizer == "adamw-bf16" and lora_rank:
        raise ValueError("optimizer 'adamw-bf16' rounds updates into bf16 weights, but lora_rank > 0 trains fp32 "
                         f"adapters (lora_rank={lora_rank}); use optimizer adamw or adamw8bit with LoRA")
    if optimizer == "adamw-bf16" and dtype != "bf16":
        raise ValueError(f"optimizer 'adamw-bf16' keeps bf16 states for bf16 weights, but dtype is {dtype!r}; set "
                         "dtype: bf16, or use optimizer adamw / adamw8bit")
    if installed and optimizer in LOW_BIT and importlib.util.find_spec("torchao") is None:
        raise ValueError(f"optimizer {optimizer!r} needs torchao, which is not installed: pip install "
                         "'grpo-fast[lowbit]' (or torchao), or use optimizer adamw")


def weights_dtype(dtype: str):
    """The torch dtype the model's weights are held in (for a resolved dtype option)."""
    return torch.bfloat16 if dtype == "bf16" else torch.float32


def compute_dtype(dtype: str):
    """The torch dtype of the forward pass and of the loss's inputs (for a resolved dtype option)."""
    return torch.float32 if dtype == "fp32" else torch.bfloat16


def make_optimizer(parameters, optimizer: str, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The optimizer of `parameters` (those with requires_grad): torch's AdamW (with fp32 master weights for bf16
    parameters), or torchao's AdamW8bit / bf16-state AdamW with bf16 stochastic rounding."""
    parameters = [p for p in parameters if p.requires_grad]
    if optimizer == "adamw":
        return MasterWeightAdamW(parameters, lr=lr, weight_decay=weight_decay)
    import torchao.optim

    if optimizer == "adamw8bit":
        return torchao.optim.AdamW8bit(parameters, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=True)
    return torchao.optim._AdamW(parameters, lr=lr, weight_decay=weight_decay, bf16_stochastic_round=True)


class MasterWeightAdamW(torch.optim.AdamW):
    """torch.optim.AdamW whose bf16 (or fp16) parameters are updated through an fp32 master copy kept in the
    optimizer state (state["master"]): the moments are fp32 and no update is lost to bf16 rounding; the parameter
    then holds the master rounded to its dtype. fp32 parameters are updated as by AdamW itself. Low-precision
    parameters are stepped one at a time, so the fp32 copy of a gradient exists for one parameter at once. The
    state dict carries the master copies: a resume continues from them, not from the rounded weights."""

    @torch.no_grad()
    def step(self, closure=None):
        low = [(group, param) for group in self.param_groups for param in group["params"]
               if param.grad is not None and param.dtype != torch.float32]
        grads = [param.grad for _, param in low]
        for _, param in low:                 # AdamW's own step sees the fp32 parameters alone
            param.grad = None
        try:
            loss = super().step(closure)
        finally:
            for (_, param), grad in zip(low, grads):
                param.grad = grad
        for group, param in low:
            state = self.state[param]
            if not state:
                state.update(step=torch.tensor(0.0), master=param.detach().float(),
                             exp_avg=torch.zeros_like(param, dtype=torch.float32),
                             exp_avg_sq=torch.zeros_like(param, dtype=torch.float32))
            beta1, beta2 = group["betas"]
            adam([state["master"]], [param.grad.float()], [state["exp_avg"]], [state["exp_avg_sq"]],
                                  [], [state["step"]], foreach=False, decoupled_weight_decay=True, amsgrad=False,
                                  beta1=beta1, beta2=beta2, lr=group["lr"], weight_decay=group["weight_decay"],
                                  eps=group["eps"], maximize=False)
            param.copy_(state["master"])
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # Optimizer.load_state_dict casts floating states to their parameter's dtype: a bf16 parameter's master
        # and moments are put back in fp32, as saved
        super().load_state_dict(state_dict)
        params = [param for group in self.param_groups for param in group["params"]]
        saved_ids = [index for group in state_dict["param_groups"] for index in group["params"]]
        for param, saved_id in zip(params, saved_ids):
            if param.dtype == torch.float32 or saved_id not in state_dict["state"]:
                continue
            for key, value in state_dict["state"][saved_id].items():
                if key != "step" and torch.is_tensor(value) and value.is_floating_point():
                    self.state[param][key] = value.to(param.device, torch.float32, copy=True)
