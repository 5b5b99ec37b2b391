"""The optimizer of a run and its learning-rate schedule: built, stepped through an fp32 master copy for bf16
weights, and restored from a checkpoint.

    optimizer, scheduler = optimizer_for(policy, config.optimization, config.run.max_steps, state)  # state: or None

optimizer (the config key)   optimizer's own memory per trained parameter
    adamw        8 B (fp32 m, v); 12 B for bf16 weights (fp32 master weights, m, v: MasterWeightAdamW)
    adamw8bit    2 B (torchao, 8-bit block-quantized states, bf16 stochastic rounding)
    adamw-bf16   4 B (torchao, bf16 states, bf16 stochastic rounding; bf16 weights only)

With bf16 weights an update smaller than a weight's rounding step would be lost: `adamw` keeps an fp32 master
copy of each bf16 weight in its state (the classic mixed-precision recipe); the torchao optimizers round each
updated weight to bf16 stochastically, so that small updates survive on average without a master copy. The
schedule is a linear warm-up over warmup_steps, then cosine, linear or constant to max_steps; it moves at every
optimizer step (steps_per_generation x num_iterations of them a training step).
"""

from __future__ import annotations

import importlib.util
import math

import torch
from torch.optim.adam import adam

from grpo_fast.train.update.precision import DTYPES

OPTIMIZERS = ("adamw", "adamw8bit", "adamw-bf16")
LOW_BIT = ("adamw8bit", "adamw-bf16")          # torchao's


def check_optimizer(dtype: str, optimizer: str, lora_rank: int, installed: bool = True) -> None:
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


def lr_factor(update: int, optimization, max_steps: int) -> float:
    """The learning-rate factor of the run's optimizer step `update` (0-based; a training step takes
    optimization.updates_per_step of them): linear warm-up over optimization.warmup_steps training steps, then
    (its lr_schedule) cosine or linear decay to 0 at the run's max_steps, or constant."""
    per_step, schedule = optimization.updates_per_step, optimization.lr_schedule
    warmup, total = optimization.warmup_steps * per_step, max_steps * per_step
    if update < warmup:
        return (update + 1) / (warmup + 1)
    progress = (update - warmup) / max(1, total - warmup)
    if schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))
    if schedule == "linear":
        return max(0.0, 1.0 - progress)
    return 1.0


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


def optimizer_for(policy, optimization, max_steps: int, state):
    """(optimizer, scheduler): the optimization section's optimizer of the trained parameters and its
    learning-rate schedule over the run's max_steps (lr_factor: the scheduler steps after every optimizer step),
    restored from `state` when resuming."""
    optimizer = make_optimizer(policy.trunk.parameters(), optimization.optimizer, optimization.learning_rate,
                               optimization.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, optimization, max_steps))
    if state is not None:
        restore_optimizer(policy, optimizer, scheduler, state, optimization)
    return optimizer, scheduler


def restore_optimizer(policy, optimizer, scheduler, state: dict, optimization) -> None:
    """Loads the optimizer (into a plain, DDP or FSDP2-sharded policy) and scheduler states of `state`, then
    applies this run's learning_rate and weight_decay (the loaded states carry the checkpoint's)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    sharded = any(hasattr(p, "device_mesh") for p in policy.trunk.parameters())
    # set_optimizer_state_dict first runs a dummy step to create the states, and the dummy step of an optimizer
    # that rounds stochastically draws random numbers: the resumed run's random streams must not see it
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    try:
        with torch.random.fork_rng(devices=devices):
            set_optimizer_state_dict(policy.trunk, optimizer, state["optimizer"],
                                     options=StateDictOptions(full_state_dict=sharded))
        scheduler.load_state_dict(state["scheduler"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:      # a state.pt that is not this run's
        reason = (str(error).splitlines() or [""])[0][:160]
        raise ValueError(f"--resume: the checkpoint's optimizer or scheduler state does not fit this model "
                         f"({type(error).__name__}: {reason})") from None
    for group in optimizer.param_groups:
        group["initial_lr"], group["weight_decay"] = optimization.learning_rate, optimization.weight_decay
    scheduler.base_lrs = [optimization.learning_rate] * len(optimizer.param_groups)
    for group, factor in zip(optimizer.param_groups, scheduler.lr_lambdas):   # this step's rate, new schedule
        rate = optimization.learning_rate * factor(scheduler.last_epoch)
        if torch.is_tensor(group["lr"]):          # torchao's optimizers hold it as a tensor
            group["lr"].fill_(rate)
        else:
            group["lr"] = rate
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]
