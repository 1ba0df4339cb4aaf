"""SIGTERM while training (a scheduler preempting the job; torchrun passes it on to every process).

A step's state changes only at its end (the optimizer step): until then, a step can be given up and the run keeps
its last whole step. One process gives it up at the first signal (a CPU step can take minutes), inside the forward
and backward or the validation, and saves that last whole step. Several processes must stop together (a save is
collective): they agree between micro-batches on the CPU, else after the step, and save; a second signal stops each
at once, inside the step, without a save (the others may be inside the step's collectives).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


class Preempted(Exception):
    """SIGTERM interrupted a step or a validation: the model holds the state of the last whole step. ``together``:
    every process gave the step up at the same point (so they can still save together)."""

    def __init__(self, together: bool = False):
        super().__init__("SIGTERM")
        self.together = together


class Preemption:
    """While entered, SIGTERM is counted instead of killing the process (where Python lets a handler be installed:
    the main thread). The signal that ``stop_after`` counts (default: the first; 2 for several processes, which stop
    after a step on the first) raises ``Preempted`` inside ``interruptible()`` blocks, or on entering one."""

    def __init__(self, announce: bool = True, stop_after: int = 1):
        self.signals = 0
        self._announce = announce  # whether this process says what the first signal does (the main process)
        self._stop_after = stop_after
        self._interruptible = False
        self._previous = None

    @property
    def requested(self) -> bool:
        return self.signals > 0

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signals += 1
        if self.signals == 1 and self._announce:  # os.write: a handler may run in the middle of a print
            os.write(2, b"SIGTERM: stopping at the next safe point, saving the last whole step\n"
                     if self._stop_after == 1 else
                     b"SIGTERM: stopping after this step, with a checkpoint (a second SIGTERM stops at once)\n")
        if self.signals >= self._stop_after and self._interruptible:
            raise Preempted

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block that SIGTERM may cut short: one that changes no state a checkpoint holds."""
        if self.signals >= self._stop_after:
            raise Preempted
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
