"""Reward functions the trainer tests load by `module:function`."""

CALLS = {"n": 0, "interrupt_at": None}


def counting_reward(completions, solution, **kwargs):
    CALLS["n"] += 1
    if CALLS["interrupt_at"] is not None and CALLS["n"] == CALLS["interrupt_at"]:
        raise KeyboardInterrupt
    return [float(c.strip() == s) for c, s in zip(completions, solution)]


def broken_reward(completions, **kwargs):
    raise ZeroDivisionError("bad reward")


def text_length_reward(completions, **kwargs):
    """Varies with every sample, so advantages are never all zero (an untrained model scores 0 on accuracy)."""
    return [float(len(c)) for c in completions]
