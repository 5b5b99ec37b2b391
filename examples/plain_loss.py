"""grpo_fast in a plain PyTorch training step: a tiny causal LM, one GRPO update, no logits tensor.

python examples/plain_loss.py
"""

import torch
from torch import nn

import grpo_fast as gf

torch.manual_seed(0)
vocab, hidden_size, group, prompt_len, completion_len = 1000, 64, 4, 8, 24


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden_size)
        self.body = nn.GRU(hidden_size, hidden_size, batch_first=True)
        self.norm = nn.LayerNorm(hidden_size)
        self.lm_head = nn.Linear(hidden_size, vocab, bias=False)

    def hidden_states(self, ids):          # (B, L) -> (B, L, H): everything but the LM head
        return self.norm(self.body(self.embed(ids))[0])


model = TinyLM()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

# A "rollout": prompts + sampled completions, rewards per completion, group-normalized advantages.
ids = torch.randint(0, vocab, (group, prompt_len + completion_len))
completion_mask = torch.ones(group, completion_len, dtype=torch.bool)
completion_mask[0, -5:] = False                                   # a shorter completion (padding)
rewards = torch.tensor([1.0, 0.0, 0.5, 0.0])
advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)

# Hidden states that predict each completion token: positions prompt_len - 1 ... L - 2.
hidden = model.hidden_states(ids)[:, prompt_len - 1:-1]
targets = ids[:, prompt_len:]
with torch.no_grad():                                             # old policy = this policy (one update)
    old_logps = gf.token_logprobs(hidden, model.lm_head.weight, targets)

loss, metrics = gf.grpo_loss(hidden, model.lm_head.weight, targets, advantages, completion_mask,
                             old_logps=old_logps, config=gf.LossConfig(loss_type="dapo", epsilon_high=0.28))
loss.backward()
optimizer.step()
optimizer.zero_grad()
print(f"loss {loss.item():.6f}  " + "  ".join(f"{k} {v.item():.4f}" for k, v in metrics.items()))
