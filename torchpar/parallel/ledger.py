"""A ledger of the bytes every collective moves, per mesh dimension (the planner's check).

``with CommLedger(mesh) as ledger: ...`` records each collective this process issues — the c10d
ops that FSDP2, the ZeRO engine and the trainer call and the functional collectives of DTensor —
with its payload (the bytes of the full tensor being reduced or gathered; for point-to-point,
the tensor sent) and the group it ran on, named by the mesh dimension that owns the group.
``sent_bytes`` converts payloads into what a ring algorithm sends per rank: 2(n-1)/n for
all-reduce, (n-1)/n for all-gather and reduce-scatter, the tensor itself for a send; an
all-to-all's payload is what it sends to the other ranks (its own piece stays).

With ``synchronize`` (the device's), each collective is also timed from its issue to its
completion — waited for at once, so the counted steps lose their overlap — into ``seconds`` per
mesh dimension: the time spent inside collectives if nothing overlapped them (sends excepted).
"""

from __future__ import annotations

import time
from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Share of the payload a ring sends per rank: the ledger and the planner count with the same factors.
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0,
               "broadcast": lambda n: (n - 1) / n, "all_to_all": lambda n: 1.0}


def _first(args, n):  # the (full) tensor or tensor list the op reduces, gathers into, or sends
    return _nbytes(args[0])


def _second(args, n):  # reduce-scatter's full input
    return _nbytes(args[1])


def _shard_times_n(args, n):  # functional all-gather: the input is this rank's shard
    return _nbytes(args[0]) * n


def _ring_hops(args, n):  # torchpar's ring attention (q, k, v, group name): n - 1 key/value hops forward
    return (n - 1) * (_nbytes(args[1]) + _nbytes(args[2]))


def _to_others(args, n):  # functional all-to-all (input, output splits, input splits, group name)
    rows, splits = args[0].shape[0], args[2]
    mine = splits[dist.get_rank(dist.distributed_c10d._resolve_process_group(args[3]))]
    return _nbytes(args[0]) * (rows - mine) // max(rows, 1)


def _c10d_to_others(args, n):  # c10d all-to-all (output, input, group, output splits, input splits, ...)
    x, group, splits = args[1], dist.ProcessGroup.unbox(args[2]), args[4]
    rows = x.shape[0]
    mine = splits[group.rank()] if splits else rows // n
    return _nbytes(x) * (rows - mine) // max(rows, 1)


# op name (c10d and functional collectives) -> (kind, payload in bytes from (args, group size))
OPS = {"allreduce_": ("all_reduce", _first), "all_reduce": ("all_reduce", _first),
       "all_reduce_": ("all_reduce", _first), "all_reduce_coalesced": ("all_reduce", _first),
       "_allgather_base_": ("all_gather", _first), "allgather_": ("all_gather", _first),
       "allgather_into_tensor_coalesced_": ("all_gather", _first),
       "all_gather_into_tensor": ("all_gather", _shard_times_n),
       "all_gather_into_tensor_out": ("all_gather", _shard_times_n),
       "_reduce_scatter_base_": ("reduce_scatter", _second), "reduce_scatter_": ("reduce_scatter", _second),
       "reduce_scatter_tensor_coalesced_": ("reduce_scatter", _second),
       "reduce_scatter_tensor": ("reduce_scatter", _first), "send": ("send", _first),
       "broadcast_": ("broadcast", _first), "broadcast": ("broadcast", _first),
       "all_to_all_single": ("all_to_all", _to_others), "alltoall_base_": ("all_to_all", _c10d_to_others),
       # one op whose hops the ledger does not see one by one (its backward's it does)
       "ring_attention": ("all_to_all", _ring_hops)}
# Namespaces of the ops the ledger counts: c10d's, the functional collectives', torchpar's ring.
COUNTED = ("c10d", "_c10d_functional", "torchpar")
# The mesh's flattened views, then the dimensions of its experts' view (Layout.build_mesh).
FLATTENED = ("dp", "dp_shard_cp", "dp_cp")
EXPERT_DIMS = ("efsdp", "ep", "efsdp_cp")
# Not traffic of their own: waits, autograd wrappers, receives (the sender counts), barriers.
IGNORED = {"wait_tensor", "_wrap_tensor_autograd", "recv_", "recv_any_source_", "barrier"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


def _wait(out) -> None:
    """Wait for a collective's result: a c10d op's Work, or a functional collective's tensor."""
    for x in out if isinstance(out, (list, tuple)) else (out,):
        if isinstance(x, torch.ScriptObject):
            dist.distributed_c10d.Work.unbox(x).wait()
        elif isinstance(x, torch.Tensor):
            torch.ops._c10d_functional.wait_tensor(x)


class CommLedger(TorchDispatchMode):
    def __init__(self, mesh=None, synchronize=None, experts_view=None, views=None):
        """``mesh``: the layout's, whose dimensions name its groups; ``views``: its flattened
        meshes by name (Layout.views); ``experts_view``: its experts' view (efsdp x ep)."""
        super().__init__()
        self.synchronize = synchronize
        self.seconds: dict[str, float] = defaultdict(float)  # per mesh dim, when timed
        self.names: dict[str, str] = {}
        views = views or {}
        # A group that is several things is named by the last: flattened view, world, mesh dimension.
        for dim in (d for d in FLATTENED if d in views):
            self.names[views[dim].get_group().group_name] = dim
        if dist.is_initialized():
            self.names[dist.group.WORLD.group_name] = "world"
        for dim in mesh.mesh_dim_names if mesh is not None else ():
            self.names[mesh[dim].get_group().group_name] = dim
        for dim in EXPERT_DIMS if experts_view is not None else ():
            try:
                self.names[(views[dim] if dim in views else experts_view[dim]).get_group().group_name] = dim
            except KeyError:  # a view this layout does not build
                continue
        resolve = dist.distributed_c10d._resolve_process_group
        self.by_ranks = {tuple(dist.get_process_group_ranks(resolve(g))): d for g, d in self.names.items()}
        self.unknown: set[str] = set()  # collective ops the ledger cannot size (should stay empty)
        self.records: list[tuple[str, str, int, int]] = []  # (mesh dim, kind, payload bytes, group size)

    def _group(self, args) -> tuple[str, int]:
        for a in args:
            if isinstance(a, torch.ScriptObject):  # c10d ops carry the ProcessGroup boxed
                group = dist.ProcessGroup.unbox(a)
            elif isinstance(a, str) and a in self.names:  # functional collectives carry its name
                group = dist.distributed_c10d._resolve_process_group(a)
            elif isinstance(a, str) and a in dist.distributed_c10d._world.pg_names.values():
                # another mesh's group over the same ranks: DTensor caches its redistribution
                # plans by mesh equality, so a second Trainer in a process may reuse the first's
                group = dist.distributed_c10d._resolve_process_group(a)
            else:
                continue
            name = self.names.get(group.group_name)
            if name is None:
                name = self.by_ranks.get(tuple(dist.get_process_group_ranks(group)), group.group_name)
            return name, group.size()
        return "?", 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: let DTensor turn the op into plain ops and
            # collectives first, which then come back here.
            return NotImplemented
        # Point-to-point sends are not timed: waiting for one at its issue, before this rank posts
        # its receives, would deadlock a pipeline schedule (its waits show in the measured bubble).
        timed = (self.synchronize is not None and func.namespace.startswith(COUNTED)
                 and OPS.get(func._opname, ("send",))[0] != "send")
        if timed:
            self.synchronize()
            t0 = time.perf_counter()
        out = func(*args, **kwargs)
        if func.namespace.startswith(COUNTED):
            op = func._opname
            if op in OPS:
                kind, payload = OPS[op]
                dim, size = self._group(list(args) + list(kwargs.values()))
                self.records.append((dim, kind, payload(args, size), size))
                if timed:
                    _wait(out)
                    self.synchronize()
                    self.seconds[dim] += time.perf_counter() - t0
            elif op not in IGNORED:
                self.unknown.add(f"{func.namespace}.{op}")
        return out

    def sent_bytes(self) -> dict[str, float]:
        """Bytes a ring algorithm sends per rank, summed per mesh dimension."""
        out: dict[str, float] = defaultdict(float)
        for dim, kind, payload, size in self.records:
            if size > 1:
                out[dim] += RING_FACTOR[kind](size) * payload
        return dict(out)
