"""Checkpoints: exact resume, resharding across layouts, consolidated export.

A checkpoint is a folder ``step-00000042`` written by ``torch.distributed.checkpoint`` (DCP)
plus ``torchpar.json``, the manifest: step, model args, layout, config snapshot and the size and
CRC32 of every file. Ranks write into ``step-00000042.partial``; only when DCP has written its
metadata (every rank done) does rank 0 write the manifest and rename the folder — one atomic
``rename`` — so a crash mid-save never leaves a folder that looks complete.

What is saved is a dict of *stateful parts*, each with ``state_dict`` / ``load_state_dict``
(DCP's ``Stateful`` protocol); the checkpointer knows nothing else about the trainer. The
trainer's parts, all keyed by names of the unsplit model so any layout can load them:

- ``model``: ``get_model_state_dict`` of each pipeline stage (DTensors for TP/FSDP shards);
- ``optimizer``: Adam moments and step per parameter (``state.<name>.exp_avg`` ...), laid out like
  the parameter — written in the same format by FSDP2 (ZeRO-3) and the flat ZeRO 0-2 engine;
- ``lr_scheduler``, ``train_state`` (step, tokens seen), ``dataloader`` (the global data position);
- ``rng``: each rank's RNG state under its own key (restored when the rank exists in the new
  layout: parts marked ``per_rank`` may lack this rank's keys).

A part is added with one line in the trainer's ``stateful_parts``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist

from torchpar.config import ConfigError
from torchpar.models import DEFAULT_FAMILY

MANIFEST = "torchpar.json"
PARTIAL_MARKER = "torchpar.partial"  # written into step-N.partial when a save starts
FORMAT = 2  # 2: stateful parts (model, optimizer, lr_scheduler, train_state, dataloader, rng)
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


def interrupted_saves(root: Path) -> list[Path]:
    """``step-N.partial`` folders that torchpar itself started (they hold its marker file): the
    only folders it ever deletes besides checkpoints pruned by keep_latest_k."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.glob("step-*.partial") if d.is_dir() and (d / PARTIAL_MARKER).exists())


def unexpected_folders(root: Path) -> list[Path]:
    """``step-*`` folders that are neither a complete checkpoint nor an interrupted save of
    torchpar's (e.g. a manifest deleted by hand): reported and left alone, never loaded."""
    return sorted(d for d in incomplete_checkpoints(root) if d not in interrupted_saves(root))


def incomplete_checkpoints(root: Path) -> list[Path]:
    return (
        sorted(d for d in root.glob("step-*") if d.is_dir() and not (d / MANIFEST).exists())
        if root.is_dir()
        else []
    )


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
            raise ConfigError(
                f"checkpoint {path} is damaged: {name} has {actual} bytes, the manifest says {size} "
                f"(truncated?); {fix}"
            )
        if checksums and _file_crc32(f) != crc:
            raise ConfigError(
                f"checkpoint {path} is damaged: {name} fails its CRC32 check (corrupted); {fix}"
            )


def check_model_matches(where: str, saved: dict, name: str, flavor: str, args) -> None:
    """A checkpoint or weights file (``saved``: its manifest) only loads into the model family and
    shape it was saved from."""
    saved_name, saved_flavor, saved_args = (saved.get("model_name", DEFAULT_FAMILY), saved["model_flavor"],
                                            saved["model_args"])
    if saved_name != name:
        raise ConfigError(f"{where} holds a {saved_name!r} model but model.name = {name!r}; set model.name = "
                          f"{saved_name!r}, or start from a new job.dump_folder / checkpoint.folder")
    if saved_flavor != flavor:
        raise ConfigError(
            f"{where} holds model flavor {saved_flavor!r} but model.flavor = {flavor!r}; set "
            f"model.flavor = {saved_flavor!r}, or start from a new job.dump_folder / checkpoint.folder"
        )
    diff = {k: (v, args.to_dict()[k]) for k, v in saved_args.items() if args.to_dict().get(k) != v}
    if diff:
        pretty = ", ".join(f"{k}: saved {a} vs config {b}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"{where} holds a model of another shape ({pretty}); use the config it was saved with "
            "(e.g. model.n_layers) or a new checkpoint folder"
        )


def find_resume(cfg, args) -> Path | None:
    """The checkpoint to resume from, fully validated; no process group needed (preflight)."""
    ck = cfg.checkpoint
    if not ck.enable or ck.load_step == 0:
        return None
    root = checkpoint_root(cfg)
    for d in interrupted_saves(root):
        _warn(f"ignoring incomplete checkpoint {d} (a save was interrupted); it will be removed")
    for d in unexpected_folders(root):
        _warn(
            f"{d} has no manifest ({MANIFEST}); it is not a checkpoint torchpar can load, and is left alone"
        )
    found = complete_checkpoints(root)
    if ck.load_step > 0:
        if ck.load_step not in found:
            have = ", ".join(map(str, sorted(found))) or "none"
            raise ConfigError(
                f"checkpoint.load_step = {ck.load_step}: no complete checkpoint "
                f"{step_dir(root, ck.load_step)} (complete steps there: {have}); set load_step to one "
                "of them, or -1 for the latest"
            )
        path = found[ck.load_step]
    elif found:
        path = found[max(found)]
    else:
        return None
    manifest = read_manifest(path)
    if manifest.get("format", 1) != FORMAT:
        raise ConfigError(
            f"checkpoint {path} was written in checkpoint format {manifest.get('format', 1)}, this "
            f"torchpar reads format {FORMAT}; export its weights (`torchpar export`) and start from "
            "them with checkpoint.initial_load_path, or use a new checkpoint folder"
        )
    check_model_matches(f"checkpoint {path}", manifest, cfg.model.name, cfg.model.flavor, args)
    verify_files(path, manifest, ck.verify_checksums)
    return path


# ---------------------------------------------------------------------- saving and restoring parts


class Checkpointer:
    """Saves and restores a dict of stateful parts with DCP, atomically, under ``root``.

    ``manifest``: what to record beside the tensors (model, tokenizer, layout, config); each save
    adds the step, the time and every file's size and CRC32. ``resume_from``: a checkpoint
    validated in preflight, restored by :meth:`load`.
    """

    def __init__(self, cfg, root: Path, parts: dict, manifest: dict, resume_from: Path | None):
        import torch.distributed.checkpoint as dcp

        self.dcp, self.cfg, self.root = dcp, cfg, root
        self.parts, self.manifest, self.resume_from = parts, manifest, resume_from
        self.rank = dist.get_rank()
        self.pending = None  # (future, partial folder, final folder, step, extra manifest) of an async save
        self.async_group = None
        self.executor = None
        if cfg.enable and cfg.async_mode == "async":
            # The background writer's collectives need their own group (gloo works for any device).
            self.async_group = dist.new_group(backend="gloo")
        self.branch: dict | None = None  # where a resume from an older step moved the newer checkpoints
        if cfg.enable and self.rank == 0:
            for d in interrupted_saves(root):
                shutil.rmtree(d, ignore_errors=True)
            self.branch = self._set_newer_aside(int(read_manifest(resume_from)["step"]) if resume_from else 0)
        if cfg.enable:
            dist.barrier()  # nobody writes before stale partial folders are gone and the timeline is set

    def _state(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def _set_newer_aside(self, start: int) -> dict | None:
        """This run's timeline starts at ``start``: complete checkpoints of later steps (a resume
        from an older step, or a fresh start in a folder with checkpoints) are moved, never
        deleted, into ``superseded-<time>-from-step-<start>/`` so that neither keep_latest_k nor this
        run's saves can touch them."""
        newer = {s: d for s, d in complete_checkpoints(self.root).items() if s > start}
        if not newer:
            return None
        aside = self.root / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-from-step-{start}"
        aside.mkdir()
        for d in newer.values():
            os.replace(d, aside / d.name)
        steps = ", ".join(map(str, sorted(newer)))
        _warn(f"this run starts at step {start} but {self.root} held later checkpoints (steps {steps}); "
              f"they are "
              f"kept in {aside} and a new timeline starts here")
        return {"branch_from_step": start, "moved_steps": sorted(newer), "moved_to": str(aside)}

    # -- save

    def due(self, step: int, force: bool = False) -> bool:
        return self.cfg.enable and (force or step % self.cfg.interval == 0)

    def latest(self) -> Path | None:
        """The newest complete checkpoint of this folder (after any save in flight)."""
        found = complete_checkpoints(self.root) if self.cfg.enable else {}
        return found[max(found)] if found else None

    def maybe_save(self, step: int, force: bool = False, **extra) -> None:
        """Save at every ``interval`` steps (or when ``force``); ``extra`` goes into the manifest."""
        self._poll()
        if not self.due(step, force):
            return
        self.wait()  # one save in flight at a time
        final = step_dir(self.root, step)
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:  # marks the folder as torchpar's own, so an interrupted save may be removed
            partial.mkdir(parents=True, exist_ok=True)
            (partial / PARTIAL_MARKER).write_text(f"step {step}\n")
        state = self._state()
        if self.cfg.async_mode == "async":
            # Our own staging (CPU copies the next steps cannot touch), then DCP's ordinary save in a
            # thread on its own process group. torch 2.13's async_save stager can mix up storages
            # between tensors and fail ("invalid python storage"), so it is not used.
            future = self._writer().submit(self.dcp.save, _snapshot(state), checkpoint_id=str(partial),
                                           process_group=self.async_group)
            self.pending = (future, partial, final, step, extra)
        else:
            self.dcp.save(state, checkpoint_id=str(partial))
            self._finalize(partial, final, step, extra)

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

    def _finalize(self, partial: Path, final: Path, step: int, extra: dict) -> None:
        # DCP returns on the coordinator only after every rank's files and the metadata are written.
        if self.rank != 0:
            return
        (partial / PARTIAL_MARKER).unlink(missing_ok=True)
        files = {f.name: [f.stat().st_size, _file_crc32(f)] for f in sorted(partial.iterdir()) if f.is_file()}
        manifest = {"format": FORMAT, "step": step, **extra, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
                    **self.manifest, "files": files}
        tmp = partial / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1) + "\n")
        os.replace(tmp, partial / MANIFEST)
        if final.exists():  # a folder torchpar did not finish (no manifest): kept, beside
            os.replace(final, final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
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

    def load(self) -> Path | None:
        """Restore every part from ``resume_from`` (validated in preflight); returns that path."""
        path = self.resume_from
        if path is None:
            return None
        state = self._state()  # templates: DCP loads into their tensors in place
        metadata = self.dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name, part in self.parts.items():
            if getattr(part, "per_rank", False):  # keys of ranks the saving layout did not have
                state[name] = {k: v for k, v in state[name].items() if f"{name}.{k}" in metadata}
        _check_tensors(path, state, metadata)
        self.dcp.load(state, checkpoint_id=str(path))
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
        return path


def _check_tensors(path: Path, state: dict, metadata: dict) -> None:
    """Every tensor of the templates is in the checkpoint with the same shape: one clear line
    if not (DCP's own error is a traceback from deep inside the planner)."""
    def walk(prefix: str, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor):
            yield prefix, obj

    for key, value in walk("", state):
        saved = metadata.get(key)
        if saved is None:
            raise ConfigError(
                f"checkpoint {path} has no tensor {key}; it was saved from another model or job"
            )
        if hasattr(saved, "size") and tuple(saved.size) != tuple(value.shape):
            raise ConfigError(
                f"checkpoint {path}: {key} is {tuple(saved.size)} there but {tuple(value.shape)} "
                "here; use the config it was saved with"
            )


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
