"""No silent hangs: a stopped rank ends the job within the watchdog's time, named, with the
flight recorder's dump; the survey names whom a stuck job waits for."""

import os
import pickle
import signal
import subprocess
import time

import pytest
import torch.distributed as dist
from harness import ROOT
from test_checkpoint_files import _rank_pids
from test_train import env

from torchpar.watchdog import KEY, Watchdog


@pytest.mark.slow
def test_a_stopped_rank_ends_the_job_with_its_name(tmp_path):
    folder = tmp_path / "run"
    cmd = ["./run_train.sh", "--training.steps", "100000", "--training.seq_len", "32", "--metrics.log_freq",
           "1", "--validation.enable", "false", "--comm.watchdog_s", "6", "--job.dump_folder", str(folder)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path, NGPU="2", LOG_RANK="0,1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stopped_at = started = None
    try:
        deadline = time.time() + 300
        while proc.poll() is None and time.time() < deadline:
            metrics = folder / "metrics.jsonl"
            started = started or (metrics.exists() and time.time())
            # Training for a few heartbeats (1.5 s apart), so that rank 1 has reported a step.
            if stopped_at is None and started and time.time() - started > 4:
                (pid,) = _rank_pids(1, folder)
                os.kill(pid, signal.SIGSTOP)
                stopped_at = time.time()
            time.sleep(0.05)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in _rank_pids(1, folder):  # never leave a stopped process behind
            os.kill(pid, signal.SIGKILL)
    assert stopped_at is not None, "the run ended before a rank could be stopped"
    ended_after = time.time() - stopped_at
    assert proc.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("torchpar: error:")]
    assert len(lines) == 1, err[-3000:]
    assert "rank 1 stopped answering" in lines[0] and "its last heartbeat was in step " in lines[0], lines[0]
    assert "comm.watchdog_s = 6" in lines[0] and "flight_recorder" in lines[0]
    # 6 s without a heartbeat, a beat's delay, and the launcher's teardown; torchrun alone would
    # wait 30 s more for the stopped process.
    assert ended_after < 20, ended_after
    trace = pickle.loads((folder / "flight_recorder" / "rank0.pkl").read_bytes())
    assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"])


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
    assert verdict == "rank 2 stopped answering (last heartbeat in step 7)"
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
    assert verdict.startswith("no progress for 2 s in step 5") or verdict.startswith("no progress for 3 s")
    assert "every rank is there" in verdict
    assert run_watchdog(monkeypatch, short=False, seconds=4) == []
