"""Triton kernels of grpo_fast (installed as `grpo_fast.kernels`): one file per kernel, launcher beside it.

- logprob_forward: one read of a (C, V) logits buffer -> log-sum-exp, target log-prob and entropy per row.
- policy_grad: the loss epilogue -> dL/dlogp per row (ratio, clipping, KL, importance weights, reduction weight).
- dlogits: one read and one write of the same buffer -> dL/dlogits in place.
- tuning: the block sizes and warp counts of all three.

They know nothing of autograd or trainers; `grpo_fast.backends.triton_ops` drives them.
"""

from grpo_fast.kernels.dlogits import dlogits_
from grpo_fast.kernels.logprob_forward import logprob_forward
from grpo_fast.kernels.policy_grad import policy_grad

__all__ = ["logprob_forward", "policy_grad", "dlogits_"]
