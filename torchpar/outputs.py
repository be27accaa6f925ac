"""What torchpar's commands write, and what they never replace.

Every command that writes (``prepare-data``, ``export``, ``plan --out``, ``plot``, ``schedule
--out``) claims its path with :func:`claim` before any work: an existing file, or a folder that
holds files, is refused with one line unless it is the command's own (a marker it wrote there
before: a prepared corpus's ``prepare.json``, an export folder's :data:`MARKER`, a picture's
:data:`PICTURE_MARK`) or the user passes ``--overwrite``. Files are written through
:func:`replacing`, so a reader (or an interrupted write) sees the old file or the new one whole.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
from pathlib import Path

from torchpar.console import output_path
from torchpar.errors import ConfigError

MARKER = "torchpar-output.json"  # in a folder a command writes: which command, and the files it wrote
PICTURE_MARK = "torchpar-picture"  # in the metadata near the start of every picture torchpar draws
OVERWRITE_HELP = ("replace an existing file, or write into a folder holding files torchpar did not "
                  "write (by default both are refused)")


def add_overwrite(parser) -> None:
    parser.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def claim(flag: str, path: str | Path, *, folder: bool = False, suffixes: tuple[str, ...] = (),
          overwrite: bool = False, own=None) -> Path:
    """The path ``flag`` names, checked like :func:`torchpar.console.output_path`, and refused if
    writing there would replace what torchpar did not write: an existing file, or a folder with
    files in it, unless ``own(path)`` recognises it as this command's earlier output or
    ``overwrite`` is set."""

    p = output_path(flag, path, folder=folder, suffixes=suffixes)
    if overwrite or not p.exists() or (own is not None and own(p)):
        return p
    if folder:
        names = sorted(q.name for q in p.iterdir())
        if not names:
            return p
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"{flag} {p} holds files torchpar did not write there ({shown}); choose a new or "
                          "empty folder, or add --overwrite to write into it anyway")
    raise ConfigError(f"{flag} {p} already exists; choose another file name, or add --overwrite to "
                      "replace it")


@contextlib.contextmanager
def replacing(path: Path):
    """Yields a temporary path beside ``path`` to write; renamed onto ``path`` when the block ends
    without an error, removed when it fails (or is interrupted)."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(path: Path, text: str, durable: bool = False) -> None:
    """``path`` holds ``text`` whole or not at all; ``durable``: on the disk before this returns,
    name included (the file and then its folder synced), so that a node dying just after cannot
    leave an empty file behind a name that says it was written."""
    with replacing(path) as tmp:
        with open(tmp, "w") as f:
            f.write(text)
            if durable:
                f.flush()
                os.fsync(f.fileno())
    if durable:
        sync_folder(path.parent)


def sync_folder(folder: Path) -> None:
    """The folder's entries (a file renamed into it, or out) on the disk, where the file system
    syncs folders (some network and FUSE mounts refuse: their renames are durable or never)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.ENOSYS, errno.EBADF):
            raise
    finally:
        os.close(fd)


def write_marker(folder: Path, command: str, files: list[str]) -> None:
    """Mark ``folder`` as ``command``'s output before writing ``files`` into it, so that even an
    interrupted write leaves a folder the command recognises as its own."""
    write_text(folder / MARKER, json.dumps({"written_by": command, "files": sorted(files)}, indent=1) + "\n")


def read_marker(folder: Path, command: str) -> dict | None:
    """The marker ``command`` left in ``folder``, or None (no marker, another command's, unreadable)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) and marker.get("written_by") == command else None


def is_own_picture(path: Path) -> bool:
    """A picture torchpar drew: PNG text chunks and SVG metadata come before the image data."""
    try:
        with open(path, "rb") as f:
            return PICTURE_MARK.encode() in f.read(1 << 16)
    except OSError:
        return False
