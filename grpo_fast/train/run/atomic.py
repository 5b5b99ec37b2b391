"""One way to write a folder: whole or not at all.

    with atomic_folder("runs/x/checkpoint-20") as temporary:
        torch.save(state, os.path.join(temporary, "state.pt"))

Everything is written to `<folder>.tmp` first and renamed onto `<folder>` once the block ends without error, so a
crash, a Ctrl-C or a full disk leaves the previous folder (or none), never a half-written one. Checkpoints, the
exported model and the engine's copy of the policy are all written this way.
"""

from __future__ import annotations

import contextlib
import os
import shutil


@contextlib.contextmanager
def atomic_folder(folder: str, replace: bool = False):
    """Yields an empty temporary folder beside `folder`; on a clean exit it becomes `folder`. replace: an existing
    `folder` is removed once the new one is complete; otherwise an existing `folder` is a FileExistsError before
    anything is written. On any error (KeyboardInterrupt included) the temporary folder is removed and the error
    raised; `folder` is untouched."""
    folder = folder.rstrip("/")
    if not replace and os.path.lexists(folder):
        raise FileExistsError(f"{folder!r} already exists")
    temporary = folder + ".tmp"
    shutil.rmtree(temporary, ignore_errors=True)
    os.makedirs(temporary)
    try:
        yield temporary
        if replace and os.path.isdir(folder):
            shutil.rmtree(folder)
        os.replace(temporary, folder)
    except BaseException:
        shutil.rmtree(temporary, ignore_errors=True)
        raise
