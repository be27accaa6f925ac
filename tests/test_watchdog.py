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
