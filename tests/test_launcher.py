"""The launcher speaks in one line: a job that stops after launch (a divergence, a stop signal, the
watchdog, a check that only the ranks make) ends with the first failing rank's own line and its
exit code, torchrun's report in the dump folder's logs; start-up waits say whom they wait for and
end at comm.timeout_s; launch variables that do not add up are one line before anything waits.

Real ``./run_train.sh`` runs of the tiny job on 2 CPU ranks; each asserts the exit code, that the
last line on stderr that is not a warning is the expected one, that no torchrun report or
traceback reached the console, and a time bound."""

from __future__ import annotations

import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from harness import ROOT, TINY, free_port
from test_bad_inputs import error_line
from test_checkpoint_files import _rank_pids, folder_digest
from test_train import env

from torchpar.commands.launch import Ended, first_failure, on_console

# A start-up wait that ends soon: the waits end at comm.timeout_s (the watchdog must be below it).
SHORT = ["--comm.timeout_s", "6", "--comm.watchdog_s", "0"]
LONG = ["--training.steps", "100000", "--metrics.log_freq", "1", "--validation.enable", "false"]


class Run:
    """``./run_train.sh`` (or any command) in the background, its stderr lines timed as they come."""

    def __init__(self, tmp_path, cmd, **extra):
        self.started = time.time()
        environment = env(tmp_path, **{"CONFIG_FILE": str(TINY), "NGPU": "2", **extra})
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[tuple[float, str]] = []
        self.out: list[str] = []
        self.readers = [threading.Thread(target=self._read, args=args, daemon=True)
                        for args in ((self.proc.stderr, True), (self.proc.stdout, False))]
        for reader in self.readers:
            reader.start()

    def _read(self, stream, timed: bool) -> None:
        for line in stream:
            if timed:
                self.lines.append((time.time() - self.started, line.rstrip("\n")))
            else:
                self.out.append(line)

    def wait(self, timeout: float = 240) -> int:
        try:
            self.proc.wait(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        for reader in self.readers:
            reader.join(timeout=10)
        self.elapsed = time.time() - self.started
        return self.proc.returncode

    @property
    def stderr(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, text: str) -> float:
        """Seconds from the start to the first stderr line containing ``text``."""
        return next(t for t, line in self.lines if text in line)


def train_sh(tmp_path, *overrides, **extra) -> Run:
    return Run(tmp_path, ["./run_train.sh", "--job.dump_folder", str(tmp_path / "run"), *overrides], **extra)


def assert_one_line(run: Run, code: int, start: str, *fragments: str, traceback_ok: bool = False) -> str:
    err = run.stderr
    assert run.proc.returncode == code, f"exit {run.proc.returncode}:\n{err[-4000:]}"
    line = error_line(err)
    assert line.startswith(start), err[-4000:]
    for fragment in fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    assert err.count(line) == 1, err[-4000:]  # said once, though several ranks know it
    for noise in ("ChildFailedError", "Traceback", "torch.distributed.elastic", "Root Cause"):
        assert noise not in err or (noise == "Traceback" and traceback_ok), err[-4000:]
    return line


def report(tmp_path) -> str:
    return (tmp_path / "run" / "logs" / "torchrun_node0.log").read_text()


def wait_for_steps(run: Run, folder: Path, steps: int, limit: float = 180) -> None:
    deadline = time.time() + limit
    metrics = folder / "metrics.jsonl"
    while run.proc.poll() is None and time.time() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {steps} steps logged:\n{run.stderr[-3000:]}")


# --- after launch: the first failing rank's line and code


@pytest.mark.slow
@pytest.mark.parametrize("report_disk", ["free", "full"])
def test_a_divergence_stop_is_its_line_and_code_3(tmp_path, report_disk):
    """torchrun's failure goes to the launcher's report, and the console has the rank's line alone;
    where the report cannot be written (a full disk: here the file is /dev/full), the same line
    and code, not the launcher's own traceback."""
    if report_disk == "full":
        (tmp_path / "run" / "logs").mkdir(parents=True)
        (tmp_path / "run" / "logs" / "torchrun_node0.log").symlink_to("/dev/full")
    run = train_sh(tmp_path, "--optimizer.lr", "1e30")
    assert run.wait() == 3
    assert_one_line(run, 3, "torchpar: error: step ", "non-finite loss", "last good checkpoint: none")
    # Rank 0's first line says where the start-up went: its parts add up to the whole, which the
    # launch's wall clock contains.
    ready = next(line for line in "".join(run.out).splitlines() if line.startswith("torchpar: ready "))
    total = float(ready.split()[2])
    parts = [float(x) for x in re.findall(r" (\d+\.\d) s", ready.split(": ", 2)[2])]
    assert "after the launch: the launcher's imports and check" in ready, ready
    assert abs(sum(parts) - total) <= 0.05 * (len(parts) + 1) and total <= run.elapsed, ready
    if report_disk == "free":
        assert "ChildFailedError" in report(tmp_path) and "Root Cause" in report(tmp_path)
    assert run.elapsed < 120, run.elapsed


# Rank 1 of the job sees one GPU (torch.cuda patched at its interpreter's start): the ranks' own
# check of their device, which no check before the launch can make, refuses LOCAL_RANK 1.
ONE_GPU_FOR_RANK_1 = """import os
if os.environ.get("LOCAL_RANK") == "1" and "TORCHELASTIC_RUN_ID" in os.environ:
    import torch
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
"""


@pytest.mark.slow
@pytest.mark.parametrize("log_rank", ["0", "0,1"])
def test_a_check_only_a_rank_makes_is_its_line(tmp_path, log_rank):
    """A ConfigError that rank 1 alone raises (rank 0 goes on to wait for it in the process group
    until torchrun stops it): its line, once, whether the console shows rank 1 or not, and 2."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(ONE_GPU_FOR_RANK_1)
    run = train_sh(tmp_path, LOG_RANK=log_rank, PYTHONPATH=str(tmp_path / "site"))
    assert run.wait() == 2
    assert_one_line(run, 2, "torchpar: error: rank 1: LOCAL_RANK 1 but this node has 1 visible GPU(s)",
                    "NGPU")
    assert run.elapsed < 120, run.elapsed


# SIGINT as a terminal's foreground job has it (Python's KeyboardInterrupt), whatever the test
# runner's shell left: one started in the background ignores SIGINT, and its children inherit that.
DEFAULT_SIGINT = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execvp(sys.argv[1], sys.argv[1:])")


@pytest.mark.slow
@pytest.mark.parametrize("sig, to", [(signal.SIGTERM, "rank 1"), (signal.SIGINT, "every process")],
                         ids=["SIGTERM-rank1", "SIGINT-all"])
def test_a_stop_signal_saves_and_keeps_its_code(tmp_path, sig, to):
    """SIGTERM to one rank (SIGTERM to the launcher, which torchrun passes on to every rank, is
    test_checkpoint_files' resume test), and SIGINT to the launcher and every rank at once (an
    interactive srun's Ctrl-C; the ranks get it twice, the launcher's agent passes it on too): a
    save after the same step on every rank, rank 0's line, 128 + the signal, no traceback."""
    folder = tmp_path / "run"
    command = ["./run_train.sh", "--job.dump_folder", str(folder), *LONG, "--checkpoint.enable", "true",
               "--checkpoint.interval", "100000"]
    run = Run(tmp_path, [sys.executable, "-c", DEFAULT_SIGINT, *command])
    wait_for_steps(run, folder, 3)
    pids = _rank_pids(1, folder) if to == "rank 1" else [run.proc.pid, *_rank_pids(0, folder),
                                                          *_rank_pids(1, folder)]
    for pid in pids:
        os.kill(pid, sig)
    assert run.wait() == 128 + sig
    line = assert_one_line(run, 128 + sig, f"torchpar: stopped by {sig.name} after step ", "saved checkpoint")
    (saved,) = (folder / "checkpoint").glob("step-*")
    assert saved.name in line


def test_the_relayed_copy_of_a_stop_signal_is_not_a_second_one(monkeypatch):
    """A rank's stop flag: the same signal again within RELAYED_S (the launcher's agent relaying
    the Ctrl-C every process got) is ignored; later, it ends the process at once
    (here: the handler it replaced runs)."""
    from torchpar import signals

    clock, ended = [100.0], []
    monkeypatch.setattr(signals.time, "monotonic", lambda: clock[0])
    previous = signal.signal(signal.SIGHUP, lambda signum, frame: ended.append(signum))
    try:
        for later in (0.01, signals.RELAYED_S):
            flags = signals.StopSignals().install()  # (the handlers it replaces: restored below)
            signal.raise_signal(signal.SIGHUP)
            clock[0] += later
            signal.raise_signal(signal.SIGHUP)
            assert flags.received == signal.SIGHUP
            assert ended == ([] if later < signals.RELAYED_S else [signal.SIGHUP]), later
            flags.restore()
    finally:
        signal.signal(signal.SIGHUP, previous)


@pytest.mark.slow
def test_the_watchdog_stop_is_its_line_and_code_4(tmp_path):
    """A rank that stops answering (SIGSTOP) is named by the watchdog of the rank that noticed,
    with the step of its last heartbeat, soon after comm.watchdog_s, and the flight recorder's
    trace of the collectives is written."""
    folder = tmp_path / "run"
    run = train_sh(tmp_path, *LONG, "--comm.watchdog_s", "4")
    stopped = []
    try:
        wait_for_steps(run, folder, 3)
        time.sleep(3)  # a few heartbeats, so that rank 1 has reported a step
        for pid in _rank_pids(1, folder):
            os.kill(pid, signal.SIGSTOP)
            stopped.append(pid)
        stopped_at = time.time()
        assert run.wait() == 4
        ended_after = time.time() - stopped_at
    finally:
        for pid in stopped:  # never leave a stopped process behind
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    line = assert_one_line(run, 4, "torchpar: error: rank ", "watchdog (comm.watchdog_s = 4)",
                           "rank 1 stopped answering", "its last heartbeat was in step ", "flight_recorder")
    # 4 s without a heartbeat, a beat's delay, and the launcher's teardown; torchrun alone would
    # wait 30 s more for the stopped process.
    assert ended_after < 20, (ended_after, line)
    trace = pickle.loads((folder / "flight_recorder" / "rank0.pkl").read_bytes())
    assert any(e["profiling_name"].startswith("gloo:") for e in trace["entries"])


@pytest.mark.slow
def test_a_rank_that_dies_without_a_word_is_named(tmp_path):
    """SIGKILL leaves no line of the rank's own: the launcher names the rank, how it ended and
    where its output is. (Rank 0's collective may fail with the peer gone and print its traceback
    before torchrun stops it; the launcher's line still comes last.)"""
    folder = tmp_path / "run"
    run = train_sh(tmp_path, *LONG)
    wait_for_steps(run, folder, 2)
    for pid in _rank_pids(1, folder):
        os.kill(pid, signal.SIGKILL)
    assert run.wait() == 128 + signal.SIGKILL
    assert_one_line(run, 137, "run_train.sh: error: rank 1 was killed by SIGKILL without a message",
                    f"{folder}/logs/rank_1.log", f"{folder}/logs/torchrun_node0.log", traceback_ok=True)


def test_which_rank_speaks_and_with_which_code():
    said = {"torchpar": {"line": "torchpar: error: x", "time": 2.0, "shown": True}}
    later = {"torchpar": {"line": "torchpar: error: y", "time": 3.0, "shown": False}}
    raised = {"message": {"message": "RuntimeError: Connection closed by peer"}, "torchpar": {"time": 1.0}}
    # rank 1 exited by itself with code 3 first; rank 0 had printed the line when torchrun stopped it
    assert pick([Ended(0, 0, -15, said), Ended(1, 1, 3, {})]) == (0, 3)
    assert pick([Ended(0, 0, 4, later), Ended(1, 1, 4, said)]) == (1, 4)  # the earlier line
    # a peer's collective fails after a rank is killed: the killed one is the cause
    assert pick([Ended(0, 0, 1, raised), Ended(1, 1, -9, {})]) == (1, 137)
    assert pick([Ended(0, 0, -15, {}), Ended(1, 1, 1, raised)]) == (1, 1)
    assert pick([Ended(0, 0, -15, {}), Ended(1, 1, 2, {})]) == (1, 2)
    assert pick([Ended(0, 0, None, said)]) == (0, 1)  # (a line but no code: stopped before it could exit)


def test_a_line_the_console_showed_is_not_said_again():
    shown = {"torchpar": {"line": "torchpar: error: x", "time": 2.0, "shown": True}}
    unshown = {"torchpar": {"line": "torchpar: error: x", "time": 1.0, "shown": False}}
    ended = [Ended(0, 0, 2, shown), Ended(1, 1, 2, unshown)]
    assert first_failure(ended)[0].rank == 1  # recorded first, by a rank that did not print it
    assert on_console("torchpar: error: x", ended, {0})  # rank 0 printed the same line
    assert not on_console("torchpar: error: x", ended, {1})  # (the console shows rank 1 alone)
    assert not on_console("torchpar: error: y", ended, {0, 1})


def pick(ended: list[Ended]) -> tuple[int, int]:
    first, code = first_failure(ended)
    return first.rank, code


# --- start-up waits: who is waited for, and an end at comm.timeout_s


def srun_task(tmp_path, task: int, port: int) -> Run:
    """One task of a 2-task srun step that starts python -m torchpar train itself (no torchrun)."""
    cmd = [sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--job.dump_folder",
           str(tmp_path / "run"), *SHORT]
    return Run(tmp_path, cmd, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_NUM_NODES="1",
               SLURM_STEP_NODELIST="localhost", SLURM_PROCID=str(task), SLURM_LOCALID=str(task),
               MASTER_PORT=str(port))


@pytest.fixture(scope="module")
def waits(tmp_path_factory):
    """The start-up waits that end at their timeout, started together (each spends most of its
    time waiting, idle): {name: (its Run, its folder, the port it waits at)}."""
    runs = {}

    def start(name, make):
        folder, port = tmp_path_factory.mktemp(name.replace(" ", "_")), free_port()
        runs[name] = (make(folder, port), folder, port)

    start("node alone", lambda f, p: train_sh(f, *SHORT, NNODES="2", NODE_RANK="0",
                                              RDZV_ENDPOINT=f"127.0.0.1:{p}"))
    start("first node silent", lambda f, p: train_sh(f, *SHORT, NNODES="2", NODE_RANK="1",
                                                     RDZV_ENDPOINT=f"127.0.0.2:{p}"))
    for task in (0, 1):
        start(f"srun task {task}", lambda f, p, task=task: srun_task(f, task, p))
    yield runs
    for run, _, _ in runs.values():
        if run.proc.poll() is None:
            run.proc.kill()


@pytest.mark.slow
def test_a_node_alone_says_whom_it_waits_for_and_stops_at_the_timeout(waits):
    run, folder, port = waits["node alone"]
    assert run.wait() == 2
    assert_one_line(run, 2, f"run_train.sh: error: the other node of NNODES=2 at 127.0.0.1:{port}",
                    "did not join within comm.timeout_s = 6 s", "RDZV_ENDPOINT")
    waiting = run.first("run_train.sh: waiting for the other node of NNODES=2 at 127.0.0.1:")
    assert waiting < 35, run.lines
    assert run.elapsed < waiting + 6 + 15, (waiting, run.elapsed)  # 6 s after the first note at most
    # nothing started: the launch check's lock file and torchrun's report only
    files = sorted(str(p.relative_to(folder / "run")) for p in (folder / "run").rglob("*") if p.is_file())
    assert files == ["logs/torchrun_node0.log", "torchpar.lock"], files


@pytest.mark.slow
def test_a_node_whose_first_node_never_answers_says_so_and_stops_at_the_timeout(waits):
    """NODE_RANK 1 waits for the rendezvous on the first node (nothing listens at 127.0.0.2)."""
    run, _, port = waits["first node silent"]
    assert run.wait() == 2
    assert_one_line(run, 2, f"run_train.sh: error: the rendezvous at RDZV_ENDPOINT=127.0.0.2:{port} did not "
                    "answer within comm.timeout_s = 6 s", "start NODE_RANK 0 there")
    waiting = run.first(f"run_train.sh: waiting for the other node of NNODES=2 at 127.0.0.2:{port}")
    assert waiting < 35 and run.elapsed < waiting + 6 + 15, (waiting, run.elapsed)
    assert "TCPStore" not in run.stderr  # torch's own retries, with their C++ stack traces


@pytest.mark.slow
def test_a_stop_while_waiting_for_the_other_node_is_one_line(tmp_path):
    # (the first note comes after a quarter of the timeout, the stop well before its end)
    run = train_sh(tmp_path, "--comm.timeout_s", "20", "--comm.watchdog_s", "0", NNODES="2", NODE_RANK="0",
                   RDZV_ENDPOINT=f"127.0.0.1:{free_port()}")
    deadline = time.time() + 60
    while not any("run_train.sh: waiting for" in line for _, line in run.lines) and time.time() < deadline:
        time.sleep(0.1)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait(timeout=60) == 128 + signal.SIGTERM
    assert_one_line(run, 143, "run_train.sh: stopped by SIGTERM before the ranks could stop at a step")


@pytest.mark.slow
@pytest.mark.parametrize("task", [0, 1])
def test_an_srun_task_alone_says_whom_it_waits_for_and_stops_at_the_timeout(waits, task):
    run, _, port = waits[f"srun task {task}"]
    assert run.wait() == 2
    whom = "the other ranks to join" if task == 0 else "rank 0 to answer"
    waiting = run.first(f"torchpar: rank {task} of 2: waiting for {whom} at localhost:{port}")
    assert waiting < 35, run.lines
    prefix = "torchpar: error: " + ("rank 1: " if task else "")
    assert_one_line(run, 2, prefix + f"the process group of 2 ranks did not form at localhost:{port}",
                    "start all 2 processes", "comm.timeout_s (6 s)")
    assert run.elapsed < waiting + 6 + 15, (waiting, run.elapsed)


# --- launch variables that do not add up: one line before anything starts or waits


@pytest.mark.slow
@pytest.mark.parametrize("extra, message", [
    ({"NGPU": "0"}, "NGPU=0: give the number of processes on this node, 1 or more"),
    ({"NGPU": "-2"}, "NGPU=-2: give the number of processes"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0"}, "RDZV_ENDPOINT=node0: give host:port"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0:"}, "RDZV_ENDPOINT=node0:: give host:port"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "256.1.1.1:29500"},
     "RDZV_ENDPOINT=256.1.1.1:29500: 256.1.1.1 is not an IPv4 address (each part 0-255)"),
    ({"NNODES": "2", "RDZV_ENDPOINT": "node0:70000"}, "RDZV_ENDPOINT=node0:70000: the port must be 1-65535"),
    ({"SLURM_STEP_NUM_TASKS": "abc"}, "SLURM_STEP_NUM_TASKS=abc is not a number of tasks"),
    ({"MAX_RESTARTS": "-1"}, "MAX_RESTARTS=-1: give 0 or more"),
    ({"LOG_RANK": "all"}, "LOG_RANK=all: give local ranks"),
    ({"LOG_RANK": "0,5"}, "LOG_RANK=0,5: this node runs local ranks 0-1 (NGPU=2); give local ranks below 2"),
], ids=["NGPU=0", "NGPU=-2", "endpoint without port", "endpoint with empty port", "endpoint not an address",
        "endpoint port too large", "srun tasks abc",
        "negative restarts", "LOG_RANK all", "LOG_RANK beyond the node's ranks"])
def test_launch_variables_that_do_not_add_up(tmp_path, extra, message):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "keep.txt").write_text("the user's")
    before = folder_digest(folder)
    run = train_sh(tmp_path, **extra)
    assert run.wait(timeout=60) == 2
    assert_one_line(run, 2, f"run_train.sh: error: {message}")
    assert run.elapsed < 30, run.elapsed
    assert folder_digest(folder) == before


@pytest.mark.parametrize("cpus, given", [({"SLURM_CPUS_PER_TASK": "16"}, "16"), ({}, "96")],
                         ids=["cpus-per-task given", "the whole node"])
def test_the_slurm_script_hands_srun_its_cpus(tmp_path, cpus, given):
    """srun inherits no --cpus-per-task from the batch since Slurm 22.05: the script passes on the
    batch's, or every CPU of the node where sbatch was given none (srun and scontrol stand-ins record
    what the script asks of them); it leaves torch's NCCL error handling as it is."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu001\\ngpu002\\n'\n")
    (bin_dir / "srun").write_text('#!/bin/sh\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n'
                                  'echo "$TORCH_NCCL_ASYNC_ERROR_HANDLING" > "$SRUN_ARGS.nccl"\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    slurm = {"SLURM_CPUS_ON_NODE": "96", "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu[001-002]",
             "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT), **cpus}
    slurm.update(PATH=f"{bin_dir}:{os.environ['PATH']}", SRUN_ARGS=str(tmp_path / "srun_args"))
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCH_NCCL"))}
    r = subprocess.run(["bash", "scripts/slurm/train.sbatch", "--training.steps", "3"], cwd=ROOT,
                       env={**environment, **slurm}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    args = (tmp_path / "srun_args").read_text().splitlines()
    assert {"--ntasks-per-node=1", f"--cpus-per-task={given}", "--kill-on-bad-exit=1"} <= set(args), args
    assert (tmp_path / "srun_args.nccl").read_text() == "\n"  # (unset: torch's default)
    assert args[-3:] == ["bash", "--training.steps", "3"], args  # the overrides reach run_train.sh


def test_the_replica_groups_script_starts_a_lighthouse_and_restarts_a_failed_group(tmp_path):
    """scripts/slurm/replica_groups.sbatch on 4 nodes as 2 groups (srun and scontrol stand-ins record
    each step): a lighthouse on the first node, each group a step of its own on its 2 nodes with a
    rendezvous on its first node, the overrides passed on; group 1's first attempt fails and it is
    started again with a fresh rendezvous id. A count of groups that does not divide the nodes is one
    line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/sh\nprintf 'gpu001\\ngpu002\\ngpu003\\ngpu004\\n'\n")
    (bin_dir / "srun").write_text(
        '#!/bin/bash\n'
        'echo "$* | $RDZV_ENDPOINT $RDZV_ID $NNODES $TORCHFT_LIGHTHOUSE" >> "$SRUN_LOG"\n'
        'case "$*" in *torchft_lighthouse*) exec sleep 60;; esac\n'
        'if [[ "$*" == *"replica_id 1 "* && ! -e "$SRUN_LOG.failed" ]]; then\n'
        '  touch "$SRUN_LOG.failed"; exit 1\n'
        'fi\n')
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    slurm = {"SLURM_CPUS_ON_NODE": "96", "SLURM_JOB_NUM_NODES": "4", "SLURM_JOB_NODELIST": "gpu[001-004]",
             "SLURM_JOB_ID": "7", "SLURM_SUBMIT_DIR": str(ROOT), "PATH": f"{bin_dir}:{os.environ['PATH']}",
             "SRUN_LOG": str(tmp_path / "srun.log")}
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RDZV_", "TORCHFT"))}
    script = ["bash", "scripts/slurm/replica_groups.sbatch", "--training.steps", "3"]
    r = subprocess.run(script, cwd=ROOT, env={**environment, **slurm}, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert "replica group 1 failed; starting it again (1 of 3)" in r.stderr
    steps = (tmp_path / "srun.log").read_text().splitlines()
    lighthouse = [s for s in steps if "torchft_lighthouse" in s]
    assert len(lighthouse) == 1 and "--nodelist=gpu001" in lighthouse[0] and "--overlap" in lighthouse[0]
    groups = sorted(s for s in steps if "torchft_lighthouse" not in s)
    assert len(groups) == 3, groups
    for g, first in ((0, "gpu001"), (1, "gpu003")):
        mine = [s for s in groups if f"--fault_tolerance.replica_id {g} " in s]
        assert len(mine) == 1 + g  # (group 1: its failed attempt and the next)
        for attempt, step in enumerate(sorted(mine, key=lambda s: s.split(" | ")[1])):
            assert f"--nodes=2 --ntasks=2 --ntasks-per-node=1 --relative={2 * g} " in step, step
            assert "--fault_tolerance.replica_groups 2" in step and step.split(" | ")[0].endswith(
                "--training.steps 3"), step
            assert step.split(" | ")[1] == f"{first}:29500 7_group{g}_{attempt} 2 http://gpu001:29510", step
    r = subprocess.run(script, cwd=ROOT, env={**environment, **slurm, "REPLICA_GROUPS": "3"},
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "replica_groups.sbatch: error: REPLICA_GROUPS=3 must divide the job's 4 nodes"], r.stderr
