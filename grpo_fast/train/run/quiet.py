"""What a grpo-fast process prints besides its results: the lines dependencies log on every run, dropped, and
grpo_fast's own warnings as one line. The command line installs it (grpo_fast.cli), and the rollout process of a
run whose trainer installed it (grpo_fast.train.rollout.process). A leaf: it imports the standard library only."""

from __future__ import annotations

import os
import sys
import warnings

_installed = False


def installed() -> bool:
    """Whether quiet_output ran in this process."""
    return _installed


# Lines dependencies log on every run, by logger and how the message starts, that say nothing about the run: torchao's
# optional C++ kernels (MX formats, sm_90a CUTLASS) built for another torch or a GPU (grpo_fast uses none of them;
# transformers imports torchao), torch's deprecation of the enums torchao registers with pytree, and DeepSpeed's
# accelerator guess (accelerate imports DeepSpeed, installed with the optional extras, when a model is saved).
DEPENDENCY_NOISE = {"torchao": "Failed to load ",
                    "torch.utils._pytree": "%s is an Enum subclass and is now natively supported",
                    "DeepSpeed": "Setting accelerator to CPU."}


class _DropNoise:
    """A logging filter that drops the records whose message starts with `prefix` (and keeps every other)."""

    def __init__(self, prefix: str):
        self.prefix = prefix

    def filter(self, record) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _own_roots() -> tuple:
    """The folders of grpo_fast's modules: the package, and the kernels and benchmarks mapped into it."""
    import importlib.util

    roots = [os.path.dirname(os.path.abspath(importlib.util.find_spec("grpo_fast").origin))]
    for name in ("grpo_fast.kernels", "grpo_fast.benchmarks"):
        spec = importlib.util.find_spec(name)
        roots += [os.path.abspath(path) for path in (spec.submodule_search_locations or [])] if spec else []
    return tuple(root + os.sep for root in roots)


def quiet_output() -> None:
    """What the process prints besides its results: DEPENDENCY_NOISE dropped, and grpo_fast's own warnings as one
    line, `warning: <message>` on stderr, instead of Python's file:line and source line (every other warning as
    Python shows it). Only for a process of grpo-fast's own (its command line, its rollout process): a program that
    calls grpo_fast.cli.main keeps its logging and warnings as they are. installed() says whether this process
    did it, so that the rollout process it starts does it too."""
    global _installed
    import logging

    for name, prefix in DEPENDENCY_NOISE.items():
        logging.getLogger(name).addFilter(_DropNoise(prefix))
    roots, python_show = _own_roots(), warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        if not os.path.abspath(filename).startswith(roots):
            return python_show(message, category, filename, lineno, file, line)
        try:
            print(f"warning: {message}", file=file or sys.stderr)
        except OSError:                         # as Python's own: a closed stderr loses the warning, not the run
            pass

    warnings.showwarning = show
    _installed = True
