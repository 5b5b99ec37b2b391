"""GRPO with TRL's GRPOTrainer and grpo_fast computing its log-probs: a tiny model on CPU in about a minute.

python examples/trl_grpo.py [--steps 100] [--plain]     # --plain: TRL's own GRPOTrainer, for comparison
python examples/trl_grpo.py --steps 5 --vocab 65536 --completion-length 256 [--plain]   # a heavier LM head
python examples/trl_grpo.py --moe ...   # a Qwen3-MoE-style model (4 experts, 2 per token, router aux loss)

The model (a 2-layer Qwen2) and a byte-level tokenizer are built in code and saved locally: nothing is
downloaded. The reward asks for short completions that end the text; it rises from ~0.1 to ~1 in 100 steps.
With --vocab larger than the tokenizer's 259 ids the extra rows only widen the LM head (ids the tokenizer does
not know decode to nothing). Prints the time per step and the peak RSS of the run.
"""

import argparse
import os
import tempfile
import time

import torch
from datasets import Dataset
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM
from trl import GRPOConfig, GRPOTrainer

from grpo_fast.benchmarks.profiling import peak_rss_bytes
from grpo_fast.integrations.trl import FastGRPOTrainer
from grpo_fast.train.policy import train_tokenizer


def short_answer_reward(completions, **kwargs):
    """1 for a completion that stops (end-of-text) within 4 characters, less the longer it runs."""
    return [max(0.0, 1.0 - max(len(c) - 4, 0) / 12) for c in completions]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=None, help="LM-head rows (default: the tokenizer's 259)")
    parser.add_argument("--completion-length", type=int, default=16)
    parser.add_argument("--plain", action="store_true", help="run trl.GRPOTrainer instead of FastGRPOTrainer")
    parser.add_argument("--moe", action="store_true", help="a Qwen3-MoE-style model with its load-balancing loss")
    args = parser.parse_args()
    torch.manual_seed(0)
    tokenizer = train_tokenizer([], vocab_size=259)      # bytes and special tokens, no merges
    shape = dict(vocab_size=args.vocab or len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=max(256, args.completion_length + 64),
                 eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    if args.moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**shape, head_dim=16, moe_intermediate_size=64, num_experts=4,
                                                   num_experts_per_tok=2, output_router_logits=True,
                                                   router_aux_loss_coef=0.01))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    with tempfile.TemporaryDirectory() as workdir:
        model_dir = os.path.join(workdir, "tiny-model")
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        prompts = [f"{a}+{b}=" for a in range(10) for b in range(10)]
        training = GRPOConfig(
            output_dir=os.path.join(workdir, "out"), max_steps=args.steps, per_device_train_batch_size=8,
            num_generations=8, max_completion_length=args.completion_length, learning_rate=1e-2, beta=0.02,
            logging_steps=5, report_to="none", bf16=False, use_cpu=True, save_strategy="no", seed=0,
        )
        trainer_cls = GRPOTrainer if args.plain else FastGRPOTrainer
        trainer = trainer_cls(model=model_dir, reward_funcs=short_answer_reward, args=training,
                              train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer)
        start = time.perf_counter()
        trainer.train()
        elapsed = time.perf_counter() - start
        rewards = [entry["reward"] for entry in trainer.state.log_history if "reward" in entry]
        step_times = [entry["step_time"] for entry in trainer.state.log_history if "step_time" in entry]
        print(f"{trainer_cls.__name__}: {args.steps} steps in {elapsed:.1f} s "
              f"(training step {sum(step_times) / max(len(step_times), 1):.3f} s); "
              f"reward {rewards[0]:.3f} -> {rewards[-1]:.3f}; peak RSS {peak_rss_bytes() / 2**20:.0f} MiB")


if __name__ == "__main__":
    main()
