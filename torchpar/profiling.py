"""torch.profiler traces of chosen steps, on every rank, and CUDA memory snapshots.

Every ``profile_freq`` steps the profiler warms up for ``profile_warmup`` steps and records
``profile_active`` steps; each rank writes a Chrome trace (chrome://tracing, Perfetto) to
``<dump_folder>/profiling/traces/iteration_<step>/rank<r>_trace.json``. Memory snapshots
(allocations recorded by ``torchpar.device``; open them at pytorch.org/memory_viz) are written
every ``profile_freq`` steps and, when the device runs out of memory, before the process dies;
they exist only for CUDA.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

from torchpar import device as dev
from torchpar.console import warn


class Profiler:
    def __init__(self, cfg, dump_folder: str, rank: int, device_type: str):
        """``cfg`` is the [profiling] section."""
        self.cfg, self.rank, self.step_no = cfg, rank, 0
        self.folder = Path(dump_folder) / "profiling"
        self.prof = None
        if cfg.enable_profiling:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if device_type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            wait = cfg.profile_freq - cfg.profile_warmup - cfg.profile_active
            self.prof = torch.profiler.profile(
                activities=activities, on_trace_ready=self._write_trace,
                schedule=torch.profiler.schedule(wait=wait, warmup=cfg.profile_warmup,
                                                 active=cfg.profile_active))
            self.prof.start()
        self.snapshots = cfg.enable_memory_snapshot and dev.record_memory_history(True)
        if cfg.enable_memory_snapshot and not self.snapshots:
            warn("profiling.enable_memory_snapshot: memory snapshots exist only for CUDA; on this device "
                 "only the traces of profiling.enable_profiling are written")

    def _write_trace(self, prof) -> None:
        out = self.folder / "traces" / f"iteration_{self.step_no}"
        out.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(out / f"rank{self.rank}_trace.json"))

    def step(self, step: int) -> None:
        """After training step ``step``."""
        self.step_no = step
        if self.prof is not None:
            self.prof.step()
        if self.snapshots and step % self.cfg.profile_freq == 0:
            self.memory_snapshot(f"iteration_{step}")

    def memory_snapshot(self, name: str) -> None:
        if not self.snapshots:
            return
        out = self.folder / "memory_snapshot" / name
        out.mkdir(parents=True, exist_ok=True)
        with open(out / f"rank{self.rank}_memory_snapshot.pickle", "wb") as f:
            pickle.dump(dev.memory_snapshot(), f)

    def close(self) -> None:
        if self.prof is not None:
            self.prof.stop()
            self.prof = None
        if self.snapshots:
            dev.record_memory_history(False)
            self.snapshots = False
