"""The trained policy as a Hugging Face model folder, for transformers, vLLM or the hub.

    grpo-fast export RUN_DIR OUT_DIR             # from a run's newest checkpoint
    grpo-fast export RUN_DIR OUT_DIR --peft-adapter   # and, for a LoRA run, the adapters in OUT_DIR/adapter
                                                      # (with the RoPE scaling their base must be loaded with)
    output_dir/model/                            # written by `grpo-fast train` at the end of every run

The folder is grpo_fast.train.run.model_folder's: a LoRA run's adapters merged into the base weights, so
`AutoModelForCausalLM.from_pretrained` and `vllm.LLM(model=...)` load it as a plain model. It is written to a
temporary folder and renamed: an export that fails leaves nothing behind, and an existing target is never
overwritten.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from grpo_fast.train import lora
from grpo_fast.train.config import saved_config
from grpo_fast.train.policy import load_model
from grpo_fast.train.run.atomic import free_gib
from grpo_fast.train.run.model_folder import BASE_RECORD, check_target, save_model_folder
from grpo_fast.train.saved import checkpoint
from grpo_fast.train.update import precision


def save_final_model(model, tokenizer, output_dir: str, weights, step: int) -> str:
    """`save_model_folder` to output_dir/model (replacing an older export) at a run's end. A write that fails
    (a full disk) is an OSError on one line that names the folder, the free space and the checkpoint kept."""
    target = os.path.join(output_dir, "model")
    try:
        return save_model_folder(model, tokenizer, target, weights, replace=True, step=step)
    except OSError as error:
        kept = checkpoint.latest_checkpoint(output_dir)
        raise OSError(error.errno, f"the final export to {target!r} could not be written ({error.strerror or error}; "
                      f"{free_gib(output_dir):.2f} GiB free); the run's checkpoint, {kept}, is kept: free some space "
                      f"and --resume to write it again, or `grpo-fast export {output_dir} OUT_DIR` elsewhere") \
            from error


def export_run(run_dir: str, out_dir: str, adapter: bool = False, log=None) -> str:
    """The newest checkpoint of the run in run_dir, exported to out_dir (see `save_model_folder`). adapter: a
    LoRA run's adapters also as a PEFT adapter in out_dir/adapter, for the base the run started from. Raises
    ValueError naming what is missing: no run folder, no checkpoint, a checkpoint without the config and
    tokenizer that rebuild its model, or an adapter that does not exist (full training) or would not reproduce
    the policy on its base (a warm start trained the base first). log: where the warning that a RoPE-scaled run's
    adapters need the scaled base goes (default: stderr)."""
    log = log or (lambda line: print(line, file=sys.stderr))
    check_target(out_dir)
    if not os.path.isdir(run_dir):
        raise ValueError(f"run folder {run_dir!r} does not exist")
    folder, state = checkpoint.require_latest(run_dir, "export", required=("step", "model"))
    tokenizer = checkpoint.load_tokenizer(folder)
    if state.get("config") is None or tokenizer is None:
        raise ValueError(f"{folder} was written by an older version without its config and tokenizer: it cannot "
                         "be rebuilt for export")
    config = saved_config(state["config"])
    if adapter and not config.policy.lora_rank:
        raise ValueError(f"--peft-adapter: the run in {run_dir!r} trained the whole model (lora_rank 0); there are no "
                         "adapters to save")
    if adapter and config.warm_start.sft_steps:
        raise ValueError(f"--peft-adapter: the warm start (sft_steps {config.warm_start.sft_steps}) trained the base "
                         f"before the adapters were added, so the adapters alone on {config.policy.model!r} are not "
                         "the policy; export the merged model only")
    # the weights' dtype as trained: the saved base weights', else (LoRA adapters alone) the config's on this machine
    base = [t for name, t in state["model"].items() if ".lora_" not in name and t.is_floating_point()]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = base[0].dtype if base else precision.weights_dtype(precision.resolve(config.policy.dtype, device,
                                                                                  config.policy.lora_rank))
    model, tokenizer = load_model(config.policy, [], tokenizer, dtype, prompt_format=config.data.prompt_format,
                                  seed=config.run.seed, max_completion_length=config.rollout.max_completion_length)
    model = lora.adapted(model, config.policy, dtype)      # a 4-bit base as trained: exported dequantized
    checkpoint.restore_model(model, state, folder)
    save_model_folder(model, tokenizer, out_dir, adapter=adapter, step=state["step"],
                      rope_scaling=config.policy.rope_scaling)
    if adapter and config.policy.rope_scaling is not None:     # PEFT loads the base as its folder has it: unscaled
        log(f"warning: the adapters in {os.path.join(out_dir, 'adapter')} were trained on a base with "
            f"policy.rope_scaling {json.dumps(config.policy.rope_scaling)}; load the base with it "
            f"(AutoModelForCausalLM.from_pretrained(base, **the keys in adapter/{BASE_RECORD})), or the adapters' "
            "log-probs are not the policy's")
    if adapter and config.policy.load_in_4bit:
        log(f"warning: the adapters in {os.path.join(out_dir, 'adapter')} were trained on the base quantized to 4 "
            f"bits (policy.load_in_4bit, NF4{', double quantization' if config.policy.bnb_4bit_double_quant else ''}); "
            "load the base so (transformers' BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')), or "
            "use the merged model in the folder itself, whose base is that 4-bit one dequantized")
    return out_dir
