"""Where a step goes: on logged steps only, the time of each phase (data loading, forward and
backward, gradient reduction and clipping, the optimizer step) and, if asked, the bytes each
mesh dimension communicates.

A phase's time is wall time between device synchronizations at its borders, so on a GPU it is
the phase's own work and not its launch; those synchronizations happen on logged steps only, and
every other step runs untouched. The bytes come from the communication ledger (a dispatch mode:
it slows the steps it counts, hence ``metrics.log_communication`` is off by default); the
planner's prediction of them is logged at step 1.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

PHASES = ("data", "forward_backward", "reduce_clip", "optimizer")


class StepBreakdown:
    def __init__(self, mesh, synchronize):
        self.mesh, self.synchronize = mesh, synchronize
        self.on = False
        self.times: dict[str, float] = defaultdict(float)
        self.sent: dict[str, float] | None = None

    @contextlib.contextmanager
    def step(self, timed: bool, count_bytes: bool):
        """Around one whole step: ``timed`` = time its phases; ``count_bytes`` = count its traffic."""
        self.on, self.times, self.sent = timed, defaultdict(float), None
        if not count_bytes:
            yield
            return
        from torchpar.tools.ledger import CommLedger

        with CommLedger(self.mesh) as ledger:
            yield
        self.sent = ledger.sent_bytes()

    @contextlib.contextmanager
    def phase(self, name: str):
        if not self.on:
            yield
            return
        self.synchronize()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.synchronize()
            self.times[name] += time.perf_counter() - t0

    def record(self) -> dict:
        """The last step's figures, as metrics."""
        out = {}
        if self.on:
            total = sum(self.times.values())
            out = {f"time_{name}_s": self.times[name] for name in PHASES}
            out["data_share"] = self.times["data"] / total if total else 0.0
        if self.sent is not None:
            out.update({f"comm_{dim}_bytes": sent for dim, sent in self.sent.items()})
            out["comm_bytes"] = sum(self.sent.values())
        return out
