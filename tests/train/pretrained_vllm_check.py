"""Run by tests/train/test_pretrained.py in a fresh process (vLLM changes process-wide state): three GRPO steps on
SmolLM2-135M-Instruct with the chat template and the colocated vLLM engine in the given vllm_dtype
(argv[2]); prints RESULT {json}."""

import json
import math
import sys

from grpo_fast.train.loop import train
from grpo_fast.train.pretrained import SMOLLM2
from tests.helpers import flat_config

if __name__ == "__main__":
    history = train(flat_config(model=SMOLLM2, engine="vllm", vllm_dtype=sys.argv[2], prompt_format="chat",
                                task="arithmetic", group_size=2, prompts_per_step=2, max_completion_length=16,
                                max_steps=3,
                                sft_steps=0, eval_every=0, save_every=3, log_completions=0,
                                rewards=["tests.helpers:text_length_reward"], output_dir=sys.argv[1]),
                    log=lambda *_: None)
    print("RESULT " + json.dumps({"steps": [r["step"] for r in history],
                                  "finite": all(math.isfinite(r["loss"]) for r in history),
                                  "is_ratio_mean": [r["is_ratio_mean"] for r in history]}))
