"""Run by tests/train/test_rope_scaling.py in a fresh process (vLLM changes process-wide state): SmolLM2-135M-Instruct
with its context shrunk to 128 positions (a copy of its folder, max_position_embeddings 128) and policy.rope_scaling
YaRN x2, 160-token completions sampled by one engine (argv[2]: "hf", the rollout process's copy, or "vllm") with
the scaling, then without it; each time the largest |engine log-prob - trainer log-prob| over the sampled tokens,
the trainer's model loaded as the trainer loads it (with the scaling). Prints RESULT {json}.

    python tests/train/rope_scaling_check.py OUT_DIR hf|vllm
"""

import json
import os
import shutil
import sys

import torch

from grpo_fast.train import pretrained
from grpo_fast.train.policy import load_model
from grpo_fast.train.rollout.process import _build_engine
from grpo_fast.train.tasks import prompt_ids
from grpo_fast.train.update.step import Policy, UpdateBatch, completion_logprobs
from tests.helpers import flat_config

CONTEXT, COMPLETION = 128, 160
YARN = {"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": CONTEXT}


def shrunk_folder(out_dir: str) -> str:
    """SmolLM2's folder with max_position_embeddings CONTEXT (the weights linked, not copied)."""
    source, folder = pretrained.model_folder(pretrained.SMOLLM2), os.path.join(out_dir, f"smollm2-{CONTEXT}")
    os.makedirs(folder, exist_ok=True)
    for name in os.listdir(source):
        if name == "config.json":
            config = json.load(open(os.path.join(source, name)))
            json.dump({**config, "max_position_embeddings": CONTEXT}, open(os.path.join(folder, name), "w"))
        elif not os.path.exists(os.path.join(folder, name)):
            os.symlink(os.path.join(source, name), os.path.join(folder, name))
    return folder


def gap(engine_name: str, folder: str, rope_scaling, trainer, tokenizer, config) -> float:
    spec = {"rollout": config.rollout, "seed": 0, "model_dir": folder, "dtype": torch.float32, "device": "cpu",
            "max_model_len": 16 + COMPLETION, "rope_scaling": rope_scaling}
    engine = _build_engine(spec)
    if engine_name == "hf":
        engine.sampling_logps = True
    generation = engine.generate(prompt_ids(["The longest river in the world is"], tokenizer), seed=5, n=1)
    batch = UpdateBatch(generation.input_ids, generation.attention_mask, generation.prompt_length,
                        generation.completion_ids, loss_mask=generation.completion_mask,
                        advantages=torch.zeros(generation.input_ids.shape[0]))
    assert int(generation.completion_mask.sum(1).min()) == COMPLETION
    logps = completion_logprobs(Policy.of(trainer), batch, config.batching, config.rollout.temperature)
    del engine
    return float((generation.sampling_logps - logps).abs()[generation.completion_mask].max())


if __name__ == "__main__":
    out_dir, engine_name = sys.argv[1], sys.argv[2]
    # unscaled, vLLM refuses a context past the folder's: this lets the unscaled engine start (read as vLLM
    # starts, so set before); the scaled one is within its context anyway
    os.environ["VLLM_ALLOW_LONG_MAX_MODEL_LEN"] = "1"
    folder = shrunk_folder(out_dir)
    config = flat_config(model=folder, engine=engine_name, rope_scaling=YARN, group_size=2, ignore_eos=True,
                         max_completion_length=COMPLETION, vllm_dtype="float32", micro_batch_size=1)
    trainer, tokenizer = load_model(config.policy, [], weights_dtype=torch.float32)
    result = {"rope_parameters": trainer.config.rope_parameters,
              "gap_scaled": gap(engine_name, folder, YARN, trainer, tokenizer, config)}
    result["gap_unscaled"] = gap(engine_name, folder, None, trainer, tokenizer, config)
    shutil.rmtree(folder, ignore_errors=True)
    print("RESULT " + json.dumps(result))
