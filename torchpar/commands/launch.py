"""run_train.sh's torchrun: torchrun itself (its options, agent and rendezvous), after the job's
check and reporting the way torchpar does.

    python -m torchpar.commands.launch [torchrun options] -m torchpar train --config FILE [overrides]

- Before any rank starts, ``torchpar train --check`` for the whole job runs in this process: a
  mistake in the config, data, layout or checkpoint is its one line and exit code 2.
- A failed job ends with one line and the first failing rank's exit code: that rank's own
  ``torchpar: ...`` line, read from the error file torchrun gives each rank (written by
  :class:`torchpar.console.Reason`) — printed unless the console showed it already. A stop on
  purpose keeps its code (divergence 3, the watchdog 4, a signal 128 + its number).
  torchrun's own log and its failure report go to <dump_folder>/logs/torchrun_node<N>.log.
- While the agents of a multi-node job wait for each other at the rendezvous, a line every
  30 s says for whom; after ``comm.timeout_s`` the wait ends with one line (exit code 2).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousTimeoutError
from torch.distributed.run import parse_args, parse_min_max_nnodes, run

from torchpar import device as dev
from torchpar.commands.train import check_before_launch, parse_train_args
from torchpar.config import load_config
from torchpar.console import LAUNCH_CHECK_S, LAUNCHED_AT, process_age_s, progress, run_command
from torchpar.fault_tolerance import for_replica

PROG = "run_train.sh"


@dataclass
class Ended:
    """A rank that ended with a nonzero code, and what it recorded in its error file."""

    rank: int | str
    local_rank: int
    code: int | None
    data: dict

    @property
    def line(self) -> str | None:
        return self.data.get("torchpar", {}).get("line")

    @property
    def exception(self) -> str | None:
        """torchrun's record of an exception no check foresaw: 'RuntimeError: ...'."""
        message = self.data.get("message")
        return message.get("message") if isinstance(message, dict) else None


def first_failure(ended: list[Ended]) -> tuple[Ended, int]:
    """The rank to speak for the job, and the job's exit code. The rank: the first to record a
    line; else one that was killed or crashed (torchrun stops the others with SIGTERM, and their
    collectives fail after a peer's death); else the first to raise an exception; else one that
    exited by itself. The code is that rank's own — unless torchrun stopped it after it had said
    why, when it is the code of a rank that exited by itself (a divergence stop on every rank: rank
    0 has the line, and may be stopped by torchrun once another rank exits with 3)."""
    def at(e: Ended) -> float:
        return e.data.get("torchpar", {}).get("time", float("inf"))

    said = [e for e in ended if e.line]
    crashed = [e for e in ended if e.code is not None and e.code < 0 and e.code != -signal.SIGTERM]
    raised = [e for e in ended if e.exception]
    by_itself = [e for e in ended if e.code is not None and e.code > 0]
    first = (min(said, key=at) if said else crashed[0] if crashed else min(raised, key=at) if raised
             else by_itself[0] if by_itself else ended[0])
    code = first.code
    if first.line and (code is None or code < 0) and by_itself:
        code = by_itself[0].code
    return first, exit_code(code if code is not None else 1)


def on_console(line: str, ended: list[Ended], console: set[int] | None) -> bool:
    """A rank that the console shows (local ranks ``console``; None: all) printed ``line``: every
    rank may record the same error (a check all ranks make), rank 0 alone prints it."""
    return any(e.line == line and e.data["torchpar"].get("shown")
               and (console is None or e.local_rank in console) for e in ended)


def exit_code(code: int) -> int:
    """A shell's code for a process's: a death by signal N is 128 + N."""
    return 128 - code if code < 0 else code


class Launch:
    def __init__(self, args, cfg):
        self.args, self.cfg = args, cfg
        self.nnodes = parse_min_max_nnodes(args.nnodes)[1]
        self.timeout = cfg.comm.timeout_s
        self.logs = Path(for_replica(cfg).job.dump_folder) / "logs"  # (a replica group's: its own)
        self.report = self.logs / f"torchrun_node{args.node_rank}.log"
        self.report_where = str(self.report)  # as the lines name it: the path, or why it is not there
        self.shown = {int(r) for r in args.local_ranks_filter.split(",")} if args.local_ranks_filter else None

    def where(self) -> str:
        others = "the other node" if self.nnodes == 2 else f"the other {self.nnodes - 1} nodes"
        a = self.args
        return (f"{others} of NNODES={self.nnodes} at {a.rdzv_endpoint} (RDZV_ID {a.rdzv_id}; "
                f"this is NODE_RANK {a.node_rank})")

    def run(self) -> int:
        self._log_to_report()
        with tempfile.TemporaryDirectory(prefix="torchpar-torchrun-") as log_dir:
            # torchrun's folder for the ranks' error files (attempt_<n>/<local rank>/error.json)
            self.args.log_dir = log_dir

            def started() -> bool:
                return any(Path(log_dir).glob("*/attempt_*"))

            def note(seconds: float) -> str:
                return (f"{PROG}: waiting for {self.where()}: {seconds:.0f} s, at most "
                        f"comm.timeout_s = {self.timeout} s")

            try:
                # (a short timeout still says whom it waits for before it ends)
                with progress("", shown=self.nnodes > 1, line=note, until=started,
                              after_s=min(10.0, self.timeout / 4)):
                    self._rendezvous()
                    run(self.args)
                return 0
            except ChildFailedError as e:
                self._to_report(e)
                return self._failed([Ended(rank, f.local_rank, f.exitcode, f.error_file_data)
                                     for rank, f in e.failures.items()])
            except SignalException as e:
                self._to_report(e)
                return self._stopped(e.sigval, log_dir)
            except RendezvousTimeoutError as e:
                self._to_report(e)
                return self._say(f"{PROG}: error: {self.where()} did not join within comm.timeout_s = "
                                 f"{self.timeout} s: start run_train.sh on every node with the same NNODES, "
                                 "RDZV_ENDPOINT and RDZV_ID, or raise --comm.timeout_s", 2)
            except (RendezvousConnectionError, TimeoutError) as e:
                self._to_report(e)
                return self._say(
                    f"{PROG}: error: the rendezvous at RDZV_ENDPOINT={self.args.rdzv_endpoint} did not "
                    f"answer within comm.timeout_s = {self.timeout} s: start NODE_RANK 0 there, give every "
                    "node an address of it that they reach (host:port), or raise --comm.timeout_s", 2)
            except Exception as e:  # torchrun's own fault: its traceback to the report
                self._to_report(e)
                first = (str(e).strip().splitlines() or [""])[0]
                return self._say(f"{PROG}: error: torchrun failed: {type(e).__name__}: {first} "
                                 f"(its report: {self.report_where})", 1)

    def _rendezvous(self) -> None:
        """The rendezvous gives up when comm.timeout_s is over: the agents' wait for each other, and
        a node's wait for the first node's store, which the other nodes wait for here first —
        torchrun's own retries would print a native warning with a C++ stack trace each time."""
        deadline = time.monotonic() + self.timeout
        if self.nnodes > 1 and self.args.node_rank != 0:
            host, port = self.args.rdzv_endpoint.rsplit(":", 1)
            dev.wait_for_listener(host.strip("[]"), int(port), self.timeout)
        left = max(1, round(deadline - time.monotonic()))
        conf = f"join_timeout={left},read_timeout={left}"
        self.args.rdzv_conf = f"{conf},{self.args.rdzv_conf}" if self.args.rdzv_conf else conf

    def _failed(self, ended: list[Ended]) -> int:
        """The first failing rank's line (unless the console showed it) and its code."""
        first, code = first_failure(ended)
        if first.line:
            return code if on_console(first.line, ended, self.shown) else self._say(first.line, code)
        output = (f"its output: {self.logs}/rank_{first.rank}.log" if self.cfg.job.rank_logs
                  else f"LOG_RANK={first.local_rank} shows its output")
        if first.exception:
            return self._say(f"{PROG}: error: rank {first.rank} failed: {first.exception} ({output}; "
                             f"torchrun's report: {self.report_where})", code)
        killed = first.code is not None and first.code < 0
        how = f"was killed by {signal.Signals(-first.code).name}" if killed else f"exited with code {code}"
        return self._say(f"{PROG}: error: rank {first.rank} {how} without a message ({output}; torchrun's "
                         f"report: {self.report_where})", code)

    def _stopped(self, signum: int, log_dir: str) -> int:
        """This launcher got a stop signal and torchrun passed it on: the ranks' own lines and codes,
        from their error files in torchrun's last attempt."""
        attempts = sorted(Path(log_dir).glob("*/attempt_*"), key=lambda p: int(p.name.split("_")[1]))
        ended = []
        for path in sorted(attempts[-1].glob("*/error.json")) if attempts else []:
            data = json.loads(path.read_text())
            record = data.get("torchpar", {})
            ended.append(Ended(record.get("rank", "?"), int(path.parent.name), record.get("code"), data))
        if any(e.line for e in ended):
            return self._failed(ended)
        name = signal.Signals(signum).name
        return self._say(f"{PROG}: stopped by {name} before the ranks could stop at a step (nothing was "
                         f"saved; torchrun's report: {self.report_where})", 128 + signum)

    @staticmethod
    def _say(line: str, code: int) -> int:
        print(line, file=sys.stderr, flush=True)
        return code

    def _log_to_report(self) -> None:
        """torchrun's log lines (and Python's warnings here) go to the report file, not the console;
        a report that cannot be written (a full disk) loses them, not the run or its one line."""
        header = (f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: "
                  f"torchrun {' '.join(sys.argv[1:])}\n")
        handler: logging.Handler = logging.NullHandler()
        if self._append(header):
            handler = logging.FileHandler(self.report)
            handler.handleError = self._unwritten  # (logging's own would print a traceback to stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        logging.captureWarnings(True)
        for name in ("torch.distributed", "py.warnings"):
            log = logging.getLogger(name)
            log.handlers = [handler]  # (torch gives torch.distributed a handler of its own, to stderr)
            log.setLevel(logging.INFO)
            log.propagate = False

    def _to_report(self, e: BaseException) -> None:
        self._append("".join(traceback.format_exception(e)))

    def _append(self, text: str) -> bool:
        """``text`` appended to the report (by every launch on this node); False where it could not be."""
        try:
            self.logs.mkdir(parents=True, exist_ok=True)
            with open(self.report, "a") as f:
                f.write(text)
            return True
        except OSError as e:
            self._unwritten(e)
            return False

    def _unwritten(self, why) -> None:
        if self.report_where == str(self.report):
            reason = why if isinstance(why, OSError) else sys.exc_info()[1]
            self.report_where = f"{self.report} could not be written: {reason}"


def main(argv: list[str]) -> int:
    """torchrun's options and entry point; ``--nproc-per-node auto``: one process per visible GPU,
    else 2 CPU ranks (``run_train.sh`` without NGPU)."""
    args = parse_args(argv)
    if args.nproc_per_node == "auto":
        args.nproc_per_node = str(dev.default_nproc())
    nproc = int(args.nproc_per_node)
    shown = args.local_ranks_filter.split(",") if args.local_ranks_filter else []
    if any(int(r) >= nproc for r in shown):  # (else no rank's output would reach the console)
        return Launch._say(f"{PROG}: error: LOG_RANK={args.local_ranks_filter}: this node runs local ranks "
                           f"0-{nproc - 1} (NGPU={nproc}); give local ranks below {nproc}", 2)
    script_args = args.training_script_args  # (-m torchpar) train --config ...
    script_args = script_args[1:] if script_args[:1] == ["train"] else script_args
    code = check_once(args, script_args)
    if code:
        return code
    age = process_age_s()
    if age is not None:  # (each rank's first line says where the start-up went)
        os.environ[LAUNCHED_AT], os.environ[LAUNCH_CHECK_S] = f"{time.time() - age:.3f}", f"{age:.3f}"
    config, overrides, _, _ = parse_train_args(script_args, "")
    cfg = load_config(config, overrides)  # (the check loaded the same: no error left)
    # The agent turns these signals into its own exception from the moment it starts ranks; before
    # that (the rendezvous) too, so that a stop while waiting is one line.
    def stop(signum, frame):
        raise SignalException(f"got {signal.Signals(signum).name}", sigval=signal.Signals(signum))

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    return Launch(args, cfg).run()


def check_once(args, script_args: list[str]) -> int:
    """The trainer's check for the whole job (``check_before_launch``: ``--check`` but for the
    reading of every byte, which the ranks share), in this process before torchrun starts a rank
    (a process of its own would import torch and the trainer once more, seconds on every launch):
    its exit code, its error already said in one line. Sets each CPU rank's threads."""
    nproc = int(args.nproc_per_node)
    if dev.device_type() == "cpu" and "OMP_NUM_THREADS" not in os.environ:
        # Oversubscribed CPU ranks slow down badly with more than one thread each.
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    world = parse_min_max_nnodes(args.nnodes)[1] * nproc
    job = {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(nproc), "NODE_RANK": str(args.node_rank)}
    before = {k: os.environ.get(k) for k in job}
    os.environ.update(job)  # (the check reads the job's shape as a rank would)
    try:
        return run_command(check_before_launch, script_args)
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
