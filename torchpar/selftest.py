"""``torchpar selftest``: does this machine compute, in every layout it can hold, what one device computes?

    torchpar selftest [--config FILE] [--set section.key=value ...] [--section.key value ...]
                      [--nproc N] [--dtype float32,bfloat16] [--layout NAME='--section.key value ...']

Trains a job for a few steps — the debug model's (``assets/selftest.toml``), or the one ``--config``
and the overrides give, a fork's change included — in a table of layouts that fit ``--nproc``
devices (ZeRO stages, TP with sequence and loss parallelism, HSDP, pipeline schedules, context
parallelism, 3-D), each in its own group of processes started here, every one with the job's global
batch, and compares it with a one-device run of the same job and precision: every step's loss, the
held-out losses, the final parameters. A row per layout: PASS (equal within the dtype's
tolerance), DIFFERS (by how much and where first), REFUSED (the job's check refuses the layout:
its one line) or ERROR (a rank raised or died: that rank's one-line error; the other layouts still
run), with tokens/s, MFU and peak memory; exit 1 on any DIFFERS or ERROR. The test suite runs its
layout tables through the same functions (:func:`run_layouts`, :func:`spawn_ranks`,
:func:`differences`).
"""

from __future__ import annotations

import faulthandler
import importlib
import json
import math
import multiprocessing
import os
import random
import re
import shutil
import socket
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

from torchpar import device as dev
from torchpar.config import load_config, parse_overrides
from torchpar.data.loader import PackedWindows
from torchpar.errors import ConfigError
from torchpar.models import canonical_name
from torchpar.optim import holds_vectors, kind_of, rounding_drift
from torchpar.parallel.zero import full_value
from torchpar.plan import predict_for_trainer
from torchpar.preflight import preflight
from torchpar.train import Trainer

BASE = Path(__file__).resolve().parent / "assets" / "selftest.toml"
# (glibc's own line before it aborts on a damaged heap: "malloc(): ...", "free(): ...", "double free
# or corruption", "corrupted size vs. prev_size")
NATIVE_ERROR = re.compile(r"terminate called|what\(\)|enforce fail|Fatal|SIGABRT|SIGSEGV|malloc\(\)|free\(\)|"
                          r"double free|corrupted")
# What a layout may differ from one device by, over the run: (every step's and held-out loss,
# every final parameter element). fp32 differs only in summation order (CPU: gloo and one thread;
# GPU: cuBLAS and NCCL pick algorithms by shape); bf16 rounds every matmul's inputs, and layouts
# round at different points, so its parameters are compared per matrix, in norm relative to the
# matrix's norm (vectors left out). fp32 parameters: another summation order changes gradients in
# their last bits, and Adam's normalization turns that into up to about 1e-5 on entries whose
# gradient is near zero (lr 2e-3; 7.7e-6 for tp 2 on the debug job); a CI machine with other GEMM
# kernels reached 1.1e-5 on one attention output matrix under TP and ring CP. 2e-5 bounds it with
# room, two orders below a real error (a lost gradient, a wrong shard: 1e-3 and above).
TOLERANCE = {("cpu", "float32"): (1e-5, 2e-5), ("cuda", "float32"): (1e-4, 1e-4),
             ("cpu", "bfloat16"): (1e-2, 5e-2), ("cuda", "bfloat16"): (1e-2, 5e-2)}
# FP8 matmuls (quantize.float8) round each operand to 3 mantissa bits (steps of 1/16 of a value)
# under scales taken from the tensor (tensorwise) or its rows (rowwise) that a rank holds. Against
# one process whose micro-batches hold the same rows (so the same scales), a layout's last-bit
# differences flip the FP8 rounding of a few elements, each by a 1/16 step, which Adam spreads: up
# to 6.7e-3 of a matrix's norm and 1e-4 of the loss after 5 steps of the tiny job (both recipes, 2-4
# ranks); FP8 against fp32 is 3.2-3.6e-2 and 1.3-2.2e-3 apart, a wrong shard 30-100%.
FLOAT8_MATCHED = (5e-4, 1.5e-2)
# Where a layout's scales cover other tokens than one process's (a data-parallel rank's share of the
# batch, a pipeline's microbatch, context parallelism's part of a sequence), a tensor's FP8 rounding
# differs wholesale: the composition matrix's cells part from one process by up to 11% of a
# matrix's norm after 3 steps (FP8 with Muon's orthogonalization, bf16 compute, accumulation), the
# loss within bf16's bound. A wrong shard or a lost gradient is 30-100% off.
FLOAT8_OTHER_SCALES = (1e-2, 0.15)
# An optimizer whose step is a sign (optim.Kind.continuous False) moves an element by 2 x lr where
# a last-bit difference flips it: its parameters are compared per matrix, in norm, within this.
SIGN_PARAM_TOL = 1e-2


def bounds(device: str, dtype: str, optimizer=None, ref: dict | None = None, float8: str = "off",
           same_scales: bool = False) -> dict:
    """How close a layout's run must stay to one device's (``ref``, a result of :func:`run_layouts`)
    under [optimizer] ``optimizer``, as :func:`differences`' keywords: losses within ``tol``;
    parameters per element within ``param_tol`` (wider by the drift of moments stored rounded:
    ``optim.rounding_drift``), or, in bf16, under FP8 matmuls (``float8``: quantize.float8) or under
    an optimizer that is not continuous (``optim.Kind.continuous``), each matrix in norm (vectors
    left out). Under FP8, ``same_scales``: one device's micro-batches held the layout's ranks' rows
    (:data:`FLOAT8_MATCHED`); otherwise the scales covered other tokens (a data-parallel rank's
    share of a batch, a pipeline's microbatch, context parallelism's part of a sequence)
    (:data:`FLOAT8_OTHER_SCALES`)."""
    tol, param_tol = TOLERANCE[device, dtype]
    if float8 != "off":
        tol, param_tol = FLOAT8_MATCHED if same_scales else FLOAT8_OTHER_SCALES
    continuous = kind_of(optimizer).continuous
    if not continuous:
        param_tol = max(param_tol, SIGN_PARAM_TOL)
    if ref is not None:
        shapes = [tuple(p.shape) for p in ref["params"].values()]
        param_tol = max(param_tol, rounding_drift(optimizer, len(ref["losses"]), shapes))
    return {"tol": tol, "param_tol": param_tol,
            "matrices_in_norm": dtype == "bfloat16" or float8 != "off" or not continuous}

Z = "--parallelism.zero_stage"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
# (world, name, overrides): each trains the job's global batch (its local batch is set to match).
LAYOUTS = [
    (1, "zero3", [Z, "3"]),
    (1, "accumulation_2", [Z, "0"]),
    (1, "activation_checkpoint", [Z, "0", "--training.activation_checkpoint", "full"]),
    (1, "selective_recompute", [Z, "0", "--training.activation_checkpoint", "selective"]),
    (1, "recompute_every_2", [Z, "3", "--training.activation_checkpoint", "full",
                              "--training.activation_checkpoint_every", "2"]),
    (1, "compile", [Z, "0", "--training.compile", "true"]),
    *((2, f"dp2_zero{z}", [Z, str(z)]) for z in (0, 1, 2, 3)),
    (2, "tp2_sp_lp", [*TP2, Z, "0"]),
    *((2, f"pp2_{s}", [*PP2, s, Z, "0"]) for s in ("1F1B", "Interleaved1F1B", "ZBVZeroBubble")),
    *((2, f"cp2_{m}", [*CP2, "--parallelism.context_parallel_method", m, Z, "3"])
      for m in ("alltoall", "ring")),
    (4, "hsdp2x2", [Z, "3", "--parallelism.data_parallel_replicate_degree", "2"]),
    (4, "dp2_tp2_zero3", [Z, "3", *TP2]),
    (4, "pp2_dp2_zero3", [*PP2, "1F1B", Z, "3"]),
    (4, "pp2_tp2", [*PP2, "1F1B", Z, "0", *TP2]),
    (4, "cp2_tp2", [*CP2, Z, "3", *TP2]),
    (8, "pp2_dp2_tp2", [*PP2, "Interleaved1F1B", Z, "3", *TP2]),
]
ACCUMULATION = {"accumulation_2": 2}  # micro-steps per step, where a layout accumulates
REFERENCE = [Z, "0"]


def free_port() -> int:
    """A port that is free now and that no other process is handed by the system before the job
    binds it: below the ephemeral range, from which every bind to port 0 and every outgoing
    connection (other jobs' gloo sockets) draws, so the seconds between this check and the bind
    (a launcher's start-up) leave no window for an automatic pick to take it."""
    low = 32768
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    rng = random.Random()  # (the callers seed the global generator)
    for _ in range(100):
        port = rng.randrange(10000, low) if low > 11000 else 0
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise RuntimeError(f"no free port found in 10000..{low - 1}")


def _rank_main(rank: int, target, world: int, port: int, out: str, args: tuple, parent: dict) -> None:
    # A forked rank starts from the fork server's state: take the caller's environment, folders
    # and import path, then its function (a spawned rank gets them anyway).
    os.environ.clear()
    os.environ.update(parent["env"])
    os.chdir(parent["cwd"])
    sys.path[:] = parent["path"]
    tempfile.tempdir = parent["tempdir"]
    if isinstance(target, tuple):
        module, _, name = target
        target = getattr(importlib.import_module(module), name)
    # Each rank's output goes to its own file, at the descriptor level so that a C++ abort's
    # message is kept too; spawn_ranks shows it when a rank dies.
    log = open(f"{out}/rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    # A native crash logs every thread's native stack, then (torch's handler calls the one it
    # replaced) every thread's Python stack: what each thread was running.
    faulthandler.enable(all_threads=True)
    torch._C._set_print_stack_traces_on_fatal_signal(True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dev.init_distributed()
    try:
        target(rank, world, out, *args)
    finally:
        dev.shutdown_distributed()


def spawn_ranks(target, world: int, *args) -> str:
    """Run ``target(rank, world, out, *args)`` in ``world`` new processes (one thread each; GPU
    ``rank`` each where there are GPUs) in one process group, and return ``out``, the folder they
    wrote to (the caller removes it). A rank that fails (a Python error, a signal) fails the call at
    once, with every rank's last lines.

    The processes are forked from a server that has imported torch and the trainer once (a new
    interpreter importing them costs seconds per rank, every time); each takes this process's
    environment, working folder and import path. A function of a script (``__main__``) is spawned."""
    out = tempfile.mkdtemp(prefix="torchpar_ranks_")
    parent = {"env": dict(os.environ), "cwd": os.getcwd(), "path": list(sys.path),
              "tempdir": tempfile.gettempdir()}
    method = "spawn" if target.__module__ == "__main__" else "forkserver"
    if method == "forkserver":
        multiprocessing.get_context("forkserver").set_forkserver_preload([__name__])
        target = (target.__module__, ".", target.__qualname__)  # (imported after the path is set)
    try:
        mp.start_processes(_rank_main, args=(target, world, free_port(), out, args, parent), nprocs=world,
                           start_method=method)
    except ProcessException as e:
        tails = _log_tails(out, world, e.error_index)
        shutil.rmtree(out, ignore_errors=True)
        raise RuntimeError(f"{e}\n{tails}") from None
    return out


def full_parameters(parts) -> dict[str, torch.Tensor]:
    """This rank's stages' parameters as full fp32 CPU tensors (collective over TP and FSDP), by
    canonical name."""

    return {canonical_name(name): full_value(p.detach()).float().cpu().clone()
            for part in parts for name, p in part.named_parameters()}


def _worker(rank: int, world: int, out: str, layouts: dict, base: str, keep: str) -> None:
    """Train ``layouts`` one after the other; after each one that every rank finished, rank 0
    writes its result to a file of its own in ``keep`` (``<index>.pt``), so a rank's death leaves
    the finished ones behind. (One file each: rewriting every result so far after each layout grew
    with the square of a group's size, on the path every rank waits on.)"""

    seen: list[tuple[int, int, list[int]]] = []  # (loader id, dp rank, window CRCs)
    plain_iter = PackedWindows.__iter__

    def recording_iter(self):
        for batch in plain_iter(self):
            seen.append((id(self), self.dp_rank, [zlib.crc32(row.numpy().tobytes()) for row in batch]))
            yield batch

    PackedWindows.__iter__ = recording_iter
    for index, (name, overrides) in enumerate(layouts.items()):
        cfg = load_config(base, list(overrides) + ["--job.dump_folder", f"{out}/{name}"])
        seen.clear()
        start = time.perf_counter()
        trainer = Trainer(cfg, on_first_step=predict_for_trainer)
        losses = trainer.train()
        trained = [(d, crcs) for loader, d, crcs in seen if loader == id(trainer.dataloader.dataset)]
        gathered = [None] * world if rank == 0 else None
        dist.gather_object((full_parameters(trainer.model.parts), trained), gathered, dst=0)
        if rank == 0:
            metrics = Path(trainer.cfg.job.dump_folder) / "metrics.jsonl"  # (a replica group's: its own)
            result = _merge(gathered, losses, trainer, metrics)
            result["seconds"] = time.perf_counter() - start  # (building and training it)
        dist.barrier()  # every rank finished this layout
        if rank == 0:
            result["process_groups"] = len(dist.distributed_c10d._world.pg_map)  # (so far)
            # (whole or not at all: a rank killed mid-write leaves no file for this layout)
            torch.save({name: result}, f"{keep}/{index:05d}.tmp")
            os.replace(f"{keep}/{index:05d}.tmp", f"{keep}/{index:05d}.pt")


def _merge(gathered: list, losses: list[float], trainer, metrics: Path) -> dict:
    """Rank 0's result of one layout: losses, full parameters, the windows each dp rank trained on
    (CRC32 per window, in order), held-out losses and every logged record (step1: the first step's)."""
    params, windows = {}, {}
    for p, w in gathered:
        params.update(p)
        batches = [batch for _, batch in w]
        for dp_rank in {d for d, _ in w}:
            # The TP / pipeline ranks of one data-parallel rank read the same windows.
            assert windows.setdefault(dp_rank, batches) == batches, f"dp rank {dp_rank} ranks disagree"
    logged = [json.loads(line) for line in metrics.read_text().splitlines()]
    first = next(r for r in logged if "loss" in r)  # (events may come before the first step's record)
    return {"losses": losses, "params": params, "step1": first, "windows": windows,
            "val_losses": trainer.val_losses, "logged": logged}


def run_layouts(world: int, layouts: dict[str, list[str]], base: str | Path = BASE) -> dict:
    """Train each of ``layouts`` ({name: config overrides on ``base``}) in one group of ``world``
    processes; rank 0's result per layout (see :func:`_merge`). A rank that dies fails the call
    (RuntimeError, with the ranks' last lines)."""
    results, error = run_group(world, layouts, base)
    if error is not None:
        raise error
    return results


def run_group(world: int, layouts: dict[str, list[str]], base: str | Path = BASE
              ) -> tuple[dict, RuntimeError | None]:
    """:func:`run_layouts` that keeps going: (the results of the layouts every rank finished, in
    order, and None), or (those before the one a rank died in, and that RuntimeError)."""
    keep = tempfile.mkdtemp(prefix="torchpar_results_")
    try:
        try:
            out, error = spawn_ranks(_worker, world, layouts, str(base), keep), None
            shutil.rmtree(out, ignore_errors=True)  # every layout's run folder: metrics, checkpoints
        except RuntimeError as e:
            error = e
        results = {}
        for path in sorted(Path(keep).glob("*.pt")):  # (in training order)
            results.update(torch.load(path, weights_only=False))
        return results, error
    finally:
        shutil.rmtree(keep, ignore_errors=True)


def _log_tails(out: str, world: int, failed: int) -> str:
    """The failed rank's first 10 native error lines (a C++ abort prints them before the
    stacks), its threads' native stacks after a fatal signal, its Python stacks and its last 40
    lines, and every other rank's last 3 lines; warnings left out."""
    parts = []
    if not Path(f"{out}/rank{failed}.log").exists():
        return (f"--- rank {failed} left no log: it died before its function started (its error is on this "
                "process's stderr, above). A script that starts ranks when imported, with no `if __name__ == "
                "'__main__':` guard, starts them again inside every new process.")
    for rank in [failed] + [r for r in range(world) if r != failed]:
        path = Path(f"{out}/rank{rank}.log")
        lines, skip = [], False
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if not skip and "Warning: " not in line:
                lines.append(line)
            skip = "Warning: " in line  # a warning's second line is the source line
        if rank == failed:
            stacks = _native_stacks(lines)
            shown = set(stacks)
            native = [line for line in lines[:-40] if NATIVE_ERROR.search(line) and line not in shown][:10]
            python = _python_stacks(lines[:-40])
            tail = [line for line in lines[-40:] if line not in shown]
            parts.append(f"--- rank {rank} ---\n" + "\n".join(native + stacks + python + tail))
        else:
            parts.append(f"--- rank {rank} ---\n" + "\n".join(lines[-3:]))
    return "\n".join(parts)


_THREAD_HEADER = re.compile(r"^SIG\w+\(\d+\), PID: \d+, Thread \d+:")


def _native_stacks(lines: list[str]) -> list[str]:
    """torch's report of a fatal signal in a rank's log: each thread's native frames. The thread
    that took the signal (its frames pass through ``fatalSignalHandler``; a native thread, such as
    a process group's worker, has no Python stack to show) comes first and whole (at most 30
    lines), then every other thread's first frames (6 lines each, 60 in all)."""
    blocks, block = [], None
    for line in lines:
        if _THREAD_HEADER.match(line):
            block = [line]
            blocks.append(block)
        elif block is not None and line.lstrip().startswith(("frame #", "<omitting")):
            block.append(line)
        else:
            block = None
    crashed = [b for b in blocks if any("fatalSignalHandler" in line for line in b)]
    rest = [line for b in blocks if b not in crashed for line in b[:6]][:60]  # (a process may run dozens)
    return [line for b in crashed for line in b[:30]] + rest


def _python_stacks(lines: list[str]) -> list[str]:
    """faulthandler's report in a rank's log (after a fatal signal): the thread that crashed,
    then the others, each thread's frames most recent first (at most 60 lines)."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if start is None:
        return []
    block = [lines[start]]
    for line in lines[start + 1:]:
        if not (line == "" or line.startswith(("Thread 0x", "Current thread 0x", "  File", "  <no Python"))):
            break
        block.append(line)
    current = next((i for i, line in enumerate(block) if line.startswith("Current thread")), 0)
    return (block[:1] + block[current:] + block[1:current])[:60]


def differences(run: dict, ref: dict, tol: float, param_tol: float, matrices_in_norm: bool = False,
                per_param: dict[str, float] | None = None) -> list[str]:
    """How ``run`` differs from ``ref`` (two results of :func:`run_layouts`) beyond the tolerances,
    one line each, the first difference first (empty: equal): the losses (``tol``, step by step),
    the loss's logged terms (``tol``: the z-loss, auxiliary terms, prediction depths), the final
    parameters (``param_tol`` per element, or per name from ``per_param``; with
    ``matrices_in_norm``, each matrix's difference in norm relative to its norm, vectors and stacks
    of them left out),
    the held-out losses (``tol``)."""
    out = []
    if len(run["losses"]) != len(ref["losses"]):
        out.append(f"{len(run['losses'])} steps trained, {len(ref['losses'])} by one device")
    for step, (a, b) in enumerate(zip(run["losses"], ref["losses"]), 1):
        if not abs(a - b) <= tol:
            out.append(f"the loss differs from step {step} on: {a:.6f} vs {b:.6f} (by {abs(a - b):.1e})")
            break
    if run["params"].keys() != ref["params"].keys():
        out.append(f"other parameters: {sorted(set(run['params']) ^ set(ref['params']))[:3]}")
    worst = (0.0, "")
    for name, want in ref["params"].items():
        if name not in run["params"] or (matrices_in_norm and holds_vectors(name, want.dim())):
            continue
        diff = run["params"][name] - want
        d = (diff.norm() / want.norm()).item() if matrices_in_norm else diff.abs().max().item()
        if not d <= (per_param or {}).get(name, param_tol):
            worst = max(worst, (d if d == d else float("inf"), name))
    if worst[1]:
        out.append(f"final parameters differ, most {worst[1]} by {worst[0]:.1e}")
    # The loss's terms (loss/z_loss, loss/mtp1, ...) at the steps both logged (a resumed run logs
    # from where it resumed).
    logged = {r["step"]: r for r in ref.get("logged", ()) if "loss" in r and "step" in r}
    for a in run.get("logged", ()):
        b = logged.get(a.get("step")) if "loss" in a else None
        terms = sorted(k for k in a.keys() | b.keys() if k.startswith("loss/")) if b else []
        bad = [k for k in terms if not abs(a.get(k, math.nan) - b.get(k, math.nan)) <= tol]
        if bad:
            out.append(f"{bad[0]} differs at step {a['step']}: {a.get(bad[0])} vs {b.get(bad[0])}")
            break
    if [s for s, _ in run["val_losses"]] != [s for s, _ in ref["val_losses"]]:
        out.append("evaluated at other steps than one device")
    for (step, a), (_, b) in zip(run["val_losses"], ref["val_losses"]):
        if not abs(a - b) <= tol:
            out.append(f"the held-out loss at step {step} differs: {a:.6f} vs {b:.6f}")
            break
    return out


def _row(name: str, world: int, dtype: str, run: dict, ref: dict, job=None) -> dict:
    """``job``: the config every run shares (None: the default's)."""
    job = job or load_config(None, [])
    bound = bounds(dev.device_type(), dtype, job.optimizer, ref, job.quantize.float8)
    last = [r for r in run["logged"] if "loss" in r][-1]
    delta = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    memory = last.get("mem_max_allocated_gib", last.get("mem_peak_rss_gib"))
    found = differences(run, ref, **bound)
    return {"layout": name, "world": world, "dtype": dtype, "max_dloss": delta, "tolerance": bound["tol"],
            "tokens_per_sec": last["tokens_per_sec"], "mfu": last.get("mfu"), "peak_mem_gib": memory,
            "status": "DIFFERS: " + found[0] if found else "PASS", "differences": found}


def batch_overrides(world: int, name: str, overrides: list[str], batch: int) -> list[str]:
    """The local batch that makes a layout train ``batch`` sequences a step (the job's), given its
    degrees; the layout's own overrides may still set another."""
    given = dict(parse_overrides(overrides))  # (the last of each wins, as when the config loads)
    split = 1
    for key in ("tensor_parallel_degree", "pipeline_parallel_degree", "context_parallel_degree"):
        split *= int(given.get(f"parallelism.{key}", 1))
    dp = max(1, world // split)
    local = max(1, batch // dp // ACCUMULATION.get(name, 1))
    return ["--training.local_batch_size", str(local), "--training.global_batch_size", str(batch)]


def refusal(base: str | Path, overrides: list[str], world: int) -> str | None:
    """The one line the job's check gives a layout before it starts (None: it may run)."""
    try:
        preflight(load_config(base, overrides), world)
    except ConfigError as e:
        return str(e).splitlines()[0]
    return None


def selftest(nproc: int, dtypes: list[str], extra: dict[str, list[str]],
             base: str | Path = BASE, only: list[str] | None = None, overrides: list[str] = ()) -> list[dict]:
    """One row per layout and dtype: the built-in layouts of at most ``nproc`` processes (those
    named in ``only``, when given), and ``extra`` ({name: overrides}) on ``nproc`` processes, each
    against one device; ``overrides`` (the job's, on ``base``) apply to every run, the one
    device's included."""
    job = load_config(base, list(overrides))
    batch = job.training.global_batch_size or job.training.local_batch_size
    table = [(w, n, o) for w, n, o in LAYOUTS if w <= nproc and (only is None or n in only)]
    table += [(nproc, n, o) for n, o in extra.items()]
    rows = []
    for dtype in dtypes:
        common = [*overrides, "--training.mixed_precision_param", dtype, "--training.tf32", "false"]
        ref = run_each(1, {"one_device": [*common, *REFERENCE]}, base)["one_device"]
        if isinstance(ref, str):  # nothing to compare with: every layout of this dtype says so
            rows += [_error_row(n, w, dtype, f"no one-device run: {ref}")
                     for w, n, _ in [(1, "one_device", None), *table]]
            continue
        rows.append(_row("one_device", 1, dtype, ref, ref, job))
        for world in sorted({w for w, _, _ in table}):
            layouts = {n: [*common, *batch_overrides(w, n, o, batch), *o] for w, n, o in table if w == world}
            refused = {n: refusal(base, o, world) for n, o in layouts.items()}
            rows += [{"layout": n, "world": world, "dtype": dtype, "status": f"REFUSED: {line}"}
                     for n, line in refused.items() if line]
            layouts = {n: o for n, o in layouts.items() if not refused[n]}
            for name, result in run_each(world, layouts, base).items() if layouts else ():
                rows.append(_error_row(name, world, dtype, result) if isinstance(result, str)
                            else _row(name, world, dtype, result, ref, job))
    return rows


def run_each(world: int, layouts: dict, base: str | Path = BASE) -> dict[str, dict | str]:
    """Each layout's result, or the one-line reason it has none. The layouts of a world train in
    one group of processes; a rank that dies ends the group, so the layout it died in gets that
    error and the layouts after it train in a new group."""
    outcome, pending = {}, dict(layouts)
    while pending:
        results, error = run_group(world, pending, base)
        outcome.update(results)
        pending = {n: o for n, o in pending.items() if n not in results}
        if error is None:
            break
        if pending:
            outcome[next(iter(pending))] = _reason(error)
            pending.pop(next(iter(pending)))
        else:  # every layout done, the group failed after them: the last one's row says so
            outcome[next(reversed(results))] = f"after training, at the group's end: {_reason(error)}"
    return {n: outcome[n] for n in layouts}


def _reason(error: RuntimeError) -> str:
    """The failed rank's exception line, at most 200 characters."""
    lines = [line for line in str(error).splitlines() if re.match(r"[\w.]+(Error|Exception)\b", line)]
    return lines[-1][:200] if lines else "a rank died (no Python error: a signal or a native abort)"


def _error_row(name: str, world: int, dtype: str, error: str) -> dict:
    return {"layout": name, "world": world, "dtype": dtype, "status": f"ERROR: {error}"}


def format_rows(rows: list[dict]) -> str:
    def fmt(row: dict) -> list[str]:
        if "max_dloss" not in row:
            return [row["layout"], str(row["world"]), row["dtype"], "", "", "", "", "", row["status"]]
        mfu = "n/a" if row["mfu"] is None else f"{100 * row['mfu']:.1f}%"
        return [row["layout"], str(row["world"]), row["dtype"], f"{row['max_dloss']:.1e}",
                f"{row['tolerance']:.0e}", f"{row['tokens_per_sec']:,.0f}", mfu, f"{row['peak_mem_gib']:.2f}",
                row["status"]]

    header = ["layout", "world", "dtype", "max|dloss|", "tol", "tokens/s", "MFU", "peak GiB", "result"]
    cells = [header] + [fmt(r) for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in cells)
