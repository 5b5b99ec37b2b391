"""Stops that lose nothing: a Ctrl-C or a SIGTERM lands between the trainer's steps, never inside one.

    with stops_as_interrupts():                  # the whole run: SIGTERM (timeout, docker stop) acts as Ctrl-C
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
import threading
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"stopped by {signal.Signals(signum).name}")


@contextmanager
def stops_as_interrupts():
    """Within the block a SIGTERM raises KeyboardInterrupt as a Ctrl-C does, so that the trainer saves its state
    and stops its rollout process; the previous handlers come back at the end."""
    if not _in_main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
