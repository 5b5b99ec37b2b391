"""Stops that lose nothing: a Ctrl-C or a SIGTERM lands between the trainer's steps, never inside one.

    with stops_as_interrupts():                  # the whole run: SIGTERM (timeout, docker stop) acts as Ctrl-C,
                                                 # once: a second stop cannot cut the save the first one starts
        ...
        with interrupts_deferred():              # a step's update, weight push and records: whole or not at all
            ...

A step changes the weights, the optimizer, the schedule and the rollout engine's copy of the weights before the
loop records it. A KeyboardInterrupt raised in between would make the loop save the new weights under the
previous step's number, and a resume would then apply the step twice; inside `interrupts_deferred` the signal is
held and raised when the block ends, where the step is complete. Both do nothing outside the main thread, where
Python cannot set signal handlers (a run started from a worker thread keeps the default behaviour).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager

from grpo_fast.train.run.errors import error_chain

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class StopOnce:
    """The handler of SIGINT and SIGTERM while a run may stop: the first raises KeyboardInterrupt (the loop then
    saves the last complete step and closes its processes); later ones are dropped with a line on stderr, so that
    a second Ctrl-C, or a burst of them, cannot cut that save, the cleanup, or the interpreter's exit."""

    def __init__(self):
        self.fired = False

    def __call__(self, signum, frame):
        if not self.fired:
            self.fired = True
            raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")
        print(f"grpo-fast: {signal.Signals(signum).name} again: already stopping, saving the last complete step "
              "first (SIGKILL is safe too: a checkpoint is written whole or not at all)", file=sys.stderr)


def stop_once_for_good() -> None:
    """Installs `StopOnce` for SIGINT and SIGTERM for the rest of the process: what a command line that runs one
    job calls first (`grpo-fast train`), so that no later signal interrupts its exit; `stops_as_interrupts` inside
    it then changes nothing."""
    if _in_main_thread():
        handler = StopOnce()
        for signum in STOP_SIGNALS:
            signal.signal(signum, handler)


def ignore_stops() -> None:
    """SIGINT and SIGTERM ignored for the rest of the process: a command line that has saved and is about to say
    where calls it, so that its last line is that one and nothing cuts the interpreter's exit."""
    if _in_main_thread():
        for signum in STOP_SIGNALS:
            signal.signal(signum, signal.SIG_IGN)


def interrupt_behind(error: BaseException):
    """The KeyboardInterrupt `error` is, or was raised while handling (torch's zip writer turns one raised inside
    its write into RuntimeError "unexpected pos" as it closes the file), or None."""
    return next((seen for seen in error_chain(error) if isinstance(seen, KeyboardInterrupt)), None)


@contextmanager
def stops_as_interrupts():
    """Within the block the first SIGINT or SIGTERM raises KeyboardInterrupt (a SIGTERM as a Ctrl-C does), so
    that the trainer saves its state and stops its rollout process; later ones are dropped (`StopOnce`). The
    previous handlers come back at the end; under `stop_once_for_good` the block changes nothing."""
    if not _in_main_thread() or isinstance(signal.getsignal(signal.SIGINT), StopOnce):
        yield
        return
    handler = StopOnce()
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def interrupts_deferred():
    """Holds SIGINT and SIGTERM while the block runs, then delivers the first one received to the handler that
    was in place before (a KeyboardInterrupt, as a rule), once the block has finished. An exception raised
    inside the block propagates as usual and drops a held signal (the run is stopping anyway)."""
    if not _in_main_thread():
        yield
        return
    received = []
    previous = {signum: signal.signal(signum, lambda number, frame: received.append(number))
                for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if received:
        signal.raise_signal(received[0])
