"""Checkpoints: written atomically (the last good one survives a crash or a full disk), resumed exactly.

output_dir/checkpoint-{step}/state.pt holds the model, optimizer and scheduler states, the random states, the
KL reference, the run's config and its data's identity (a hash of the samples, the held-out problems), as full
(unsharded) tensors keyed by parameter name: a checkpoint written by any number of processes (plain, DDP or
FSDP2) resumes with any other. The tokenizer is saved beside it, so that a
resume reads the ids the weights were trained with. Only the newest complete checkpoint is kept, and weights
that are not finite are never written.
"""

from __future__ import annotations

import dataclasses
import os
import random
import shutil

import torch

from grpo_fast.train import distributed, lora
from grpo_fast.train.config import flat_values
from grpo_fast.train.run import signals
from grpo_fast.train.run.atomic import PREVIOUS, atomic_folder, complete_version

# Keys a resumed run must share with its checkpoint: they decide the model (its vocabulary and positions, its
# dtype, its adapters, its warm start), the optimizer's state, the prompts each step draws and how rewards are
# grouped. Every other key may change on resume and then applies.
RESUME_FIXED = ("model", "task", "prompt_column", "solution_column", "train_split", "eval_task", "eval_split",
                "eval_fraction", "num_prompts", "max_operand", "seed", "prompt_format", "system_prompt",
                "group_size", "prompts_per_step", "max_completion_length", "dtype", "optimizer", "lora_rank",
                "lora_alpha", "lora_target_modules", "sft_steps")


def save_checkpoint(output_dir: str, step: int, state: dict, tokenizer=None) -> str:
    """Writes `state` (see `training_state`) as output_dir/checkpoint-{step}/state.pt (and the tokenizer beside
    it), whole or not at all (grpo_fast.train.run.atomic), so a crash or a full disk never leaves a broken
    checkpoint; older ones are then removed. Refuses (RuntimeError) weights that are not finite, keeping the last
    good one."""
    bad = [name for name, tensor in state.get("model", {}).items()
           if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
    if bad:
        raise RuntimeError(f"not saving checkpoint-{step}: {len(bad)} weight tensors are not finite (first: "
                           f"{bad[0]}); the last good checkpoint in {output_dir} is kept")
    final = os.path.join(output_dir, f"checkpoint-{step}")
    try:
        with atomic_folder(final, replace=True) as temporary:
            # a file of ours, not a path: torch's own writer reports a full disk as two chained errors that never
            # say so, Python's file as OSError ENOSPC
            with open(os.path.join(temporary, "state.pt"), "wb") as file:
                torch.save({"step": step, **state}, file)
            if tokenizer is not None:
                tokenizer.save_pretrained(temporary)
    except OSError as error:
        kept = latest_checkpoint(output_dir)
        raise OSError(error.errno, f"checkpoint-{step} could not be written in {output_dir!r} "
                      f"({error.strerror or error}; {shutil.disk_usage(output_dir).free / 2**30:.2f} GiB free); "
                      + (f"the last good checkpoint, {kept}, is kept" if kept else "no checkpoint was kept")) \
            from error
    with signals.interrupts_deferred():                       # keep only the newest complete checkpoint
        for name in os.listdir(output_dir):
            if checkpoint_step(name) is not None and name != os.path.basename(final):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return final


def checkpoint_step(name: str):
    """The step of a checkpoint folder's name: checkpoint-N, or checkpoint-N.old (the previous version of step N's
    checkpoint, which a replace cut between its two renames left complete; grpo_fast.train.run.atomic); None for
    any other name (a .tmp folder is never complete)."""
    if not name.startswith("checkpoint-"):
        return None
    number = name[len("checkpoint-"):]
    number = number[:-len(PREVIOUS)] if number.endswith(PREVIOUS) else number
    return int(number) if number.isdigit() else None


def training_state(policy, optimizer, scheduler, ref_model=None, rng=None, config=None, data=None) -> dict:
    """Everything a resume needs, as full (unsharded) tensors keyed by parameter name. Call it on every rank
    (a collective under FSDP2). policy: a grpo_fast.train.update.step.Policy; of a LoRA model only the adapters are
    kept when the base is the model the run loads (no warm start: sft_steps 0).

    rng: the (torch, python) random states to resume with; default the current ones. ref_model: the KL
    reference (beta > 0), so that a resumed run keeps the same one. config: the run's TrainConfig, which a
    resume compares with its own. data: the identity of the run's data (grpo_fast.train.tasks.data_identity),
    which a resume checks.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    torch_rng, python_rng = rng or (torch.get_rng_state(), random.getstate())
    options = StateDictOptions(full_state_dict=True, cpu_offload=distributed.initialized())
    # a LoRA run keeps its adapters alone, unless its warm start changed the base the run loads
    adapters_only = lora.is_peft(policy.model) and config is not None and config.warm_start.sft_steps == 0
    return {"model": distributed.full_state_dict(policy.model, trainable_only=adapters_only),
            "optimizer": get_optimizer_state_dict(policy.trunk, optimizer, options=options),
            "scheduler": scheduler.state_dict(), "torch_rng": torch_rng, "python_rng": python_rng,
            "ref_model": None if ref_model is None else ref_model.state_dict(),
            "config": None if config is None else dataclasses.asdict(config), "data": data}


def latest_checkpoint(output_dir: str):
    """The newest complete checkpoint folder in output_dir (checkpoint-N, or the complete previous version a cut
    replace left as checkpoint-N.old), or None."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = [step for step in map(checkpoint_step, names) if step is not None]
    return complete_version(os.path.join(output_dir, f"checkpoint-{max(steps)}")) if steps else None


def load_latest(output_dir: str):
    """(folder, state) of the newest checkpoint in output_dir, or (None, None) when there is none."""
    folder = latest_checkpoint(output_dir)
    if folder is None:
        return None, None
    path = os.path.join(folder, "state.pt")
    try:
        return folder, torch.load(path, weights_only=False, map_location="cpu")
    except Exception as error:                     # empty, truncated or overwritten: torch's errors name no file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"checkpoint {path} cannot be read ({type(error).__name__}: {reason[:120]}); it was cut "
                         f"short or damaged after it was written: restore it from a copy, or start a new run "
                         f"without --resume in another output_dir") from None


def resume_changes(saved: dict, config) -> dict:
    """{key: (checkpoint's value, this run's value)} for the keys this run changes; raises ValueError naming the
    keys a resume cannot change (RESUME_FIXED, and beta between zero and non-zero: the KL reference exists or
    not). saved: the checkpoint's config as a dict."""
    current, saved = config.flat(), flat_values(saved)
    changed = {key: (saved[key], value) for key, value in current.items() if key in saved and saved[key] != value}
    fixed = [key for key in RESUME_FIXED if key in changed]
    if "beta" in changed and (changed["beta"][0] == 0) != (changed["beta"][1] == 0):
        fixed.append("beta")
    if fixed:
        described = ", ".join(f"{key} {changed[key][0]!r} -> {changed[key][1]!r}" for key in fixed)
        raise ValueError(f"--resume cannot change what the checkpoint's model and data depend on: {described}; "
                         f"keep the checkpoint's values or start a new run in another output_dir")
    return changed


def load_tokenizer(folder: str):
    """The tokenizer a checkpoint saved beside its state, or None (checkpoints of older versions)."""
    if not os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


def restore_model(model, state: dict) -> int:
    """Loads the weights (of a LoRA model: the adapters, and the base when saved) and the random states of
    `state` (the RNG continues where the run stopped); returns the number of steps done."""
    if lora.is_peft(model):                       # adapters only: the base is the model as loaded
        result = model.load_state_dict(state["model"], strict=False)
        trainable = {name for name, param in model.named_parameters() if param.requires_grad}
        missing = sorted(trainable & set(result.missing_keys))
        if missing or result.unexpected_keys:
            raise ValueError(f"the checkpoint's adapters do not fit this model: missing {missing[:3]}, unexpected "
                             f"{sorted(result.unexpected_keys)[:3]}")
    else:
        model.load_state_dict(state["model"])
    torch.set_rng_state(state["torch_rng"].cpu())
    random.setstate(state["python_rng"])
    return state["step"]


def require_latest(run_dir: str, needed_by: str, remedy: str = "a run writes one every save_every steps and at "
                   "its end") -> tuple:
    """(folder, state) of the newest checkpoint in run_dir; ValueError "`needed_by`: no checkpoint in run_dir
    (`remedy`)" when there is none: the one error of every command that needs one (resume, export, eval)."""
    folder, state = load_latest(run_dir)
    if state is None:
        raise ValueError(f"{needed_by}: no checkpoint in {run_dir!r} ({remedy})")
    return folder, state


def resume_point(config, resume: bool, log):
    """(checkpoint folder, state) to resume from, or (None, None) for a new run. Refuses --resume without a
    checkpoint, and a checkpoint whose model or data this config changes; logs the keys it changes."""
    if not resume:
        return None, None
    folder, state = require_latest(config.run.output_dir, "--resume", "drop --resume to start a new run")
    if state.get("config") is None:
        log(f"{folder} holds no config (an older version wrote it): resuming without comparing keys")
    else:
        changed = resume_changes(state["config"], config)
        if changed:
            log("resuming with changed keys, applied from here on: " +
                ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items())))
    return folder, state
