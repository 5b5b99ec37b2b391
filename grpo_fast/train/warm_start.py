"""A supervised warm start before GRPO: next-token training on prompt -> solution<eos>, from hidden states."""

from __future__ import annotations

import random

import torch

import grpo_fast as gf
from grpo_fast.models import final_hidden_states, lm_head
from grpo_fast.train import precision
from grpo_fast.train.tasks import prompt_text


def supervised_warm_start(model, tokenizer, samples: list, config, log, dtype: str = "fp32") -> float:
    """config.sft_steps steps of the configured optimizer on the mean negative log-likelihood of the solution
    tokens (the loss from `token_logprobs`, no logits), in the resolved dtype option `dtype`
    (grpo_fast.train.precision); trains what requires grad (a LoRA model's adapters). Returns the last loss."""
    # weight decay 0.01: torch AdamW's default, which the warm start has always used
    optimizer = precision.make_optimizer(model.parameters(), config.optimizer, config.sft_learning_rate, 0.01)
    compute = precision.compute_dtype(dtype)
    rng = random.Random(config.seed)
    loss_value = float("nan")
    for step in range(config.sft_steps):
        batch = rng.sample(samples, min(32, len(samples)))
        prompts = [prompt_text(s, tokenizer, config) for s in batch]
        full = [p + s["solution"] + tokenizer.eos_token for p, s in zip(prompts, batch)]
        encoded = tokenizer(full, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        device = next(model.parameters()).device
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].bool().to(device)
        answer = torch.zeros_like(mask)
        for row, (length, valid) in enumerate(zip(prompt_lengths, mask.sum(1).tolist())):
            answer[row, ids.shape[1] - valid + length:] = True          # left padding: answers end each row
        with torch.autocast(device.type, dtype=compute, enabled=dtype == "bf16-autocast"):
            hidden = final_hidden_states(model, ids, mask.long())[:, :-1]
        head = lm_head(model)
        targets = torch.where(answer[:, 1:], ids[:, 1:], 0)
        kwargs = head.logit_kwargs()
        if kwargs["bias"] is not None:
            kwargs["bias"] = kwargs["bias"].to(compute)
        logp = gf.token_logprobs(hidden.to(compute), head.weight.to(compute), targets, **kwargs)
        loss = -(logp * answer[:, 1:]).sum() / answer[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 50 == 0 or step == config.sft_steps - 1:
            log(f"warm start {step + 1}/{config.sft_steps}: loss {loss_value:.3f}")
    return loss_value
