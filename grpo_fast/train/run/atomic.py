"""One way to write a folder: whole or not at all, and never without a complete copy on disk.

    with atomic_folder("runs/x/checkpoint-20", replace=True) as temporary:
        torch.save(state, os.path.join(temporary, "state.pt"))
    complete_version("runs/x/checkpoint-20")     # the folder, or its previous version when a kill cut the replace

Everything is written to `<folder>.tmp` first. Once the block ends without error, an existing `<folder>` is renamed
to `<folder>.old`, `<folder>.tmp` to `<folder>`, and `<folder>.old` is removed: every step is a rename or the
removal of a copy that has a complete successor, so whatever stops the writer (a crash, a full disk, a Ctrl-C, a
SIGTERM, a SIGKILL) and whenever, the disk holds `<folder>` complete, or between the two renames `<folder>.old`
complete (`complete_version` finds it), never only a half-written or half-removed copy. Ctrl-C and SIGTERM are held
during the renames and the removal, and delivered once they are done. Checkpoints, the exported model and the
engine's copy of the policy are all written this way.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from typing import Optional

from grpo_fast.train.run.errors import error_chain
from grpo_fast.train.run.signals import interrupt_behind, interrupts_deferred

TEMPORARY, PREVIOUS = ".tmp", ".old"


def complete_version(folder: str) -> Optional[str]:
    """`folder` if it exists; else `folder`.old when it exists (a replace stopped between its two renames left the
    previous version there, complete); else None."""
    folder = folder.rstrip("/")
    if os.path.isdir(folder):
        return folder
    return folder + PREVIOUS if os.path.isdir(folder + PREVIOUS) else None


def write_error(error: BaseException) -> Optional[OSError]:
    """The operating system's error behind a failed write, or None: `error` itself when it is an OSError, the
    OSError it was raised while handling (torch's zip writer meets a full disk as an OSError, then raises a
    RuntimeError "unexpected pos" while closing), or the one a library's message quotes (safetensors:
    "I/O error: No space left on device (os error 28)")."""
    for seen in error_chain(error):
        if isinstance(seen, OSError) and seen.errno:
            return seen
        quoted = re.search(r"\(os error (\d+)\)", str(seen))
        if quoted:
            return OSError(int(quoted[1]), os.strerror(int(quoted[1])))
    return None


def free_gib(path: str) -> float:
    """The free space, in GiB, of the filesystem holding `path` (0 when it cannot be read)."""
    try:
        return shutil.disk_usage(path).free / 2**30
    except OSError:
        return 0.0


def _replace(temporary: str, folder: str) -> None:
    """`temporary` (complete) becomes `folder`; a complete copy exists on disk at every instant (see the module)."""
    previous = folder + PREVIOUS
    if os.path.isdir(folder):
        shutil.rmtree(previous, ignore_errors=True)   # a leftover of an earlier replace: `folder` is complete
        os.replace(folder, previous)
    os.replace(temporary, folder)
    shutil.rmtree(previous, ignore_errors=True)


@contextlib.contextmanager
def atomic_folder(folder: str, replace: bool = False):
    """Yields an empty temporary folder beside `folder`; on a clean exit it becomes `folder`. replace: an existing
    `folder` is replaced once the new one is complete; otherwise an existing `folder` is a FileExistsError before
    anything is written. On any error (KeyboardInterrupt included) inside the block the temporary folder is removed
    and the error raised (as the OSError behind it when a library wrapped one: `write_error`); `folder` is
    untouched. A Ctrl-C or SIGTERM during the replace is delivered after it."""
    folder = folder.rstrip("/")
    if not replace and os.path.lexists(folder):
        raise FileExistsError(f"{folder!r} already exists")
    temporary = folder + TEMPORARY
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        yield temporary
    except BaseException as error:
        shutil.rmtree(temporary, ignore_errors=True)
        interrupt = interrupt_behind(error)
        if interrupt is not None and interrupt is not error:  # a stop inside a library's write is still a stop
            raise interrupt from error
        disk = write_error(error) if isinstance(error, Exception) else None
        if disk is not None and disk is not error:           # a full disk is an OSError, whatever wrote the file
            raise disk from error
        raise
    with interrupts_deferred():
        _replace(temporary, folder)
