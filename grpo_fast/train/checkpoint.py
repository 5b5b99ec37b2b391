"""Checkpoints: written atomically (the last good one survives a crash or a full disk), resumed exactly.

output_dir/checkpoint-{step}/state.pt holds the model, optimizer and scheduler states, the random states and the
KL reference, as full (unsharded) tensors keyed by parameter name: a checkpoint written by any number of
processes (plain, DDP or FSDP2) resumes with any other. Only the newest complete checkpoint is kept.
"""

from __future__ import annotations

import os
import random
import shutil

import torch

from grpo_fast.train import distributed


def save_checkpoint(output_dir: str, step: int, state: dict) -> str:
    """Writes `state` (see `training_state`) as output_dir/checkpoint-{step}/state.pt: to a temporary folder
    first, then renamed, so a crash or a full disk never leaves a broken checkpoint; older ones are then removed.
    """
    final = os.path.join(output_dir, f"checkpoint-{step}")
    temporary = final + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        torch.save({"step": step, **state}, os.path.join(temporary, "state.pt"))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(temporary, final)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    for name in os.listdir(output_dir):                       # keep only the newest complete checkpoint
        if name.startswith("checkpoint-") and not name.endswith(".tmp") and name != os.path.basename(final):
            shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return final


def training_state(policy, optimizer, scheduler, ref_model=None, rng=None) -> dict:
    """Everything a resume needs, as full (unsharded) tensors keyed by parameter name. Call it on every rank
    (a collective under FSDP2). policy: a grpo_fast.train.update.Policy.

    rng: the (torch, python) random states to resume with; default the current ones. ref_model: the KL
    reference (beta > 0), so that a resumed run keeps the same one.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch_rng, python_rng = rng or (torch.get_rng_state(), random.getstate())
    options = StateDictOptions(full_state_dict=True, cpu_offload=distributed.initialized())
    return {"model": distributed.full_state_dict(policy.model),
            "optimizer": get_optimizer_state_dict(policy.forward, optimizer, options=options),
            "scheduler": scheduler.state_dict(), "torch_rng": torch_rng, "python_rng": python_rng,
            "ref_model": None if ref_model is None else ref_model.state_dict()}


def latest_checkpoint(output_dir: str):
    """The newest complete checkpoint folder in output_dir, or None."""
    steps = [int(name.split("-")[1]) for name in os.listdir(output_dir) if name.startswith("checkpoint-")
             and not name.endswith(".tmp")] if os.path.isdir(output_dir) else []
    return os.path.join(output_dir, f"checkpoint-{max(steps)}") if steps else None


def load_latest(output_dir: str):
    """(folder, state) of the newest checkpoint in output_dir, or (None, None) when there is none."""
    folder = latest_checkpoint(output_dir)
    if folder is None:
        return None, None
    return folder, torch.load(os.path.join(folder, "state.pt"), weights_only=False, map_location="cpu")


def restore_model(model, state: dict) -> int:
    """Loads the weights and the random states of `state` (the RNG continues where the run stopped); returns
    the number of steps done."""
    model.load_state_dict(state["model"])
    torch.set_rng_state(state["torch_rng"].cpu())
    random.setstate(state["python_rng"])
    return state["step"]


def restore_optimizer(policy, optimizer, scheduler, state: dict) -> None:
    """Loads the optimizer (into a plain, DDP or FSDP2-sharded policy) and scheduler states of `state`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    sharded = any(hasattr(p, "device_mesh") for p in policy.forward.parameters())
    set_optimizer_state_dict(policy.forward, optimizer, state["optimizer"],
                             options=StateDictOptions(full_state_dict=sharded))
    scheduler.load_state_dict(state["scheduler"])
