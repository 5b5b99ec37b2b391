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
from grpo_fast.train.run.atomic import PREVIOUS, atomic_folder, complete_version, free_gib
from grpo_fast.train.run.errors import RunError, mismatches, non_finite
from grpo_fast.train.run.record import check_output_dir

# Keys a resumed run must share with its checkpoint: they decide the model (its vocabulary and positions, its
# dtype, its adapters, its warm start; rope_scaling would re-encode the positions of the policy, its reference
# and the old log-probs mid-run), the optimizer's state and the schedule's count of optimizer steps
# (num_iterations x steps_per_generation a step), the prompts each step draws and how rewards are grouped. Every
# other key may change on resume and then applies.
RESUME_FIXED = ("model", "task", "prompt_column", "solution_column", "train_split", "eval_task", "eval_split",
                "eval_fraction", "num_prompts", "max_operand", "seed", "prompt_format", "system_prompt",
                "group_size", "prompts_per_step", "max_completion_length", "dtype", "optimizer", "lora_rank",
                "lora_alpha", "lora_target_modules", "sft_steps", "rope_scaling", "num_iterations",
                "steps_per_generation")


def save_on_main(output_dir: str, step: int, state: dict, tokenizer, world) -> str:
    """save_checkpoint on the main process while the others wait (every rank has gathered `state`: a collective
    under FSDP2); returns the checkpoint's folder on every rank."""
    path = os.path.join(output_dir, f"checkpoint-{step}")
    if world.is_main:
        path = save_checkpoint(output_dir, step, state, tokenizer)
    distributed.barrier(world)
    return path


def save_checkpoint(output_dir: str, step: int, state: dict, tokenizer=None) -> str:
    """Writes `state` (see `training_state`) as output_dir/checkpoint-{step}/state.pt (and the tokenizer beside
    it), whole or not at all (grpo_fast.train.run.atomic), so a crash or a full disk never leaves a broken
    checkpoint; older ones are then removed. Refuses (RunError) weights that are not finite, keeping the last
    good one."""
    bad = non_finite(state.get("model", {}))
    if bad:
        raise RunError(f"not saving checkpoint-{step}: {len(bad)} weight tensors are not finite (first: "
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
                      f"({error.strerror or error}; {free_gib(output_dir):.2f} GiB free); "
                      + (f"the last good checkpoint, {kept}, is kept (each takes {_mib(kept):.1f} MiB, and a save "
                         "needs room for the new one beside it)" if kept else "no checkpoint was kept")) from error
    with signals.interrupts_deferred():                       # keep only the newest complete checkpoint
        for name in os.listdir(output_dir):
            if checkpoint_step(name) is not None and name != os.path.basename(final):
                shutil.rmtree(os.path.join(output_dir, name), ignore_errors=True)
    return final


def _mib(folder: str) -> float:
    """The size of the files in `folder`, in MiB."""
    return sum(entry.stat().st_size for entry in os.scandir(folder) if entry.is_file()) / 2**20


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


def _complete(folder) -> bool:
    """Whether `folder` is a checkpoint folder with a non-empty state.pt (what save_checkpoint leaves)."""
    path = os.path.join(folder, "state.pt")
    return os.path.isfile(path) and os.path.getsize(path) > 0


def checkpoint_entries(output_dir: str) -> list:
    """The checkpoint entries of output_dir, newest step first: for each step its folder, or the complete previous
    version a cut replace left as checkpoint-N.old, or whatever else holds the name (a file, an empty folder)."""
    names = os.listdir(output_dir) if os.path.isdir(output_dir) else []
    steps = sorted({step for step in map(checkpoint_step, names) if step is not None}, reverse=True)
    entries = []
    for step in steps:
        name = os.path.join(output_dir, f"checkpoint-{step}")
        entries.append(complete_version(name) or (name if os.path.lexists(name) else name + PREVIOUS))
    return entries


def latest_checkpoint(output_dir: str):
    """The newest complete checkpoint folder in output_dir (checkpoint-N with its state.pt, or the complete
    previous version a cut replace left as checkpoint-N.old), or None."""
    return next((entry for entry in checkpoint_entries(output_dir) if _complete(entry)), None)


# what training_state writes: key -> (accepted types, what it should be)
STATE_KEYS = {"step": (int, "a step number"), "model": (dict, "the weights by name"),
              "optimizer": (dict, "the optimizer's state"), "scheduler": (dict, "the scheduler's state"),
              "torch_rng": (torch.Tensor, "torch's random state"), "python_rng": (tuple, "Python's random state")}


def state_problem(state, required=("step",)) -> str | None:
    """What makes `state` (a loaded state.pt) unusable as a checkpoint, in a few words, or None: not a dict, a
    `required` key missing, a key of the wrong type, weights that are not tensors or not finite (save_checkpoint
    never writes those: the file was replaced or damaged)."""
    if not isinstance(state, dict):
        return f"it holds a {type(state).__name__}, not a checkpoint's dict"
    for key, (kind, what) in STATE_KEYS.items():
        if key not in state:
            if key in required:
                return f"it has no {key!r} ({what})"
            continue
        if not isinstance(state[key], kind) or (key == "step" and (isinstance(state[key], bool) or state[key] < 0)):
            return f"its {key!r} is {type(state[key]).__name__} {str(state[key])[:40]!r}, not {what}"
    for group in ("model", "ref_model"):
        tensors = state.get(group) or {}
        if not isinstance(tensors, dict):
            return f"its {group!r} is a {type(tensors).__name__}, not the weights by name"
        for name, tensor in tensors.items():
            if not isinstance(tensor, torch.Tensor):
                return f"its {group} weight {name!r} is a {type(tensor).__name__}, not a tensor"
        bad = non_finite(tensors)
        if bad:
            return f"its {group} weight {bad[0]!r} is not finite"
    return None


def _unusable(output_dir: str, entry: str, problem: str):
    """ValueError "`problem`; what to do": resume from the next complete checkpoint once `entry` is moved aside,
    or restore it."""
    older = next((other for other in checkpoint_entries(output_dir) if other != entry and _complete(other)), None)
    remedy = (f"{older} is complete: move {entry} out of {output_dir} to resume from it" if older else
              "restore it from a copy, or start a new run without --resume in another output_dir")
    return ValueError(f"{problem}; {remedy}")


def load_latest(output_dir: str, required=("step",)):
    """(folder, state) of the newest checkpoint in output_dir, or (None, None) when there is none. ValueError on
    one line when the newest is not a usable checkpoint (a file or an empty folder by its name, a state.pt that is
    empty, cut short, not a checkpoint's or without a `required` key of STATE_KEYS), naming it and the complete
    checkpoint to use instead if any: an older one is never taken silently (the next save would remove the newer
    entry)."""
    entries = checkpoint_entries(output_dir)
    if not entries:
        return None, None
    folder = entries[0]
    path = os.path.join(folder, "state.pt")
    if not os.path.isdir(folder):
        raise _unusable(output_dir, folder, f"checkpoint {folder} is not a folder")
    if not os.path.isfile(path):
        raise _unusable(output_dir, folder, f"checkpoint {folder} has no state.pt (it holds "
                       f"{sorted(os.listdir(folder))[:4] or 'nothing'})")
    try:
        state = torch.load(path, weights_only=False, map_location="cpu")
    except Exception as error:                     # empty, truncated or overwritten: torch's errors name no file
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise _unusable(output_dir, folder, f"checkpoint {path} cannot be read ({type(error).__name__}: "
                        f"{reason[:120]}); it was cut short or damaged after it was written") from None
    problem = state_problem(state, required)
    if problem:
        raise _unusable(output_dir, folder, f"checkpoint {path} is not a checkpoint's state: {problem}")
    return folder, state


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
    """The tokenizer a checkpoint saved beside its state, or None (checkpoints of older versions). ValueError
    naming the folder and its missing files when the saved tokenizer cannot be loaded."""
    if not os.path.exists(os.path.join(folder, "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except Exception as error:                    # transformers' errors run to many lines and name no file
        missing = [name for name in ("tokenizer.json", "tokenizer_config.json")
                   if not os.path.isfile(os.path.join(folder, name))]
        what = f"{', '.join(missing)} missing" if missing else f"{type(error).__name__}: " + \
            (str(error).strip().splitlines() or [""])[0][:120]
        raise ValueError(f"checkpoint {folder}: the tokenizer saved with it cannot be loaded ({what}); copy the "
                         f"files back from the model the run started from, or restore the checkpoint") from None


def restore_model(model, state: dict, folder: str = "(in memory)") -> int:
    """Loads the weights (of a LoRA model: the adapters, and the base when saved) and the random states of
    `state` (the RNG continues where the run stopped); returns the number of steps done. ValueError naming
    `folder` when the weights do not fit the model (shapes, names) or the random states are not ones."""
    try:
        if lora.is_peft(model):                       # adapters only: the base is the model as loaded
            result = model.load_state_dict(state["model"], strict=False)
            trainable = {name for name, param in model.named_parameters() if param.requires_grad}
            missing = sorted(trainable & set(result.missing_keys))
            if missing or result.unexpected_keys:
                raise ValueError(f"checkpoint {folder}: its adapters do not fit this model: missing {missing[:3]}, "
                                 f"unexpected {sorted(result.unexpected_keys)[:3]}")
        else:
            model.load_state_dict(state["model"])
    except RuntimeError as error:                 # load_state_dict's report: one line per mismatch
        reasons = mismatches(error)
        raise ValueError(f"checkpoint {folder}: its weights do not fit this model ({len(reasons)} mismatches; "
                         f"first: {reasons[0][:200]})") from None
    try:
        torch.set_rng_state(state["torch_rng"].cpu())
        random.setstate(state["python_rng"])
    except (TypeError, ValueError, RuntimeError) as error:
        raise ValueError(f"checkpoint {folder}: its random states cannot be restored ({error})") from None
    return state["step"]


def require_latest(run_dir: str, needed_by: str, remedy: str = "a run writes one every save_every steps and at "
                   "its end", required=("step",)) -> tuple:
    """(folder, state) of the newest checkpoint in run_dir; ValueError "`needed_by`: no checkpoint in run_dir
    (`remedy`)" when there is none: the one error of every command that needs one (resume, export, eval)."""
    folder, state = load_latest(run_dir, required)
    if state is None:
        raise ValueError(f"{needed_by}: no checkpoint in {run_dir!r} ({remedy})")
    return folder, state


def resume_point(config, resume: bool, log):
    """(checkpoint folder, state) to resume from, or (None, None) for a new run, once the output folder is checked
    (record.check_output_dir: before anything is written). Refuses --resume without a checkpoint, and a checkpoint
    whose model or data this config changes; logs the keys it changes, and the files a new run replaces of one that
    stopped before its first checkpoint."""
    leftovers = check_output_dir(config.run.output_dir, resume, config.run.overwrite_output_dir)
    if not resume:
        if leftovers:
            log(f"{config.run.output_dir} holds no checkpoint, only the files of a run that stopped before its "
                f"first one ({', '.join(leftovers)}): nothing to resume, this run replaces them")
        return None, None
    folder, state = require_latest(config.run.output_dir, "--resume", "drop --resume to start a new run",
                                   required=tuple(STATE_KEYS))
    if state.get("config") is None:
        log(f"{folder} holds no config (an older version wrote it): resuming without comparing keys")
    else:
        changed = resume_changes(state["config"], config)
        if changed:
            log("resuming with changed keys, applied from here on: " +
                ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in sorted(changed.items())))
    if state["step"] >= config.run.max_steps:
        log(f"nothing left to train: {folder} is at step {state['step']} and max_steps is {config.run.max_steps} "
            "(raise --max-steps to train further); an evaluation or export a stop cut is redone")
    return folder, state
