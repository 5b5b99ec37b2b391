"""The error a run raises when it stops for a cause a user can act on, and how the run reads the errors libraries
raise (a chain of causes, load_state_dict's report) to name one in a line."""

import torch


class RunError(RuntimeError):
    """A failure of the run that names its cause (a reward, the engine, non-finite updates, an evaluation) and the
    step it happened in: the CLI prints it on one line."""


def error_chain(error: BaseException, depth: int = 8):
    """`error`, then the error it was raised from or while handling, and so on (at most `depth`): libraries wrap
    the cause (torch's zip writer raises RuntimeError "unexpected pos" while handling a full disk's OSError, or a
    KeyboardInterrupt raised inside its write)."""
    seen = error
    while seen is not None and depth > 0:
        yield seen
        seen, depth = seen.__cause__ or seen.__context__, depth - 1


def mismatches(error: RuntimeError) -> list:
    """The lines of load_state_dict's report (one per missing, unexpected or misshapen tensor); the message itself
    when it has no such lines."""
    return [line.strip() for line in str(error).splitlines()[1:] if line.strip()] or [str(error)]


def non_finite(tensors: dict) -> list:
    """The names of the floating tensors of {name: tensor} that hold a NaN or an infinity."""
    return [name for name, tensor in tensors.items()
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all())]
