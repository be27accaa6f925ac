"""Where a step goes: on logged steps only, the time of each phase (data loading, forward and
backward, gradient reduction and clipping, the optimizer step), under a pipeline the measured
bubble beside the predicted one, and, if asked, the bytes each mesh dimension communicates.

The measured bubble times every compute action of the schedule (forward, backward, weight
gradient) on every pipeline rank: a rank's bubble is the time it computed nothing over the step's
makespan (the first action on any rank to the last), as the planner's cost model defines it, and
``pp_bubble`` is the mean over the pipeline ranks. Ranks' clocks are the wall clock (one clock on
one machine; NTP's across nodes).

The borders of phases and actions are marked without stopping the step. On a GPU each border is a
CUDA event on the current stream, so a phase's time is the device's: from the stream reaching the
phase (its earlier work done) to the end of the phase's own work, time the device waited for the
host to queue it included, the host's launching ahead while the device was busy not. The events
are read once, after the step, and that one wait stands where the host waits for a logged step's
figures anyway; the overlap of host and device is kept. On the CPU the work is done when its code
returns, and the wall clock marks the borders. Every other step runs untouched.

The bytes come from the communication ledger (a dispatch mode: it slows the steps it counts, hence
``metrics.log_communication`` is off by default); the planner's prediction of them is logged at
step 1.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from torchpar import device as dev
from torchpar.parallel.ledger import CommLedger

PHASES = ("data", "forward_backward", "reduce_clip", "optimizer")


class HostClock:
    """The CPU's timer: a phase's work is done when its code returns, so the wall clock at its
    borders times it."""

    def mark(self) -> float:
        return time.time()

    def seconds(self, marks: list) -> list[float]:
        return list(marks)


class DeviceEvents:
    """A GPU's timer: the host runs ahead of the device, so each border is an event ``record()``
    puts on the current stream, and the events are read once, after the step (one wait). Their
    wall-clock times, which the bubble compares between ranks, count back from a last event,
    completed at ``clock()`` once waited for."""

    def __init__(self, record, clock=time.time):
        self.record, self.clock = record, clock

    def mark(self):
        return self.record()

    def seconds(self, marks: list) -> list[float]:
        if not marks:
            return []
        end = self.record()
        end.synchronize()
        now = self.clock()
        return [now - mark.elapsed_time(end) / 1e3 for mark in marks]  # (elapsed_time: ms)


def step_timer():
    """This machine's timer: CUDA events on GPUs, the host's clock on the CPU."""
    return DeviceEvents(dev.record_timing_event) if dev.device_type() == "cuda" else HostClock()


# A rank's own work must exceed the median's by this much, beside the factor, to be named: phases of
# a few milliseconds vary by more than any factor from one step to the next.
STRAGGLER_FLOOR_S = 0.05


class Stragglers:
    """Names a rank slower than the others at its own work. Every rank waits for the slowest in
    each collective, so their step times are alike; what differs is the time each spends in the
    phases no other rank takes part in — loading its data and its optimizer step — which a slow
    device, host or input pipeline lengthens on that rank alone. On each logged step the ranks
    all-gather those two times; a rank over ``factor`` times the median (and STRAGGLER_FLOOR_S
    more) on ``steps`` logged steps in a row is named once per streak."""

    def __init__(self, factor: float, steps: int, device, world: int):
        self.factor, self.steps, self.device, self.world = factor, steps, device, world
        self.slow_for = [0] * world

    def check(self, times: dict) -> list[tuple[int, float, float]]:
        """This logged step's (rank, its own work's seconds, the median's) of each rank named now."""
        mine = torch.tensor([times.get("data", 0.0) + times.get("optimizer", 0.0)], dtype=torch.float64,
                            device=self.device)
        ranks = mine.new_empty(self.world)
        dev.all_gather_single(ranks, mine)
        own = ranks.tolist()  # (one read of the device for every rank's time)
        median = sorted(own)[(len(own) - 1) // 2]  # (the lower one of an even count: of 2 ranks, the faster)
        named = []
        for rank, t in enumerate(own):
            slow = t > self.factor * median and t - median > STRAGGLER_FLOOR_S
            self.slow_for[rank] = self.slow_for[rank] + 1 if slow else 0
            if self.slow_for[rank] == self.steps:
                named.append((rank, t, median))
        return named


class StepBreakdown:
    def __init__(self, mesh, synchronize, pipeline=None, timer=None, experts_view=None, views=None):
        """``synchronize``: the device's, for the communication ledger, which waits for each
        collective; ``timer``: marks the phases' borders (default :func:`step_timer`);
        ``experts_view`` and ``views``: the layout's, naming the expert-parallel and flattened
        groups in the ledger."""
        self.mesh, self.synchronize, self.pipeline = mesh, synchronize, pipeline
        self.experts_view, self.views = experts_view, views
        self.timer = timer or step_timer()
        self.on = False
        self.times: dict[str, float] = defaultdict(float)
        self.sent: dict[str, float] | None = None
        self.comm_seconds: dict[str, float] = {}  # time inside collectives per mesh dim (counted steps)
        self.actions: list[tuple[str, float, float]] = []  # this rank's pipeline actions: (kind, start, end)
        self.spans: list[tuple[str, bool, object, object]] = []  # (name, is a phase, start mark, end mark)
        if pipeline is not None:
            pipeline.time_actions(self.action)
            self.predicted_bubble = pipeline.predicted_bubble()  # the schedule's, fixed for the run

    @contextlib.contextmanager
    def step(self, timed: bool, count_bytes: bool):
        """Around one whole step: ``timed`` = time its phases; ``count_bytes`` = count its traffic."""
        self.on, self.times, self.sent, self.actions, self.spans = timed, defaultdict(float), None, [], []
        if count_bytes:
            with CommLedger(self.mesh, self.synchronize, self.experts_view, self.views) as ledger:
                yield
            self.sent, self.comm_seconds = ledger.sent_bytes(), dict(ledger.seconds)
        else:
            yield
        self._read_spans()

    @contextlib.contextmanager
    def _span(self, name: str, phase: bool):
        """On timed steps, mark the block's start and end (read at the step's end)."""
        if not self.on:
            yield
            return
        start = self.timer.mark()
        try:
            yield
        finally:
            self.spans.append((name, phase, start, self.timer.mark()))

    def _read_spans(self) -> None:
        """The step's marks, read at once, as phase times and timed actions."""
        marks = self.timer.seconds([mark for *_, start, end in self.spans for mark in (start, end)])
        for (name, phase, _, _), t0, t1 in zip(self.spans, marks[0::2], marks[1::2]):
            if phase:
                self.times[name] += t1 - t0
            else:
                self.actions.append((name, t0, t1))
        self.spans = []

    def phase(self, name: str):
        """One phase of the step (see PHASES)."""
        return self._span(name, True)

    def action(self, kind: str):
        """One compute action of the pipeline schedule: F, B, I, W, or L (the loss)."""
        return self._span(kind, False)

    def _bubble(self) -> dict:
        """The measured bubble of this rank's pipeline (a collective over the pp ranks)."""
        durations = defaultdict(list)
        for kind, s, e in self.actions:
            durations[kind].append(e - s)
        mine = (min(s for _, s, _ in self.actions), max(e for _, _, e in self.actions),
                sum(e - s for _, s, e in self.actions), dict(durations))
        ranks = [None] * self.mesh["pp"].size()
        dist.all_gather_object(ranks, mine, group=self.mesh["pp"].get_group())
        makespan = max(r[1] for r in ranks) - min(r[0] for r in ranks)
        per_rank = [1 - r[2] / makespan for r in ranks]
        # Mean time per action kind over the pipeline: the cost model run with these instead of
        # F=1, B=2 separates a wrong cost ratio from waiting on sends (what neither model has).
        kinds = {k: [t for r in ranks for t in r[3].get(k, [])] for k in ("F", "B", "I", "W")}
        cost = {k: sum(v) / len(v) if v else 0.0 for k, v in kinds.items()}
        return {"pp_bubble": sum(per_rank) / len(per_rank), "pp_bubble_max": max(per_rank),
                "pp_bubble_predicted": self.predicted_bubble,
                "pp_bubble_measured_costs": self.pipeline.predicted_bubble(cost),
                **{f"pp_time_{k}_s": v for k, v in cost.items() if v}}

    def record(self) -> dict:
        """The last step's figures, as metrics."""
        out = {}
        if self.on:
            total = sum(self.times.values())
            out = {f"time_{name}_s": self.times[name] for name in PHASES}
            out["data_share"] = self.times["data"] / total if total else 0.0
            if self.pipeline is not None and self.actions:
                out.update(self._bubble())
        if self.sent is not None:
            out.update({f"comm_{dim}_bytes": sent for dim, sent in self.sent.items()})
            out["comm_bytes"] = sum(self.sent.values())
            out.update({f"comm_{dim}_s": seconds for dim, seconds in self.comm_seconds.items()})
        return out
