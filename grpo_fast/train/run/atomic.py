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
import shutil
from typing import Optional

from grpo_fast.train.run.signals import interrupts_deferred

TEMPORARY, PREVIOUS = ".tmp", ".old"


def complete_version(folder: str) -> Optional[str]:
    """`folder` if it exists; else `folder`.old when it exists (a replace stopped between its two renames left the
    previous version there, complete); else None."""
    folder = folder.rstrip("/")
    if os.path.isdir(folder):
        return folder
    return folder + PREVIOUS if os.path.isdir(folder + PREVIOUS) else None


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
    and the error raised; `folder` is untouched. A Ctrl-C or SIGTERM during the replace is delivered after it."""
    folder = folder.rstrip("/")
    if not replace and os.path.lexists(folder):
        raise FileExistsError(f"{folder!r} already exists")
    temporary = folder + TEMPORARY
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        yield temporary
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
    with interrupts_deferred():
        _replace(temporary, folder)
