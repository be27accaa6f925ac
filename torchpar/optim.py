"""Optimizers and the learning-rate schedule: the parts a fork swaps, each built from its section.

An optimizer is a :class:`Kind` in :data:`OPTIMIZERS` (or any ``torch.optim`` class by dotted name):
how to build it over parameter groups, whether it needs each parameter whole (Muon's
orthogonalization, Adafactor's row and column factors) or can take slices of the ZeRO buckets,
and how many bytes of state it keeps per parameter (what the planner counts). Parameters are put
in groups by role (:func:`param_role`) through one table, :data:`PARAM_GROUPS`.

To add an optimizer: write a ``torch.optim.Optimizer`` (or name one by its dotted path) and add a
``Kind`` beside the three below; every engine, the checkpoints and the guard take it from there.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import math
from dataclasses import dataclass
from itertools import chain
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from torchpar.errors import ConfigError, did_you_mean

# ---------------------------------------------------------------------------- parameter groups

# Roles of a parameter, by its shape and which top-level module holds it (the model adapter's
# first_stage / last_stage: embeddings and the output head).
ROLES = ("matrix", "head", "embedding", "vector")

# The parameter groups, one row per role: whether weight decay applies (unless [optimizer]
# decay_all), which [optimizer] field multiplies its learning rate, and whether Muon takes it
# (the rest go to Muon's AdamW). A fork edits this table.
PARAM_GROUPS = {
    "matrix": {"decay": True, "lr_mult": None, "muon": True},  # 2-D hidden weights
    "head": {"decay": True, "lr_mult": "head_lr_mult", "muon": False},  # the output projection
    "embedding": {"decay": False, "lr_mult": "embedding_lr_mult", "muon": False},
    "vector": {"decay": False, "lr_mult": None, "muon": False},  # norm gains, biases
}


def holds_vectors(name: str, ndim: int) -> bool:
    """Whether a parameter is a vector, or a stack of one per expert (an expert's bias)."""
    return ndim < 2 or name.endswith("_bias")


def param_role(name: str, ndim: int, model) -> str:
    """``name``'s row of :data:`PARAM_GROUPS` (``model``: the family's adapter)."""
    top = name.split(".")[0]
    if top in model.first_stage:
        return "embedding"
    if holds_vectors(name, ndim):
        return "vector"
    return "head" if top in model.last_stage else "matrix"


def param_groups(items, cfg, model) -> dict[str, list[torch.Tensor]]:
    """The tensors of ``items`` — (canonical name, the model's parameter, the tensor the optimizer
    updates: the parameter itself or the engine's piece of it) — by role."""
    out: dict[str, list[torch.Tensor]] = {role: [] for role in ROLES}
    for name, param, tensor in items:
        out[param_role(name, param.dim(), model)].append(tensor)
    return out


def _group(role: str, tensors: list[torch.Tensor], cfg, lr: float) -> dict:
    row = PARAM_GROUPS[role]
    mult = getattr(cfg, row["lr_mult"]) if row["lr_mult"] else 1.0
    decay = cfg.weight_decay if row["decay"] or cfg.decay_all else 0.0
    return {"params": tensors, "lr": lr * mult, "weight_decay": decay, "role": role}


# ---------------------------------------------------------------------------- moments in bf16


def optimized(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates, over its groups (none on a pipeline stage that LoRA
    leaves without adapters)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def state_dtype(cfg) -> torch.dtype:
    """The dtype [optimizer] ``cfg`` keeps the moments in (None: float32)."""
    return getattr(torch, getattr(cfg, "state_dtype", "float32"))


def rounding_drift(cfg, steps: int, shapes) -> float:
    """How far two runs' weights may part after ``steps`` steps, per element, when [optimizer] ``cfg``
    stores its moments rounded (state_dtype bfloat16) and the runs' gradients differ in the last bits
    (two layouts reduce in other orders): a moment whose rounding flips moves by one unit of the
    stored dtype, at most its epsilon (2^-7) of itself, and so does the element's step, which
    Adam's normalization bounds by the learning rate (Muon's: the matrix's adjusted rate, its
    orthogonalized update having entries of at most 1); ``shapes``: the parameters'. 0 in float32,
    where last-bit differences stay in the last bits."""
    dtype = state_dtype(cfg)
    if dtype == torch.float32 or not kind_of(cfg).compact_state:
        return 0.0
    lr = cfg.lr * max(1.0, cfg.head_lr_mult, cfg.embedding_lr_mult)
    if cfg.name.lower() == "muon":
        adjust = _kwargs(cfg).get("adjust_lr_fn")
        lr = max([lr] + [adjusted_lr(cfg.muon_lr, adjust, s) for s in shapes if len(s) >= 2])
    return steps * torch.finfo(dtype).eps * lr


class KeepsStateDtype:
    """Loads a state dict without the fp32 copy torch's ``Optimizer.load_state_dict`` makes of every
    floating-point state value (it casts each to its parameter's dtype): the moments are set aside,
    the rest loaded by torch, and the moments put back in ``state_dtype`` (no copy when the
    checkpoint's were already in it; a float32 checkpoint is cast value by value)."""

    state_dtype: torch.dtype = torch.float32

    def load_state_dict(self, state_dict: dict) -> None:
        if self.state_dtype == torch.float32:
            return super().load_state_dict(state_dict)
        rest, moments = {}, {}
        for pid, s in state_dict["state"].items():
            rest[pid] = {k: v for k, v in s.items() if not (torch.is_tensor(v) and v.dim() > 0)}
            moments[pid] = {k: v for k, v in s.items() if k not in rest[pid]}
        super().load_state_dict({**state_dict, "state": rest})
        ids = chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        for pid, p in zip(ids, params):
            for key, v in moments.get(pid, {}).items():
                self.state[p][key] = v.to(device=p.device, dtype=self.state_dtype)


def closure_loss(closure) -> torch.Tensor | None:
    """The loss a step's ``closure`` returns, computed with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def _chunks(params: list[torch.Tensor], elements: int) -> list[list[torch.Tensor]]:
    """``params`` in runs of at most ``elements`` local elements (a larger parameter: alone)."""
    out, size = [[]], 0
    for p in params:
        n = (p.to_local() if isinstance(p, DTensor) else p).numel()
        if out[-1] and size + n > elements:
            out.append([])
            size = 0
        out[-1].append(p)
        size += n
    return [c for c in out if c]


class CompactAdamW(KeepsStateDtype, torch.optim.Optimizer):
    """AdamW whose moments are stored in ``state_dtype`` (bfloat16: 4 bytes per parameter instead of
    8; 6 instead of 12 with amsgrad) while the weights it updates stay fp32. A step reads the
    moments of a bounded run of parameters into fp32 (:attr:`CHUNK` elements: the step's transient),
    runs torch's foreach AdamW on them op for op, and stores them back rounded to nearest. With
    ``state_dtype = torch.float32`` it is ``torch.optim.AdamW(foreach=True)`` bit for bit (a test
    pins it).

    Rounding to nearest loses a second-moment update smaller than half a bf16 unit (2^-9 of the
    value): with beta2 above 0.992 the moment then lags a gradient that changes slowly; the config
    check warns."""

    CHUNK = 1 << 25  # fp32 elements read at once (128 MiB per moment)

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 1e-2, amsgrad: bool = False,
                 state_dtype: torch.dtype = torch.bfloat16):
        # torch's checks of the arguments, on a stand-in parameter
        torch.optim.AdamW([torch.zeros(1)], lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.state_dtype = state_dtype
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": amsgrad})

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            for run in _chunks([p for p in group["params"] if p.grad is not None], self.CHUNK):
                self._update(group, run)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        beta1, beta2 = group["betas"]
        lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
        keys = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ())
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.tensor(0.0)
                for key in keys:
                    state[key] = torch.zeros_like(p, dtype=self.state_dtype)
        grads = [p.grad if p.grad.dtype == p.dtype else p.grad.to(p.dtype) for p in params]
        stored = {key: [self.state[p][key] for p in params] for key in keys}
        wide = {key: [m.to(p.dtype) for m, p in zip(ms, params)] for key, ms in stored.items()}
        steps = [self.state[p]["step"] for p in params]
        torch._foreach_add_(steps, 1)
        if decay != 0:
            torch._foreach_mul_(params, 1 - lr * decay)
        torch._foreach_lerp_(wide["exp_avg"], grads, 1 - beta1)
        torch._foreach_mul_(wide["exp_avg_sq"], beta2)
        torch._foreach_addcmul_(wide["exp_avg_sq"], grads, grads, 1 - beta2)
        counts = [s.item() for s in steps]
        step_sizes = [(lr / (1 - beta1 ** n)) * -1 for n in counts]
        root_corrections = [(1 - beta2 ** n) ** 0.5 for n in counts]
        if group["amsgrad"]:
            torch._foreach_maximum_(wide["max_exp_avg_sq"], wide["exp_avg_sq"])
        denom = torch._foreach_sqrt(wide["max_exp_avg_sq" if group["amsgrad"] else "exp_avg_sq"])
        torch._foreach_div_(denom, root_corrections)
        torch._foreach_add_(denom, eps)
        torch._foreach_addcdiv_(params, wide["exp_avg"], denom, step_sizes)
        for key, ms in stored.items():
            for m, w in zip(ms, wide[key]):
                if m is not w:
                    m.copy_(w)


# ---------------------------------------------------------------------------- Muon


def newton_schulz(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """The orthogonalized matrix U V^T of ``g`` = U S V^T, approximately, by ``steps`` iterations of
    the quintic X <- a X + (b A + c A^2) X, A = X X^T (Muon's), in ``dtype``, on the wide side. A
    stack of matrices [..., m, n] (a mixture of experts' weights) is orthogonalized matrix by matrix,
    in one batched iteration."""
    a, b, c = coefficients
    x = g.to(dtype)
    if g.dim() > 2:
        x = x.reshape(-1, *g.shape[-2:])
    mm = torch.addmm if x.dim() == 2 else torch.baddbmm  # (the 2-D path is torch.optim.Muon's, bit for bit)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    # spectral norm <= Frobenius norm <= 1
    x = x / torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True).clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.mT
        x = mm(x, mm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return (x.mT if tall else x).reshape(g.shape)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """Muon's per-matrix learning rate: x sqrt(max(1, rows / cols)) ('original', the default) or
    0.2 sqrt(max(rows, cols)) ('match_rms_adamw': an update of AdamW's RMS). A stack's matrices are
    its last two dimensions."""
    rows, cols = shape[-2:]
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(rows, cols))
    return lr * math.sqrt(max(1.0, rows / cols)) if adjust_lr_fn in (None, "original") else lr


class Muon(KeepsStateDtype, torch.optim.Muon):
    """torch's Muon, whose matrices may also be sharded (DTensors, under TP or ZeRO-3) or stacked
    (a mixture of experts' [experts, rows, cols] weights, each expert's matrix orthogonalized on its
    own, as if it were a parameter of its own). A sharded update is gathered in the Newton-Schulz
    dtype (nothing is lost: that is the precision it runs in) along its matrix dimensions only — a
    stack split by experts (expert parallelism, ZeRO-3) keeps each rank's experts where they are —
    orthogonalized on each rank holding a piece, and each keeps its own part. ``ns_dtype``: the
    iteration's dtype — torch's bfloat16 on GPUs; by default float32 on the CPU, where bf16 matmuls
    are slow, and where a last-bit difference of a gradient between two layouts would flip bf16
    roundings that the iteration amplifies. With ``ns_dtype = "bfloat16"`` it steps exactly like
    ``torch.optim.Muon`` on 2-D parameters (a test pins it). ``state_dtype``: the momentum's
    (bfloat16: half the bytes), updated in fp32 and stored rounded to nearest."""

    def __init__(self, params, ns_dtype: str | None = None, state_dtype: torch.dtype = torch.float32,
                 **kwargs):
        if ns_dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"ns_dtype must be 'bfloat16' or 'float32' (or unset), got {ns_dtype!r}")
        # torch's checks of the arguments and its defaults, on a stand-in matrix: its own check of
        # the parameters refuses stacks, which this class orthogonalizes matrix by matrix.
        defaults = torch.optim.Muon([torch.zeros(1, 1)], **kwargs).defaults
        self.state_dtype = state_dtype
        torch.optim.Optimizer.__init__(self, params, {**defaults, "ns_dtype": ns_dtype})
        for group in self.param_groups:
            for p in group["params"]:
                if p.dim() < 2:
                    raise ValueError(f"Muon updates matrices and stacks of them, not a parameter of shape "
                                     f"{tuple(p.shape)}")

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure_loss(closure)
        for group in self.param_groups:
            params, grads, bufs = [], [], []
            for p in group["params"]:  # (before torch makes it in the gradient's dtype)
                if p.grad is not None and "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad, dtype=self.state_dtype)
            self._init_group(group, params, grads, bufs)
            momentum = group["momentum"]
            updates = []
            for grad, buf in zip(grads, bufs):
                wide = buf.to(grad.dtype)
                wide.lerp_(grad, 1 - momentum)
                if wide is not buf:
                    buf.copy_(wide)
                updates.append(grad.lerp(wide, momentum) if group["nesterov"] else wide)
            done = _owner_orthogonalized(params, updates, group)
            for p, update in zip(params, updates):
                update = done[id(p)] if id(p) in done else self._orthogonalized(update, p, group)
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update, alpha=-adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape))
        return loss

    @staticmethod
    def _orthogonalized(update: torch.Tensor, p: torch.Tensor, group: dict) -> torch.Tensor:
        args = _ns_args(update, group)
        if not isinstance(update, DTensor):
            return newton_schulz(update, *args)
        if any(pl.is_partial() for pl in update.placements):  # (reduced in fp32, before the cast)
            update = update.redistribute(placements=p.placements)
        # Whole matrices: a split of a stack's leading (expert) dimension stays; the rest is gathered.
        whole = [pl if isinstance(pl, (Shard, _StridedShard)) and pl.dim < p.dim() - 2 else Replicate()
                 for pl in p.placements]
        local = update.to(args[-1]).redistribute(placements=whole).to_local()
        done = DTensor.from_local(newton_schulz(local, *args), p.device_mesh, whole, run_check=False,
                                  shape=p.shape, stride=p.stride())
        return done.redistribute(p.device_mesh, p.placements)  # (keeps this rank's part: no communication)


def _ns_args(update: torch.Tensor, group: dict) -> tuple:
    dtype = group["ns_dtype"] or ("bfloat16" if update.device.type == "cuda" else "float32")
    return group["ns_coefficients"], group["ns_steps"], group["eps"], getattr(torch, dtype)


def _row_sharded_dim(p: torch.Tensor) -> int | None:
    """The mesh dimension whose ranks split matrix ``p`` by rows (ZeRO-3's Shard(0)) where that is
    its only split (other dimensions replicate it: HSDP's replicas); None otherwise (TP, a stack)."""
    if not isinstance(p, DTensor) or p.dim() != 2:
        return None
    sharded = [d for d, pl in enumerate(p.placements) if not isinstance(pl, Replicate)]
    if len(sharded) != 1 or type(p.placements[sharded[0]]) is not Shard or p.placements[sharded[0]].dim != 0:
        return None
    return sharded[0]


def _row_counts(rows: int, n: int) -> list[int]:
    """The rows each of ``n`` ranks holds of a matrix split by rows (torch.chunk's sizes, as
    DTensor's Shard(0) splits: the last ranks may hold fewer, or none)."""
    size = -(-rows // n)
    return [max(0, min(size, rows - k * size)) for k in range(n)]


def _owner_orthogonalized(params: list, updates: list, group: dict) -> dict[int, torch.Tensor]:
    """The orthogonalized updates of the matrices ZeRO-3 splits by rows, by ``id`` of their
    parameter: each orthogonalized by one rank of its shard group, not by all of them. The
    matrices go round-robin to the group's ranks; per round of one matrix a rank, an all-to-all
    brings every rank's rows of a matrix to its owner (in the Newton-Schulz dtype), the owner runs
    Newton-Schulz on the whole matrix (the same input and kernel as on one device, so the result
    is the same), and a second all-to-all returns each rank its rows — for N ranks, 1/N of the
    iterations and of the bytes of gathering every matrix on every rank."""
    out: dict[int, torch.Tensor] = {}
    by_group: dict[tuple, list] = {}
    for p, update in zip(params, updates):
        dim = _row_sharded_dim(p)
        if dim is not None and p.device_mesh.size(dim) > 1 and update.placements == p.placements:
            by_group.setdefault((id(p.device_mesh), dim), []).append((p, update))
    for pairs in by_group.values():
        mesh, dim = pairs[0][0].device_mesh, _row_sharded_dim(pairs[0][0])
        pg, n = mesh.get_group(dim), mesh.size(dim)
        me = mesh.get_local_rank(dim)
        for start in range(0, len(pairs), n):
            chunk = pairs[start:start + n]
            args = _ns_args(chunk[0][1], group)
            dtype = args[-1]
            counts = [_row_counts(p.shape[0], n) for p, _ in chunk]
            if any(u.to_local().shape[0] != c[me] for (_, u), c in zip(chunk, counts)):
                raise RuntimeError("Muon: a ZeRO-3 shard is not the rows torch.chunk gives its rank")
            cols = [p.shape[1] for p, _ in chunk]
            # There: my rows of matrix j to rank j.
            mine = [u.to_local().to(dtype).reshape(-1) for _, u in chunk]
            send = torch.cat(mine) if mine else torch.empty(0, dtype=dtype, device=chunk[0][1].device)
            send_sizes = [t.numel() for t in mine] + [0] * (n - len(chunk))
            owned = me < len(chunk)
            recv_sizes = [c * cols[me] for c in counts[me]] if owned else [0] * n
            got = send.new_empty(sum(recv_sizes))
            dist.all_to_all_single(got, send, recv_sizes, send_sizes, group=pg)
            # The owner's Newton-Schulz; then back: rank k's rows of my matrix to rank k.
            result = (newton_schulz(got.view(chunk[me][0].shape[0], cols[me]), *args).reshape(-1) if owned
                      else got)
            back = send.new_empty(sum(send_sizes))  # (my rows of each matrix, as I sent them)
            dist.all_to_all_single(back, result, send_sizes, recv_sizes, group=pg)
            for (p, u), piece in zip(chunk, back.split(send_sizes[:len(chunk)])):
                out[id(p)] = DTensor.from_local(piece.view(u.to_local().shape), p.device_mesh, p.placements,
                                                run_check=False, shape=p.shape, stride=p.stride())
    return out


class MuonWithAdamW(KeepsStateDtype, torch.optim.Optimizer):
    """Muon for the hidden matrices, AdamW for every other parameter: one optimizer (one state,
    one list of groups, one state dict) over the two optimizers, which share them; both keep their
    moments in ``state_dtype``."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon_kwargs: dict,
                 adamw_kwargs: dict, state_dtype: torch.dtype = torch.float32):
        self.parts, self.state_dtype = [], state_dtype
        if muon_groups:
            self.parts.append(Muon(muon_groups, state_dtype=state_dtype, **muon_kwargs))
        if adamw_groups:
            cls, moments = _adamw(state_dtype)
            self.parts.append(cls(adamw_groups, **adamw_kwargs, **moments))
        super().__init__([g for o in self.parts for g in o.param_groups], {})
        self._link()

    def _link(self) -> None:
        """The parts update this optimizer's groups and state (load_state_dict replaces both)."""
        at = 0
        for o in self.parts:
            o.param_groups, at = self.param_groups[at: at + len(o.param_groups)], at + len(o.param_groups)
            o.state = self.state

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        for o in self.parts:
            o.step()


# ---------------------------------------------------------------------------- the registry


def _implementation(cls, cfg) -> dict:
    """``fused``/``foreach`` for classes that take them ([optimizer] implementation)."""
    sig = inspect.signature(cls).parameters
    impl = cfg.implementation
    if impl == "auto":  # (torch's other fused kernels have no DTensor rule: no ZeRO-3, no TP)
        impl = "fused" if cls in (torch.optim.AdamW, torch.optim.Adam) else "foreach"
    out = {}
    if "fused" in sig:
        out["fused"] = impl == "fused"
    if "foreach" in sig:
        out["foreach"] = impl == "foreach"
    return out


def _adam_arguments(cls, cfg) -> dict:
    """[optimizer] beta1, beta2 and eps, for classes that take Adam's ``betas`` and ``eps``."""
    sig = inspect.signature(cls).parameters
    out = {"betas": (cfg.beta1, cfg.beta2)} if "betas" in sig else {}
    if "eps" in sig and isinstance(sig["eps"].default, float):
        out["eps"] = cfg.eps
    return out | _implementation(cls, cfg)


def _build_single(cls):
    def build(groups: dict[str, list], cfg) -> torch.optim.Optimizer:
        kwargs = _adam_arguments(cls, cfg) | _kwargs(cfg)
        return cls(_present([_group(r, t, cfg, cfg.lr) for r, t in groups.items()]), **kwargs)
    return build


def _adamw(dtype: torch.dtype) -> tuple[type, dict]:
    """torch's AdamW, or for moments in another dtype :class:`CompactAdamW`: the class and what it
    is told of the dtype."""
    return (torch.optim.AdamW, {}) if dtype == torch.float32 else (CompactAdamW, {"state_dtype": dtype})


def _build_adamw(groups: dict[str, list], cfg) -> torch.optim.Optimizer:
    cls, moments = _adamw(state_dtype(cfg))
    kwargs = _adam_arguments(cls, cfg) | _kwargs(cfg) | moments
    return cls(_present([_group(r, t, cfg, cfg.lr) for r, t in groups.items()]), **kwargs)


def _build_muon(groups: dict[str, list], cfg) -> torch.optim.Optimizer:
    muon = [_group(r, t, cfg, cfg.muon_lr) for r, t in groups.items() if t and PARAM_GROUPS[r]["muon"]]
    rest = [_group(r, t, cfg, cfg.lr) for r, t in groups.items() if not PARAM_GROUPS[r]["muon"]]
    rest = [g for g in rest if g["params"]] or ([] if muon else rest[:1])
    adamw_kwargs = _adam_arguments(_adamw(state_dtype(cfg))[0], cfg)
    return MuonWithAdamW(muon, rest, _kwargs(cfg), adamw_kwargs, state_dtype(cfg))


def _present(groups: list[dict]) -> list[dict]:
    """The groups that have parameters (DCP's optimizer state dict cannot key an empty one); a rank
    of the flat engine that owns none keeps one empty group (torch refuses an optimizer without)."""
    return [g for g in groups if g["params"]] or groups[:1]


def _kwargs(cfg) -> dict:
    # TOML has no tuples: a list argument (Muon's ns_coefficients, Adam's betas) becomes one
    return {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.kwargs.items()}


def _adam_state(shape: tuple[int, ...], role: str, kwargs: dict) -> int:
    # exp_avg and exp_avg_sq, and max_exp_avg_sq with amsgrad
    return (12 if kwargs.get("amsgrad") else 8) * math.prod(shape)


def _muon_state(shape: tuple[int, ...], role: str, kwargs: dict) -> int:
    return 4 * math.prod(shape) if PARAM_GROUPS[role]["muon"] else _adam_state(shape, role, {})


def _adafactor_state(shape: tuple[int, ...], role: str, kwargs: dict) -> int:
    if len(shape) < 2:
        return 4 * math.prod(shape)  # (a vector keeps its whole second moment)
    return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])  # row and column factors


def _muon_flops(shape: tuple[int, ...], role: str, kwargs: dict) -> int:
    """Newton-Schulz on an m x n matrix (m <= n), per iteration: X X^T (2 m^2 n), the quintic's
    A + A A (2 m^3) and its product with X (2 m^2 n); torch's default runs 5. A stack [..., m, n]:
    each of its matrices."""
    if not PARAM_GROUPS[role]["muon"] or len(shape) < 2:
        return 0
    m, n = sorted(shape[-2:])
    return math.prod(shape[:-2]) * kwargs.get("ns_steps", 5) * (4 * m * m * n + 2 * m ** 3)


@dataclass(frozen=True)
class Kind:
    """What the engines, the checkpointer and the planner ask of an optimizer."""

    build: Callable  # (tensors by role, [optimizer]) -> torch.optim.Optimizer
    # which parameters its update needs whole (role, ndim) -> bool; None: none (element-wise)
    whole: Callable[[str, int], bool] | None
    gathers_shards: bool  # it gathers a sharded (TP / ZeRO-3) matrix itself (Muon)
    state_bytes: Callable[[tuple, str, dict], int] | None  # fp32 state of one parameter (shape, role, kwargs)
    # matmul FLOPs of the update of one whole parameter (shape, role, kwargs); element-wise work not counted
    update_flops: Callable[[tuple, str, dict], int] = lambda shape, role, kwargs: 0
    # Its update moves with the gradient continuously, so two layouts (whose reductions differ in
    # the last bits) end within rounding of each other. False for a sign or threshold of a
    # gradient-derived value (Rprop, Lion, signSGD): a last-bit difference flips an element's step
    # (2 x lr apart), so layouts are compared by their losses and each matrix in norm.
    continuous: bool = True
    # Its step takes plain tensors only: DTensor parameters (ZeRO-3's and TP's shards) are refused
    # by the composition table (ZeRO 0-2 hands it plain slices of its buckets).
    plain_tensors: bool = False
    # Its build keeps the moments in [optimizer] state_dtype (state_bytes declares them in fp32).
    compact_state: bool = False


OPTIMIZERS = {
    "adamw": Kind(_build_adamw, None, False, _adam_state, compact_state=True),
    "muon": Kind(_build_muon, lambda role, ndim: PARAM_GROUPS[role]["muon"], True, _muon_state, _muon_flops,
                 compact_state=True),
    # (every parameter whole: its update is clipped by the parameter's own RMS, vectors included)
    "adafactor": Kind(_build_single(torch.optim.Adafactor), lambda role, ndim: True, False, _adafactor_state),
}

# torch.optim classes whose step is the sign of a gradient-derived value (see Kind.continuous); a
# class of one's own says so with a class attribute ``continuous = False``.
SIGN_BASED = {"Rprop"}
# torch.optim classes whose update of each element reads only that element's gradient and state:
# they may take slices of the ZeRO buckets; any other dotted class gets whole parameters.
# torch.optim classes whose step DTensor parameters (ZeRO-3's and TP's shards) cannot take: Rprop's
# foreach step calls _foreach_copy_ and its loop an in-place masked write, which have no DTensor
# rule in torch 2.13 (see Kind.plain_tensors).
PLAIN_TENSORS_ONLY = {"Rprop"}
ELEMENTWISE = {"Adam", "AdamW", "SGD", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta",
               "ASGD", "Rprop"}


def _not_a_class_in_source(module: str, attr: str) -> str:
    """Why ``module``'s source, read without running it (importing runs its code, and a config
    names it), defines or imports no ``attr`` at its top level; '' if it does. The top-level
    package is found by the import system's finders (finding runs no code), the rest by folder."""
    top, *inner = module.split(".")
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        return f"no module {top!r} on the import path"
    if not inner:
        candidates = [Path(spec.origin)] if spec.origin else []
    else:
        *packages, leaf = inner
        folders = [Path(loc).joinpath(*packages) for loc in spec.submodule_search_locations or []]
        candidates = [path for folder in folders
                      for path in (folder / f"{leaf}.py", folder / leaf / "__init__.py")]
    path = next((c for c in candidates if c.suffix == ".py" and c.is_file()), None)
    if path is None:
        return f"no Python source for module {module!r}"
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError, ValueError) as e:
        return f"{path} cannot be read ({e})"
    names = set()
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return "" if attr in names else f"{path} defines no class {attr!r} at its top level"


def optimizer_kind(cfg) -> Kind:
    """The :class:`Kind` that [optimizer] ``name`` names: a registered one, or a torch.optim class by
    dotted path (``torch.optim.SGD``); its state bytes measured on a small tensor."""
    name = cfg.name.lower()
    if name in OPTIMIZERS:
        return OPTIMIZERS[name]
    if "." not in cfg.name:
        raise ConfigError(f"optimizer.name = {cfg.name!r} is not one of {sorted(OPTIMIZERS)} nor a dotted "
                          f"class path like 'torch.optim.SGD'.{did_you_mean(name, list(OPTIMIZERS))}")
    module, _, attr = cfg.name.rpartition(".")
    if module.split(".")[0] != "torch":
        problem = _not_a_class_in_source(module, attr)
        if problem:
            raise ConfigError(f"optimizer.name = {cfg.name!r}: {problem}; name a torch.optim.Optimizer class "
                              "by its dotted path (e.g. 'torch.optim.SGD' or 'my_package.my_module.Lion')")
    try:
        cls = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"optimizer.name = {cfg.name!r} cannot be imported ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ConfigError(f"optimizer.name = {cfg.name!r} is not a torch.optim.Optimizer subclass")
    elementwise = cls.__module__.startswith("torch.optim") and attr in ELEMENTWISE
    continuous = attr not in SIGN_BASED and bool(getattr(cls, "continuous", True))
    plain = cls.__module__.startswith("torch.optim") and attr in PLAIN_TENSORS_ONLY
    return Kind(_build_single(cls), None if elementwise else lambda role, ndim: True, False, None,
                continuous=continuous, plain_tensors=plain)


def build_optimizer(items, cfg, model) -> torch.optim.Optimizer:
    """The optimizer [optimizer] ``cfg`` names, over ``items`` (see :func:`param_groups`) in groups
    by role; ``model``: the family's adapter."""
    return optimizer_kind(cfg).build(param_groups(items, cfg, model), cfg)


def state_bytes(cfg, shape: tuple[int, ...], role: str) -> int:
    """Bytes of optimizer state one parameter (or its local shard) of ``shape`` keeps under [optimizer]
    ``cfg`` (None: AdamW): declared,
    or for a dotted class measured once on a small tensor and scaled by the elements (element-wise
    state is what such classes keep)."""
    kind = kind_of(cfg)
    if kind.state_bytes is not None:
        fp32 = kind.state_bytes(tuple(shape), role, _kwargs(cfg) if cfg is not None else {})
        return fp32 * state_dtype(cfg).itemsize // 4 if kind.compact_state else fp32
    return round(_measured_per_element(cfg, len(shape) >= 2) * math.prod(shape))


def update_flops(cfg, shape: tuple[int, ...], role: str) -> int:
    """The optimizer's matmul FLOPs to update one whole parameter of ``shape`` (Muon's Newton-Schulz)."""
    return kind_of(cfg).update_flops(tuple(shape), role, _kwargs(cfg) if cfg is not None else {})


def needs_whole(cfg, role: str, ndim: int) -> bool:
    """Whether [optimizer] ``cfg``'s update of a parameter of ``role`` and ``ndim`` needs it whole."""
    whole = kind_of(cfg).whole
    return whole is not None and whole(role, ndim)


class OptimizerFactory:
    """What the engines are given: ``factory(items)`` builds the optimizer ([optimizer] ``cfg``,
    the family's adapter ``model``: see :func:`build_optimizer`); ``factory.whole(name, param)``
    says whether its update needs that parameter whole."""

    def __init__(self, cfg, model):
        self.cfg, self.model = cfg, model

    def __call__(self, items) -> torch.optim.Optimizer:
        return build_optimizer(items, self.cfg, self.model)

    def whole(self, name: str, param: torch.Tensor) -> bool:
        return needs_whole(self.cfg, param_role(name, param.dim(), self.model), param.dim())


def kind_of(cfg) -> Kind:
    """[optimizer] ``cfg``'s :class:`Kind` (None: AdamW)."""
    return OPTIMIZERS["adamw"] if cfg is None else optimizer_kind(cfg)


_MEASURED: dict = {}


def _measured_per_element(cfg, matrix: bool) -> float:
    key = (cfg.name, repr(sorted(cfg.kwargs.items())), matrix)
    if key not in _MEASURED:
        p = torch.nn.Parameter(torch.zeros((8, 8) if matrix else (8,)))
        opt = optimizer_kind(cfg).build({"matrix" if matrix else "vector": [p]}, cfg)
        ensure_state(opt)
        _MEASURED[key] = sum(v.numel() * v.element_size() for v in opt.state[p].values()
                             if torch.is_tensor(v) and v.dim() > 0) / p.numel()
    return _MEASURED[key]


def check_optimizer(cfg, kinds=(("matrix", 2), ("vector", 1))) -> None:
    """[optimizer] checked by building it over a small stand-in of each (role, dimensions) in
    ``kinds`` — the model's: its vectors, matrices and stacks of matrices (a mixture of experts') —
    and taking a step: an unknown name, an unknown or bad keyword argument, a parameter shape the
    class refuses is one line here, not an error on every rank at start-up."""
    kind = optimizer_kind(cfg)
    for key, value in cfg.kwargs.items():
        if key in ("params", "lr", "weight_decay", "betas", "fused", "foreach"):
            raise ConfigError(f"optimizer.kwargs.{key}: set it through [optimizer] itself (lr, muon_lr, "
                              "weight_decay, beta1/beta2, implementation), not kwargs")
    groups: dict[str, list] = {}
    for role, ndim in sorted(set(kinds)):
        shape = (2,) * (ndim - 2) + (4,) * min(ndim, 2)  # (a stack: 2 matrices of 4 x 4)
        groups.setdefault(role, []).append(torch.nn.Parameter(torch.ones(shape)))
    try:
        opt = kind.build(groups, cfg)
        ensure_state(opt)
    except (TypeError, ValueError, RuntimeError) as e:
        raise ConfigError(f"[optimizer] name = {cfg.name!r} with kwargs {cfg.kwargs}: {e}") from None


def local_state(optimizer: torch.optim.Optimizer) -> list:
    """Every value of the optimizer's state in a fixed order (by parameter group, parameter and key):
    this rank's pieces of its tensors (a DTensor's local shard), and its numbers — what the same
    rank of another replica group of the same layout loads with :func:`load_local_state`."""
    out = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state.get(p, {})
            out += [v.to_local() if isinstance(v, DTensor) else v for _, v in sorted(state.items())]
    return out


@torch.no_grad()
def load_local_state(optimizer: torch.optim.Optimizer, values: list) -> None:
    """:func:`local_state`'s values into this optimizer's state (made first, as the other's was, if
    this one has not stepped yet; its parameters' gradients are kept)."""
    grads = [(p, p.grad) for group in optimizer.param_groups for p in group["params"]]
    ensure_state(optimizer)
    for p, g in grads:
        p.grad = g
    mine = [(p, key, v) for group in optimizer.param_groups for p in group["params"]
            for key, v in sorted(optimizer.state[p].items())]
    if len(mine) != len(values):
        raise RuntimeError(f"the optimizer state to load holds {len(values)} values, this optimizer's "
                           f"{len(mine)}: it comes from another optimizer or layout")
    for (p, key, v), theirs in zip(mine, values):
        if torch.is_tensor(v):
            (v.to_local() if isinstance(v, DTensor) else v).copy_(theirs)
        else:
            optimizer.state[p][key] = theirs


def ensure_state(optimizer: torch.optim.Optimizer) -> None:
    """Create an optimizer's lazily made state now (a checkpoint is loaded into it before any step):
    one step with zero gradients and lr 0, which leaves the parameters exactly as they are."""
    if optimizer.state:
        return
    lrs = [g["lr"] for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["lr"] = 0.0
        for p in g["params"]:
            p.grad = torch.zeros_like(p)
    optimizer.step()
    for g, lr in zip(optimizer.param_groups, lrs):
        g["lr"] = lr
        for p in g["params"]:
            p.grad = None


# ---------------------------------------------------------------------------- learning rate


def lr_factor(step: int, cfg, total_steps: int) -> float:
    """Multiplier of the peak lr for optimizer step ``step`` (0-based); ``cfg`` is [lr_scheduler].

    Linear warmup from 1/(warmup+1) to 1, then linear or cosine decay to ``min_lr_ratio``.
    """
    warmup = cfg.warmup_steps
    if step < warmup:
        return (step + 1) / (warmup + 1)
    if cfg.decay_type == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    decay = 1.0 - progress if cfg.decay_type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * decay


class LRSchedule(torch.optim.lr_scheduler.LambdaLR):
    """LambdaLR whose restore takes the position in the schedule only: each group's peak lr comes
    from the config (a checkpoint may have other groups: those of an older torchpar), and the
    restored lr is put into the optimizer at once (LambdaLR's own restore leaves the optimizer at
    its initial lr until the next step)."""

    def load_state_dict(self, state_dict: dict) -> None:
        self.last_epoch = state_dict["last_epoch"]
        self._step_count = state_dict.get("_step_count", self.last_epoch + 1)
        self._last_lr = [base * f(self.last_epoch) for f, base in zip(self.lr_lambdas, self.base_lrs)]
        for group, lr in zip(self.optimizer.param_groups, self._last_lr):
            group["lr"] = lr


def build_lr_scheduler(optimizer: torch.optim.Optimizer, cfg, total_steps: int) -> LRSchedule:
    return LRSchedule(optimizer, lambda step: lr_factor(step, cfg, total_steps))
