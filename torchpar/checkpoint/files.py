"""A checkpoint on disk: its folder layout, its manifest, and the checks before a resume."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
import zlib
from pathlib import Path

from torchpar.console import warn
from torchpar.errors import ConfigError
from torchpar.models import DEFAULT_FAMILY
from torchpar.models.common import TRAINING_FIELDS
from torchpar.outputs import sync_folder, write_text

MANIFEST = "torchpar.json"
# Written into step-N.partial when a save starts: the manifest-to-be (everything but the files) and
# the world size of the save, so that a save whose files were all written can be committed later.
PARTIAL_MARKER = "torchpar.partial"
TIMELINE = "torchpar.timeline.json"  # which job's timeline the folder holds, from which step
RANK_FILES = "torchpar.files-{rank}.json"  # each rank's written files with [size, CRC32], after DCP's save
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
    """``step-N.partial`` folders that torchpar itself started (they hold its marker file, or the
    manifest of a commit that did not finish): the only folders it ever deletes besides checkpoints
    pruned by keep_latest_k — and only when a file of theirs is missing."""
    if not root.is_dir():
        return []
    return sorted(d for d in root.glob("step-*.partial")
                  if d.is_dir() and ((d / PARTIAL_MARKER).exists() or (d / MANIFEST).exists()))


def pending_manifest(partial: Path) -> dict | None:
    """The manifest of a ``step-N.partial`` folder whose files were all written — DCP's metadata
    (written once every rank's data is) and every rank's list of its files, each there with its
    size — but whose commit (manifest, rename) never happened; None if any piece is missing."""
    try:
        if not (partial / ".metadata").is_file():
            return None
        if (partial / MANIFEST).is_file():  # (its commit began: the manifest lists every file)
            manifest = json.loads((partial / MANIFEST).read_text())
            files = manifest["files"]
        else:
            pending = json.loads((partial / PARTIAL_MARKER).read_text())
            files = {}
            for rank in range(int(pending["world"])):
                files.update(json.loads((partial / RANK_FILES.format(rank=rank)).read_text()))
            manifest = {**pending["manifest"], "files": dict(sorted(files.items()))}
    except (OSError, ValueError, KeyError, TypeError):
        return None
    for name, (size, _) in files.items():
        f = partial / name
        if not f.is_file() or f.stat().st_size != size:
            return None
    return manifest


def write_pending(partial: Path, manifest: dict, world: int) -> None:
    """Start a save: the folder, marked as torchpar's, with the manifest-to-be."""
    partial.mkdir(parents=True, exist_ok=True)
    _write_atomically(partial / PARTIAL_MARKER, {"world": world, "manifest": manifest})


def write_rank_files(partial: Path, rank: int, files: dict) -> None:
    _write_atomically(partial / RANK_FILES.format(rank=rank), files)


def commit(partial: Path, manifest: dict) -> Path:
    """The commit point of a save whose files are all written: the manifest, then one rename of
    ``step-N.partial`` to ``step-N``; the save's own notes (its marker, the ranks' file lists) are
    removed after, from the committed folder. A process killed anywhere in it leaves a save that
    the next start commits, or a checkpoint. Returns the checkpoint's folder."""
    final = partial.with_name(partial.name.removesuffix(".partial"))
    _write_atomically(partial / MANIFEST, manifest)
    if final.exists():  # a folder torchpar did not finish (no manifest): kept, beside
        os.replace(final, final.with_name(f"{final.name}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"))
    os.replace(partial, final)
    sync_folder(final.parent)  # (the commit itself on the disk before the save is reported done)
    drop_save_notes(final)
    return final


def drop_save_notes(folder: Path) -> None:
    """A committed checkpoint's leftover notes of its save (a commit killed after its rename); the
    marker goes last, so a folder without it has none left."""
    for f in folder.glob("torchpar.files-*.json"):
        f.unlink(missing_ok=True)
    (folder / PARTIAL_MARKER).unlink(missing_ok=True)


def recoverable_saves(root: Path) -> dict[int, tuple[Path, dict]]:
    """Interrupted saves whose files were all written, by step: (the partial folder, its manifest)."""
    out = {}
    for d in interrupted_saves(root):
        manifest = pending_manifest(d)
        if manifest is not None:
            out[int(manifest["step"])] = (d, manifest)
    return out


def _write_atomically(path: Path, obj) -> None:
    write_text(path, json.dumps(obj, indent=1) + "\n", durable=True)


def unexpected_folders(root: Path) -> list[Path]:
    """``step-*`` folders that are neither a complete checkpoint nor an interrupted save of
    torchpar's (e.g. a manifest deleted by hand): reported and left alone, never loaded."""
    if not root.is_dir():
        return []
    ours = set(interrupted_saves(root))
    return sorted(d for d in root.glob("step-*")
                  if d.is_dir() and not (d / MANIFEST).exists() and d not in ours)


def saved_folder(path: Path) -> Path:
    """Where the files of checkpoint ``path`` are now: the folder itself, or its ``.partial``
    folder when that save's commit is still to be made."""
    partial = path.with_name(path.name + ".partial")
    return partial if not path.exists() and pending_manifest(partial) is not None else path


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_manifest(path: Path) -> dict:
    """The manifest of the checkpoint ``path``, or of its save whose commit is still to be made
    (``find_resume`` chose it; rank 0's checkpointer commits it before any rank loads it)."""
    if not path.exists():  # (the pending save's pieces are read once, not checked and then read)
        pending = pending_manifest(path.with_name(path.name + ".partial"))
        if pending is not None:
            return pending
    try:
        return json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"checkpoint {path}: unreadable manifest {MANIFEST} ({e}); delete the folder or "
                          "set checkpoint.load_step to another step") from None


def verify_files(path: Path, manifest: dict, checksums: bool, names: list[str] | None = None) -> None:
    """Every file the manifest lists (or those of ``names``) is there with its size (and CRC32):
    one clear error if not."""
    fix = "delete this folder to fall back to the previous checkpoint, or set checkpoint.load_step"
    names = None if names is None else set(names)
    for name, (size, crc) in manifest["files"].items():
        if names is not None and name not in names:
            continue
        f = path / name
        if not f.exists():
            raise ConfigError(f"checkpoint {path} is damaged: {name} is missing; {fix}")
        actual = f.stat().st_size
        if actual != size:
            raise ConfigError(
                f"checkpoint {path} is damaged: {name} has {actual} bytes, the manifest says {size} "
                f"(truncated?); {fix}"
            )
        if checksums and file_crc32(f) != crc:
            raise ConfigError(
                f"checkpoint {path} is damaged: {name} fails its CRC32 check (corrupted); {fix}"
            )


def check_model_matches(where: str, saved: dict, name: str, flavor: str, args) -> None:
    """A checkpoint or weights file (``saved``: its manifest) only loads into the model family and
    shape it was saved from (fields that change only how it trains, TRAINING_FIELDS, may differ)."""
    saved_name, saved_flavor, saved_args = (saved.get("model_name", DEFAULT_FAMILY), saved["model_flavor"],
                                            saved["model_args"])
    if saved_name != name:
        raise ConfigError(f"{where} holds a {saved_name!r} model but model.name = {name!r}; set model.name = "
                          f"{saved_name!r}, or start from a new job.dump_folder / checkpoint.folder")
    if saved_flavor != flavor:
        raise ConfigError(
            f"{where} holds model flavor {saved_flavor!r} but model.flavor = {flavor!r}; set model.flavor = "
            f"{saved_flavor!r}, or start from a new job.dump_folder / checkpoint.folder"
        )
    mine = {k: v for k, v in args.to_dict().items() if k not in TRAINING_FIELDS}
    saved_args = {k: v for k, v in saved_args.items() if k not in TRAINING_FIELDS}
    diff = {k: (v, mine[k]) for k, v in saved_args.items() if mine.get(k) != v}
    # A field newer than the checkpoint: it was saved with the field's default (e.g. no attention sinks).
    defaults = {f.name: f.default for f in dataclasses.fields(args)}
    diff.update({k: (defaults.get(k), v) for k, v in mine.items()
                 if k not in saved_args and v != defaults.get(k, v)})
    if diff:
        pretty = ", ".join(f"{k}: saved {a} vs config {b}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"{where} holds a model of another shape ({pretty}); use the config it was saved with (e.g. "
            "model.n_layers) or a new checkpoint folder"
        )


def job_key() -> str | None:
    """This job across its restarts, the same on every node: SLURM's job id (a requeue keeps it),
    else torchrun's run id (the rendezvous's); None for a process started on its own."""
    if os.environ.get("SLURM_JOB_ID"):
        return f"slurm job {os.environ['SLURM_JOB_ID']}"
    return f"torchrun {os.environ['TORCHELASTIC_RUN_ID']}" if os.environ.get("TORCHELASTIC_RUN_ID") else None


def restarted() -> bool:
    """This start is a restart of the job: torchrun's (its ranks started again) or SLURM's (a
    requeue). (A job id alone does not tell: runs in one allocation share SLURM's.)"""
    counts = (os.environ.get(k, "") for k in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
    return any(c.isdigit() and int(c) > 0 for c in counts)


def mark_timeline(root: Path, start: int) -> None:
    """This job's timeline in ``root`` starts at step ``start`` (checkpoint.load_step asked for it),
    for :func:`restart_step` to read at the job's restarts."""
    key = job_key()
    if key is not None:
        root.mkdir(parents=True, exist_ok=True)
        _write_atomically(root / TIMELINE, {"from_step": start, "job": key})


def restart_step(root: Path, asked: int) -> int:
    """The step a start with checkpoint.load_step = ``asked`` (0: none) resumes from: ``asked``,
    unless this start is a restart of the job whose timeline in ``root`` began there (a torchrun
    restart or a SLURM requeue runs the same command line again) — then that timeline's latest
    checkpoint: going back to ``asked`` would set the job's own later checkpoints aside at every
    restart."""
    if not restarted():
        return asked
    try:
        timeline = json.loads((root / TIMELINE).read_text())
    except (OSError, ValueError):
        return asked
    key = job_key()
    if key is None or timeline.get("job") != key or timeline.get("from_step") != asked:
        return asked
    later = [s for s in [*complete_checkpoints(root), *recoverable_saves(root)] if s >= asked]
    return max(later, default=asked)


def find_resume(cfg, args) -> Path | None:
    """The checkpoint to resume from, fully validated; no process group needed (preflight)."""
    ck = cfg.checkpoint
    if not ck.enable:
        return None
    root = checkpoint_root(cfg)
    asked = restart_step(root, ck.load_step) if ck.load_step >= 0 else -1
    if asked == 0:
        return None
    written = recoverable_saves(root)
    for d in interrupted_saves(root):
        if all(d != partial for partial, _ in written.values()):
            warn(f"ignoring incomplete checkpoint {d} (a save was interrupted); it will be removed")
    for d in unexpected_folders(root):
        warn(
            f"{d} has no manifest ({MANIFEST}); it is not a checkpoint torchpar can load, and is left alone"
        )
    found = complete_checkpoints(root)
    for step, (partial, _) in written.items():
        if step not in found:
            warn(f"the save of {partial} was interrupted after every file was written; it is committed "
                 f"as {step_dir(root, step)}")
            found[step] = step_dir(root, step)
    if asked > 0:
        if asked not in found:
            have = ", ".join(map(str, sorted(found))) or "none"
            raise ConfigError(
                f"checkpoint.load_step = {ck.load_step}: no complete checkpoint "
                f"{step_dir(root, asked)} (complete steps there: {have}); set load_step to one of "
                "them, or -1 for the latest"
            )
        path = found[asked]
    elif found:
        path = found[max(found)]
    else:
        return None
    manifest = read_manifest(path)
    if manifest.get("format", 1) != FORMAT:
        raise ConfigError(
            f"checkpoint {path} was written in checkpoint format {manifest.get('format', 1)}, this torchpar "
            f"reads format {FORMAT}; export its weights (`torchpar export`) and start from them with "
            "checkpoint.initial_load_path, or use a new checkpoint folder"
        )
    check_model_matches(f"checkpoint {path}", manifest, cfg.model.name, cfg.model.flavor, args)
    # Sizes here; the CRC32s once the ranks can share the reading (Checkpointer.load).
    verify_files(saved_folder(path), manifest, checksums=False)
    return path
