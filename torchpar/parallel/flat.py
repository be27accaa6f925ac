"""ZeRO stages 0, 1 and 2: one flat buffer that the model's (local) parameters alias, its gradients
reduced bucket by bucket while backward still runs.

The buffer holds this rank's parameters in the compute dtype, in model order, padded to a multiple
of N = dp_shard x cp (the ranks ZeRO shards over), cut into buckets of ``bucket_mb`` (multiples of
N elements; a parameter may straddle two). Rank r owns the r-th N-th of every bucket: its
optimizer updates those pieces of an fp32 master (the buffer itself in an fp32 run), so each
collective is one call per bucket. An optimizer that needs whole parameters (Muon, Adafactor) gets
buckets laid out so that each N-th holds whole ones (:func:`flat_layout`), and each owned
parameter shaped like itself.

- backward: a parameter's post-accumulate-grad hook (last micro-step; with a pipeline, last
  microbatch) copies its gradient into its bucket(s) and drops it. A full bucket is reduced
  asynchronously — all-reduce over dp x cp (stages 0, 1), or reduce-scatter over the N into the owned
  piece (stage 2, which frees the bucket once reduced: the whole gradient never exists) — in one
  fixed order on every rank, last bucket first;
- ``reduce_gradients``: what backward did not reduce (split-backward schedules, unused parameters)
  is reduced now and everything waited for; under HSDP stage 2 all-reduces each owned piece over
  dp_replicate once its reduce-scatter is done, while backward still runs;
- ``step``: the optimizer updates the owned fp32 pieces, whose compute-dtype copies are gathered
  back bucket by bucket, asynchronously; a module waits for its own buckets just before its next
  forward, so the gathers of later blocks run while earlier blocks compute.
"""

from __future__ import annotations

import bisect
import itertools
import math
import weakref
from collections import Counter

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from torchpar.device import all_gather_single, reduce_scatter_single
from torchpar.parallel import zero
from torchpar.parallel.flat_state import FlatCheckpoints
from torchpar.parallel.zero import local, nbytes

IN_FLIGHT = 2  # stage 2: reduce-scatters in flight before backward waits for the oldest (and frees it)
# Each bucket is a collective and an optimizer tensor per step: beyond this many, a step is mostly
# their overhead (and a bucket of a few bytes builds for minutes), so the layout refuses the size.
MAX_BUCKETS = 10_000


def flat_shards(layout) -> int:
    """Ranks the flat buffer is cut over: dp_shard x cp under stages 1-2, none under stage 0."""
    return layout.shard_ranks if layout.zero_stage in (1, 2) else 1


def bucket_elements(layout) -> int:
    """Elements of a gradient bucket: ``bucket_mb`` in the reduction dtype, a multiple of the shards."""
    n = flat_shards(layout)
    return max(n, int(layout.bucket_mb * 2**20 / getattr(torch, layout.reduce_dtype).itemsize) // n * n)


def flat_layout(sizes: list[int], shards: int, bucket: int, whole: list[bool] | None = None
                ) -> tuple[list[int], list[int]]:
    """Where each parameter (of ``sizes`` elements, in model order) starts in the flat buffer, and
    the bucket bounds (each bucket a multiple of ``shards``; rank r owns the r-th ``shards``-th).

    The parameters an element-wise update takes come first, back to back, cut every ``bucket``
    elements. Those whose update needs them whole (``whole[i]``: Muon's hidden matrices) follow,
    in their own buckets: a bucket takes them in order until it holds ``bucket`` elements and
    ``shards`` x its largest (a short tail joins the bucket before it); they are dealt to the ranks
    largest first, each to the least loaded, so each rank's N-th holds whole parameters; every
    N-th is padded to the most loaded one."""
    whole = whole or [False] * len(sizes)
    sliced = [i for i in range(len(sizes)) if not whole[i]]
    starts, at = [0] * len(sizes), 0
    for i in sliced:
        starts[i], at = at, at + sizes[i]
    padded = math.ceil(at / shards) * shards
    bounds = [*range(0, padded, bucket), padded]
    groups, current, total, largest = [], [], 0, 0
    for i in (i for i in range(len(sizes)) if whole[i]):
        current.append(i)
        total, largest = total + sizes[i], max(largest, sizes[i])
        if total >= max(bucket, shards * largest):
            groups.append(current)
            current, total, largest = [], 0, 0
    if current:
        if groups:
            groups[-1] += current
        else:
            groups.append(current)
    for group in groups:
        loads, mine = [0] * shards, [[] for _ in range(shards)]
        for i in sorted(group, key=lambda j: -sizes[j]):  # (stable: equal sizes keep model order)
            r = loads.index(min(loads))
            mine[r].append(i)
            loads[r] += sizes[i]
        region, lo = max(loads), bounds[-1]
        for r, members in enumerate(mine):
            at = lo + r * region
            for i in sorted(members):
                starts[i], at = at, at + sizes[i]
        bounds.append(lo + shards * region)
    return starts, [b for j, b in enumerate(bounds) if j == 0 or b > bounds[j - 1]]


class FlatZero(FlatCheckpoints):
    """ZeRO stages 0, 1 and 2 over one flat buffer (see the module docstring)."""

    def __init__(self, model_parts: list[nn.Module], layout, build_optimizer, device: torch.device,
                 initial_values, whole=None):
        """``model_parts``: parameters not yet allocated (on the meta device); ``initial_values(part)``
        yields (parameter, its destination, this rank's fp32 value of it) for each parameter of
        ``part`` (``SeededInit.initial_values``), one made at a time: each goes into the buffer (and
        the master) and is dropped, so start-up never holds more than the engine's own buffers and
        one parameter's initial value."""
        self.stage, self.layout, self.parts = layout.zero_stage, layout, model_parts
        everything = zero.unique_params(model_parts)
        dtypes = {p.dtype for p in everything}
        if dtypes != {torch.float32}:
            raise ValueError(f"zero stages 0-2 start from fp32 parameters; got {dtypes}")
        # Only trained parameters enter the buffer; frozen ones (a LoRA base) get one of their own
        # in the compute dtype: no master, no gradient, no bucket, no gather.
        params = [p for p in everything if p.requires_grad]
        self.names = [n for n, p in zip(zero.param_names(model_parts), everything) if p.requires_grad]
        frozen = [p for p in everything if not p.requires_grad]
        self.compute_dtype = getattr(torch, layout.param_dtype)
        self.grad_dtype = getattr(torch, layout.reduce_dtype)
        self.shards = n = flat_shards(layout)
        mesh = layout.mesh
        # Groups are looked up when used, never held: the hooks keep this engine alive until the
        # garbage collector runs, and a held group would outlive destroy_process_group.
        # "dp" / "dp_shard": the ranks gradients are averaged / sharded over (with context
        # parallelism the flattened dp_cp / dp_shard_cp: a sequence's parts are like more data).
        self.meshes = {"dp": layout.submesh(layout.reduce_dim), "dp_shard": layout.submesh(layout.shard_dim),
                       "dp_replicate": mesh["dp_replicate"]}
        rank = self.meshes["dp_shard"].get_local_rank() if n > 1 else 0
        sizes = [local(p).numel() for p in params]
        self.total = sum(sizes)  # the parameters' elements (the buffer adds padding)
        # which parameters the optimizer needs whole: whole(canonical name, parameter)
        self.whole = [bool(whole and whole(name, p)) for name, p in zip(self.names, params)]
        starts, self.bounds = flat_layout(sizes, n, bucket_elements(layout), self.whole)
        padded = self.bounds[-1]  # bucket k = [bounds[k], bounds[k + 1])
        self.buckets = list(zip(self.bounds, self.bounds[1:]))
        self.owned = [(lo + rank * (hi - lo) // n, lo + (rank + 1) * (hi - lo) // n)
                      for lo, hi in self.buckets]
        self.shard_starts = [0, *itertools.accumulate(b - a for a, b in self.owned)]  # in the shard
        # (start, end, tp copies) per parameter
        self.segments = [(a, a + size, zero.replicas(p, layout.tp))
                         for p, a, size in zip(params, starts, sizes)]
        self.gaps = _gaps(self.segments, padded)  # the padding: zero in every buffer
        self.gap_ends = [b for _, b in self.gaps]
        cut = self.bounds  # the buckets each parameter touches:
        self.buckets_of = [list(range(bisect.bisect_right(cut, s) - 1, bisect.bisect_left(cut, e)))
                           for s, e, _ in self.segments]
        self.separate_master = self.compute_dtype != torch.float32
        self.flat = torch.empty(padded, dtype=self.compute_dtype, device=device)  # what forward reads
        self._zero_gaps(self.flat, 0)
        if self.separate_master:
            self.master = torch.empty(self.shard_starts[-1], dtype=torch.float32, device=device)
            starts = self.shard_starts
            self.masters = [self.master[a:b] for a, b in zip(starts, starts[1:])]  # the owned pieces
            for (lo, _), m in zip(self.owned, self.masters):
                self._zero_gaps(m, lo)
        else:
            self.masters = [self.flat[a:b] for a, b in self.owned]
        frozen_sizes = [local(p).numel() for p in frozen]
        self.frozen = torch.empty(sum(frozen_sizes), dtype=self.compute_dtype, device=device)
        frozen_at = dict(zip(map(id, frozen), itertools.accumulate([0, *frozen_sizes])))
        index = {id(p): i for i, p in enumerate(params)}
        for part in model_parts:
            for p, _, value in initial_values(part):
                if id(p) in index:
                    self._fill(index[id(p)], value.reshape(-1))
                else:
                    at = frozen_at[id(p)]
                    self.frozen[at: at + local(p).numel()].copy_(value.reshape(-1))
                del value  # before the next one is made
        views = [self.flat[start:end] for start, end, _ in self.segments]
        views += [self.frozen[frozen_at[id(p)]: frozen_at[id(p)] + n] for p, n in zip(frozen, frozen_sizes)]
        self.params = self._alias([*params, *frozen], views)[: len(params)]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}  # parameter -> its position
        self.runs = self._runs()
        self.optimizer = build_optimizer([(self.names[i], p, t) for i, p in enumerate(self.params)
                                          for *_, t in self.runs[i]])
        members = Counter(k for ks in self.buckets_of for k in ks)
        self.members = [members[k] for k in range(len(self.buckets))]  # parameters each bucket waits for
        self.expected = layout.n_microbatches if layout.pp > 1 else 1  # hook calls per step
        self.sync, self.gathers, self.peak_grad_bytes = True, {}, 0
        self.grad_flat = self.grad_shard = None  # stages 0-1's whole reduced gradient, stage 2's shard
        self.grads: list[torch.Tensor] | None = None  # reduced fp32 gradients of the owned pieces
        self._start_step()
        engine = weakref.ref(self)  # the model's hooks must not keep the engine alive
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _, i=i: engine()._on_grad(i))
        self._hook_gathers(engine)

    def _fill(self, i: int, value: torch.Tensor) -> None:
        """Parameter ``i``'s initial fp32 values (flat) into the buffer and the owned master pieces."""
        start, end, _ = self.segments[i]
        self.flat[start:end].copy_(value)
        if self.separate_master:
            for k in self.buckets_of[i]:
                (lo, hi), master = self.owned[k], self.masters[k]
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    master[a - lo: b - lo].copy_(value[a - start: b - start])

    def _zero_gaps(self, buf: torch.Tensor, lo: int) -> None:
        """The padding inside ``buf``, a buffer over flat elements [lo, lo + len(buf))."""
        first = bisect.bisect_right(self.gap_ends, lo)  # (the gaps are sorted)
        for a, b in itertools.islice(self.gaps, first, None):
            if a >= lo + len(buf):
                break
            a, b = max(a, lo), min(b, lo + len(buf))
            buf[a - lo: b - lo].zero_()

    def _runs(self) -> list[list[tuple[int, int, int, torch.Tensor]]]:
        """Per parameter, its values this rank's optimizer updates: (bucket, start, end in the flat
        buffer, the tensor the optimizer takes) — a slice of an owned piece, or with whole
        parameters the whole parameter shaped like it (a DTensor under TP) or nothing."""
        out = []
        for p, (start, end, _), ks, whole in zip(self.params, self.segments, self.buckets_of, self.whole):
            runs = []
            for k in ks:
                lo, hi = self.owned[k]
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    values = self.masters[k][a - lo: b - lo]
                    runs.append((k, a, b, zero.shaped_like(p, values) if whole else values))
            assert not whole or not runs or runs[0][1:3] == (start, end), "a whole parameter was cut"
            out.append(runs)
        return out

    def _alias(self, params: list[nn.Parameter], views: list[torch.Tensor]) -> list[nn.Parameter]:
        """New parameters over ``views`` (flat pieces of the buffers, in the compute dtype), put in
        place of the old ones in every module that holds them (tied weights stay tied)."""
        new = {}
        for p, view in zip(params, views):
            view = view.view(local(p).shape)
            if isinstance(p, DTensor):
                view = DTensor.from_local(view, p.device_mesh, p.placements, run_check=False,
                                          shape=p.shape, stride=p.stride())
            new[id(p)] = q = nn.Parameter(view, requires_grad=p.requires_grad)
            if q.requires_grad:  # bf16 parameters: micro-steps accumulate their gradients in fp32
                q.grad_dtype = torch.float32
        for module in (m for part in self.parts for m in part.modules()):
            for name, p in module._parameters.items():
                if p is not None and id(p) in new:
                    module._parameters[name] = new[id(p)]
        return [new[id(p)] for p in params]

    def _hook_gathers(self, engine) -> None:
        """Before its forward, a module waits for the gathers of the buckets holding its own
        parameters; a compiled block (``Module.compile``) waits for all of its parameters' buckets,
        from a hook dynamo leaves out of the graph, so later blocks' gathers still overlap."""
        if self.shards == 1:
            return
        index = self.index_of

        def buckets(params) -> list[int]:
            return sorted({k for p in params if id(p) in index for k in self.buckets_of[index[id(p)]]})

        compiled = [m for part in self.parts for m in part.modules()
                    if getattr(m, "_compiled_call_impl", None) is not None]
        inside = {id(sub) for m in compiled for sub in m.modules()}
        for m in compiled:
            wait = torch.compiler.disable(lambda *_, mine=buckets(m.parameters()): engine().wait_params(mine))
            m.register_forward_pre_hook(wait)
        for part in self.parts:
            for module in part.modules():
                mine = buckets(module.parameters(recurse=False))
                if mine and id(module) not in inside:
                    module.register_forward_pre_hook(lambda *_, mine=mine: engine().wait_params(mine))

    def _group(self, dim: str):  # (looked up at each use: see __init__)
        return self.meshes[dim].get_group()

    # ------------------------------------------------------------------ gradients

    def _start_step(self) -> None:
        self.arrivals, self.taken = [0] * len(self.params), [False] * len(self.params)
        self.missing = list(self.members)
        self.next = len(self.buckets) - 1  # buckets are reduced last first: backward's order
        self.bucket_bufs: dict[int, torch.Tensor] = {}
        self.in_flight: list[tuple] = []  # (work, the bucket if it has its own memory, views...)
        self.replicating: list = []  # HSDP stage 2: the owned pieces' all-reduces over dp_replicate

    def set_sync(self, enabled: bool) -> None:
        self.sync = enabled

    def _on_grad(self, i: int) -> None:
        if not self.sync:
            return  # an earlier micro-step: the gradient accumulates in the parameter
        self.arrivals[i] += 1
        if self.arrivals[i] == self.expected:
            self._take(i)

    def _bucket(self, k: int) -> torch.Tensor:
        """Bucket ``k``'s gradient buffer: a view of the whole flat gradient (stages 0, 1) or a
        buffer of its own (stage 2); the padding is zeroed."""
        lo, hi = self.buckets[k]
        if self.stage != 2:
            if self.grad_flat is None:
                self.grad_flat = self.flat.new_empty(self.bounds[-1], dtype=self.grad_dtype)
                self._zero_gaps(self.grad_flat, 0)
            return self.grad_flat[lo:hi]
        if k not in self.bucket_bufs:
            buf = self.flat.new_empty(hi - lo, dtype=self.grad_dtype)
            self._zero_gaps(buf, lo)
            self.bucket_bufs[k] = buf
        return self.bucket_bufs[k]

    def _take(self, i: int) -> None:
        """Parameter ``i``'s gradient into its bucket(s) (zeros if it has none), each bucket
        reduced as soon as it is ready (a large parameter spanning many buckets never has them
        all allocated at once); the parameter's own gradient is dropped. The copy divides by the
        dp degree on the way (the reduction's sum is then the mean, without a pass of its own)."""
        p, (start, end, _) = self.params[i], self.segments[i]
        g = zero.local_grad(p).reshape(-1) if p.grad is not None else None
        for k in reversed(self.buckets_of[i]):
            lo, hi = self.buckets[k]
            a, b = max(start, lo), min(end, hi)
            dst = self._bucket(k)[a - lo: b - lo]
            if g is None:
                dst.zero_()
            else:
                torch.mul(g[a - start: b - start], 1 / self.layout.grad_ranks, out=dst)
            self.missing[k] -= 1
            self._launch_ready()
        p.grad = None
        self.taken[i] = True

    def _launch_ready(self) -> None:
        while self.next >= 0 and self.missing[self.next] == 0:
            self._launch(self.next)
            self.next -= 1

    def _launch(self, k: int) -> None:
        buf = self._bucket(k)
        if self.stage == 2:
            if self.grad_shard is None:
                self.grad_shard = self.flat.new_empty(self.bounds[-1] // self.shards, dtype=self.grad_dtype)
            out = self._shard_piece(k)
            work = reduce_scatter_single(out, buf, group=self._group("dp_shard"), async_op=True)
            self.in_flight.append((work, self.bucket_bufs.pop(k), out))  # (the bucket: its own memory)
        elif self.layout.grad_ranks > 1:
            self.in_flight.append((dist.all_reduce(buf, group=self._group("dp"), async_op=True), None, buf))
        self._note_grad_bytes()
        while self.stage == 2 and len(self.in_flight) > IN_FLIGHT:
            self._reduced(self.in_flight.pop(0))  # its bucket is freed here

    def _reduced(self, flight: tuple) -> None:
        """Wait for a bucket's reduction; under HSDP (stage 2) its owned piece then goes on to the
        all-reduce over the replicas, while backward still runs."""
        work, _, out = flight
        work.wait()
        if self.stage == 2 and self.layout.dp_replicate > 1:
            self.replicating.append(dist.all_reduce(out, group=self._group("dp_replicate"), async_op=True))

    def _shard_piece(self, k: int) -> torch.Tensor:
        start = self.shard_starts[k]
        return self.grad_shard[start: start + self.owned[k][1] - self.owned[k][0]]

    def _note_grad_bytes(self) -> None:  # the running peak of the gradient storage held
        if self.stage != 2:  # (only the whole buffer)
            self.peak_grad_bytes = nbytes(self.grad_flat)
            return
        held = [self.grad_shard, *self.bucket_bufs.values(), *(e[1] for e in self.in_flight)]
        self.peak_grad_bytes = max(self.peak_grad_bytes, sum(nbytes(b) for b in held))

    def reduce_gradients(self) -> None:
        for i in reversed(range(len(self.params))):  # (buckets go last first)
            if not self.taken[i]:
                self._take(i)
        for flight in self.in_flight:
            self._reduced(flight)
        for work in self.replicating:
            work.wait()
        if self.stage == 2:
            pieces = [self._shard_piece(k) for k in range(len(self.buckets))]
        else:
            held = self.grad_flat
            pieces = [held[a:b] for a, b in self.owned]
        # The optimizer's gradients are fp32 like its master: views, or copies of a bf16 reduction.
        self.grads = [g if g.dtype == torch.float32 else g.float() for g in pieces]
        for p, runs, whole in zip(self.params, self.runs, self.whole):
            for k, a, b, t in runs:
                lo = self.owned[k][0]
                g = self.grads[k][a - lo: b - lo]
                t.grad = zero.shaped_like(p, g) if whole else g
        self._start_step()
        if self.grad_dtype != torch.float32:  # the fp32 copies are the gradients now
            self.grad_flat = self.grad_shard = None

    def grad_pieces(self) -> list[tuple[torch.Tensor, int]]:
        # Owned pieces are distinct within dp_shard x cp; stage 0's whole buffer is held by all of dp x cp.
        dp_copies = self.layout.grad_ranks if self.shards == 1 else self.layout.dp_replicate
        pieces = []
        for (start, end, tp_copies), ks in zip(self.segments, self.buckets_of):
            for k in ks:
                (lo, hi), g = self.owned[k], self.grads[k]
                a, b = max(start, lo), min(end, hi)
                if a < b:
                    pieces.append((g[a - lo: b - lo], tp_copies * dp_copies))
        return pieces

    def scale_grads(self, coef: torch.Tensor) -> None:
        if self.grads:  # (none on a pipeline stage that LoRA leaves without adapters)
            torch._foreach_mul_(self.grads, coef)

    # ------------------------------------------------------------------ the update

    def step(self) -> None:
        self.wait_params()  # (a gather nobody waited for still writes this rank's piece too)
        self.optimizer.step()
        self.publish_params()

    def publish_params(self, one_at_a_time: bool = False) -> None:
        """The compute-dtype parameters from the owned fp32 pieces: copied (stage 0), or gathered
        bucket by bucket, asynchronously (forward waits for each module's own buckets) — or, with
        ``one_at_a_time``, each finished before the next starts (a resume holds one bucket's copy)."""
        if self.shards == 1:
            if self.separate_master:
                self.flat.copy_(self.master)  # stage 0 owns every bucket, in order
            return
        for k, ((lo, hi), m) in enumerate(zip(self.buckets, self.masters)):
            src = m.to(self.compute_dtype, copy=True)  # (gloo's all-gather may not read its output)
            # The output shares the buffer's memory, not the version counter of its views (the
            # parameters): a gather landing mid-forward (gloo writes when it finishes) must not mark
            # the parameters earlier modules saved as modified; it writes buckets none has read yet.
            out = self.flat.new_empty(0).set_(self.flat.untyped_storage(), lo, (hi - lo,))
            work = all_gather_single(out, src, group=self._group("dp_shard"), async_op=True)
            self.gathers[k] = (work, src, out)
            if one_at_a_time:
                self.wait_params([k])

    def wait_params(self, buckets=None) -> None:
        """Wait for the parameter gathers of ``buckets`` (all of them by default)."""
        for k in list(self.gathers) if buckets is None else buckets:
            if k in self.gathers:
                self.gathers.pop(k)[0].wait()

    def zero_grad(self) -> None:
        self.grads, self.grad_flat, self.grad_shard, self.peak_grad_bytes = None, None, None, 0
        self.optimizer.zero_grad(set_to_none=True)
        for p in self.params:
            p.grad = None

    def weights(self) -> list[torch.Tensor]:
        return self.masters

    def state_bytes(self) -> dict[str, int]:
        grads = nbytes(self.grad_flat) + nbytes(self.grad_shard)
        grads += sum(nbytes(g) for g in self.grads or () if g.dtype != self.grad_dtype)
        master = nbytes(self.master) if self.separate_master else 0
        # (the buffer: padding included; and the frozen parameters' own)
        return {"param_bytes": nbytes(self.flat) + nbytes(self.frozen), "grad_bytes": grads,
                "optim_bytes": zero.optimizer_state_bytes(self.optimizer) + master}


def _gaps(segments: list[tuple[int, int, int]], total: int) -> list[tuple[int, int]]:
    """The ranges of [0, total) no parameter covers."""
    out, at = [], 0
    for start, end, _ in sorted(segments):
        if start > at:
            out.append((at, start))
        at = max(at, end)
    return out + [(at, total)] if at < total else out
