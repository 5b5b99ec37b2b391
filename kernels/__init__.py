"""Triton kernels of grpo_fast (installed as `grpo_fast.kernels`): one file per kernel, launcher beside it.

- logprob_forward: one read of a (C, V) logits buffer -> log-sum-exp, target log-prob and entropy per row.
- policy_grad: the loss epilogue -> dL/dlogp per row (ratio, clipping, KL, importance weights, reduction weight).
- dlogits: one read and one write of the same buffer -> dL/dlogits in place.
- kept_logprob_forward / kept_dlogits: the same two passes over each row's kept set (top-k / top-p sampling):
  K gathered logits read per row, the row cleared and its K gradients scattered.
- tuning: the block sizes and warp counts of all of them.

They know nothing of autograd or trainers; `grpo_fast.backends.triton_ops` drives them.
"""

if __name__ == "kernels":
    # This folder sits at the repository's top level, so with the repository on sys.path (pytest, `python -m` from
    # its root) `import kernels` finds it before Hugging Face's `kernels` package, which transformers >= 5.25
    # requires and imports. That import gets the installed package; this folder's code is grpo_fast.kernels. Where
    # Hugging Face's is not installed the import stays an empty module without a version, which transformers'
    # probe (it imports a package that has no metadata) counts as no usable `kernels`.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _repository = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _elsewhere = [p for p in sys.path if os.path.abspath(p or os.curdir) != _repository]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _elsewhere)
    if _spec is not None:
        _module = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _module            # what `import kernels` returns once this file has run
        _spec.loader.exec_module(_module)
else:
    from grpo_fast.kernels.dlogits import dlogits_
    from grpo_fast.kernels.kept_dlogits import kept_dlogits_
    from grpo_fast.kernels.kept_logprob_forward import kept_logprob_forward
    from grpo_fast.kernels.logprob_forward import logprob_forward
    from grpo_fast.kernels.policy_grad import policy_grad

    __all__ = ["logprob_forward", "policy_grad", "dlogits_", "kept_logprob_forward", "kept_dlogits_"]
