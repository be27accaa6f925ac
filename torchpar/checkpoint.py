"""Checkpoints: exact resume, resharding across layouts, consolidated export.

A checkpoint is a folder ``step-00000042`` written by ``torch.distributed.checkpoint`` (DCP)
plus ``torchpar.json``, the manifest: step, model args, layout, config snapshot and the size and
CRC32 of every file. Ranks write into ``step-00000042.partial``; only when DCP has written its
metadata (every rank done) does rank 0 write the manifest and rename the folder — one atomic
``rename`` — so a crash mid-save never leaves a folder that looks complete.

What is saved, all keyed by names of the unsplit model so any layout can load it:

- ``model``: ``get_model_state_dict`` of each pipeline stage (DTensors for TP/FSDP shards);
- ``optim``: Adam moments and step per parameter (``state.<name>.exp_avg`` ...), laid out like the
  parameter — written in the same format by FSDP2 (ZeRO-3) and the flat ZeRO 0-2 engine;
- ``lr_scheduler``, ``train`` (step, tokens seen, the global data position), ``config``;
- ``rng.rank<r>``: each rank's RNG state (restored when the rank exists in the new layout).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import warnings
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from torchpar.config import ConfigError

MANIFEST = "torchpar.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoint_root(cfg) -> Path:
    return Path(cfg.job.dump_folder) / cfg.checkpoint.folder  # an absolute folder replaces the prefix


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def complete_checkpoints(root: Path) -> dict[int, Path]:
    """Steps with a finished checkpoint (renamed into place, so manifest and metadata exist)."""
    out = {}
    if root.is_dir():
        for d in root.iterdir():
            m = _STEP_DIR.match(d.name)
            if m and d.is_dir() and (d / MANIFEST).exists():
                out[int(m.group(1))] = d
    return out


def incomplete_checkpoints(root: Path) -> list[Path]:
    return sorted(d for d in root.glob("step-*") if d.is_dir() and not (d / MANIFEST).exists()) if root.is_dir() else []


def _warn(message: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(f"torchpar: warning: {message}", file=sys.stderr, flush=True)


def _file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_manifest(path: Path) -> dict:
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {path}: unreadable manifest {MANIFEST} ({e}); delete the folder "
                          "or set checkpoint.load_step to another step") from None


def verify_files(path: Path, manifest: dict, checksums: bool) -> None:
    """Every file the manifest lists is there with its size (and CRC32): one clear error if not."""
    fix = "delete this folder to fall back to the previous checkpoint, or set checkpoint.load_step"
    for name, (size, crc) in manifest["files"].items():
        f = path / name
        if not f.exists():
            raise ConfigError(f"checkpoint {path} is damaged: {name} is missing; {fix}")
        actual = f.stat().st_size
        if actual != size:
            raise ConfigError(f"checkpoint {path} is damaged: {name} has {actual} bytes, the manifest says {size} "
                              f"(truncated?); {fix}")
        if checksums and _file_crc32(f) != crc:
            raise ConfigError(f"checkpoint {path} is damaged: {name} fails its CRC32 check (corrupted); {fix}")


def check_model_matches(where: str, saved_flavor: str, saved_args: dict, flavor: str, args) -> None:
    """A checkpoint or weights file only loads into the model shape it was saved from."""
    if saved_flavor != flavor:
        raise ConfigError(f"{where} holds model flavor {saved_flavor!r} but model.flavor = {flavor!r}; set "
                          f"model.flavor = {saved_flavor!r}, or start from a new job.dump_folder / checkpoint.folder")
    diff = {k: (v, args.to_dict()[k]) for k, v in saved_args.items() if args.to_dict().get(k) != v}
    if diff:
        pretty = ", ".join(f"{k}: saved {a} vs config {b}" for k, (a, b) in diff.items())
        raise ConfigError(f"{where} holds a model of another shape ({pretty}); use the config it was saved with "
                          "(e.g. model.n_layers) or a new checkpoint folder")


def find_resume(cfg, args) -> Path | None:
    """The checkpoint to resume from, fully validated; no process group needed (preflight)."""
    ck = cfg.checkpoint
    if not ck.enable or ck.load_step == 0:
        return None
    root = checkpoint_root(cfg)
    for d in incomplete_checkpoints(root):
        _warn(f"ignoring incomplete checkpoint {d} (a save was interrupted); it will be removed")
    found = complete_checkpoints(root)
    if ck.load_step > 0:
        if ck.load_step not in found:
            have = ", ".join(map(str, sorted(found))) or "none"
            raise ConfigError(f"checkpoint.load_step = {ck.load_step}: no complete checkpoint "
                              f"{step_dir(root, ck.load_step)} (complete steps there: {have}); set load_step to one "
                              "of them, or -1 for the latest")
        path = found[ck.load_step]
    elif found:
        path = found[max(found)]
    else:
        return None
    manifest = read_manifest(path)
    check_model_matches(f"checkpoint {path}", manifest["model_flavor"], manifest["model_args"], cfg.model.flavor, args)
    verify_files(path, manifest, ck.verify_checksums)
    return path


# ---------------------------------------------------------------------- weights files (export)


def save_weights(state: dict[str, torch.Tensor], meta: dict, out: Path) -> None:
    """One ``torch.save`` file of full tensors (loadable with ``weights_only=True``) + ``<out>.json``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out)
    out.with_name(out.name + ".json").write_text(json.dumps(meta, indent=1) + "\n")


def load_weights(path: str | Path, flavor: str | None = None, args=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an exported weights file (never unpickles code) and, given a model, check its shape."""
    path = Path(path)
    meta_path = path.with_name(path.name + ".json")
    if not path.exists() or not meta_path.exists():
        raise ConfigError(f"weights file {path} (and its {meta_path.name}) not found; make one with "
                          "`torchpar export --checkpoint DIR --out FILE`")
    try:
        meta = json.loads(meta_path.read_text())
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file: one line, not a traceback
        raise ConfigError(f"weights file {path} cannot be read ({type(e).__name__}: {e}); export it again") from None
    if args is not None:
        check_model_matches(f"weights file {path}", meta["model_flavor"], meta["model_args"], flavor, args)
    return {k: v.float() for k, v in state.items()}, meta


# ---------------------------------------------------------------------- the trainer's side


class Checkpointer:
    """Saves and restores a :class:`torchpar.train.Trainer`'s whole state with DCP."""

    def __init__(self, trainer, resume_from: Path | None):
        import torch.distributed.checkpoint as dcp

        self.dcp = dcp
        self.trainer, self.cfg = trainer, trainer.cfg.checkpoint
        self.root = checkpoint_root(trainer.cfg)
        self.resume_from = resume_from
        self.rank = dist.get_rank()
        self.pending = None  # (future, partial folder, final folder, step, tokens seen) of an async save
        self.async_group = None
        self.executor = None
        if self.cfg.enable and self.cfg.async_mode == "async":
            # The background writer's collectives need their own group (gloo works for any device).
            self.async_group = dist.new_group(backend="gloo")
        if self.cfg.enable and self.rank == 0:
            for d in incomplete_checkpoints(self.root):
                shutil.rmtree(d, ignore_errors=True)
        if self.cfg.enable:
            dist.barrier()  # nobody writes before stale partial folders are gone

    def _state(self) -> tuple[dict, list[dict]]:
        """The DCP state dict, and each pipeline stage's model dict (sharing its tensors)."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        t = self.trainer
        per_part = [get_model_state_dict(part) for part in t.model.parts]
        model = {k: v for sd in per_part for k, v in sd.items()}
        return {
            "model": model,
            "optim": t.model.state.optimizer_state_dict(),
            "lr_scheduler": t.lr_scheduler.state_dict(),
            "train": {"step": t.step, "tokens_seen": t.tokens_seen, "data": t.dataloader.state_dict()},
            f"rng.rank{self.rank}": torch.get_rng_state(),
        }, per_part

    # -- save

    def maybe_save(self, force: bool = False) -> None:
        step = self.trainer.step
        self._poll()
        if not self.cfg.enable or not (force or step % self.cfg.interval == 0):
            return
        self.wait()  # one save in flight at a time
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + ".partial")
        state, _ = self._state()
        state["config"] = self.trainer.config_toml
        if self.cfg.async_mode == "async":
            # Our own staging (CPU copies the next steps cannot touch), then DCP's ordinary save in a
            # thread on its own process group. torch 2.13's async_save stager can mix up storages
            # between tensors and fail ("invalid python storage"), so it is not used.
            snapshot = _snapshot(state)
            future = self._writer().submit(self.dcp.save, snapshot, checkpoint_id=str(partial),
                                           process_group=self.async_group)
            self.pending = (future, partial, final, step, self.trainer.tokens_seen)
        else:
            self.dcp.save(state, checkpoint_id=str(partial))
            self._finalize(partial, final, step, self.trainer.tokens_seen)

    def _writer(self):
        if self.executor is None:
            from concurrent.futures import ThreadPoolExecutor

            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchpar-checkpoint")
        return self.executor

    def _poll(self) -> None:
        if self.pending is not None and self.pending[0].done():
            self.wait()

    def wait(self) -> None:
        """Finish the save in flight (if any)."""
        if self.pending is None:
            return
        future, *where = self.pending
        self.pending = None
        future.result()
        self._finalize(*where)

    def _finalize(self, partial: Path, final: Path, step: int, tokens_seen: int) -> None:
        # DCP returns on the coordinator only after every rank's files and the metadata are written.
        if self.rank != 0:
            return
        t = self.trainer
        files = {f.name: [f.stat().st_size, _file_crc32(f)] for f in sorted(partial.iterdir()) if f.is_file()}
        manifest = {
            "step": step, "tokens_seen": tokens_seen, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "model_flavor": t.cfg.model.flavor, "model_args": t.args.to_dict(),
            "tokenizer_path": t.cfg.model.tokenizer_path,
            "layout": {"world": t.dims.world_size, "pp": t.dims.pp, "dp_replicate": t.dims.dp_replicate,
                       "dp_shard": t.dims.dp_shard, "tp": t.dims.tp, "zero_stage": t.cfg.parallelism.zero_stage},
            "files": files, "config": t.config_toml,
        }
        tmp = partial / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, partial / MANIFEST)
        if final.exists():
            shutil.rmtree(final)
        os.replace(partial, final)  # the commit point
        print(f"torchpar: saved checkpoint {final}", flush=True)
        if self.cfg.keep_latest_k > 0:
            steps = sorted(complete_checkpoints(self.root))
            for old in steps[: -self.cfg.keep_latest_k]:
                shutil.rmtree(step_dir(self.root, old), ignore_errors=True)

    def close(self) -> None:
        self.wait()
        if self.cfg.enable:
            dist.barrier()  # the last checkpoint is in place before any rank moves on
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        if self.async_group is not None:
            dist.destroy_process_group(self.async_group)
            self.async_group = None

    # -- load

    def load(self) -> None:
        """Restore everything from ``resume_from`` (validated in preflight) into the trainer."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        path = self.resume_from
        if path is None:
            return
        t = self.trainer
        state, per_part = self._state()
        metadata = self.dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        rng_key = f"rng.rank{self.rank}"
        if rng_key not in metadata:
            state.pop(rng_key)  # a rank the saving layout did not have: keeps its seeded RNG
        self._check_shapes(path, state["model"], metadata)
        self.dcp.load(state, checkpoint_id=str(path))
        for part, sd in zip(t.model.parts, per_part):  # DCP filled these tensors in place
            set_model_state_dict(part, sd)
        t.model.state.load_optimizer_state_dict(state["optim"])
        t.lr_scheduler.load_state_dict(state["lr_scheduler"])
        for group, lr in zip(t.model.state.optimizer.param_groups, t.lr_scheduler.get_last_lr()):
            group["lr"] = lr
        t.step = int(state["train"]["step"])
        t.tokens_seen = int(state["train"]["tokens_seen"])
        t.dataloader.load_state_dict(state["train"]["data"])
        if rng_key in state:
            torch.set_rng_state(state[rng_key])
        if self.rank == 0:
            print(f"torchpar: resumed from {path} at step {t.step} ({t.tokens_seen:,} tokens seen)", flush=True)

    @staticmethod
    def _check_shapes(path: Path, model: dict, metadata: dict) -> None:
        for name, value in model.items():
            saved = metadata.get(f"model.{name}")
            if saved is None:
                raise ConfigError(f"checkpoint {path} has no tensor for model parameter {name}; it was saved from "
                                  "another model")
            if tuple(saved.size) != tuple(value.shape):
                raise ConfigError(f"checkpoint {path}: {name} is {tuple(saved.size)} there but {tuple(value.shape)} "
                                  "in this model; use the config it was saved with")



def _snapshot(obj):
    """A copy of a state dict whose tensors are fresh CPU copies (DTensors keep their layout)."""
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        local = obj.to_local().detach().to("cpu", copy=True)
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False, shape=obj.shape,
                                  stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: _snapshot(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_snapshot(v) for v in obj)
    return obj


# ---------------------------------------------------------------------- single-process use


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder as is; a checkpoint folder (or a job's dump folder) -> its latest complete step."""
    p = Path(path)
    if (p / MANIFEST).exists():
        return p
    found = complete_checkpoints(p) or complete_checkpoints(p / "checkpoint")
    if not found:
        raise ConfigError(f"no complete checkpoint in {p} (expected step-NNNNNNNN folders with {MANIFEST})")
    return found[max(found)]


def load_model(path: str | Path):
    """A whole model on the CPU in fp32 from a checkpoint folder or an exported weights file,
    with its metadata (model flavour and args, tokenizer path, step). No process group needed."""
    import torch.distributed.checkpoint as dcp

    from torchpar.models import ModelArgs, Transformer

    p = Path(path)
    if p.is_file():
        values, meta = load_weights(p)
    else:
        p = resolve_checkpoint(p)
        meta = read_manifest(p)
        verify_files(p, meta, checksums=True)
    with torch.device("meta"):
        model = Transformer(ModelArgs(**meta["model_args"]))
    model.to_empty(device="cpu")
    model.tie_weights()
    if not p.is_file():
        sd = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            dcp.load(sd, checkpoint_id=str(p), no_dist=True)  # reads every shard into full tensors
        values = sd["model"]
    model.init_weights(0, values=values)
    model.eval()
    return model, meta


def export_main(argv: list[str]) -> int:
    """torchpar export --checkpoint DIR --out FILE [--dtype bf16|fp32]"""
    import argparse

    ap = argparse.ArgumentParser(prog="torchpar export", description="Consolidate a DCP checkpoint into one "
                                 "weights file (torch.save, loadable with weights_only=True) + FILE.json.")
    ap.add_argument("--checkpoint", required=True, help="step folder, checkpoint folder or dump folder (latest step)")
    ap.add_argument("--out", required=True, help="output file, e.g. model.pt")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    a = ap.parse_args(argv)
    try:
        model, meta = load_model(a.checkpoint)
    except ConfigError as e:
        print(f"torchpar: error: {e}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    keys = ("model_flavor", "model_args", "tokenizer_path", "step", "tokens_seen")
    out_meta = {"format": "torchpar-weights-v1", "dtype": a.dtype, "source": str(a.checkpoint),
                **{k: meta[k] for k in keys if k in meta}}
    save_weights(state, out_meta, Path(a.out))
    n = sum(v.numel() for k, v in state.items() if not (k == "output.weight" and model.args.tie_embeddings))
    print(f"torchpar: wrote {a.out} ({n / 1e6:.2f}M parameters, {a.dtype}, step {meta.get('step')}) and {a.out}.json")
    return 0
