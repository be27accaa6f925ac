"""Replica groups through torchft: several jobs of one layout train as one, and a lost group costs
the others a step at most, not a restart.

Each replica group is a torchpar job of its own (its own ranks, process group, mesh and layout:
ZeRO-3, TP, PP, CP or EP inside it). Rank r of every group also joins a process group that torchft
manages across the groups' rank r, and a torchft ``Manager`` (one per rank; group rank 0's talks to
the lighthouse) decides each step's quorum: which groups take part. A step then runs as usual
inside each group; once a group has reduced its gradients, each rank averages its pieces of them
(the ZeRO engine's own: an FSDP2 shard, the flat engine's owned pieces) with the same pieces of the
other groups, and the optimizer steps only if the step commits — every group in the quorum got
through it (``should_commit``). A group that dies drops out of the next quorum; the others go on.

The data is split over every group's data-parallel ranks: group g's rank of data-parallel index i
reads shard ``g x dp + i`` of ``replica_groups x dp``, so with every group present a step trains
on what one job of ``replica_groups`` times the data-parallel ranks would (and equals it, as the
tests check); a step some group misses trains on the others' shards alone.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import zlib
from pathlib import Path

import torch

from torchpar.errors import ConfigError

try:  # (an optional dependency: only a job with [fault_tolerance] enable = true needs it)
    from torchft.manager import Manager
    from torchft.process_group import ProcessGroupGloo
except ImportError:  # pragma: no cover - the check below says what to install
    Manager = ProcessGroupGloo = None


def for_replica(cfg):
    """``cfg`` as replica group ``fault_tolerance.replica_id`` runs it: in a dump folder (and, if
    absolute, a checkpoint folder) of its own, ``replica_<id>`` inside the given one."""
    ft = cfg.fault_tolerance
    if not ft.enable:
        return cfg
    own = f"replica_{ft.replica_id}"
    folder = cfg.checkpoint.folder
    checkpoint = (dataclasses.replace(cfg.checkpoint, folder=str(Path(folder) / own))
                  if Path(folder).is_absolute() else cfg.checkpoint)
    job = dataclasses.replace(cfg.job, dump_folder=str(Path(cfg.job.dump_folder) / own))
    out = dataclasses.replace(cfg, job=job, checkpoint=checkpoint)
    out.overridden = cfg.overridden
    return out


def replica_groups(ft) -> tuple[int, int, int]:
    """([fault_tolerance]'s) replica groups training the job (1 without it), the steps between two
    syncs of all the weights (0: gradients every step) and the fragments synced in turn."""
    if not ft.enable:
        return 1, 0, 1
    if ft.semi_sync == "off":
        return ft.replica_groups, 0, 1
    return ft.replica_groups, ft.sync_every, ft.fragments


def tag_bytes(groups: int) -> int:
    """Bytes an average of fp32 tensors carries beside them (:meth:`ReplicaGroups.average`): the
    layout's 2-float fingerprint and the one-hot of each of ``groups`` groups."""
    return 4 * (2 + groups)


def data_shard(ft, dp_rank: int, dp: int) -> tuple[int, int]:
    """(the shard, of how many) that data-parallel rank ``dp_rank`` of ``dp`` reads: with replica
    groups, shard ``replica_id x dp + dp_rank`` of ``replica_groups x dp``."""
    if not ft.enable:
        return dp_rank, dp
    return ft.replica_id * dp + dp_rank, ft.replica_groups * dp


def lighthouse_of(ft) -> str:
    """The lighthouse's address: [fault_tolerance] lighthouse, else TORCHFT_LIGHTHOUSE; one line if none."""
    address = ft.lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE", "")
    if not address:
        raise ConfigError("fault_tolerance.enable = true needs the torchft lighthouse's address: set "
                          "fault_tolerance.lighthouse = 'http://host:port' or TORCHFT_LIGHTHOUSE (start one "
                          "with torchft_lighthouse --min_replicas 1)")
    return address


def check_fault_tolerance(ft) -> None:
    """What fault tolerance needs before any process group: torchft and a lighthouse."""
    if not ft.enable:
        return
    if Manager is None:
        raise ConfigError("fault_tolerance.enable = true needs torchft: pip install torchft")
    lighthouse_of(ft)


class ReplicaGroups:
    """This rank's place among the replica groups: its torchft manager and the data shard it reads."""

    def __init__(self, ft, group_rank: int, group_world: int):
        timeout = datetime.timedelta(seconds=ft.timeout_s)
        self.replica_id, self.groups = ft.replica_id, ft.replica_groups
        self.fingerprint, self.described = None, ""
        self.payload = 0  # bytes this rank averaged with the other groups in this step
        self.members: list[int] = []  # the groups whose work the last average holds (ids, ascending)
        # The groups' ranks of one position average their gradients over gloo (on GPUs too, the
        # pieces are copied to the host: torchft's NCCL groups are its own, not yet torchpar's).
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=ft.min_replicas,
            load_state_dict=None, state_dict=None, replica_id=f"torchpar_{ft.replica_id}",
            lighthouse_addr=lighthouse_of(ft), rank=group_rank, world_size=group_world,
            # every group starts from the same seeded (or loaded) weights: nothing to send at step 0
            init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)

    def serve(self, state_dict, load_state_dict) -> None:
        """What a recovering group's rank receives from this one (``state_dict()``), and how this
        rank takes it when recovering (``load_state_dict(sd)``, called as the step commits)."""
        self.manager.register_state_dict_fn("torchpar", load_state_dict, state_dict)

    def new_step(self) -> None:
        """A step begins: nothing averaged in it yet (a semi-synchronous step may average nothing)."""
        self.payload, self.members = 0, []

    def start_step(self) -> None:
        """The quorum of this step, computed while the step's forward runs."""
        self.manager.start_quorum()

    def describe(self, what: str) -> None:
        """What this group's ranks must share with the same ranks of the others (its layout and
        this rank's gradient pieces, described): pieces are averaged position by position."""
        x = zlib.crc32(what.encode()) / 2**32
        self.fingerprint, self.described = torch.tensor([x, x * x]), what

    def average(self, tensors: list[torch.Tensor]) -> None:
        """Each tensor averaged in place with its counterparts in the other groups of the quorum, in
        one collective per dtype (a rank's own pieces, flattened: never more than it holds). With
        the fp32 ones go :meth:`describe`'s fingerprint, x and x^2 of its CRC32 — both averages
        equal this rank's only if every group's is the same (the others', for a group that is
        recovering and does not count): one line on every rank otherwise — and a one-hot of this
        group's id, whose average times the participants names the groups that took part
        (:attr:`members`: a recovering group's part is zeroed by torchft)."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {torch.float32: []}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        for dtype, group in by_dtype.items():
            check = []
            if dtype == torch.float32:
                mine = torch.zeros(self.groups)
                mine[self.replica_id] = 1.0
                check = [mine] + ([self.fingerprint] if self.fingerprint is not None else [])
            # One copy to the host and one back for all of a dtype's pieces (a copy per piece would
            # wait for the device once per parameter, each way).
            sizes = [t.numel() for t in group]
            pieces = [torch.cat([t.detach().reshape(-1) for t in group]).cpu()] if group else []
            flat = torch.cat(pieces + check)
            self.manager.allreduce(flat).wait()
            self.payload += flat.numel() * flat.element_size()
            at = sum(sizes)
            if group:
                back = flat[:at].to(group[0].device).split(sizes)
                torch._foreach_copy_(group, [b.view_as(t) for b, t in zip(back, group)])
            if not check or self.manager.errored() is not None:
                continue  # (a failed average holds anything: the step will not commit)
            present = flat[at: at + self.groups] * self.participants()
            self.members = [i for i, x in enumerate(present.tolist()) if x > 0.5]
            at += self.groups
            fingerprint = self.fingerprint
            if fingerprint is not None and not torch.allclose(flat[at:], fingerprint, rtol=1e-5, atol=0):
                raise ConfigError(f"replica group {self.replica_id} runs a layout the other groups do not "
                                  f"({self.described}); every group of fault_tolerance.replica_groups must "
                                  "run the same layout and model")

    def resume_at(self, meetings: int) -> None:
        """Start counting committed steps at ``meetings`` (a run resumed from a checkpoint)."""
        self.manager.load_state_dict({"step": meetings, "batches_committed": 0})

    def meetings(self) -> int:
        """The steps (meetings) the groups have committed, once this one's quorum is known: the same
        in every group of the quorum, a recovering one's included (torchft's step count)."""
        self.manager.wait_quorum()
        return self.manager.current_step()

    def commit(self) -> bool:
        """Whether this step's update is applied: every group of the quorum got through it (the same
        answer on every rank of this group)."""
        return self.manager.should_commit()

    def committed(self) -> int:
        """The steps the groups have committed so far (after this one's commit)."""
        return self.manager.current_step()

    def participants(self) -> int:
        return self.manager.num_participants()

    def close(self) -> None:
        self.manager.shutdown(wait=False)


def fragment_slices(sizes: list[int], fragments: int) -> list[list[tuple[int, int, int]]]:
    """Streaming DiLoCo's fragments of what a rank holds: pieces of ``sizes`` elements, taken in
    order as one range, cut into ``fragments`` equal runs; each a list of (piece, start, end)."""
    total, out = sum(sizes), []
    for f in range(fragments):
        lo, hi, at, run = f * total // fragments, (f + 1) * total // fragments, 0, []
        for i, n in enumerate(sizes):
            a, b = max(lo, at), min(hi, at + n)
            if a < b:
                run.append((i, a - at, b - at))
            at += n
        out.append(run)
    return out


class CommitCount:
    """The steps the replica groups have committed (torchft's count), kept in a checkpoint of a
    synchronous group: a group's own step also counts the steps the quorum did not commit, so two
    groups resumed at one count could hold different weights (and one counting above the other
    would heal it from older ones). A checkpoint without it (older, or trained without replica
    groups) leaves the count to the step."""

    keys_optional = True  # (a checkpoint without it: nothing loaded)

    def __init__(self):
        self.count = torch.tensor(-1, dtype=torch.int64)

    def resume_at(self, step: int) -> int:
        """The count to resume at, for a run at ``step``."""
        return int(self.count) if int(self.count) >= 0 else step

    def state_dict(self) -> dict:
        return {"commits": self.count}

    def load_state_dict(self, sd: dict) -> None:
        if "commits" in sd:
            self.count.copy_(sd["commits"])


class OuterStep:
    """Semi-synchronous replica groups ([fault_tolerance] semi_sync): each group trains on alone and
    the groups meet every ``sync_every / fragments`` steps, each time over one fragment of the
    weights in turn (streaming DiLoCo; one fragment: all of them every ``sync_every`` steps).
    LocalSGD averages the fragment's weights; DiLoCo averages each group's move since the fragment's
    last sync, ``start - now``, and takes it as the gradient of an outer Nesterov SGD on ``start``;
    the group then holds ``start`` mixed with its own weights by ``fragment_alpha`` (0: ``start``).
    Both act on what this rank holds of the weights (the ZeRO engine's fp32 master pieces or FSDP2
    shards), copies of which — the weights of the last sync and DiLoCo's momentum — are kept on the
    host; a fragment is an equal run of them (:func:`fragment_slices`). A sync that does not commit
    puts the fragment back to ``start``."""

    keys_optional = True  # (each rank's own pieces, under keys of its own: another layout's lack some)

    def __init__(self, ft, weights: list[torch.Tensor], rank: int):
        self.kind, self.alpha = ft.semi_sync, ft.fragment_alpha
        self.lr, self.momentum = ft.outer_lr, ft.outer_momentum
        self.fragments, self.every = ft.fragments, ft.sync_every // ft.fragments
        self.key = f"rank{rank}"
        self.start = [w.detach().to("cpu", copy=True) for w in weights]
        self.buf = [torch.zeros_like(s) for s in self.start] if self.kind == "diloco" else []
        self.slices = fragment_slices([w.numel() for w in weights], self.fragments)
        # The meetings committed so far (torchft's step count, which picks the fragment): saved, so
        # that a resumed run takes the fragments on in the same turn.
        self.meetings = torch.zeros((), dtype=torch.int64)

    def due(self, step: int) -> bool:
        return step % self.every == 0

    @torch.no_grad()
    def sync(self, replicas: ReplicaGroups, weights: list[torch.Tensor]) -> bool:
        """Meet the other groups over the fragment due (``weights``: this rank's pieces, changed in
        place); whether the sync committed."""
        replicas.start_step()
        # The fragment by the groups' count of committed meetings, not this group's step: a group
        # that joined late (or retries a meeting that failed) meets over the others' fragment.
        run = self.slices[replicas.meetings() % self.fragments]

        def views(tensors):
            return [tensors[i].view(-1)[a:b] for i, a, b in run]

        mine, start = views(weights), views(self.start)
        now = [w.detach().cpu() for w in mine]
        if self.kind == "localsgd":
            moved = [m.clone() for m in now]
        else:
            moved = [s - m for s, m in zip(start, now)]
        replicas.average(moved)
        committed = replicas.commit()  # (a recovering group takes start and buf from a peer here)
        if committed and self.kind == "localsgd":
            for s, m in zip(start, moved):
                s.copy_(m)
        elif committed:
            for s, d, b in zip(start, moved, views(self.buf)):
                b.mul_(self.momentum).add_(d)
                s.sub_(self.lr * (d + self.momentum * b))  # (Nesterov)
        for w, s in zip(mine, start):
            if committed and self.alpha:  # (read after the commit: a recovering group's are the peer's)
                w.copy_(s.lerp(w.detach().cpu(), self.alpha))
            else:
                w.copy_(s)
        self.meetings.fill_(replicas.meetings())
        return committed

    def state_dict(self) -> dict:
        return ({f"{self.key}.start.{i}": t for i, t in enumerate(self.start)}
                | {f"{self.key}.momentum.{i}": t for i, t in enumerate(self.buf)}
                | {f"{self.key}.meetings": self.meetings})

    def load_state_dict(self, sd: dict) -> None:
        for i, t in enumerate(self.start):
            t.copy_(sd.get(f"{self.key}.start.{i}", t))
        for i, t in enumerate(self.buf):
            t.copy_(sd.get(f"{self.key}.momentum.{i}", t))
        self.meetings.copy_(sd.get(f"{self.key}.meetings", self.meetings))
