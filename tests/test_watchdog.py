"""No silent hangs: a stopped rank ends the job within the watchdog's time, named, with the
flight recorder's dump; the survey names whom a stuck job waits for."""

import re
import time

import pytest
import torch.distributed as dist

from torchpar.watchdog import KEY, Watchdog


class Records:
    """Watchdog records written straight into a store, as ranks would."""

    def __init__(self, world):
        self.store, self.world = dist.HashStore(), world

    def write(self, rank, beats, phase, changes=1):
        self.store.set(f"{KEY}{rank}", f"{beats} {changes} host:{10_000 + rank} {phase}")

    def watchdog(self):
        return Watchdog(self.store, 0, self.world, limit=2.0, dump_folder="/nonexistent")


@pytest.fixture
def beating(monkeypatch):
    """Between the survey's two reads every rank in ``alive`` beats once more."""
    def make(records, phases, alive):
        for r, phase in phases.items():
            records.write(r, 1, phase)

        def sleep(_):
            for r in alive:
                records.write(r, 2, phases[r])

        monkeypatch.setattr("torchpar.watchdog.time.sleep", sleep)
        return records.watchdog()
    return make


def test_survey_names_the_rank_that_stopped_answering(beating):
    records = Records(4)
    wd = beating(records, {r: "step 7" for r in range(4)}, alive=[0, 1, 3])
    verdict, stopped = wd._survey()
    assert verdict == "rank 2 stopped answering; its last heartbeat was in step 7"
    assert list(stopped) == [2]


def test_survey_names_the_ranks_the_others_wait_for(beating):
    records = Records(4)
    phases = {0: "step 7", 1: "step 7", 2: "the evaluation after step 6", 3: "step 7"}
    wd = beating(records, phases, alive=range(4))
    assert wd._survey() == ("the job waits for rank 2 (in the evaluation after step 6); the others are in "
                            "step 7", {})


def test_survey_when_every_rank_waits_in_the_same_place(beating):
    records = Records(2)
    wd = beating(records, {0: "step 3", 1: "step 3"}, alive=range(2))
    verdict, stopped = wd._survey()
    assert "every rank is there: a deadlock inside a collective" in verdict and stopped == {}


def run_watchdog(monkeypatch, short: bool, seconds: float) -> list[str]:
    """Rank 0's watchdog thread for ``seconds`` in one phase, its neighbour beating all along;
    returns the verdicts it reached (instead of ending the process)."""
    records = Records(2)
    verdicts = []

    def end(self, why, elect=True, stopped=None):
        verdicts.append(why)
        self._stop.set()

    monkeypatch.setattr(Watchdog, "_end", end)
    wd = records.watchdog().start()
    wd.phase("step 5", short=short)
    deadline = time.time() + seconds
    beats = 0
    while time.time() < deadline and not verdicts:
        beats += 1
        records.write(1, beats, "step 5")
        time.sleep(0.1)
    wd.stop()
    return verdicts


def test_a_step_without_progress_is_a_hang_a_long_phase_is_not(monkeypatch):
    (verdict,) = run_watchdog(monkeypatch, short=True, seconds=10)
    # (2 s is the limit; a loaded machine reaches the verdict a little later, so the figure may be more)
    assert re.match(r"no progress for \d+ s in step 5", verdict), verdict
    assert "every rank is there" in verdict
    assert run_watchdog(monkeypatch, short=False, seconds=4) == []


class Clock:
    """A watchdog thread's time, run in this thread: each wait of a beat moves the clock on by
    it, lets ``each`` act (the neighbour beats, the main thread moves), and ends after ``seconds``."""

    def __init__(self, monkeypatch):
        self.now = 1000.0
        monkeypatch.setattr("torchpar.watchdog.time.monotonic", lambda: self.now)
        monkeypatch.setattr("torchpar.watchdog.time.sleep", lambda s: None)

    def run(self, wd, records, seconds, each=lambda: None) -> list[str]:
        verdicts, end = [], self.now + seconds

        class Stop:
            def wait(_, beat):
                self.now += beat
                records.write(1, int(self.now * 10), "step 5")
                each()
                return self.now > end or bool(verdicts)

            def is_set(_):
                return bool(verdicts)

        wd._stop = Stop()
        wd._end = lambda why, elect=True, stopped=None: verdicts.append(why)
        wd._run()
        return verdicts


def test_a_step_may_take_three_times_the_last_measured_one(monkeypatch):
    """Under a 2 s limit: a warm-up step of 50 s and short steps of 10 s measured, the next step
    is a hang only past 30 s (3 x 10), an evaluation of 4 batches past 120 s; a step that ends
    in time is no hang; the verdict says it went beyond its measured steps."""
    clock, records = Clock(monkeypatch), Records(2)
    wd = records.watchdog()
    wd.phase("step 1", short=False, step=True)
    clock.now += 50
    wd.phase("step 2", step=True)
    assert wd.step_s == 50 and wd.phase_state[3] == 150  # (the warm-up's, until a step is measured)
    clock.now += 10
    wd.phase("step 3", step=True)
    clock.now += 12
    wd.phase("the evaluation after step 3", steps=4)
    assert wd.step_s == 12 and wd.phase_state[3] == 3 * 4 * 12
    wd.phase("step 4", step=True)
    assert wd.step_s == 12 and wd.phase_state[3] == 36
    assert clock.run(wd, records, 34) == []  # (each run of the thread starts the phase's time again)
    (verdict,) = clock.run(wd, records, 45)
    assert re.match(r"no progress for 3\d s in step 4, beyond 3 x the 12 s that measured steps give it",
                    verdict), verdict


def test_each_micro_batch_is_progress(monkeypatch):
    """A step of many micro-batches, each within the bound, is no hang however long it runs;
    without them it is, after its bound (2 s: nothing measured yet)."""
    clock, records = Clock(monkeypatch), Records(2)
    wd = records.watchdog()
    wd.phase("step 5", step=True)
    assert clock.run(wd, records, 20, each=wd.progress) == []
    (verdict,) = clock.run(wd, records, 20)
    assert verdict.startswith("no progress for ") and "beyond" not in verdict
