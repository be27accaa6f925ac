"""The flat ZeRO 0-2 engine's checkpoints: per-parameter tensors laid out like the parameters, for
the model (its fp32 master, under every name a tied weight has) and Adam's moments alike, in the
format FSDP2's state dicts use, so that any layout loads what any other saved. A rank's owned
pieces are gathered over dp_shard for this (a transient whole copy: the price of that format)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchpar.models.common import canonical_name
from torchpar.optim import ensure_state
from torchpar.parallel import zero
from torchpar.parallel.zero import local


class FlatCheckpoints:
    """What :class:`~torchpar.parallel.flat.FlatZero` saves and loads (a mixin over its buffers)."""

    def _whole(self, pieces: list[torch.Tensor]) -> torch.Tensor:
        """The flat fp32 values of which this rank holds ``pieces`` (one per bucket)."""
        if self.shards == 1:
            return torch.cat(pieces) if len(pieces) > 1 else pieces[0]
        out = torch.empty(self.bounds[-1], dtype=pieces[0].dtype, device=pieces[0].device)
        for (lo, hi), piece in zip(self.buckets, pieces):
            dist.all_gather_into_tensor(out[lo:hi], piece.contiguous(), group=self._group("dp_shard"))
        return out

    def _per_param(self, flat: torch.Tensor, prefix: str = "", suffix: str = "", names=None) -> dict:
        """Values cut from ``flat`` per parameter, under ``names`` ((name, index) pairs; default:
        each parameter's first name)."""
        out = {}
        for name, i in names or zip(self.names, range(len(self.params))):
            start, end, _ = self.segments[i]
            out[f"{prefix}{name}{suffix}"] = zero.shaped_like(self.params[i], flat[start:end])
        return out

    def _load_pieces(self, values: dict, pieces: list[torch.Tensor], key=lambda n: n) -> None:
        flat = torch.zeros(self.bounds[-1], dtype=torch.float32, device=self.flat.device)
        for name, (start, end, _) in zip(self.names, self.segments):
            flat[start:end].copy_(local(values[key(name)]).reshape(-1))
        for (a, b), piece in zip(self.owned, pieces):
            piece.copy_(flat[a:b])

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        self.wait_params()
        sd = zero.parts_state_dict(self.parts)
        if self.separate_master:  # the fp32 master under every name (tied weights have two)
            names = [(canonical_name(n), self.index_of[id(p)])
                     for part in self.parts for n, p in part.named_parameters(remove_duplicate=False)]
            sd.update(self._per_param(self._whole(self.masters), names=names))
        return sd

    def load_model_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.wait_params()
        zero.load_parts_state_dict(self.parts, sd)
        if self.separate_master:
            self._load_pieces(sd, self.masters)

    def optimizer_state_dict(self) -> dict[str, torch.Tensor]:
        ensure_state(self.optimizer)
        states = [self.optimizer.state[m] for m in self.masters]
        out = {}
        for key in ("exp_avg", "exp_avg_sq"):
            out.update(self._per_param(self._whole([s[key] for s in states]), "state.", f".{key}"))
        for name in self.names:
            out[f"state.{name}.step"] = states[0]["step"]
        return out

    def load_optimizer_state_dict(self, loaded: dict[str, torch.Tensor]) -> None:
        ensure_state(self.optimizer)
        states = [self.optimizer.state[m] for m in self.masters]
        for key in ("exp_avg", "exp_avg_sq"):
            self._load_pieces(loaded, [s[key] for s in states], lambda n, key=key: f"state.{n}.{key}")
        for s in states:
            s["step"].copy_(loaded[f"state.{self.names[0]}.step"])

