"""Run many layouts in one group of spawned gloo processes and compare them with one process.

``run_layouts(world, {name: overrides})`` starts ``world`` processes once; each layout trains
the tiny test config with its overrides, and rank 0 returns per-step losses, full parameters
(gathered over TP, FSDP and pipeline stages), the per-rank state bytes logged at the first step,
the windows each data-parallel rank trained on (CRC32 per window, in order) and the held-out
losses when [validation] is enabled.

``spawn_ranks`` starts the processes for it and for other multi-rank fixtures: each rank logs to
its own file, and a rank that dies shows its log in the error.
"""

from __future__ import annotations

import json
import os
import re
import socket
import tempfile
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.multiprocessing.spawn import ProcessException

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "tests" / "tiny.toml"
NATIVE_ERROR = re.compile(r"terminate called|what\(\)|enforce fail|Fatal|SIGABRT|SIGSEGV")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, target, world: int, port: int, out: str, args: tuple) -> None:
    # Each rank's output goes to its own file, at the descriptor level so that a C++ abort's
    # message is kept too; spawn_ranks shows it when a rank dies.
    log = open(f"{out}/rank{rank}.log", "w", buffering=1)
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    torch._C._set_print_stack_traces_on_fatal_signal(True)  # a native crash logs every thread's stack
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        target(rank, world, out, *args)
    finally:
        dist.destroy_process_group()


def spawn_ranks(target, world: int, *args) -> str:
    """Run ``target(rank, world, out, *args)`` in ``world`` spawned processes (one thread each,
    in a gloo world process group) and return ``out``, the folder they wrote to. A rank that fails
    (a Python error, a signal) fails the call at once, with every rank's last lines."""
    out = tempfile.mkdtemp(prefix="torchpar_ranks_")
    try:
        mp.start_processes(_rank_main, args=(target, world, free_port(), out, args), nprocs=world,
                           start_method="spawn")
    except ProcessException as e:
        raise RuntimeError(f"{e}\n{_log_tails(out, world, e.error_index)}") from None
    return out


def _worker(rank: int, world: int, out: str, layouts: dict) -> None:
    from torchpar.config import load_config
    from torchpar.data.loader import PackedWindows
    from torchpar.plan import predict_for_trainer
    from torchpar.train import Trainer

    seen: list[tuple[int, int, list[int]]] = []  # (loader id, dp rank, window CRCs)
    plain_iter = PackedWindows.__iter__

    def recording_iter(self):
        for batch in plain_iter(self):
            seen.append((id(self), self.dp_rank, [zlib.crc32(row.numpy().tobytes()) for row in batch]))
            yield batch

    PackedWindows.__iter__ = recording_iter
    results = {}
    try:
        for name, overrides in layouts.items():
            cfg = load_config(TINY, list(overrides) + ["--job.dump_folder", f"{out}/{name}"])
            seen.clear()
            trainer = Trainer(cfg, on_first_step=predict_for_trainer)
            losses = trainer.train()
            params = trainer.full_parameters()
            gathered = [None] * world
            trained = [
                (d, crcs) for loader, d, crcs in seen if loader == id(trainer.dataloader.dataset)
            ]  # not evaluation's
            dist.all_gather_object(gathered, (params, trained))
            if rank == 0:
                merged, windows = {}, {}
                for p, w in gathered:
                    merged.update(p)
                    batches = [batch for _, batch in w]
                    for dp_rank in {d for d, _ in w}:
                        # The TP / pipeline ranks of one data-parallel rank read the same windows.
                        assert windows.setdefault(dp_rank, batches) == batches, (
                            f"dp rank {dp_rank} ranks disagree"
                        )
                metrics = Path(f"{out}/{name}/metrics.jsonl").read_text().splitlines()
                logged = [json.loads(line) for line in metrics]
                results[name] = {"losses": losses, "params": merged, "step1": logged[0], "windows": windows,
                                 "val_losses": trainer.val_losses, "logged": logged}
            dist.barrier()
    finally:
        if rank == 0:
            torch.save(results, f"{out}/results.pt")


def run_layouts(world: int, layouts: dict[str, list[str]]) -> dict:
    """Rank 0's results per layout."""
    return torch.load(f"{spawn_ranks(_worker, world, layouts)}/results.pt", weights_only=False)


def _log_tails(out: str, world: int, failed: int) -> str:
    """The failed rank's first 10 native error lines (a C++ abort prints them before the
    stacks) and its last 40 lines, and every other rank's last 3 lines; warnings left out."""
    parts = []
    for rank in [failed] + [r for r in range(world) if r != failed]:
        path = Path(f"{out}/rank{rank}.log")
        lines, skip = [], False
        for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
            if not skip and "Warning: " not in line:
                lines.append(line)
            skip = "Warning: " in line  # a warning's second line is the source line
        if rank == failed:
            native = [line for line in lines[:-40] if NATIVE_ERROR.search(line)][:10]
            parts.append(f"--- rank {rank} ---\n" + "\n".join(native + lines[-40:]))
        else:
            parts.append(f"--- rank {rank} ---\n" + "\n".join(lines[-3:]))
    return "\n".join(parts)


def assert_matches(run: dict, ref: dict, tol: float = 1e-5, param_tol: float | None = None,
                   per_param: dict[str, float] | None = None) -> None:
    """Losses and held-out losses within ``tol``; final parameters within ``param_tol`` (default
    ``tol``), or the tolerance ``per_param`` gives a parameter by name."""
    param_tol = tol if param_tol is None else param_tol
    assert len(run["losses"]) == len(ref["losses"])
    dl = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    assert dl <= tol, f"losses differ by {dl:.2e}: {run['losses']} vs {ref['losses']}"
    assert run["params"].keys() == ref["params"].keys(), set(run["params"]) ^ set(ref["params"])
    for k in ref["params"]:
        dp = (run["params"][k] - ref["params"][k]).abs().max().item()
        assert dp <= (per_param or {}).get(k, param_tol), f"final parameter {k} differs by {dp:.2e}"
    assert [s for s, _ in run["val_losses"]] == [s for s, _ in ref["val_losses"]], "evaluated at other steps"
    for (step, a), (_, b) in zip(run["val_losses"], ref["val_losses"]):
        assert abs(a - b) <= tol, f"held-out loss at step {step} differs: {a} vs {b}"
