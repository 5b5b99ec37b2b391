"""Triton kernels of grpo_fast (installed as `grpo_fast.kernels`): one file per kernel, launcher beside it.

- logprob_forward: one read of a (C, V) logits buffer -> log-sum-exp, target log-prob and entropy per row.
- dlogits: one read and one write of the same buffer -> dL/dlogits in place.
- tuning: the block sizes and warp counts of both.

They know nothing of losses or autograd; `grpo_fast.backends.triton_ops` drives them.
"""

from grpo_fast.kernels.dlogits import dlogits_
from grpo_fast.kernels.logprob_forward import logprob_forward

__all__ = ["logprob_forward", "dlogits_"]
