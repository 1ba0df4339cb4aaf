"""SIGTERM while training (a scheduler preempting the job; torchrun passes it on to every process).

The first signal asks the run to stop after the current step, with a checkpoint. A second one stops it at once,
inside the step or validation (a CPU step can take minutes), and the run keeps the state of its last whole step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator


class Preempted(Exception):
    """A second SIGTERM interrupted a step or a validation: the model holds the state of the last whole step."""


class Preemption:
    """While entered, SIGTERM is counted instead of killing the process (where Python lets a handler be installed:
    the main thread). A second signal raises ``Preempted`` inside ``interruptible()`` blocks, or on entering one."""

    def __init__(self, announce: bool = True):
        self.signals = 0
        self._announce = announce  # whether this process says what the first signal does (the main process)
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
            os.write(2, b"SIGTERM: stopping after this step, with a checkpoint (a second SIGTERM stops at once)\n")
        if self.signals > 1 and self._interruptible:
            raise Preempted

    @contextlib.contextmanager
    def interruptible(self) -> Iterator[None]:
        """A block that a second SIGTERM may cut short: one that changes no state a checkpoint holds."""
        if self.signals > 1:
            raise Preempted
        self._interruptible = True
        try:
            yield
        finally:
            self._interruptible = False

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
