"""A scheduler's preemption notice (SIGTERM) as a request to save and stop after the current step."""

from __future__ import annotations

import signal
import threading

import jax


class Preemption:
    """SIGTERM, a scheduler's preemption notice, as a request to save and stop after the current step.

    In one process a signal handler sets a flag. With several processes jax's
    preemption sync point decides, so that every process stops after the same step.
    """

    def __init__(self):
        self.noticed = False
        self._previous = None

    def __enter__(self) -> "Preemption":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._notice)
        return self

    def __exit__(self, *exc) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _notice(self, signum, frame) -> None:
        self.noticed = True

    def reached(self, step: int) -> bool:
        """True once a preemption notice came (and, across processes, all agree to stop after `step`)."""
        if jax.process_count() > 1:
            import orbax.checkpoint as ocp  # here: Orbax is a quarter second of a one-process run's start-up

            return ocp.multihost.reached_preemption(step)
        return self.noticed
