"""The flat ZeRO 0-2 engine's checkpoints, without a whole copy of anything.

A checkpoint holds per-parameter tensors laid out like the parameters — the model's fp32 weights
(the master, under every name a tied weight has) and the optimizer's state — in the format FSDP2's
state dicts use, so that any layout loads what any other saved. A rank's values of a parameter are
its share of the flat buffer's owned pieces: contiguous runs of the parameter's flattened values,
which DCP takes as a few boxes each (part of a row, whole rows, part of a row). Each rank saves and
loads exactly those, in place: nothing is gathered, and a save or a resume holds no more than the
steady state. Ranks holding the same piece (every dp x cp rank at stage 0, the dp_replicate ranks
above it) each save a different part of it, so the bytes a save copies to the host do not grow with them;
so do the data-parallel ranks with a frozen LoRA base saved too (lora.save_base), which each holds whole.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from torchpar.models.common import canonical_name
from torchpar.optim import ensure_state
from torchpar.parallel import zero


def boxes(shape: tuple[int, ...], a: int, b: int) -> list[tuple[int, tuple, tuple]]:
    """Flat elements [a, b) of a row-major tensor of ``shape`` as boxes (first element, offsets,
    sizes): each box is contiguous in memory, and at most two per dimension are needed."""
    if a >= b:
        return []
    if len(shape) <= 1:
        return [(a, (a,) if shape else (), (b - a,) if shape else ())]
    row = math.prod(shape[1:])
    first, last = -(-a // row), b // row  # the whole rows are [first, last)
    if first > last:  # inside one row
        r = a // row
        return [(r * row + e, (r, *o), (1, *s)) for e, o, s in boxes(shape[1:], a - r * row, b - r * row)]
    out = []
    if a < first * row:  # the end of the row before the whole ones
        r = first - 1
        out += [(r * row + e, (r, *o), (1, *s)) for e, o, s in boxes(shape[1:], a - r * row, row)]
    if first < last:
        out.append((first * row, (first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if b > last * row:  # the start of the row after them
        out += [(last * row + e, (last, *o), (1, *s)) for e, o, s in boxes(shape[1:], 0, b - last * row)]
    return out


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) over a storage of exactly its bytes that shares its memory: DCP's file
    writer copies every tensor whose storage is larger (a view) and keeps all of a file's copies
    until the file is written — a whole copy of the rank's share."""
    start = t.storage_offset() * t.element_size()
    alias = t.untyped_storage()[start: start + t.numel() * t.element_size()]
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(alias, 0, t.shape)


def _chunks(values: torch.Tensor, first_value: int, shape: tuple, offset: tuple, a: int, b: int,
            saving: bool) -> list[tuple[tuple, torch.Tensor]]:
    """Flat elements [a, b) of this rank's piece (``shape``, at global ``offset``) of a tensor, as
    DCP chunks (global offsets, a view of ``values``, which hold the piece's flat elements from
    ``first_value`` on) — for a save, each over a storage of its own (:func:`own_storage`)."""
    chunks = []
    for first, o, sizes in boxes(shape, a, b):
        at = first - first_value
        view = values[at: at + math.prod(sizes)].view(sizes)
        chunks.append((tuple(x + y for x, y in zip(o, offset)), own_storage(view) if saving else view))
    return chunks


class FlatPiece:
    """One parameter's values on this rank, as DCP chunks over views of the engine's tensors (DCP
    saves from them and loads into them through the ``__create_*__`` protocol DTensor uses)."""

    def __init__(self, shape: torch.Size, dtype: torch.dtype, chunks: list[tuple[tuple, torch.Tensor]]):
        self.shape, self.dtype = torch.Size(shape), dtype
        self.chunks = chunks  # (global offsets, tensor of the chunk's sizes)

    def size(self) -> torch.Size:
        return self.shape

    def map(self, fn) -> FlatPiece:
        """The same chunks, each tensor replaced by ``fn(tensor)`` (a host copy, for an async save)."""
        return FlatPiece(self.shape, self.dtype, [(o, fn(t)) for o, t in self.chunks])

    def __create_write_items__(self, fqn: str, _obj) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(o)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(torch.Size(o), t.shape),
                                                      properties=TensorProperties.create_from_tensor(t),
                                                      size=self.shape))
                for o, t in self.chunks]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(torch.Size(o), t.shape) for o, t in self.chunks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return next(t for o, t in self.chunks if tuple(o) == tuple(index.offset))


class FlatCheckpoints:
    """What :class:`~torchpar.parallel.flat.FlatZero` saves and loads (a mixin over its buffers)."""

    def _shares(self, saving: bool) -> dict[int, tuple[int, int]]:
        """Bucket -> (start, end) in the flat buffer: this rank's owned piece — for a save, only its
        share of it among the ranks holding the same pieces."""
        copies, mine = 1, 0
        if saving:
            dim = "dp" if self.shards == 1 else "dp_replicate"
            copies, mine = self.meshes[dim].size(), self.meshes[dim].get_local_rank()
        return {k: (lo + (hi - lo) * mine // copies, lo + (hi - lo) * (mine + 1) // copies)
                for k, (lo, hi) in enumerate(self.owned)}

    def _piece(self, i: int, values: list[torch.Tensor], shares: dict, saving: bool) -> FlatPiece:
        """Parameter ``i``'s ``values`` on this rank (one tensor per run of :attr:`runs`, laid out
        like the run) as a :class:`FlatPiece` — for a save, this rank's share of them (``shares``:
        :meth:`_shares`)."""
        p, (start, _, _) = self.params[i], self.segments[i]
        shape, offset = zero.local_box(p)
        chunks = []
        for (k, a, b, _), v in zip(self.runs[i], values):
            lo, hi = shares[k]
            chunks += _chunks(zero.local(v).reshape(-1), a - start, shape, offset,
                              max(a, lo) - start, min(b, hi) - start, saving)
        return FlatPiece(p.shape, values[0].dtype, chunks)

    def _all_names(self) -> list[tuple[str, int]]:
        """(canonical name, parameter index) for every name of every trained parameter (tied ones:
        two); frozen ones are the parts' other entries."""
        return [(canonical_name(n), self.index_of[id(p)])
                for part in self.parts for n, p in part.named_parameters(remove_duplicate=False)
                if id(p) in self.index_of]

    def _model_dict(self, saving: bool) -> dict:
        """The fp32 master under every parameter name, beside the parts' other entries."""
        self.wait_params()
        names = self._all_names()
        keys = {name for name, _ in names}
        sd = {k: v for k, v in zero.parts_state_dict(self.parts).items() if k not in keys}
        if saving:
            sd.update(self._frozen_shares(sd))
        pieces, shares = {}, self._shares(saving)
        for i, runs in enumerate(self.runs):
            if runs:  # (with whole parameters, another rank's)
                masters = [self.masters[k][a - self.owned[k][0]: b - self.owned[k][0]] for k, a, b, _ in runs]
                pieces[i] = self._piece(i, masters, shares, saving)
        sd.update({name: pieces[i] for name, i in names if i in pieces})
        return sd

    def _frozen_shares(self, sd: dict) -> dict:
        """This rank's share of each frozen parameter in ``sd`` (a LoRA base saved with
        lora.save_base), which every data-parallel rank holds whole: a save of all of it on each
        would copy the whole base to the host on every rank of a node."""
        dp = self.meshes["dp"]
        copies, mine = dp.size(), dp.get_local_rank()
        frozen = {canonical_name(n) for part in self.parts
                  for n, p in part.named_parameters(remove_duplicate=False) if not p.requires_grad}
        out = {}
        for name in sorted(frozen & sd.keys()) if copies > 1 else ():
            v = sd[name]
            flat, (shape, offset) = zero.local(v).reshape(-1), zero.local_box(v)
            n = flat.numel()
            share = _chunks(flat, 0, shape, offset, n * mine // copies, n * (mine + 1) // copies, saving=True)
            out[name] = FlatPiece(v.shape, flat.dtype, share)
        return out

    def model_state_dict(self) -> dict:
        return self._model_dict(saving=True)

    def model_load_template(self) -> dict:
        """What a resume loads into: every owned piece (all of it: the whole piece is needed)."""
        return self._model_dict(saving=False)

    def load_model_state_dict(self, sd: dict) -> None:
        """The master pieces are loaded in place (by DCP, into :meth:`model_load_template`); the
        compute-dtype parameters are made from them, bucket by bucket."""
        self.wait_params()
        keys = {name for name, _ in self._all_names()}
        rest = {k: v for k, v in sd.items() if k not in keys}
        if rest:
            zero.load_parts_state_dict(self.parts, rest)
        self.publish_params(one_at_a_time=True)

    def _optimizer_dict(self, saving: bool) -> dict:
        """Every state tensor of every parameter this rank updates, by ``state.<name>.<key>``: what
        is laid out like the parameter as a :class:`FlatPiece` over its runs; scalars (the step)
        and a whole parameter's other state (Adafactor's row and column factors) as they are."""
        ensure_state(self.optimizer)
        out, shares = {}, self._shares(saving)
        for i, name in enumerate(self.names):
            states = [self.optimizer.state[t] for *_, t in self.runs[i]]
            for key, v in (states[0] if states else {}).items():
                if self._laid_out_like(v, i):
                    out[f"state.{name}.{key}"] = self._piece(i, [s[key] for s in states], shares, saving)
                else:
                    out[f"state.{name}.{key}"] = v
        return out

    def _laid_out_like(self, v, i: int) -> bool:
        t = self.runs[i][0][3]
        return torch.is_tensor(v) and v.dim() > 0 and v.shape == t.shape

    def optimizer_state_dict(self) -> dict:
        return self._optimizer_dict(saving=True)

    def optimizer_load_template(self) -> dict:
        return self._optimizer_dict(saving=False)

    def load_optimizer_state_dict(self, loaded: dict) -> None:
        """The state laid out like the parameters was loaded in place, and so was the rest of a
        parameter's first run; its other runs get copies."""
        for i, name in enumerate(self.names):
            states = [self.optimizer.state[t] for *_, t in self.runs[i]]
            for key, v in (states[0] if states else {}).items():
                if not self._laid_out_like(v, i):
                    for s in states[1:]:
                        if torch.is_tensor(v):
                            s[key].copy_(loaded[f"state.{name}.{key}"])
                        else:
                            s[key] = loaded[f"state.{name}.{key}"]
