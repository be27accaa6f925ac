"""The machine at hand, measured: what the step-time model needs, for planning the job that runs here.

Every rank measures at once (ranks that share cores or a memory bus slow each other, as they will
in training), and the slowest rank's figure is kept, since a step waits for it:

- matmul throughput in the compute dtype, at the model's width (FLOP/s per rank), and the rate the
  model itself reaches (one block's forward and backward with embedding, head and loss, on at
  least 512 and 1,024 tokens) with its fixed costs per block and per forward (one and two blocks
  on one sequence): the planner's compute term uses these, which count what matmuls leave out;
- the cores each rank has (where a host's ranks share its CPU cores);
- device memory bandwidth (a large copy, read + write);
- for groups of every size that divides the world (consecutive ranks; across nodes also the
  group of one rank per node), each collective the layouts use (all-reduce, all-gather,
  reduce-scatter, all-to-all, send/recv) at three sizes, fitted to ``seconds = latency + bytes /
  bandwidth``, where bytes are what the planner and the communication ledger count for that
  collective (RING_FACTOR x payload).

The figures are cached per cluster (SLURM's cluster name, else the set of its hosts) and job
shape (world, ranks per node, device, dtype and fp32 precision, model), so a probe costs its few
seconds once. It runs on the device and precision the job set (it changes neither), its model
runs inside the memory it is given (fewer tokens, or none: then the matmul rate stands in), and
each partition's groups come from one split of the default group's NCCL communicator where it is
bound to a device (one call per partition, not one per group on every rank). The datasheet
presets (``PRESETS``) stay for clusters one is not on.
"""

from __future__ import annotations

import gc
import hashlib
import json
import os
import socket
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from torchpar import device as dev
from torchpar.parallel.layout import Layout
from torchpar.parallel.ledger import RING_FACTOR
from torchpar.plan.activations import ends_bytes, stage_activation_bytes
from torchpar.plan.layout import Cluster

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")
REPEATS = 5  # timed runs per size (the median kept), after two untimed (the first connects a new group)
VERSION = 9  # of the cache's format and of what is measured


def _sizes(device_type: str) -> tuple[tuple[int, int], ...]:
    """(bytes of each rank's buffer, back-to-back calls timed together): small sizes (latency) to
    large (bandwidth); many calls of the small ones, so that one late rank does not set the figure.
    The same on every rank (the calls are collectives)."""
    if device_type == "cpu":
        return (2**12, 16), (2**15, 8), (2**18, 4), (2**21, 2), (2**23, 1)
    return (2**16, 16), (2**20, 8), (2**24, 2), (2**27, 1)


def cache_folder() -> Path:
    """$TORCHPAR_CACHE, else $XDG_CACHE_HOME/torchpar, else ~/.cache/torchpar (the system's
    temporary folder when there is no home)."""
    if os.environ.get("TORCHPAR_CACHE"):
        return Path(os.environ["TORCHPAR_CACHE"])
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]) / "torchpar"
    try:
        return Path.home() / ".cache" / "torchpar"
    except RuntimeError:
        return Path(tempfile.gettempdir()) / "torchpar-cache"


def _timed(fn, sync, repeats: int = REPEATS) -> float:
    """Median seconds of ``fn`` over ``repeats`` runs after two warm-up runs."""
    for _ in range(2):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _matmul_flops(dtype: torch.dtype, dim: int, device: torch.device) -> float:
    """FLOP/s of a (rows x dim) @ (dim x 4 dim) matmul, the shape of a block's first MLP matmul."""
    rows = 512 if device.type == "cpu" else 8192
    a = torch.randn(rows, dim, dtype=dtype, device=device)
    b = torch.randn(dim, 4 * dim, dtype=dtype, device=device)
    seconds = _timed(lambda: a @ b, dev.synchronize, 11)
    return 2 * rows * dim * 4 * dim / seconds


MAX_PROBE_TOKENS = 4096  # the longest sequence the model probe runs (its memory, on a large model)
PROBE_SHARE = 0.8  # of a rank's memory the model probe's runs may fill (the job's model is not built yet)
MIN_PROBE_TOKENS = 512  # the fewest tokens a model-probe run takes (a shorter one is mostly fixed cost)


def _run_bytes(model, args, blocks: int, batch: int, seq: int, dtype: torch.dtype) -> float:
    """Device bytes of one model-probe run: the model cut to ``blocks`` blocks, its weights and
    gradients in ``dtype``, the activations the planner counts for ``batch`` sequences of ``seq``
    tokens, and the loss's three fp32 logits-sized tensors."""
    cut = model.blocks_alone(args, blocks)
    params = model.num_params(cut)
    lay = Layout(param_dtype=str(dtype).removeprefix("torch."), local_batch_size=batch)
    held = stage_activation_bytes(model, cut, lay, batch, seq, 0, blocks) + ends_bytes(
        model, cut, lay, batch, seq, True, True)
    return 2 * params * dtype.itemsize + held + 3 * 4 * batch * seq * cut.vocab_size


def _probe_runs(seq: int) -> list[tuple[int, int]]:
    """(blocks, sequences) of the model probe's runs at ``seq`` tokens: one and two blocks on one
    sequence, one block on ``b`` and ``2b`` (``b`` making at least MIN_PROBE_TOKENS)."""
    b = -(-MIN_PROBE_TOKENS // seq)  # (rounded up)
    return list(dict.fromkeys(((1, 1), (2, 1), (1, b), (1, 2 * b))))  # (b may be 1)


def probe_tokens(model, args, seq: int, dtype: torch.dtype, budget: float) -> tuple[int, float]:
    """The longest sequence (``seq``, at most MAX_PROBE_TOKENS, halved down to MIN_PROBE_TOKENS)
    whose model-probe runs each fit in ``budget`` bytes, and the largest run's bytes; 0 tokens when
    none does (then the bytes of the smallest try)."""
    seq = min(seq, MAX_PROBE_TOKENS)
    while True:
        need = max(_run_bytes(model, args, blocks, batch, seq, dtype) for blocks, batch in _probe_runs(seq))
        if need <= budget:
            return seq, need
        if seq <= MIN_PROBE_TOKENS:
            return 0, need
        seq = max(MIN_PROBE_TOKENS, seq // 2)


def _model_costs(model, args, seq: int, dtype: torch.dtype, device: torch.device
                 ) -> tuple[float, float, float]:
    """(FLOP/s, seconds per block, seconds per forward) of a forward and backward of the model cut
    to one and to two blocks (with embedding, head and loss) on one sequence of ``seq`` tokens, and
    cut to one block on ``b`` and ``2b`` sequences (see :func:`_probe_runs`): ``seconds = per
    forward + blocks x per block + FLOPs / rate`` (FLOPs as the adapter counts them). It is what a
    matmul's rate leaves out: attention, elementwise work, the head's shape, and the fixed cost of
    running a block and a micro-step (launches, hooks), which dominates small models and
    micro-batches. The rate comes from a difference of two times (each the median of 7 runs), so
    the two differ by at least MIN_PROBE_TOKENS; the fixed costs come from one sequence, where they
    weigh most. Built on the meta device and then allocated on ``device`` only (the probe runs
    before the job's model)."""
    runs = {}
    for blocks, batch in _probe_runs(seq):
        cut = model.blocks_alone(args, blocks)
        with torch.device("meta"):
            module = model.build(cut).to(dtype)
        module.to_empty(device=device)
        module.tie_weights()
        module.init_weights(0, buffer_device=device)  # (uninitialized memory may hold slow denormals)
        tokens = torch.randint(0, cut.vocab_size, (batch, seq + 1), device=device)

        def step(module=module, tokens=tokens):
            logits = module(tokens[:, :-1]).flatten(0, 1).float()
            torch.nn.functional.cross_entropy(logits, tokens[:, 1:].flatten()).backward()
        flops = model.flops_per_token(cut, seq) * seq * batch
        runs[blocks, batch] = (flops, _timed(step, dev.synchronize, 7))
        del module, step
        gc.collect()
        dev.empty_cache()
    b = _probe_runs(seq)[-1][1] // 2
    (fb, tb), (f2b, t2b) = runs[1, b], runs[1, 2 * b]
    rate = (f2b - fb) / (t2b - tb) if t2b > tb else f2b / t2b  # twice the sequences: marginal
    (f1, t1), (f2, t2) = runs[1, 1], runs[2, 1]
    forward = max(0.0, t1 - f1 / rate)
    block = max(0.0, t2 - t1 - (f2 - f1) / rate)  # a second block against one
    return rate, block, min(forward, t1)


def _memory_bw(device: torch.device) -> float:
    """Bytes/s of a large copy (each byte read and written)."""
    n = (2**23 if device.type == "cpu" else 2**28) // 4
    src, dst = torch.ones(n, device=device), torch.empty(n, device=device)
    return 2 * 4 * n / _timed(lambda: dst.copy_(src), dev.synchronize, 7)


def _partitions(world: int, per_node: int) -> list[tuple[str, list[list[int]]]]:
    """(link, groups) of every partition of the ranks probed: consecutive ranks in groups of each
    size that divides the world, and across nodes one rank per node. Each rank is in one group of a
    partition, and the groups run at once, as a mesh dimension's do. 'intra' when each group fits
    in one node."""
    out = []
    for n in range(2, world + 1):
        if world % n == 0:
            groups = [list(range(start, start + n)) for start in range(0, world, n)]
            out.append(("intra" if all(g[0] // per_node == g[-1] // per_node for g in groups) else "inter",
                        groups))
    nodes = world // per_node
    if nodes > 1 and per_node > 1 and not any(link == "inter" and len(g[0]) == nodes for link, g in out):
        out.append(("inter", [list(range(first, world, per_node)) for first in range(per_node)]))
    return out


GATHERED_BYTES = 2**30  # the most an all-gather's output (a reduce-scatter's input) may hold


def _collective(kind: str, group, n: int, nbytes: int, device: torch.device):
    """(the operation, the bytes the planner counts for it) on ``group`` of ``n`` ranks; the
    gathered buffers stay under GATHERED_BYTES however many ranks there are."""
    if kind in ("all_gather", "reduce_scatter"):
        nbytes = max(4 * n, min(nbytes, GATHERED_BYTES // n // 4 * 4))
    elems = nbytes // 4
    x = torch.ones(elems, device=device)
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x, group=group)), RING_FACTOR[kind](n) * nbytes
    if kind == "all_gather":
        out = torch.empty(n * elems, device=device)
        return (lambda: dev.all_gather_single(out, x, group=group)), RING_FACTOR[kind](n) * n * nbytes
    if kind == "reduce_scatter":
        big, out = torch.ones(n * elems, device=device), torch.empty(elems, device=device)
        return (lambda: dev.reduce_scatter_single(out, big, group=group)), RING_FACTOR[kind](n) * n * nbytes
    if kind == "all_to_all":
        elems -= elems % n
        x, out = torch.ones(elems, device=device), torch.empty(elems, device=device)
        return (lambda: dist.all_to_all_single(out, x, group=group)), 4 * elems * (n - 1) / n
    # send: each rank sends to the next in the group and receives from the one before, as a
    # pipeline's stages pass activations on
    me = dist.get_rank()
    ranks = dist.get_process_group_ranks(group)
    i = ranks.index(me)
    nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
    buf = torch.empty(elems, device=device)

    def exchange():
        for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, x, nxt), dist.P2POp(dist.irecv, buf, prv)]):
            w.wait()
    return exchange, float(nbytes)


def fit(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(latency s, bandwidth bytes/s) of ``seconds = latency + bytes / bandwidth`` through
    ``points`` (bytes, seconds), by least squares of the relative error (so that the small sizes
    set the latency and the large ones the bandwidth); latency at least 0."""
    w = [1 / y**2 for _, y in points]
    sw, sx = sum(w), sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    sy, sxy = sum(wi * y for wi, (_, y) in zip(w, points)), sum(wi * x * y for wi, (x, y) in zip(w, points))
    det = sw * sxx - sx * sx
    latency, slope = (sxx * sy - sx * sxy) / det, (sw * sxy - sx * sy) / det
    if slope <= 0:  # all latency (noise): the largest size's rate
        x, y = max(points)
        return min(y for _, y in points), x / y
    if latency < 0:  # no measurable latency: bandwidth alone, still by relative error
        return 0.0, sxx / sxy
    return latency, 1 / slope


def _my_group(groups: list[list[int]]) -> tuple[object, list]:
    """This rank's group of the partition ``groups`` and the groups to destroy after, made as
    DeviceMesh makes a dimension's: where the default group's NCCL communicator is bound to a
    device, one split of it for the whole partition (one call however many groups, where a new
    group per group would be world / n calls on every rank); else a new group per group."""
    default = dist.distributed_c10d._get_default_group()
    if getattr(default, "bound_device_id", None) is not None:
        mine = dist.split_group(default, groups, timeout=dev.group_timeout())
        return mine, [mine]
    made = [dist.new_group(ranks, timeout=dev.group_timeout()) for ranks in groups]
    return next(g for g, ranks in zip(made, groups) if dist.get_rank() in ranks), made


def _measure(dtype: torch.dtype, model, args, seq: int, per_node: int, budget: float) -> dict:
    """Every rank measures; returns the slowest rank's figures (the same dict on every rank).
    The model probe's runs stay inside ``budget`` bytes (see :func:`probe_tokens`)."""
    device = dev.current_device()
    world = dist.get_world_size()
    sizes = _sizes(device.type)
    dist.barrier()
    tokens, need = probe_tokens(model, args, seq, dtype, budget)
    flops = _matmul_flops(dtype, args.dim, device)
    # With no room for even one block on MIN_PROBE_TOKENS, the matmul rate stands in (no fixed costs).
    achieved, per_block, per_forward = (_model_costs(model, args, tokens, dtype, device) if tokens
                                        else (flops, 0.0, 0.0))
    bw = _memory_bw(device)
    memory = dev.rank_memory(per_node)
    share = _cores() / (per_node * torch.get_num_threads()) if device.type == "cpu" else 1.0
    keys, times, counted = [], [], []  # per (partition, kind, size), in the same order on every rank
    for link, groups in _partitions(world, per_node):
        mine, made = _my_group(groups)
        n = len(groups[0])
        for kind in KINDS:
            for size, calls in sizes:
                op, nbytes = _collective(kind, mine, n, size, device)
                keys.append((f"{link}:{n}", kind))
                counted.append(nbytes)
                times.append(_timed(lambda: [op() for _ in range(calls)], dev.synchronize, 3) / calls)
        for g in made:
            dist.destroy_process_group(g)
    # The slowest rank's figures, in one all-reduce: MAX of times and of the rates' negatives.
    worst = torch.tensor([-flops, -bw, -achieved, per_block, per_forward, -memory, -dev.host_memory(),
                          -min(share, 1.0), -tokens, *times], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    worst = worst.tolist()
    table: dict[str, dict[str, list[float]]] = {}
    for i in range(0, len(keys), len(sizes)):
        group, kind = keys[i]
        points = list(zip(counted[i:i + len(sizes)], worst[9 + i:9 + i + len(sizes)]))
        table.setdefault(group, {})[kind] = list(fit(points))
    out = {"matmul_flops": -worst[0], "memory_bw": -worst[1], "model_flops": -worst[2],
           "block_overhead_s": worst[3], "forward_overhead_s": worst[4], "device_memory": -worst[5],
           "host_memory": -worst[6], "cores_per_rank": -worst[7], "model_tokens": int(-worst[8]),
           "collectives": table}
    if tokens == 0:
        out["model_probe"] = (f"not run: one block on {MIN_PROBE_TOKENS} tokens needs {need / 2**30:.1f} "
                              f"GiB, {budget / 2**30:.1f} GiB allowed; the matmul rate stands in")
    return out


def cluster_name() -> str:
    """What the probe's cache is keyed by: SLURM's cluster name where there is one, else the hosts
    of the job (every rank's, gathered once: rank 0 lands on another node of the same cluster from
    one job to the next)."""
    if os.environ.get("SLURM_CLUSTER_NAME"):
        return "slurm:" + os.environ["SLURM_CLUSTER_NAME"]
    hosts = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, socket.gethostname())
    return ",".join(sorted(set(hosts)))


def _cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _key(dtype: torch.dtype, model, args, seq: int, world: int, per_node: int, budget: float) -> str:
    shape = [VERSION, cluster_name(), dev.device_name(), str(dtype), dev.fp32_precision(), model.name,
             repr(args), seq, world, per_node, dist.get_backend(), torch.__version__, torch.get_num_threads(),
             _cores(), round(budget / 2**30, 1)]
    return hashlib.sha256(json.dumps(shape).encode()).hexdigest()[:16]


def probe(dtype: torch.dtype, model, args, seq: int, folder: Path | None = None, fresh: bool = False,
          memory_cap_gib: float = 0.0) -> dict:
    """The machine's figures (see the module's doc) for adapter ``model`` with ``args`` at
    ``seq``-token sequences in ``dtype``, measured on every rank of the default group or read
    from rank 0's cache; the same dict on every rank. A collective: every rank calls it. Its
    model runs fit in ``memory_cap_gib`` (training.memory_cap_gib; 0 = none), and in PROBE_SHARE of
    the rank's memory."""
    world = dist.get_world_size()
    per_node = dev.local_world_size(world)
    budget = PROBE_SHARE * dev.rank_memory(per_node)
    if memory_cap_gib > 0:
        budget = min(budget, memory_cap_gib * 2**30)
    key = _key(dtype, model, args, seq, world, per_node, budget)
    path = (folder or cache_folder()) / f"machine-{key}.json"
    found = [None]
    if dist.get_rank() == 0 and path.exists() and not fresh:
        try:
            found = [json.loads(path.read_text())]
        except (OSError, ValueError):
            found = [None]  # unreadable: measured again, and rewritten
    dist.broadcast_object_list(found, src=0)
    if found[0] is not None:
        return {**found[0], "cached": str(path)}
    t0 = time.perf_counter()
    figures = _measure(dtype, model, args, seq, per_node, budget)
    figures.update(world=world, per_node=per_node, dtype=str(dtype), seq=seq, device=dev.device_name(),
                   probe_s=time.perf_counter() - t0)
    if dist.get_rank() == 0:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            tmp.write_text(json.dumps(figures, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass  # an unwritable cache costs the next job a probe, nothing else
    return {**figures, "cached": ""}


def cluster_of(figures: dict, memory: float | None = None) -> Cluster:
    """The planner's description of the probed machine: the rate the model's own forward and
    backward reached as the peak (so plan with efficiency 1) and their fixed costs, its
    collectives' latency and bandwidth; on a CPU no overlap of communication with compute (gloo
    works on the cores that compute); ``memory``: bytes a rank may use (default: the device's)."""
    per_node, world = figures["per_node"], figures["world"]
    table = figures["collectives"]

    def bandwidth(link: str) -> float:
        rates = [bw for key, kinds in table.items() if key.startswith(link) for _, bw in kinds.values()]
        return min(rates) if rates else 1e12

    return replace(Cluster(per_node, memory or figures["device_memory"], figures["model_flops"],
                           bandwidth("intra"), bandwidth("inter"), figures["host_memory"], world // per_node,
                           figures["memory_bw"]), collectives=table,
                   block_overhead=figures["block_overhead_s"], forward_overhead=figures["forward_overhead_s"],
                   overlap=figures["device"] != "CPU", cores_per_rank=figures["cores_per_rank"],
                   peak_fp8_flops=figures["model_flops"] * dev.fp8_gain(figures["device"]))
