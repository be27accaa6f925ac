#!/usr/bin/env python
"""Run every shell command of README.md and docs/*.md, as written.

The docs write shell commands one way only: a fenced ``console`` block whose commands start with
``$ `` (a line starting with ``> `` continues the command before it, as the shell's own prompt
shows it, e.g. a here-document); every other line of such a block is the output the command
printed once and is not compared. A ``bash`` or ``sh`` block is an error here: use ``console``.

A command is skipped, with its reason, when the line before its block is
``<!-- not run here: REASON -->`` (the whole block) or when it ends in ``# not run here: REASON``.

The commands of one file run in order, in one temporary folder that mirrors the repository's
root: its folders made anew, each file a link to the repository's (nothing is copied; ``outputs``,
``.git`` and caches left out). So the commands see the repository's files as from its root, tools
that walk folders (``ruff check .``) walk them, and what the commands write (``outputs/...``,
``my.toml``) stays in the temporary folder; ``TMPDIR`` points into it too. Prints a table
command -> ok / FAIL / skipped (reason) and exits 1 if any command failed (2 if the docs
themselves break a rule).

    python scripts/check_docs.py [--only PATTERN] [--timeout S] [--list] [--keep]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP_BLOCK = re.compile(r"^<!--\s*not run here:\s*(.+?)\s*-->\s*$")
SKIP_TRAILING = re.compile(r"\s#\s*(?:<!--\s*)?not run here:\s*(.+?)\s*(?:-->)?\s*$")
FENCE = re.compile(r"^(`{3,}|~{3,})\s*([\w+-]*)")
SHELL_LANGS = {"bash", "sh", "shell", "zsh"}
NOT_MIRRORED = {"outputs", ".git", "__pycache__", ".pytest_cache", ".ruff_cache", "wandb", "build"}


@dataclass
class Command:
    doc: str  # path relative to the repository
    line: int  # 1-based line of the command's `$ `
    text: str  # the command, continuation lines joined with newlines
    skip: str | None  # the reason it is not run here, or None


def doc_files(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def fenced_blocks(text: str):
    """(language, first line number of the body, body lines, the line before the fence) of every
    fenced block."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        j = i + 1
        while j < len(lines) and not lines[j].startswith(fence[0] * len(fence)):
            j += 1
        yield lang, i + 2, lines[i + 1:j], before
        i = j + 1


def commands(path: Path, root: Path = ROOT) -> tuple[list[Command], list[str]]:
    """The commands of one file, and the rules it breaks."""
    rel = str(path.relative_to(root))
    found, problems = [], []
    for lang, first, body, before in fenced_blocks(path.read_text()):
        if lang in SHELL_LANGS:
            problems.append(f"{rel}:{first - 1}: a ```{lang} block; the docs write shell commands as "
                            "```console blocks with `$ ` prompts")
            continue
        if lang != "console":
            continue
        m = SKIP_BLOCK.match(before.strip())
        block_skip = m.group(1) if m else None
        current = None
        for k, line in enumerate(body):
            if line.startswith("$ "):
                current = Command(rel, first + k, line[2:], block_skip)
                found.append(current)
            elif line.startswith("> ") or line == ">":
                if current is None:
                    problems.append(f"{rel}:{first + k}: a `> ` continuation line without a command")
                else:
                    current.text += "\n" + line[2:]
            else:
                current = None  # output
        if not any(line.startswith("$ ") for line in body):
            problems.append(f"{rel}:{first - 1}: a ```console block without a `$ ` command")
    for c in found:
        first_line = c.text.split("\n")[0]
        m = SKIP_TRAILING.search(first_line)
        if m and c.skip is None:
            c.skip = m.group(1)
        if c.skip is not None and not c.skip.strip():
            problems.append(f"{c.doc}:{c.line}: a command skipped without a reason")
    return found, problems


def all_commands(root: Path = ROOT) -> tuple[list[Command], list[str]]:
    out, problems = [], []
    for path in doc_files(root):
        cmds, probs = commands(path, root)
        out += cmds
        problems += probs
    return out, problems


def workdir(base: Path, root: Path = ROOT) -> Path:
    """A mirror of the repository: real folders, each file a link to the repository's."""
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in NOT_MIRRORED and not d.endswith(".egg-info")]
        here = base / Path(folder).relative_to(root)
        here.mkdir(parents=True, exist_ok=True)
        for name in files:
            (here / name).symlink_to(Path(folder) / name)
    (base / "tmp").mkdir(exist_ok=True)
    return base


def run(cmd: Command, cwd: Path, timeout: float) -> tuple[bool, float, str]:
    env = {**os.environ, "TMPDIR": str(cwd / "tmp"), "WANDB_MODE": "offline", "PYTHONUNBUFFERED": "1"}
    env.setdefault("OMP_NUM_THREADS", "1")
    started = time.perf_counter()
    try:
        r = subprocess.run(["bash", "-o", "pipefail", "-c", cmd.text], cwd=cwd, env=env, timeout=timeout,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True, start_new_session=True)
        ok, tail = r.returncode == 0, f"exit code {r.returncode}\n{(r.stdout + r.stderr)[-2000:]}"
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        ok, tail = False, f"timed out after {timeout:.0f} s\n{out[-2000:].decode(errors='replace')}"
    return ok, time.perf_counter() - started, tail


def short(text: str, width: int = 88) -> str:
    one = " ".join(text.split("\n")[0].split())
    return one if len(one) <= width else one[: width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="run only the files whose path contains this")
    ap.add_argument("--timeout", type=float, default=600, help="seconds one command may take")
    ap.add_argument("--list", action="store_true", help="list the commands and their skips; run nothing")
    ap.add_argument("--keep", action="store_true", help="keep the temporary folders")
    args = ap.parse_args(argv)

    cmds, problems = all_commands()
    cmds = [c for c in cmds if args.only in c.doc]
    for p in problems:
        print(f"check_docs: {p}", file=sys.stderr)
    rows, failures = [], []
    top = Path(tempfile.mkdtemp(prefix="check_docs-"))
    try:
        dirs: dict[str, Path] = {}
        for c in cmds:
            where = f"{c.doc}:{c.line}"
            if c.skip is not None:
                rows.append((where, short(c.text), f"skipped ({c.skip})"))
                continue
            if args.list:
                rows.append((where, short(c.text), "to run"))
                continue
            if c.doc not in dirs:
                dirs[c.doc] = workdir(top / c.doc.replace("/", "_"))
            ok, seconds, tail = run(c, dirs[c.doc], args.timeout)
            rows.append((where, short(c.text), f"ok ({seconds:.0f} s)" if ok else f"FAIL ({seconds:.0f} s)"))
            print(f"{rows[-1][2]:<12} {where}  {rows[-1][1]}", file=sys.stderr, flush=True)
            if not ok:
                failures.append((where, c.text, tail))
    finally:
        if args.keep:
            print(f"check_docs: kept {top}", file=sys.stderr)
        else:
            shutil.rmtree(top, ignore_errors=True)

    w1 = max([len(r[0]) for r in rows] + [5])
    w2 = max([len(r[1]) for r in rows] + [7])
    print(f"{'where':<{w1}}  {'command':<{w2}}  result")
    for where, text, result in rows:
        print(f"{where:<{w1}}  {text:<{w2}}  {result}")
    n_ok = sum(r[2].startswith("ok") for r in rows)
    n_skip = sum(r[2].startswith("skipped") for r in rows)
    print(f"\n{len(rows)} commands: {n_ok} ok, {len(failures)} failed, {n_skip} skipped"
          + (f"; {len(problems)} rule(s) broken" if problems else ""))
    for where, text, tail in failures:
        print(f"\n--- FAIL {where}: {text}\n{tail}")
    if failures:
        return 1
    return 2 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
