"""SIGTERM while training (a scheduler preempting the job; torchrun passes it on to every process): the run stops
after the current step, with a checkpoint."""

from __future__ import annotations

import signal
import threading


class Preemption:
    """While entered, SIGTERM is recorded instead of killing the process, so that the loop can save and stop after
    the current step (where Python lets a handler be installed: the main thread)."""

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = True

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
