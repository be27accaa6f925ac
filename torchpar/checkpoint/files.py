"""A checkpoint on disk: its folder layout, its manifest, and the checks before a resume."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

from torchpar.config import ConfigError
from torchpar.console import warn
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
    if not root.is_dir():
        return []
    ours = set(interrupted_saves(root))
    return sorted(d for d in root.glob("step-*")
                  if d.is_dir() and not (d / MANIFEST).exists() and d not in ours)


def file_crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def read_manifest(path: Path) -> dict:
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
    shape it was saved from."""
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
    diff = {k: (v, args.to_dict()[k]) for k, v in saved_args.items() if args.to_dict().get(k) != v}
    if diff:
        pretty = ", ".join(f"{k}: saved {a} vs config {b}" for k, (a, b) in diff.items())
        raise ConfigError(
            f"{where} holds a model of another shape ({pretty}); use the config it was saved with (e.g. "
            "model.n_layers) or a new checkpoint folder"
        )


def find_resume(cfg, args) -> Path | None:
    """The checkpoint to resume from, fully validated; no process group needed (preflight)."""
    ck = cfg.checkpoint
    if not ck.enable or ck.load_step == 0:
        return None
    root = checkpoint_root(cfg)
    for d in interrupted_saves(root):
        warn(f"ignoring incomplete checkpoint {d} (a save was interrupted); it will be removed")
    for d in unexpected_folders(root):
        warn(
            f"{d} has no manifest ({MANIFEST}); it is not a checkpoint torchpar can load, and is left alone"
        )
    found = complete_checkpoints(root)
    if ck.load_step > 0:
        if ck.load_step not in found:
            have = ", ".join(map(str, sorted(found))) or "none"
            raise ConfigError(
                f"checkpoint.load_step = {ck.load_step}: no complete checkpoint "
                f"{step_dir(root, ck.load_step)} (complete steps there: {have}); set load_step to one of "
                "them, or -1 for the latest"
            )
        path = found[ck.load_step]
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
    verify_files(path, manifest, checksums=False)
    return path
