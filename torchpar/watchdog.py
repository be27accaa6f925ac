"""No silent hangs: each rank's heartbeat in the process group's store, and a thread that watches it.

Every ``beat`` seconds each rank's watchdog thread writes ``<beats> <changes> <host>:<pid> <phase>``
under its own key: ``beats`` counts the thread's own beats (proof that the process is alive and
scheduled), ``phase`` is what the main thread is doing ("step 12", "the evaluation after step 100")
and ``changes`` counts its changes. Then it reads the next rank's record — one read per rank,
however large the job. It ends the job when

- the next rank's record has not changed for ``limit`` seconds (by this rank's clock, so no two
  clocks need agree): that rank is stopped, frozen or gone; or
- this rank's own phase has made no progress for its bound in a phase that should be short (a
  step, an evaluation): the job is stuck. A step's bound is the larger of ``limit`` and
  STEP_MARGIN x the last step's measured wall time (so a healthy 115 s step at scale is no hang
  under a 120 s limit), an evaluation's that many steps per held-out batch; each micro-batch of
  a step counts as progress. One look at every rank's record, twice a beat apart,
  names the ranks that stopped answering, else those in another phase than the rest (the ones
  the rest wait for), else says that all wait inside one collective.

Startup and checkpoint saves and loads may take long; they are left to the collective timeout.
The flight recorder's record of this rank's recent collectives (NCCL's own on GPUs) is written to
``<dump_folder>/flight_recorder/``; the first rank to decide prints one line (a counter in the
store picks it), and every rank that decides exits with EXIT_CODE, so that torchrun stops the
others and its restart policy can take over. A rank found stopped on the decider's own host is
killed first: torchrun would wait 30 s before it kills a process that cannot take its SIGTERM.
"""

from __future__ import annotations

import atexit
import os
import pickle
import signal
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import torch.distributed as dist

EXIT_CODE = 4
KEY = "torchpar/heartbeat/"
STEP_MARGIN = 3.0  # a short phase may take this many times the steps it stands for


class Watchdog:
    def __init__(self, store, rank: int, world: int, limit: float, dump_folder: str):
        self.store, self.rank, self.world, self.limit = store, rank, world, limit
        self.beat = min(5.0, limit / 4)
        self.dump_folder = Path(dump_folder)
        # (changes, what, short, bound in seconds): replaced whole, never mutated
        self.phase_state = (0, "startup", False, limit)
        self.step_s = 0.0  # the last step's wall time (the first step's until a later one is measured)
        self._step = None  # (when the current step began, whether it is a warm-up step)
        self._measured = False
        self.beats = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="torchpar-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._publish()
        self._thread.start()
        atexit.register(self.stop)  # runs before the process group's own exit handler
        return self

    def phase(self, what: str, short: bool = True, steps: float = 1.0, step: bool = False) -> None:
        """The main thread's progress: ``short`` phases are expected to end within their bound,
        ``steps`` training steps' worth (see the module's note); ``step``: a training step begins
        (a short one is measured, a long one (warm-up) only until a short one has been)."""
        now = time.monotonic()
        if self._step is not None:  # the step before ends here
            began, warm_up = self._step
            if not (warm_up and self._measured):
                self.step_s, self._measured = now - began, self._measured or not warm_up
        self._step = (now, not short) if step else None
        bound = max(self.limit, STEP_MARGIN * steps * self.step_s)
        self.phase_state = (self.phase_state[0] + 1, what, short, bound)

    def progress(self) -> None:
        """Progress inside the current phase (a micro-batch done): its bound starts again."""
        changes, what, short, bound = self.phase_state
        self.phase_state = (changes + 1, what, short, bound)

    def stop(self) -> None:
        """Before the process group goes: the thread must not outlive the store it reads."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    # -- the thread

    def _publish(self) -> None:
        changes, what, _, _ = self.phase_state
        self.store.set(f"{KEY}{self.rank}", f"{self.beats} {changes} {HOST}:{os.getpid()} {what}")

    def _read(self, rank: int) -> str | None:
        key = f"{KEY}{rank}"
        return self.store.get(key).decode() if self.store.check([key]) else None

    def _run(self) -> None:
        neighbour = (self.rank + 1) % self.world
        seen, seen_at = None, time.monotonic()
        mine, mine_at = self.phase_state[:2], time.monotonic()
        while not self._stop.wait(self.beat):
            try:
                self.beats += 1
                self._publish()
                now = time.monotonic()
                record = self._read(neighbour)
                if record != seen:
                    seen, seen_at = record, now
                elif now - seen_at > self.limit:
                    last = f"; its last heartbeat was in {_phase(record)}" if record else ""
                    self._end(f"rank {neighbour} stopped answering: its heartbeat has not changed for "
                              f"{now - seen_at:.0f} s{last}", stopped={neighbour: record})
                changes, what, short, bound = self.phase_state
                if (changes, what) != mine:
                    mine, mine_at = (changes, what), now
                elif short and now - mine_at > bound and not self._stop.is_set():
                    verdict, stopped = self._survey()
                    measured = "" if bound <= self.limit else (
                        f", beyond {STEP_MARGIN:g} x the {bound / STEP_MARGIN:.0f} s that measured steps "
                        "give it")
                    self._end(f"no progress for {now - mine_at:.0f} s in {what}{measured}: {verdict}",
                              stopped=stopped)
            except Exception as e:  # the store itself is gone (its host died): nothing to coordinate with
                if self._stop.is_set() or not dist.is_initialized():  # or this process is ending
                    return
                self._end(f"the job's store stopped answering ({type(e).__name__}: {e})", elect=False)

    def _survey(self) -> tuple[str, dict]:
        """Who the job waits for, from every rank's record read twice, a beat apart; and the ranks
        that stopped answering, with their last records."""
        first = [self._read(r) for r in range(self.world)]
        time.sleep(2 * self.beat)
        second = [self._read(r) for r in range(self.world)]
        silent = [r for r in range(self.world) if first[r] == second[r] and r != self.rank]
        if silent:
            # (worded as the neighbour's check words it: whichever notices first, the line is the same)
            last = _phase(second[silent[0]])
            return f"{_ranks(silent)} stopped answering; its last heartbeat was in {last}", {
                r: second[r] for r in silent}
        phases = {r: _phase(second[r]) for r in range(self.world)}
        common, _ = Counter(phases.values()).most_common(1)[0]
        odd = [r for r, p in phases.items() if p != common]
        if odd:
            return f"the job waits for {_ranks(odd)} (in {phases[odd[0]]}); the others are in {common}", {}
        return "every rank is there: a deadlock inside a collective, or a stalled link", {}

    def _end(self, why: str, elect: bool = True, stopped: dict | None = None) -> None:
        dump = self._dump_flight_recorder()
        if not elect or self.store.add("torchpar/watchdog/reported", 1) == 1:
            print(f"torchpar: error: rank {self.rank}'s watchdog (comm.watchdog_s = {self.limit:g}): {why}; "
                  f"ending the job{dump}", file=sys.stderr, flush=True)
        for rank, record in (stopped or {}).items():
            _kill_if_here(rank, record)
        os._exit(EXIT_CODE)  # the main thread is blocked in a collective: nothing else would end it

    def _dump_flight_recorder(self) -> str:
        """This rank's recent collectives (torch's flight recorder), for `torchfrtrace`."""
        try:
            import torch._C._distributed_c10d as c10d

            # NCCL keeps its own recorder (with CUDA event times); gloo's is the CPU one.
            dump = getattr(c10d, "_dump_nccl_trace", None) if dist.get_backend() == "nccl" else None
            trace = (dump or c10d._dump_fr_trace)(True, True, False)
            folder = self.dump_folder / "flight_recorder"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{self.rank}.pkl").write_bytes(trace)
            active = [e for e in pickle.loads(trace).get("entries", []) if not e.get("retired", True)]
            waiting = f", waiting in {active[-1]['profiling_name']}" if active else ""
            return f" (collectives recorded in {folder}{waiting})"
        except Exception as e:  # the diagnosis must not hide the verdict
            return f" (no flight recorder dump: {e})"


HOST = socket.gethostname()


def _phase(record: str | None) -> str:
    return record.split(" ", 3)[3] if record else "startup"


def _kill_if_here(rank: int, record: str | None) -> None:
    """SIGKILL a stopped rank's process if it runs on this host (and is that rank of this job)."""
    if not record:
        return
    host, pid = record.split(" ", 3)[2].rsplit(":", 1)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "").encode()
        if host == HOST and f"RANK={rank}".encode() in environ and (
                not run_id or b"TORCHELASTIC_RUN_ID=" + run_id in environ):
            os.kill(int(pid), signal.SIGKILL)
    except (OSError, ValueError):
        pass  # gone already, or not ours to kill


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}"
