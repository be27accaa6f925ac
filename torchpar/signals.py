"""Preemption: SIGTERM (what SLURM and Kubernetes send before they kill a job), SIGINT and SIGHUP
(the terminal or ssh session that started the run went away) end the run cleanly instead of with a
traceback per rank, or with nothing saved.

A signal only sets a flag. The trainer sends the flag along with the step's loss in the one
all-reduce it makes anyway, so every rank learns of it at the same step boundary (whichever rank
the signal reached first), finishes that step, writes a final checkpoint and exits with
128 + the signal's number. A second signal ends the process at once, the default way — unless it
comes within RELAYED_S of the first: a Ctrl-C in an interactive srun (or to a terminal's whole
process group) reaches the launcher and every rank at once, and the launcher's agent passes its
copy on to the ranks milliseconds later; that copy is the same request, not a second one.
"""

from __future__ import annotations

import signal
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
RELAYED_S = 2.0  # a repeat sooner than this is the launcher relaying the same signal


class StopSignals:
    def __init__(self):
        self.received: int = 0  # the first stop signal's number, 0 = none
        self._at = 0.0  # when it came (time.monotonic())
        self._previous = {}

    def install(self) -> StopSignals:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.received:
            if signum == self.received and now - self._at < RELAYED_S:
                return  # the launcher's copy of the signal already taken
            self.restore()  # asked twice: stop now
            signal.raise_signal(signum)
        self.received, self._at = signum, now

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
