"""How torchpar speaks to the user: warnings and errors as single lines, argument parsers whose
mistakes are single lines too, and a runner for every command that turns what can go wrong
(a bad input, an unwritable file, a closed pipe, Ctrl-C) into one line and an exit code.

Rank 0 alone prints what every rank finds alike (the same checks run on every rank), so a job
of 512 ranks says a mistake once.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

from torchpar.errors import AlreadyTrained, ConfigError, RankError


def is_rank0() -> bool:
    return os.environ.get("RANK", "0") == "0"


def warn(message: str) -> None:
    if is_rank0():
        _note(f"torchpar: warning: {message}")


def error(message: str, every_rank: bool = False) -> None:
    """``every_rank``: for a fault that may be this rank's alone (a file it could not write).
    Under torchrun every rank records the line as its reason, shown or not (see :class:`Reason`)."""
    if every_rank and not is_rank0():
        message = f"rank {os.environ['RANK']}: {message}"
    line, shown = f"torchpar: error: {message}", every_rank or is_rank0()
    if isinstance(sys.stderr, Reason):
        sys.stderr.record(line, shown)
    if shown:
        _note(line)


def _note(line: str) -> None:
    """A line on stderr that is no rank's reason to stop (a warning, a progress note, or an error
    recorded already)."""
    stream = sys.stderr.stream if isinstance(sys.stderr, Reason) else sys.stderr
    print(line, file=stream, flush=True)


class Reason:
    """This process's stderr under torchrun, recording why the rank stops for the launcher.

    torchrun gives each rank an error file (``TORCHELASTIC_ERROR_FILE``) and reads it when the rank
    fails. Each line that starts with "torchpar: " and is printed to stderr by any module (an
    error, the stop on a signal, the watchdog's verdict right before it ends the process) is written
    there at once, with its time, as is every rank's error, shown or not, and at the end the exit
    code. ``torchpar.commands.launch`` shows the first failing rank's line from it; torchrun's own
    report (``message``, ``timestamp``) shows it too."""

    def __init__(self, stream, path: str):
        self.stream, self.path = stream, path
        self.reason: dict = {"rank": int(os.environ.get("RANK", "0"))}
        self._partial, self._lock = "", threading.Lock()

    def write(self, text: str) -> int:
        count = self.stream.write(text)
        with self._lock:
            *lines, self._partial = (self._partial + text).split("\n")
        for line in lines:
            if line.startswith("torchpar: ") and not line.startswith("torchpar: warning:"):
                self.record(line, shown=True)
        return count

    def __getattr__(self, name):
        return getattr(self.stream, name)

    def record(self, line: str | None = None, shown: bool = True, code: int | None = None,
               exception: bool = False) -> None:
        """This rank's line (with its time and whether it was printed), its exit code, or (beside
        torchrun's record of an exception, which the file holds then) the time of the exception."""
        with self._lock:
            if line is not None or exception:
                self.reason["time"] = time.time()
            if line is not None:
                self.reason.update(line=line, shown=shown)
            if code is not None:
                self.reason["code"] = code
            if exception:
                with open(self.path) as f:
                    data = json.load(f)
            else:
                data = {"message": self.reason.get("line", f"exit code {code}"),
                        "timestamp": int(self.reason.get("time", time.time()))}
            data["torchpar"] = self.reason
            # written whole or not at all: torchrun's agent fails on a half-written file
            temporary = f"{self.path}.{threading.get_ident()}.tmp"
            with open(temporary, "w") as f:
                json.dump(data, f)
            os.replace(temporary, self.path)


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage mistakes raise ConfigError (one line) instead of printing the usage."""

    def error(self, message: str):
        raise ConfigError(f"{self.prog}: {message} (see {self.prog} --help)")


def at_least(flag: str, value: float, low: float, exclusive: bool = False) -> None:
    """``flag`` must be >= low (> low when ``exclusive``)."""
    if value < low or (exclusive and value == low):
        raise ConfigError(f"{flag} must be {'>' if exclusive else '>='} {low:g}, got {value:g}")


def output_path(flag: str, path: str | Path, folder: bool = False, suffixes: tuple[str, ...] = ()) -> Path:
    """A path a command will write (a file, or a folder when ``folder``): its parent exists and is
    writable, it is not a folder where a file is meant (or the reverse) and it ends in one of
    ``suffixes`` if given — checked before the work, so a long export does not fail at its last step."""
    p = Path(path).expanduser()
    if suffixes and p.suffix.lower() not in suffixes:
        raise ConfigError(f"{flag} {p}: the file is written as {' or '.join(suffixes)}, not "
                          f"{p.suffix or 'no suffix'!r}")
    if not folder and p.is_dir():
        raise ConfigError(f"{flag} {p} is a folder; give a file name")
    if folder and p.exists() and not p.is_dir():
        raise ConfigError(f"{flag} {p} is a file; give a folder")
    parent = p if folder and p.exists() else p.parent
    if not parent.is_dir():
        raise ConfigError(f"{flag} {p}: the folder {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(f"{flag} {p}: not writable here; choose another path")
    return p


def run_command(main, argv: list[str] | None = None) -> int:
    """``main(argv) -> exit code``, with every way it can fail turned into one line. Under
    torchrun the rank's reason and code also go to its error file (:class:`Reason`)."""
    argv = sys.argv[1:] if argv is None else argv
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or isinstance(sys.stderr, Reason):
        return _run(main, argv)
    sys.stderr = reason = Reason(sys.stderr, path)
    code = None
    try:
        code = _run(main, argv)
        return code
    except Exception as e:  # a fault no check foresaw: torchrun's own record of it, traceback and all
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(e)
        reason.record(exception=True)  # beside it, when (to order the ranks' faults)
        raise
    finally:
        sys.stderr = reason.stream
        if code:
            reason.record(code=code)


def _run(main, argv: list[str]) -> int:
    try:
        code = main(argv)
        sys.stdout.flush()  # a closed pipe shows here, not at the interpreter's exit
        return code
    except ConfigError as e:
        error(str(e), every_rank=isinstance(e, RankError))
        return 2
    except AlreadyTrained as e:
        print(f"torchpar: {e}", flush=True)
        return 0
    except BrokenPipeError:
        # The reader went away (`torchpar plan | head`): later writes to stdout must not fail again
        # at interpreter exit.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        error("the output pipe was closed before everything was written; the output is cut short")
        return 141  # 128 + SIGPIPE, what a shell tool killed by the closed pipe reports
    except KeyboardInterrupt as e:
        phase = getattr(e, "torchpar_phase", "")
        error("interrupted" + (f" while {phase}" if phase else ""))
        return 130
    except OSError as e:  # a disk or file fault that no check could foresee
        where = f"{e.filename}: " if e.filename else ""
        error(f"{where}{e.strerror or e}", every_rank=True)
        return 1
    except Exception as e:  # a fault no check foresaw: its traceback says in which phase it came
        if hasattr(e, "torchpar_phase"):
            e.add_note(f"torchpar: raised while {e.torchpar_phase}")
        raise


@contextlib.contextmanager
def progress(what: str, shown: bool = True, after_s: float = 10.0, every_s: float = 30.0,
             line=None, until=None):
    """While ``what`` runs longer than ``after_s`` (then every ``every_s``), say it is still going:
    a long start-up, save or evaluation is visibly alive, and a stall names the phase it is in.
    ``line(seconds)``: the note in other words; ``until()``: true once the wait is over, though the
    block goes on (checked before each note)."""
    try:
        if not shown:
            yield
            return
        with _watched(what, after_s, every_s, line, until):
            yield
    except BaseException as e:  # the innermost phase names where a run stopped (see _run)
        if what and not hasattr(e, "torchpar_phase"):
            e.torchpar_phase = what
        raise


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc and the boot-time clock), or None where
    that cannot be read."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        return time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    """How long each start-up phase takes, for the line that says where a run's start-up went."""

    _first = True  # only a process's first trainer counts its imports and the launch

    def __init__(self):
        self.started_s = process_age_s() if StartupClock._first else None
        StartupClock._first = False
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def line(self) -> str:
        """``torchpar: ready N s after the launch: ...``: the launcher's share (its imports and the
        job's check, then torchrun's start; ``run_train.sh`` says when it started), this process's
        imports, then each phase of at least 0.05 s, in order."""
        age = process_age_s()
        parts, total, since = [], None, "this process started"
        if age is not None and self.started_s is not None:
            total = age
            launched, checked = os.environ.get(LAUNCHED_AT), os.environ.get(LAUNCH_CHECK_S)
            if launched and checked:
                before = time.time() - age - float(launched)  # (the launcher's start to this process's)
                parts += [f"the launcher's imports and check {float(checked):.1f} s",
                          f"torchrun {max(0.0, before - float(checked)):.1f} s"]
                total, since = age + before, "the launch"
            parts.append(f"imports {self.started_s:.1f} s")
        parts += [f"{name} {s:.1f} s" for name, s in self.seconds.items() if s >= 0.05]
        if total is None:
            return "torchpar: start-up: " + ", ".join(parts)
        rest = age - self.started_s - sum(self.seconds.values())
        parts += [f"the rest {rest:.1f} s"] if rest >= 0.05 else []
        return f"torchpar: ready {total:.1f} s after {since}: " + ", ".join(parts)


# What the launcher (run_train.sh's) tells its ranks: when it started (seconds since the epoch),
# and how long it took to import and check the job.
LAUNCHED_AT, LAUNCH_CHECK_S = "TORCHPAR_LAUNCHED_AT", "TORCHPAR_LAUNCH_CHECK_S"


@contextlib.contextmanager
def _watched(what: str, after_s: float, every_s: float, line, until):
    done, started = threading.Event(), time.perf_counter()
    line = line or (lambda seconds: f"torchpar: {what}: still going after {seconds:.0f} s")

    def watch() -> None:
        wait = after_s
        while not done.wait(wait) and not (until and until()):
            _note(line(time.perf_counter() - started))
            wait = every_s

    thread = threading.Thread(target=watch, name="torchpar-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()  # no thread outlives the phase


def tee_output(path: Path) -> None:
    """From now on this process's stdout and stderr, native writes included, also go to ``path``
    (appended). A ``tee`` process per stream reads a pipe that replaces the descriptor — not a
    thread — so what the process writes before dying (an abort's message too) still reaches the
    console and the file. tee runs in its own session, deaf to Ctrl-C, so a signal meant for the
    job leaves it copying to the end. At exit the descriptors are restored and the copies waited for."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()} "
                f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    copies = []
    for fd in (1, 2):
        original = os.dup(fd)
        tee = subprocess.Popen(["tee", "-i", "-a", str(path)], stdin=subprocess.PIPE, stdout=original,
                               stderr=original, start_new_session=True)
        os.dup2(tee.stdin.fileno(), fd)
        tee.stdin.close()  # the descriptor fd is now the pipe's only write end here
        copies.append((fd, original, tee))

    def restore() -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, original, tee in copies:
            os.dup2(original, fd)  # closes the pipe: tee reaches its end
            os.close(original)
        for _, _, tee in copies:
            try:
                tee.wait(timeout=10)  # a child process may still hold the pipe: do not wait for it
            except subprocess.TimeoutExpired:
                pass

    atexit.register(restore)
