"""A supervised warm start before GRPO: next-token training on prompt -> solution<eos>, from hidden states."""

from __future__ import annotations

import random

import torch

import grpo_fast as gf
from grpo_fast.models import final_hidden_states
from grpo_fast.train.tasks import prompt_text
from grpo_fast.train.tasks.config import DataConfig
from grpo_fast.train.update import optimizer as optim
from grpo_fast.train.update.config import WarmStartConfig
from grpo_fast.train.update.step import Policy, head_in


def supervised_warm_start(model, tokenizer, samples: list, warm_start: WarmStartConfig, optimizer_name: str,
                          data: DataConfig, seed: int, log, dtype: str = "fp32") -> float:
    """warm_start.sft_steps steps of the optimizer named `optimizer_name` (the run's) at warm_start.sft_learning_rate
    on the mean negative log-likelihood of the solution tokens (the loss from `token_logprobs`, no logits), prompts
    written as `data` says and batches drawn by the run's `seed`, in the resolved dtype option `dtype`
    (grpo_fast.train.update.precision), computed as the policy update computes. The trainer runs it on the whole model,
    before any LoRA adapters are added. Returns the last loss."""
    # weight decay 0.01: torch AdamW's default, which the warm start has always used
    optimizer = optim.make_optimizer(model.parameters(), optimizer_name, warm_start.sft_learning_rate, 0.01)
    device = next(model.parameters()).device
    compute, autocast = Policy.of(model, dtype).compute(device)
    rng = random.Random(seed)
    loss_value = float("nan")
    for step in range(warm_start.sft_steps):
        batch = rng.sample(samples, min(32, len(samples)))
        prompts = [prompt_text(s, tokenizer, data) for s in batch]
        full = [p + s["solution"] + tokenizer.eos_token for p, s in zip(prompts, batch)]
        encoded = tokenizer(full, return_tensors="pt", padding=True, add_special_tokens=False)
        prompt_lengths = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
        ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].bool().to(device)
        answer = torch.zeros_like(mask)
        for row, (length, valid) in enumerate(zip(prompt_lengths, mask.sum(1).tolist())):
            answer[row, ids.shape[1] - valid + length:] = True          # left padding: answers end each row
        with torch.autocast(device.type, dtype=compute, enabled=autocast):
            hidden = final_hidden_states(model, ids, mask.long())[:, :-1]
        targets = torch.where(answer[:, 1:], ids[:, 1:], 0)
        weight, head = head_in(model, compute)
        logp = gf.token_logprobs(hidden.to(compute), weight, targets, bias=head.bias, transform=head.transform())
        loss = -(logp * answer[:, 1:]).sum() / answer[:, 1:].sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if step % 50 == 0 or step == warm_start.sft_steps - 1:
            log(f"warm start {step + 1}/{warm_start.sft_steps}: loss {loss_value:.3f}")
    return loss_value
