"""The update stage: a step's rollouts become one optimizer step (or num_iterations of them) on the policy.

    step         UpdateBatch (the tensors the update takes), Policy, update_batch, policy_update: the reusable step
    advantages   group-normalized advantages (GRPO, RLOO) from rewards
    batching     micro-batches by sequences and tokens, packed or padded
    attention    variable-length attention for packed micro-batches (linear memory)
    correction   the rollout correction: IS_MODES and importance_weights
    precision    the `dtype` option: weights and compute dtypes
    optimizer    the optimizer (AdamW with fp32 master weights, torchao's low-bit ones) and the lr schedule
    warm_start   the supervised warm start before GRPO
"""
