"""The one place that knows about the accelerator: device, backend, memory and peak FLOP/s.

nccl with CUDA, gloo on CPU. Nothing else in torchpar calls ``torch.cuda``.
"""

from __future__ import annotations

import atexit
import os
import resource
import time
from datetime import timedelta

import torch
import torch.distributed as dist

# Dense bf16 peak FLOP/s per device, from the vendors' datasheets (no sparsity).
GPU_PEAK_BF16 = {
    "H200": 989e12,
    "H100": 989e12,  # SXM; the PCIe part is 756e12
    "H100 PCIe": 756e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10": 125e12,
    "V100": 125e12,  # fp16 tensor cores (no bf16)
}


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_nproc() -> int:
    """Processes ``run_train.sh`` starts when NGPU is unset: one per visible GPU, else 2 CPU ranks."""
    return torch.cuda.device_count() if device_type() == "cuda" else 2


def backend() -> str:
    return "nccl" if device_type() == "cuda" else "gloo"


def local_device() -> torch.device:
    if device_type() == "cuda":
        index = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def init_distributed(timeout_s: int = 600) -> tuple[int, int]:
    """Join (or create) the default process group; returns (rank, world size).

    Without torchrun a one-rank group on an in-memory store is made, so a single process runs
    the same code path as many. Every group is destroyed at exit at the latest, while the
    interpreter is whole: a gloo worker thread still holding a tensor when the interpreter is torn
    down aborts the process ("terminate called without an active exception").
    """
    if not dist.is_initialized():
        # The flight recorder keeps the last collectives of every group (any backend), for the
        # watchdog's dump when a job hangs; a ring buffer, cheap.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        atexit.register(shutdown_distributed)
        if "RANK" in os.environ:
            dist.init_process_group(backend(), timeout=timedelta(seconds=timeout_s), device_id=local_device()
                                    if device_type() == "cuda" else None)
        else:
            dist.init_process_group(backend(), store=dist.HashStore(), rank=0, world_size=1)
    return dist.get_rank(), dist.get_world_size()


def shutdown_distributed() -> None:
    """Destroy every process group (subgroups with the default one); a no-op when there is none."""
    if dist.is_initialized():
        dist.destroy_process_group()


def synchronize() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()


def record_memory_history(enabled: bool) -> bool:
    """Start (or stop) recording CUDA allocations for memory snapshots; False without CUDA."""
    if device_type() != "cuda":
        return False
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=100_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)
    return True


def memory_snapshot() -> dict:
    """The recorded allocations (for pytorch.org/memory_viz); CUDA only."""
    return torch.cuda.memory._snapshot()


def reset_peak_memory() -> None:
    if device_type() == "cuda":
        torch.cuda.reset_peak_memory_stats()


def memory_stats() -> dict[str, float]:
    """GiB: max allocated/reserved on GPU; on CPU the process's current and peak RSS."""
    if device_type() == "cuda":
        return {"mem_max_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
                "mem_max_reserved_gib": torch.cuda.max_memory_reserved() / 2**30}
    with open("/proc/self/statm") as f:
        rss_pages = int(f.read().split()[1])
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem_rss_gib": rss_pages * os.sysconf("SC_PAGE_SIZE") / 2**30,
            "mem_peak_rss_gib": peak_kib / 2**20}


def peak_flops(dtype: torch.dtype, matmul_dim: int) -> tuple[float, str]:
    """Peak FLOP/s of this process's device, and where the figure came from.

    GPU: the datasheet table above by device name. CPU there is no table: one matmul of the
    model's width (``matmul_dim`` x 4·dim, 2048 rows) is timed in this process, with its current
    thread count, and the best of a few runs is taken as the peak.
    """
    if device_type() == "cuda":
        name = torch.cuda.get_device_name()
        for key in sorted(GPU_PEAK_BF16, key=len, reverse=True):
            if key in name:
                return GPU_PEAK_BF16[key], f"datasheet bf16 peak for {name}"
        return 312e12, f"unknown GPU {name}: assumed A100 bf16 peak"
    m, k, n = 2048, matmul_dim, 4 * matmul_dim
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return (2 * m * k * n / best,
            f"measured: best of 5 {m}x{k}x{n} {dtype} matmuls on {torch.get_num_threads()} thread(s)")


if __name__ == "__main__":
    # For run_train.sh, which must not ask torch.cuda itself: "<default processes> <device type>".
    print(default_nproc(), device_type())
