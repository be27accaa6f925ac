"""The exit path, many times over, under CPU load: no process may abort at exit ("terminate called
without an active exception" is a C++ thread destroyed while still joinable) whatever it did last
— an asynchronous checkpoint save, an evaluation, a pipeline step, ZeRO-2's asynchronous
bucket collectives, or a trainer never closed. A
crash here fails the test; nothing is retried."""

import subprocess
import sys
import time

import pytest
from harness import NATIVE_ERROR, ROOT, TINY, spawn_ranks
from test_train import env

from torchpar.selftest import _log_tails

pytestmark = pytest.mark.slow  # trains in spawned processes

# What runs last before an exit (an async save, an evaluation), on two layers: the exit is what is
# tested, and each of the many processes starts sooner.
LAST_ACTS = ["--model.n_layers", "2", "--checkpoint.enable", "true", "--checkpoint.async_mode", "async",
             "--checkpoint.interval", "1", "--validation.enable", "true", "--validation.freq", "1",
             "--validation.steps", "1"]


def burn_cpu():
    """A busy process, so that the ranks' threads interleave as on a loaded machine."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def test_single_processes_exit_cleanly_under_load(tmp_path):
    burner = burn_cpu()
    try:
        done = []
        for pair in range(4):  # two at a time on two cores, beside the busy process
            cmds = [[sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--training.steps",
                     "2", *LAST_ACTS, "--job.dump_folder", str(tmp_path / f"run{pair}{i}")] for i in range(2)]
            procs = [subprocess.Popen(cmd, cwd=ROOT, env=env(tmp_path), stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for cmd in cmds]
            done += [(p, *p.communicate(timeout=300)) for p in procs]
    finally:
        burner.kill()
    for proc, out, err in done:
        assert proc.returncode == 0 and not NATIVE_ERROR.search(err), err[-3000:]


def _exit_worker(rank, world, out):
    from torchpar.config import load_config
    from torchpar.train import Trainer

    folder = f"{out}/run"
    tp2 = ["--parallelism.tensor_parallel_degree", "2", "--training.steps", "2", *LAST_ACTS]
    Trainer(load_config(TINY, tp2 + ["--job.dump_folder", folder])).train()
    # ZeRO-2's reductions and gathers are asynchronous: the last step's gathers are in flight
    # until the trainer closes.
    zero2 = ["--parallelism.zero_stage", "2", "--parallelism.bucket_mb", "1", "--training.steps", "2",
             *LAST_ACTS]
    Trainer(load_config(TINY, zero2 + ["--job.dump_folder", f"{folder}_zero2"])).train()
    # A trainer that is never closed: its watchdog thread is still running when the process group
    # goes and when the interpreter exits.
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--training.steps", "1"]
    Trainer(load_config(TINY, pp2 + ["--job.dump_folder", f"{folder}_open"]))


def test_ranks_exit_cleanly_under_load():
    burner = burn_cpu()
    try:
        for _ in range(3):
            t0 = time.time()
            spawn_ranks(_exit_worker, 4)  # raises with the ranks' logs if any rank dies
            assert time.time() - t0 < 200
    finally:
        burner.kill()


def _dereference_null():
    import ctypes

    ctypes.string_at(0)


def _crashing_worker(rank, world, out):
    _dereference_null()


def test_a_rank_killed_by_a_native_crash_fails_with_what_each_thread_ran():
    """A segmentation fault in a rank fails the call at once, with the native report and the
    Python stack of the thread that crashed (faulthandler's, after torch's own handler)."""
    with pytest.raises(RuntimeError) as failed:
        spawn_ranks(_crashing_worker, 1)
    report = str(failed.value)
    assert "SIGSEGV" in report and "Current thread" in report, report
    assert "in _dereference_null" in report and "in _crashing_worker" in report, report


def _side_thread_crash_worker(rank, world, out):
    import threading

    for step in range(60):  # a rank that logged a while: the report is no longer its last lines
        print(f"step {step}", flush=True)
    crash = threading.Thread(target=_dereference_null)
    crash.start()
    crash.join()


def test_the_native_stack_of_the_thread_that_crashed_comes_first_however_long_the_log():
    """torch's handler prints every thread's native frames; the one that took the signal (its frames
    through fatalSignalHandler) is shown whole and first, though the log's last lines are past it."""
    with pytest.raises(RuntimeError) as failed:
        spawn_ranks(_side_thread_crash_worker, 1)
    lines = str(failed.value).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("SIGSEGV(11), PID"))
    crashed = lines[header:header + 30]
    assert any("fatalSignalHandler" in line for line in crashed[1:4]), crashed
    assert any("_ctypes" in line for line in crashed), crashed


def test_a_damaged_heap_is_named_in_the_failed_ranks_lines(tmp_path):
    """glibc's own line before it aborts on a damaged heap ("malloc(): ...") is among the lines a
    failed rank's report shows, however far above its last lines it was printed."""
    lines = ["step     1  loss 8.8", "malloc(): unaligned tcache chunk detected",
             *[f"frame #{i}: somewhere" for i in range(60)], "Fatal Python error: Aborted"]
    (tmp_path / "rank1.log").write_text("\n".join(lines) + "\n")
    (tmp_path / "rank0.log").write_text("step     1  loss 8.8\n")
    assert "malloc(): unaligned tcache chunk detected" in _log_tails(str(tmp_path), 2, 1)
