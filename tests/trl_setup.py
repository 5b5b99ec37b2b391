"""A tiny Qwen2 model and a byte-level tokenizer built in code (no hub), and a GRPO run on them."""

import torch


def tiny_tokenizer():
    from grpo_fast.tiny import train_tokenizer

    return train_tokenizer([], vocab_size=259)           # bytes and special tokens, no merges


def tiny_model(vocab_size, seed=0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    return Qwen2ForCausalLM(config)


def length_reward(completions, **kwargs):
    return [float(len(c)) / 8.0 for c in completions]


def run_grpo(trainer_cls, output_dir, steps=2, peft_config=None, **config):
    from datasets import Dataset
    from trl import GRPOConfig

    tokenizer = tiny_tokenizer()
    model_dir = f"{output_dir}/tiny-model"          # saved locally: the trainer loads it (and its reference copy)
    tiny_model(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    dataset = Dataset.from_dict({"prompt": ["1+1=", "2+3=", "7-4=", "9*2=", "8/4=", "5+5=", "6-1=", "3*3="]})
    options = dict(per_device_train_batch_size=4, num_generations=4, max_completion_length=8, max_steps=steps,
                   learning_rate=1e-2, logging_steps=1, report_to="none", seed=0, bf16=False, use_cpu=True,
                   save_strategy="no")
    args = GRPOConfig(output_dir=str(output_dir), **{**options, **config})
    trainer = trainer_cls(model=model_dir, reward_funcs=length_reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, peft_config=peft_config)
    trainer.train()
    return trainer
