"""Calls of the public API as a type checker sees them (tests/test_typing.py runs mypy on this file): a line with
a trailing error comment must be an error whose message holds the comment's words, every other line must check
clean."""

import torch

import grpo_fast as gf

hidden, weight, targets = torch.randn(2, 3, 8), torch.randn(11, 8), torch.randint(0, 11, (2, 3))
advantages, mask = torch.randn(2), torch.ones(2, 3, dtype=torch.bool)

loss, metrics = gf.grpo_loss(hidden, weight, targets, advantages, mask, config=gf.LossConfig(beta=0.0),
                             transform=gf.LogitTransform(temperature=0.7), execution=gf.Execution(backend="torch"))
logp = gf.token_logprobs(hidden, weight, targets, transform=gf.LogitTransform())
total = gf.fused_token_loss(hidden, weight, targets, gf.autograd_token_loss(lambda lp, ent, index: lp.sum()))
module = gf.GRPOLoss("dapo", transform=gf.LogitTransform())
value, _ = module(hidden, weight, targets, advantages, mask)

gf.grpo_loss(hidden, weight, targets, advantages, mask, temprature=0.7)  # error: keyword argument "temprature"
gf.token_logprobs(hidden, weight, targets, transfrom=None)  # error: Unexpected keyword argument "transfrom"
gf.fused_token_loss(hidden, weight, targets, print, mask_=mask)  # error: Unexpected keyword argument "mask_"
gf.grpo_loss(hidden, weight, targets, advantages, mask, transform=gf.Execution())  # error: type "Execution"
gf.token_logprobs(hidden, weight, targets, execution=gf.LogitTransform())  # error: incompatible type "LogitTransform"
gf.GRPOLoss("dapo", execution=gf.LossConfig())  # error: incompatible type "LossConfig"
gf.GRPOLoss("dapo", chunk_bytes=4096)  # error: Unexpected keyword argument "chunk_bytes"
