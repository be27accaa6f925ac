"""Preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job), SIGINT and SIGHUP
(the terminal or ssh session that started the run went away) end the run cleanly instead of with a
traceback per rank, or with nothing saved.

A signal only sets a flag. The trainer sends the flag along with the step's loss in the one
all-reduce it makes anyway, so every rank learns of it at the same step boundary (whichever rank
the signal reached first), finishes that step, writes a final checkpoint and exits with
128 + the signal's number. A second signal ends the process at once, the default way.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    def __init__(self):
        self.received: int = 0  # the first stop signal's number, 0 = none
        self._previous = {}

    def install(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.received:  # asked twice: stop now
            self.restore()
            signal.raise_signal(signum)
        self.received = signum

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
