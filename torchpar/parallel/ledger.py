"""A ledger of the bytes every collective moves, per mesh dimension (the planner's check).

``with CommLedger(mesh) as ledger: ...`` records each collective this process issues — the c10d
ops that FSDP2, the ZeRO engine and the trainer call and the functional collectives of DTensor —
with its payload (the bytes of the full tensor being reduced or gathered; for point-to-point,
the tensor sent) and the group it ran on, named by the mesh dimension that owns the group.
``sent_bytes`` converts payloads into what a ring algorithm sends per rank: 2(n-1)/n for
all-reduce, (n-1)/n for all-gather and reduce-scatter, the tensor itself for a send.
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, where the payload tensor is among the args, payload = that tensor x world?)
_C10D = {
    "allreduce_": "all_reduce", "all_reduce": "all_reduce",
    "_allgather_base_": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "send": "send", "broadcast_": "broadcast", "allgather_": "all_gather", "reduce_scatter_": "reduce_scatter",
}
FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "send": lambda n: 1.0, "broadcast": lambda n: (n - 1) / n}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(t) for t in x)
    return 0


class CommLedger(TorchDispatchMode):
    def __init__(self, mesh=None):
        super().__init__()
        self.names: dict[str, str] = {}
        if dist.is_initialized():
            self.names[dist.group.WORLD.group_name] = "world"
        if mesh is not None:
            for dim in mesh.mesh_dim_names:
                self.names[mesh[dim].get_group().group_name] = dim
        self.unknown: set[str] = set()  # collective ops the ledger cannot size (should stay empty)
        self.records: list[tuple[str, str, int, int]] = []  # (mesh dim, kind, payload bytes, group size)

    def _group(self, args) -> tuple[str, int]:
        for a in args:
            if isinstance(a, torch.ScriptObject):  # c10d ops carry the ProcessGroup boxed
                group = dist.ProcessGroup.unbox(a)
            elif isinstance(a, str) and a in self.names:  # functional collectives carry its name
                group = dist.distributed_c10d._resolve_process_group(a)
            else:
                continue
            return self.names.get(group.group_name, group.group_name), group.size()
        return "?", 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        if any(issubclass(t, DTensor) for t in types):
            # Modes run before tensor subclasses: let DTensor turn the op into plain ops and
            # collectives first, which then come back here.
            return NotImplemented
        out = func(*args, **kwargs)
        ns, op = func.namespace, func._opname
        if ns.startswith(("c10d", "_c10d_functional")) and op not in _C10D and op not in ("wait_tensor", "_wrap_tensor_autograd"):
            self.unknown.add(f"{ns}.{op}")
        if ns.startswith(("c10d", "_c10d_functional")) and op in _C10D:
            kind = _C10D[op]
            dim, size = self._group(list(args) + list(kwargs.values()))
            if kind == "all_gather":
                payload = _nbytes(args[0]) if op.startswith("_allgather_base") or op.endswith("_out") else 0
                if op == "all_gather_into_tensor":
                    payload = _nbytes(args[0]) * size  # functional: input is this rank's shard
                elif op.startswith("allgather_into_tensor_coalesced"):
                    payload = _nbytes(args[0])
                elif op == "allgather_":
                    payload = _nbytes(args[1]) * size
            elif kind == "reduce_scatter":
                payload = _nbytes(args[1]) if op.startswith("_reduce_scatter_base") or op.endswith("coalesced_") \
                    else _nbytes(args[0])
            else:
                payload = _nbytes(args[0])
            self.records.append((dim, kind, payload, size))
        return out

    def sent_bytes(self) -> dict[str, float]:
        """Bytes a ring algorithm sends per rank, summed per mesh dimension."""
        out: dict[str, float] = defaultdict(float)
        for dim, kind, payload, size in self.records:
            if size > 1:
                out[dim] += FACTOR[kind](size) * payload
        return dict(out)
