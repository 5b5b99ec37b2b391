"""The error a run raises when it stops for a cause a user can act on."""


class RunError(RuntimeError):
    """A failure of the run that names its cause (a reward, the engine, non-finite updates, an evaluation) and the
    step it happened in: the CLI prints it on one line."""
