"""A Hugging Face model folder of the policy, written whole or not at all: what `grpo-fast export` and a run's end
write (grpo_fast.train.saved.export) and what the vLLM engine loads for the tiny model built in code.

The folder holds config.json, model.safetensors, the tokenizer, generation_config.json and, when the step is known,
grpo_fast_export.json ({"step": N}: the training step whose weights these are, which `grpo-fast eval` compares with
the run's newest checkpoint). A LoRA policy's adapters are merged into the base weights (the same merge the vLLM
engine gets), so `AutoModelForCausalLM.from_pretrained` and `vllm.LLM(model=...)` load it as a plain model.
The adapters alone (out_dir/adapter, PEFT's files) come with BASE_RECORD: the config keys the base must be loaded
with to be the model they were trained on (a RoPE-scaled run's rope_parameters and max_position_embeddings; {}
without policy.rope_scaling), since PEFT's own files say nothing of them.
"""

from __future__ import annotations

import json
import os

from grpo_fast.models import unwrap
from grpo_fast.train.lora import engine_weights
from grpo_fast.train.run.atomic import atomic_folder

EXPORT_RECORD = "grpo_fast_export.json"
BASE_RECORD = "grpo_fast_base.json"       # in the adapter folder: AutoModelForCausalLM.from_pretrained(base, **it)


def exported_step(model_dir: str):
    """The training step recorded in a model folder this module wrote (EXPORT_RECORD), or None (no record, or
    an unreadable one)."""
    try:
        with open(os.path.join(model_dir, EXPORT_RECORD)) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def check_target(out_dir: str) -> None:
    """Raises ValueError when out_dir exists (a folder or a file): an export never overwrites."""
    if os.path.lexists(out_dir):
        kind = "folder" if os.path.isdir(out_dir) else "file"
        raise ValueError(f"export target {out_dir!r} already exists (a {kind}); remove it or choose another folder")


def base_overrides(base, rope_scaling) -> dict:
    """The config keys policy.scaled_rope set on `base` (the model without its PEFT wrapper) when the run had
    `rope_scaling` (else none): what a base loaded from its own folder lacks."""
    if rope_scaling is None:
        return {}
    return {"rope_parameters": dict(base.config.rope_parameters),
            "max_position_embeddings": base.config.max_position_embeddings}


def save_model_folder(model, tokenizer, out_dir: str, weights=None, replace: bool = False,
                      adapter: bool = False, step: int | None = None, rope_scaling: dict | None = None) -> str:
    """Writes `model` (a causal LM, PEFT-wrapped or not) and `tokenizer` to out_dir as a Hugging Face folder, the
    LoRA adapters merged. weights: the state dict to write (default `engine_weights(model)`; pass it when every
    rank of a sharded model had to gather it). replace: an existing out_dir is replaced once the new folder is
    complete (a run's own output_dir/model); otherwise it is refused. adapter: also write the PEFT adapters
    (adapter_config.json, adapter_model.safetensors) to out_dir/adapter, and beside them BASE_RECORD, the keys
    `rope_scaling` (policy.rope_scaling) set on the base (see base_overrides). step: the training step of these
    weights, recorded in out_dir/grpo_fast_export.json (None: no record). Returns out_dir."""
    if not replace:
        check_target(out_dir)
    weights = engine_weights(model) if weights is None else weights
    base = unwrap(model)
    with atomic_folder(out_dir, replace=True) as temporary:       # check_target above refuses an existing one
        base.save_pretrained(temporary, state_dict={name: tensor.contiguous() for name, tensor in weights.items()})
        tokenizer.save_pretrained(temporary)
        if adapter:
            model.save_pretrained(os.path.join(temporary, "adapter"))      # PEFT: the adapters alone
            with open(os.path.join(temporary, "adapter", BASE_RECORD), "w") as f:
                json.dump(base_overrides(base, rope_scaling), f, indent=1)
        if step is not None:
            with open(os.path.join(temporary, EXPORT_RECORD), "w") as f:
                json.dump({"step": int(step)}, f)
    return out_dir
