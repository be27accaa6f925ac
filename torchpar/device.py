"""The one place that knows about the accelerator: device, backend, memory and peak FLOP/s.

nccl with CUDA, gloo on CPU. Nothing else in torchpar's runtime calls ``torch.cuda``; the models,
below it, ask a tensor's device itself (grouped GEMM's compute capability in ``models/moe.py``).
"""

from __future__ import annotations

import atexit
import fcntl
import gc
import os
import re
import resource
import socket
import struct
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from torchpar.console import progress
from torchpar.errors import ConfigError, RankError

# Dense peak FLOP/s per device, no sparsity: (bf16/fp16 tensor cores, TF32 tensor cores, plain
# fp32), from the vendors' datasheets (NVIDIA's product datasheets; AMD's MI300X data sheet). fp32
# matmuls run on the TF32 column when TF32 is on (training.tf32), else on the fp32 one. Matched by
# the longest key found in torch.cuda.get_device_name() (ROCm reports its GPUs as cuda devices).
GPU_PEAKS = {
    "GB200": (2.5e15, 1.25e15, 80e12),
    "B200": (2.25e15, 1.1e15, 75e12),  # HGX B200, 1000 W
    "H100": (989e12, 494.7e12, 67e12),  # SXM ("NVIDIA H100 80GB HBM3")
    "H100 PCIe": (756e12, 378e12, 51e12),
    "H100 NVL": (835e12, 417.5e12, 60e12),
    "H200": (989e12, 494.7e12, 67e12),  # SXM
    "H200 NVL": (835e12, 417.5e12, 60e12),
    "GH200": (989e12, 494.7e12, 67e12),  # Grace Hopper's GPU: an H100 SXM's ("NVIDIA GH200 480GB")
    "H800": (989e12, 494.7e12, 67e12),  # SXM
    "H800 PCIe": (756e12, 378e12, 51e12),
    "H20": (148e12, 74e12, 44e12),
    "A100": (312e12, 156e12, 19.5e12),
    "A10": (125e12, 62.5e12, 31.2e12),
    "A10G": (70e12, 35e12, 31.2e12),  # AWS-only A10 variant: no vendor datasheet; commonly quoted figures
    "L4": (121e12, 60e12, 30.3e12),
    "L40": (181e12, 90.5e12, 90.5e12),
    "L40S": (362e12, 183e12, 91.6e12),
    "MI300X": (1307.4e12, 653.7e12, 163.4e12),
}


# Dense FP8 (e4m3) FLOP/s per device, from the same datasheets (half the figure quoted with
# sparsity); a GPU without FP8 tensor cores (A100, A10) is absent.
GPU_FP8_PEAKS = {
    "GB200": 5e15, "B200": 4.5e15, "H100": 1979e12, "H100 PCIe": 1513e12, "H100 NVL": 1671e12,
    "H200": 1979e12, "H200 NVL": 1671e12, "GH200": 1979e12, "H800": 1979e12, "H800 PCIe": 1513e12,
    "H20": 296e12, "L4": 242.5e12, "L40": 362e12, "L40S": 733e12, "MI300X": 2614.9e12,
}


def _table_key(name: str, table: dict) -> str | None:
    """The longest key of ``table`` found in GPU ``name`` as a word."""
    for key in sorted(table, key=len, reverse=True):
        if re.search(rf"(^|[\s-]){re.escape(key)}($|[\s-])", name):
            return key
    return None


def gpu_peak(name: str, dtype: torch.dtype, tf32: bool) -> float | None:
    """Datasheet peak of GPU ``name`` for matmuls in ``dtype``; None for a GPU not in the table."""
    key = _table_key(name, GPU_PEAKS)
    if key is None:
        return None
    bf16, tf32_peak, fp32 = GPU_PEAKS[key]
    if dtype in (torch.bfloat16, torch.float16):
        return bf16
    return tf32_peak if tf32 else fp32


def fp8_gain(name: str) -> float:
    """How many times GPU ``name``'s datasheet FP8 peak is its bf16 one (what the planner scales a
    measured bf16 rate by for FP8 matmuls); 0 for a GPU without FP8 in the tables."""
    key, bf16 = _table_key(name, GPU_FP8_PEAKS), gpu_peak(name, torch.bfloat16, True)
    return GPU_FP8_PEAKS[key] / bf16 if key and bf16 else 0.0


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The compute capability of CUDA ``device``; None for any other device."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def generator_identity() -> dict:
    """What decides the numbers a seeded generator draws on this machine's device (the one this
    process uses): its kind, and on a GPU the launch grid torch's random kernels spread a tensor
    over — sized by the multiprocessors and their threads, so another GPU model draws other numbers
    from the same seed."""
    if device_type() != "cuda":
        return {"kind": "cpu"}
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    return {"kind": "cuda", "name": p.name, "multiprocessors": p.multi_processor_count,
            "threads": p.max_threads_per_multi_processor}


def same_draws(a: dict, b: dict) -> bool:
    """Whether generators of identities ``a`` and ``b`` (:func:`generator_identity`) draw the same
    numbers from a seed (an identity of an older checkpoint may hold its kind alone)."""
    return all(a.get(k) == b.get(k) for k in ("kind", "multiprocessors", "threads"))


def describe_generator(g: dict) -> str:
    if g.get("kind") != "cuda" or "multiprocessors" not in g:
        return f"a {g.get('kind', 'cpu')} device"
    return f"{g['name']} ({g['multiprocessors']} multiprocessors x {g['threads']} threads)"


def device_rng_state() -> torch.Tensor | None:
    """This process's GPU generator state (LoRA's dropout and DTensor's random ops draw from it);
    None on the CPU, whose generator is ``torch.get_rng_state``'s."""
    return torch.cuda.get_rng_state() if device_type() == "cuda" else None


def set_device_rng_state(state: torch.Tensor) -> None:
    if device_type() == "cuda":
        torch.cuda.set_rng_state(state)


def float8_matmuls() -> str | None:
    """Why this machine's device cannot run FP8 matmuls (torch._scaled_mm), or None when it can: a
    CUDA GPU needs FP8 tensor cores (compute capability 8.9: Ada, Hopper, Blackwell); ROCm's and the
    CPU's kernels run them (the CPU's slowly, for correctness)."""
    if device_type() != "cuda" or torch.version.hip:
        return None
    capability = torch.cuda.get_device_capability()
    if capability >= (8, 9):
        return None
    return (f"{device_name()} (compute capability {capability[0]}.{capability[1]}) has no FP8 tensor cores "
            "(8.9 and later: L4, L40S, H100, H200, B200)")


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_name() -> str:
    """This process's device as its vendor names it ('NVIDIA H100 80GB HBM3'), or 'CPU'."""
    return torch.cuda.get_device_name() if device_type() == "cuda" else "CPU"


def default_nproc() -> int:
    """Processes ``run_train.sh`` starts when NGPU is unset: one per visible GPU, else 2 CPU ranks."""
    return torch.cuda.device_count() if device_type() == "cuda" else 2


def compute_dtype(setting: str, device: str | None = None) -> str:
    """``training.mixed_precision_param`` on ``device`` (default: this machine's): 'auto' is bf16
    on GPUs (fp32 master weights), fp32 on CPUs, where bf16 matmuls are an order of magnitude slower."""
    if setting != "auto":
        return setting
    return "bfloat16" if (device or device_type()) == "cuda" else "float32"


def backend(cpu_tensors: bool = False) -> str:
    """The default group's backend. With ``cpu_tensors`` (CPU offload: gradients and their norm
    live on the host) a GPU job gets gloo beside nccl, so host tensors have a backend too; only
    then, as gloo connects every pair of ranks at start-up."""
    if device_type() != "cuda":
        return "gloo"
    return "cpu:gloo,cuda:nccl" if cpu_tensors else "nccl"


def local_device(tf32: bool = True) -> torch.device:
    """This process's device: GPU :func:`device_index`. ``tf32``: fp32 matmuls and convolutions in
    TF32 on GPUs."""
    if device_type() == "cuda":
        index = device_index()
        torch.cuda.set_device(index)
        # The fp32_precision settings, not allow_tf32: torch deprecates those, and reading them
        # raises once anything has used the new ones.
        precision = "tf32" if tf32 else "ieee"
        torch.backends.cuda.matmul.fp32_precision = torch.backends.cudnn.conv.fp32_precision = precision
        return torch.device("cuda", index)
    keep_freed_host_memory()
    return torch.device("cpu")


def current_device() -> torch.device:
    """The device this process computes on, as :func:`local_device` set it (nothing changed)."""
    if device_type() == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def fp32_precision() -> str:
    """How fp32 matmuls run here: 'tf32' or 'ieee' on a GPU (as :func:`local_device` set it), 'ieee'
    on the CPU."""
    return torch.backends.cuda.matmul.fp32_precision if device_type() == "cuda" else "ieee"


def device_index() -> int:
    """This process's GPU: ``LOCAL_RANK``, the index on this node (never the global rank) — or the
    one GPU a task sees under ``srun --gpus-per-task=1`` (each task started by srun, without
    torchrun, sees only its own GPU, as device 0, whatever its SLURM_LOCALID)."""
    index, count = int(os.environ.get("LOCAL_RANK", 0)), torch.cuda.device_count()
    if index >= count == 1 and started_by_srun(os.environ):
        return 0
    if index >= count:
        raise RankError(
            f"LOCAL_RANK {index} but this node has {count} visible GPU(s): start at most {count} "
            "processes per node (NGPU / --nproc-per-node), or fix CUDA_VISIBLE_DEVICES")
    return index


def started_by_srun(env) -> bool:
    """This process is one of srun's tasks, with no torchrun in between."""
    return ("SLURM_PROCID" in env and "TORCHELASTIC_RUN_ID" not in env
            and env.get("RANK") == env["SLURM_PROCID"])


def keep_freed_host_memory() -> None:
    """Training on the CPU: serve tensors from the process heap and keep what is freed there, as
    CUDA's caching allocator does on a GPU. glibc's malloc otherwise maps every large block (over
    its adaptive threshold, and always over 32 MB) fresh from the kernel and unmaps it when freed,
    so each step faults its activations in again, zero-filled page by page (at 8 x 512 tokens of
    the benchmarks' model: ~70,000 page faults and 4-6% of the step). The heap keeps the step's
    peak instead. No-op where the C library is not glibc."""
    import ctypes
    import platform

    if platform.libc_ver()[0] != "glibc":
        return
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_mmap_max = -1, -4  # <malloc.h>
    libc.mallopt(m_mmap_max, 0)  # no block gets its own mapping
    libc.mallopt(m_trim_threshold, 2**31 - 1)  # the heap's free top is not given back (up to 2 GiB)


def bind_thread_to_device() -> None:
    """A new thread's CUDA calls go to GPU 0 until it sets its own device: threads that work for
    this rank (the checkpoint writer) call this first."""
    if device_type() == "cuda":
        torch.cuda.set_device(device_index())


def slurm_environment(env: dict[str, str]) -> dict[str, str]:
    """The torchrun-style variables for a process that ``srun`` started without torchrun, from the
    step's SLURM variables; {} when this is no multi-task srun step or torchrun already set them.
    srun starts one process per task, so every task must join one job: without this each would
    run alone as rank 0 of 1, all writing the same checkpoints and metrics. Variables that do not
    add up are one line here, before any process group waits for ranks that cannot come."""
    if "RANK" in env:
        return {}
    tasks = count_of(env, "SLURM_STEP_NUM_TASKS", "1", low=1)
    if tasks <= 1:
        return {}
    missing = [k for k in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NODELIST") if not env.get(k)]
    if missing:
        raise RankError(
            f"started by srun with {tasks} tasks, but {missing[0]} is not set, so this process cannot "
            "tell its rank: launch through torchrun (scripts/slurm/train.sbatch) instead")
    rank = count_of(env, "SLURM_PROCID")
    if rank >= tasks:
        raise RankError(f"SLURM_PROCID={rank} but SLURM_STEP_NUM_TASKS={tasks}: a task's index is below "
                          "the number of tasks; start the job with srun, not with these variables by hand")
    local = count_of(env, "SLURM_LOCALID")
    nodes = count_of(env, "SLURM_STEP_NUM_NODES" if env.get("SLURM_STEP_NUM_NODES") else "SLURM_NNODES", "1",
                     low=1)
    return {"RANK": str(rank), "WORLD_SIZE": str(tasks), "LOCAL_RANK": str(local),
            "LOCAL_WORLD_SIZE": str(tasks // nodes),
            "MASTER_ADDR": env.get("MASTER_ADDR") or first_host(env["SLURM_STEP_NODELIST"]),
            # One port per job, so two jobs sharing a first node do not collide.
            "MASTER_PORT": env.get("MASTER_PORT") or str(20000 + count_of(env, "SLURM_JOB_ID", "0") % 20000)}


def count_of(env: dict[str, str], name: str, default: str | None = None, low: int = 0) -> int:
    """The whole number ``low`` or more in variable ``name`` (``default`` when unset)."""
    value = env.get(name) or default
    if value is None or not value.isdigit() or int(value) < low:
        raise RankError(f"{name}={env.get(name, '')!r}: expected a whole number {low} or more; "
                          "it is set by the launcher (torchrun, srun), not by hand")
    return int(value)


def adopt_slurm_environment() -> None:
    """Set RANK, WORLD_SIZE, ... from srun's variables (see :func:`slurm_environment`), and check
    the torchrun-style ones a multi-process job is joined by, before anything waits on them."""
    os.environ.update(slurm_environment(dict(os.environ)))
    check_rank_environment(os.environ)


def check_rank_environment(env) -> None:
    """With RANK: WORLD_SIZE, MASTER_ADDR and MASTER_PORT too, and a rank inside the world.
    Without them the process runs alone; with some, init_process_group would fail with a traceback
    or wait for ranks that do not exist."""
    if "RANK" not in env:  # (WORLD_SIZE alone is the world a single-process --check validates for)
        return
    world = count_of(env, "WORLD_SIZE", low=1)
    rank = count_of(env, "RANK")
    if rank >= world:
        raise RankError(f"RANK={rank} but WORLD_SIZE={world}: a rank is below the world size")
    count_of(env, "LOCAL_RANK", "0")
    for name in ("MASTER_ADDR", "MASTER_PORT"):
        if not env.get(name):
            raise RankError(f"RANK and WORLD_SIZE are set but {name} is not: start the processes with "
                              "torchrun (./run_train.sh), or set MASTER_ADDR and MASTER_PORT to rank 0's "
                              "host and a free port there; unset RANK and WORLD_SIZE to run one process")
    count_of(env, "MASTER_PORT", low=1)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: 'gpu[003-010,012],cpu1' -> 'gpu003'."""
    m = re.match(r"([^,\[]+)(?:\[([^-,\]]+))?", nodelist)
    if m is None:
        raise ConfigError(f"cannot read the SLURM node list {nodelist!r}: set MASTER_ADDR")
    return m.group(1) + (m.group(2) or "")


# torch 2.13 renamed these two (the old names warn at each process's first call); older torch, which
# torchpar runs on too, has only the old names. The same c10d operations either way.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_GLOO = dist.distributed_c10d.ProcessGroupGloo  # (torch's own, kept before it is replaced)


class _AnyGloo(type(_GLOO)):
    """c10d asks ``isinstance(backend, ProcessGroupGloo)`` of the backends a group hands back (to
    set a group's timeout, for one), and those come back as torch's class: any of them counts."""

    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, _GLOO)


class OneWorkerGloo(_GLOO, metaclass=_AnyGloo):
    """torch's gloo backend with one worker thread per group instead of two per network device.
    In torch 2.13 a worker, after running a collective, writes the collective's name into the
    group's status string outside the group's lock; two workers finishing together on one group
    race on that string, and a name too long for the string's inline buffer
    ("ALLGATHER_COALESCED", which DTensor's all-gathers run as) is freed twice: the rank aborts in
    malloc. One worker runs a group's collectives one after another in the order every rank
    queued them. Otherwise built as torch's own constructor builds it: a device for each interface
    in GLOO_SOCKET_IFNAME, else the host's default one."""

    def __init__(self, store, rank: int, size: int, timeout: timedelta = timedelta(minutes=30)):
        options = _GLOO._Options()
        interfaces = [name for name in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if name]
        options._devices = ([_GLOO.create_device(interface=name) for name in interfaces]
                            or [_GLOO.create_default_device()])
        options._timeout = timeout
        options._threads = 1
        super().__init__(store, rank, size, options)


def use_one_worker_gloo() -> None:
    """Every gloo group c10d makes from now on (the default one, the mesh's, the checkpointer's)
    is a :class:`OneWorkerGloo`: c10d builds them all through this one module name and takes no
    option for their thread count."""
    dist.distributed_c10d.ProcessGroupGloo = OneWorkerGloo


_MESH_STATE = DeviceMesh.__getstate__  # (torch's own, kept before it is replaced)


def _mesh_state_without_hash(mesh: DeviceMesh) -> dict:
    state = _MESH_STATE(mesh)
    state.pop("_hash", None)
    return state


def pickle_meshes_without_hash() -> None:
    """A pickled mesh leaves out its cached hash, which the mesh computes again when it is next
    hashed. torch 2.13 keeps it: a hash of strings (the device type, the dimensions' names), so a
    value of this process's string-hash seed. inductor keys a compiled graph by the pickled bytes
    of the meshes its DTensors live on, so every compiled tensor-parallel block missed the FX graph
    cache in a new process — a restarted job compiled everything again — and a mesh unpickled in
    another process held a hash that disagreed with its equals there."""
    DeviceMesh.__getstate__ = _mesh_state_without_hash


def init_distributed(timeout_s: int = 600, cpu_tensors: bool = False, tf32: bool = True) -> tuple[int, int]:
    """Join (or create) the default process group; returns (rank, world size).

    Without torchrun (or srun's variables) a one-rank group on an in-memory store is made, so a
    single process runs the same code path as many. Every group is destroyed at exit at the latest,
    while the interpreter is whole: a gloo worker thread still holding a tensor when the interpreter
    is torn down aborts the process ("terminate called without an active exception").
    """
    global _GROUP_TIMEOUT
    _GROUP_TIMEOUT = timedelta(seconds=timeout_s)
    use_one_worker_gloo()  # (before any group of ours, even where the default one exists already)
    pickle_meshes_without_hash()
    if not dist.is_initialized():
        adopt_slurm_environment()
        # The flight recorder keeps the last collectives of every group (any backend), for the
        # watchdog's dump when a job hangs; a ring buffer, cheap.
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
        atexit.register(shutdown_distributed)
        device = local_device(tf32)
        world = int(os.environ.get("WORLD_SIZE", "1"))
        across_nodes = world > local_world_size(world)
        interface = gloo_interface(os.environ.get("MASTER_ADDR", "127.0.0.1"), across_nodes)
        if interface and "GLOO_SOCKET_IFNAME" not in os.environ:
            os.environ["GLOO_SOCKET_IFNAME"] = interface
        if "RANK" in os.environ:
            join_process_group(backend(cpu_tensors), timeout_s, device)
        else:  # the same group options as many ranks: nccl connects now, not in a later barrier
            dist.init_process_group(backend(cpu_tensors), store=dist.HashStore(), rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size()


def join_process_group(name: str, timeout_s: int, device: torch.device) -> None:
    """The default group of RANK, WORLD_SIZE at MASTER_ADDR:MASTER_PORT. srun's tasks (no torchrun
    agents have met before) say whom they wait for while they wait, and a task whose peers never
    come stops with one line after ``timeout_s`` — rank 0 waits for the others in its store, and
    the others first wait for rank 0's store to answer (torch's own retries would take longer than
    the timeout and print native stack traces)."""
    env = os.environ
    rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
    host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    srun = started_by_srun(env)

    def note(seconds: float) -> str:
        whom = "the other ranks to join" if rank == 0 else "rank 0 to answer"
        return (f"torchpar: rank {rank} of {world}: waiting for {whom} at {host}:{port} ({seconds:.0f} s; "
                f"at most comm.timeout_s = {timeout_s} s)")

    # (a short timeout still says whom it waits for before it ends)
    with progress("", shown=srun, line=note, after_s=min(10.0, timeout_s / 4)):
        try:
            if srun and rank != 0:
                wait_for_listener(host, port, timeout_s)
            # device_id: nccl connects eagerly and knows its device (no guessing from the rank).
            dist.init_process_group(name, timeout=timedelta(seconds=timeout_s),
                                    device_id=device if device.type == "cuda" else None)
        except (dist.DistError, TimeoutError) as e:
            summary = str(e).strip().splitlines()[0] if str(e).strip() else "timed out"
            raise RankError(
                f"the process group of {world} ranks did not form at {host}:{port} ({type(e).__name__}: "
                f"{summary}): start all {world} processes (under srun: every task of the step) with the same "
                f"MASTER_ADDR and MASTER_PORT, or raise comm.timeout_s ({timeout_s} s) if some start "
                "slowly") from None


_GROUP_TIMEOUT = timedelta(seconds=600)  # comm.timeout_s, once init_distributed has run


def group_timeout() -> timedelta:
    """comm.timeout_s, for a group made after the default one (c10d would give it its own default:
    30 minutes on gloo, 10 on nccl): the mesh's groups, the probe's, the checkpointer's."""
    return _GROUP_TIMEOUT


OUTWARD = "10.255.255.1"  # an address no host has: the route to it is the default route


def gloo_interface(master: str, across_nodes: bool = False) -> str | None:
    """The network interface by which this host reaches ``master`` (rank 0's address), for every
    gloo group (the checkpointer's; the whole job's on CPU). Left alone, gloo binds the address
    its host name resolves to, which on many clusters is 127.0.1.1 (no other node reaches it) and
    on an offline host a lookup that can hang. ``across_nodes`` (the job has other nodes): on rank
    0's own node, where MASTER_ADDR is its host name and that name maps to 127.0.1.1, the route is
    the loopback, which the other nodes cannot reach; the default route's interface is taken
    instead. None when no route or interface is found."""
    name, address = _route(master)
    if across_nodes and address is not None and address.startswith("127."):
        outward = _route(OUTWARD)[0]
        return outward or name
    return name


def _route(host: str) -> tuple[str | None, str | None]:
    """(interface, its IPv4 address) of the route to ``host``; (None, None) without one."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))  # a datagram socket only picks its route: nothing is sent
            address = s.getsockname()[0]
            for _, name in socket.if_nameindex():
                request = struct.pack("256s", name.encode()[:15])
                try:
                    found = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, request)[20:24])  # SIOCGIFADDR
                except OSError:
                    continue  # an interface without an IPv4 address
                if found == address:
                    return name, address
    except OSError:
        return None, None
    return None, None


def wait_for_listener(host: str, port: int, timeout_s: float) -> None:
    """Until something accepts a connection at host:port; TimeoutError after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))
                                     ).close()
            return
        except OSError:
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing answered in {timeout_s} s") from None
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def shutdown_distributed() -> None:
    """Destroy every process group (subgroups with the default one); a no-op when there is none.
    Garbage (a finished trainer's reference cycles, which may hold collectives' work objects and
    tensors) is collected first, while every gloo worker thread can still take the interpreter's
    lock to let go of a tensor."""
    if dist.is_initialized():
        gc.collect()
        dist.destroy_process_group()


def synchronize() -> None:
    if device_type() == "cuda":
        torch.cuda.synchronize()


def record_event():
    """A CUDA event after the work queued so far, to wait for that work alone later; None on CPU,
    where the work is already done."""
    if device_type() != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event


def record_timing_event():
    """A CUDA event that keeps its time, recorded on the current stream after the work queued so
    far: the step breakdown's borders, read later without stopping the host at each one."""
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


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


def cap_memory(gib: float) -> None:
    """A GPU's caching allocator may hold at most ``gib`` GiB (0: no cap); on the CPU the planner's
    check before launch is the cap."""
    if gib > 0 and device_type() == "cuda":
        total = torch.cuda.get_device_properties(device_index()).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, gib * 2**30 / total), device_index())


def host_memory() -> float:
    """Bytes of this host's memory."""
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_world_size(world: int) -> int:
    """Ranks on this host: LOCAL_WORLD_SIZE (torchrun's, or srun's once adopted), else ``world``."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world))


def rank_memory(per_node: int) -> float:
    """Bytes one rank may fill: its GPU's, or on the CPU this host's memory shared by its
    ``per_node`` ranks."""
    return device_memory() or host_memory() / per_node


def device_memory() -> float | None:
    """Bytes of this process's GPU; None on the CPU."""
    if device_type() == "cuda":
        return float(torch.cuda.get_device_properties(device_index()).total_memory)
    return None


def empty_cache() -> None:
    """Give the caching allocator's free blocks back to the GPU (between jobs in one process)."""
    if device_type() == "cuda":
        torch.cuda.empty_cache()


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


def peak_flops(dtype: torch.dtype, matmul_dim: int, tf32: bool = True,
               override_tflops: float = 0.0) -> tuple[float | None, str]:
    """Peak FLOP/s of this process's device for matmuls in ``dtype``, and where the figure came
    from; None (MFU unknown) for a GPU the table lacks.

    ``override_tflops`` (``metrics.peak_tflops``) wins. GPU: the datasheet table above. CPU has no
    table: one matmul of the model's width (``matmul_dim`` x 4·dim, 2048 rows) is timed in this
    process, with its current thread count, and the best of a few runs is taken as the peak.
    """
    if override_tflops > 0:
        return override_tflops * 1e12, "metrics.peak_tflops"
    if device_type() == "cuda":
        name = device_name()
        peak = gpu_peak(name, dtype, tf32)
        kind = str(dtype).removeprefix("torch.") + (" (TF32)" if dtype == torch.float32 and tf32 else "")
        if peak is None:
            return None, (f"{name} is not in torchpar's table of datasheet peaks, so no MFU is reported: set "
                          f"metrics.peak_tflops to its dense {kind} peak in TFLOP/s")
        return peak, f"datasheet {kind} peak of {name}"
    m, k, n = 2048, matmul_dim, 4 * matmul_dim
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return (2 * m * k * n / best,
            f"measured: best of 5 {m}x{k}x{n} {dtype} matmuls on {torch.get_num_threads()} thread(s)")

