"""What the tests share: the repository root, the tiny job every layout trains (the self-test's
own), and the comparison of a layout's run with one process.

``run_layouts(world, {name: overrides})`` and ``spawn_ranks`` are ``torchpar.selftest``'s: the
tests and ``torchpar selftest`` start and compare their processes with the same code (one-process
tables trained two groups side by side on a machine of two cores or more: :func:`side_by_side`).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from torchpar.selftest import BASE as TINY  # noqa: F401 (re-exported, like the names below)
from torchpar.selftest import (  # noqa: F401
    NATIVE_ERROR,
    TOLERANCE,
    differences,
    free_port,
    run_each,
    run_group,
    spawn_ranks,
)
from torchpar.selftest import run_layouts as _run_layouts

ROOT = Path(__file__).resolve().parents[1]
# (the self-test's fp32 parameter tolerance on CPU: why it is what it is, see torchpar.selftest)
PARAM_TOL = TOLERANCE["cpu", "float32"][1]
# The layout and checkpoint tables' model depth: four layers hold every kind of parameter a layer
# has and split into 2 x 2 pipeline stages, and the self-test job's eight cost each run about a
# third more. A layout that needs more stages says so.
LAYERS = ["--model.n_layers", "4"]


def side_by_side(run, items: list) -> list:
    """``run(part)`` of the two halves of ``items`` (every other item: alike ones split evenly), at
    the same time where the machine has a core for each, and the results in the items' order; once
    where it has not. A one-process run uses one core (its rank has one thread), and on a machine
    of two the references of a table took twice as long as they need."""
    if len(items) < 2 or (os.cpu_count() or 1) < 2:
        return run(items)
    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(run, (items[0::2], items[1::2])))  # (the first error is raised)
    out = [None] * len(items)
    out[0::2], out[1::2] = halves
    return out


def run_layouts(world: int, layouts: dict[str, list[str]], base: str | Path = TINY) -> dict:
    """``torchpar.selftest.run_layouts``; one-process tables in two groups side by side
    (:func:`side_by_side`)."""
    if world > 1:
        return _run_layouts(world, layouts, base)
    names = side_by_side(lambda part: list(_run_layouts(1, {n: layouts[n] for n in part}, base).items()),
                         list(layouts))
    return dict(names)


def assert_matches(run: dict, ref: dict, tol: float = 1e-5, param_tol: float | None = None,
                   per_param: dict[str, float] | None = None, matrices_in_norm: bool = False) -> None:
    """Losses and held-out losses within ``tol``; final parameters within ``param_tol`` (default
    ``tol``), or the tolerance ``per_param`` gives a parameter by name; with ``matrices_in_norm``,
    each matrix's difference in norm relative to its norm, and vectors (and stacks of experts'
    biases) not compared (see the bf16 tolerance in test_composition.py). The self-test's
    comparison (``torchpar.selftest.differences``)."""
    found = differences(run, ref, tol, tol if param_tol is None else param_tol, matrices_in_norm, per_param)
    assert not found, "; ".join(found)


def bytes_of(run: dict, key: str) -> list[int]:
    """Each rank's ``key`` (param / grad / optim) bytes at step 1 of a layout's run."""
    return run["step1"][f"{key}_bytes_per_rank"]


def cli(argv: list[str], env: dict[str, str], timeout: float = 300, script: str | None = None
        ) -> subprocess.CompletedProcess:
    """``python -m torchpar *argv`` (or ``python -c script *argv``) with ``env`` in the repository
    root, in a process forked from the server that has imported torch and the trainer for the ranks
    (a new interpreter spends seconds importing them each time): its exit code, stdout and stderr,
    as ``subprocess.run`` gives them. A process of its own: its signals, exit code, output and exit
    handlers are the command's. Tests of what a new interpreter does (a signal to a starting
    process, torchrun, the heap of a fresh process) start one."""
    out = tempfile.mkdtemp(prefix="torchpar_cli_")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torchpar.selftest"])  # (the ranks' server: the first call sets it)
    proc = context.Process(target=_cli_main, args=(argv, env, out, script))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join()
        raise subprocess.TimeoutExpired(["torchpar", *argv], timeout)
    stdout, stderr = (Path(out, name).read_text(errors="replace") for name in ("stdout", "stderr"))
    shutil.rmtree(out)
    return subprocess.CompletedProcess(["torchpar", *argv], proc.exitcode, stdout, stderr)


def _cli_main(argv: list[str], env: dict[str, str], out: str, script: str | None) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    tempfile.tempdir = None  # (read from TMPDIR again)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        f = os.open(f"{out}/{name}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(f, fd)
        os.close(f)
    if "OMP_NUM_THREADS" in env:  # (read by a new interpreter's first parallel op; the server's ran none)
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    try:
        if script is not None:
            sys.argv = ["-c", *argv]
            exec(compile(script, "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = [str(ROOT / "torchpar" / "__main__.py"), *argv]
            from torchpar.commands import main

            sys.exit(main(argv))
    finally:
        atexit._run_exitfuncs()  # what the interpreter runs at its exit (a forked child exits without)
