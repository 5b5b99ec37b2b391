"""The rollout correction's modes: per token or per sequence, truncated or masked, with an optional floor."""

import math

import torch

from grpo_fast.train.update.correction import IS_MODES, importance_weights


def test_importance_weights_modes():
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    sampling = torch.tensor([[-1.5, -1.0, 9.0], [-1.0, -3.0, 5.0]])
    mask = torch.tensor([[True, True, False], [True, True, False]])
    token = torch.exp((old - sampling) * mask)
    assert torch.allclose(importance_weights(old, sampling, mask, "token_truncate", 2.0), token.clamp(max=2.0))
    assert torch.allclose(importance_weights(old, sampling, mask, "token_mask", 2.0),
                          torch.where(token > 2.0, 0.0, token))
    sequence = torch.tensor([[math.exp(0.5 - 1.0)], [math.exp(2.0)]]).expand(2, 3)
    assert torch.allclose(importance_weights(old, sampling, mask, "sequence_truncate", 3.0), sequence.clamp(max=3.0))
    assert torch.allclose(importance_weights(old, sampling, mask, "sequence_mask", 3.0),
                          torch.where(sequence > 3.0, 0.0, sequence))
    # a lower bound too: truncated up to it, or masked below it (both-sided); 0 changes nothing
    assert torch.allclose(importance_weights(old, sampling, mask, "token_truncate", 2.0, 0.5),
                          token.clamp(min=0.5, max=2.0))
    assert torch.allclose(importance_weights(old, sampling, mask, "token_mask", 2.0, 0.5),
                          torch.where((token > 2.0) | (token < 0.5), 0.0, token))
    assert token.min() < 0.5 and (token > 2.0).any()                  # both bounds bite on these inputs
    assert torch.allclose(importance_weights(old, sampling, mask, "sequence_mask", 9.0, 0.7),
                          torch.where(sequence < 0.7, 0.0, sequence))
    for mode in IS_MODES[1:]:
        assert torch.equal(importance_weights(old, sampling, mask, mode, 2.0, 0.0),
                           importance_weights(old, sampling, mask, mode, 2.0))
