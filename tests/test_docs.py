"""The README and docs/ name only what exists: subcommands, config fields, files and sections.

Fast and without training: it reads the Markdown and the config's dataclasses. Running the docs'
commands themselves is ``python scripts/check_docs.py``.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import re
import sys
import typing
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


def _check_docs():
    spec = importlib.util.spec_from_file_location("check_docs", ROOT / "scripts" / "check_docs.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["check_docs"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


check_docs = _check_docs()


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def subcommands() -> set[str]:
    """``torchpar <name>``'s names: the COMMANDS table of the entry point (torchpar.cli, or the
    commands package if the table lives there)."""
    for module in ("torchpar.cli", "torchpar.commands"):
        try:
            table = getattr(importlib.import_module(module), "COMMANDS", None)
        except ImportError:
            continue
        if table:
            return set(table)
    raise AssertionError("no COMMANDS table in torchpar.cli or torchpar.commands")


def config_fields() -> dict[str, set[str]]:
    """Section -> its field names, from the job config's dataclasses."""
    try:
        from torchpar.config import JobConfig
    except ImportError:  # pragma: no cover
        from torchpar.config.sections import JobConfig
    return {name: {f.name for f in dataclasses.fields(cls)}
            for name, cls in typing.get_type_hints(JobConfig).items()}


def source_keys() -> set[str]:
    """What a [[data.sources]] table may hold."""
    from torchpar.data.sources import SOURCE_KEYS

    return set(SOURCE_KEYS)


def code_texts(path: Path) -> list[tuple[int, str]]:
    """(line, text) of the code in a page: every line of a fenced block and every inline code span."""
    out, in_block = [], False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            in_block = not in_block
            continue
        if in_block:
            out.append((n, line))
        else:
            out += [(n, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def inline_spans(path: Path) -> list[tuple[int, str]]:
    out, in_block = [], False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block:
            out += [(n, span) for span in re.findall(r"`([^`]+)`", line)]
    return out


def shell_commands(path: Path) -> list[tuple[int, str]]:
    cmds, _ = check_docs.commands(path, ROOT)
    return [(c.line, c.text) for c in cmds]


def test_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().split("\n")
    assert len(lines) - (lines[-1] == "") <= README_MAX_LINES, f"README.md has {len(lines)} lines"


def test_the_docs_write_shell_commands_one_way():
    _, problems = check_docs.all_commands(ROOT)
    assert not problems, "\n".join(problems)


def test_every_torchpar_subcommand_named_exists():
    known = subcommands()
    bad = []
    for path in DOCS:
        # The shell commands, and inline code that starts with `torchpar ` (not prose about torchpar).
        texts = shell_commands(path) + [(n, s) for n, s in inline_spans(path) if s.startswith("torchpar ")]
        for n, text in texts:
            for m in re.finditer(r"(?:^|[\s;&|(])torchpar\s+([a-z][a-z-]*)", text):
                if m.group(1) not in known:
                    bad.append(f"{rel(path)}:{n}: torchpar {m.group(1)}")
    assert not bad, f"not in COMMANDS ({sorted(known)}):\n" + "\n".join(bad)


OVERRIDE = re.compile(r"(?<![\w.-])--([a-z_][a-z0-9_]*)\.([a-z_][a-z0-9_]*)(?=[\s=\"']|$)")
PLACEHOLDERS = {("section", "key")}


def test_every_override_names_a_config_field():
    fields = config_fields()
    bad, seen = [], 0
    for path in DOCS:
        for n, text in code_texts(path):
            for section, key in OVERRIDE.findall(text):
                if (section, key) in PLACEHOLDERS:
                    continue
                seen += 1
                if key not in fields.get(section, ()):
                    bad.append(f"{rel(path)}:{n}: --{section}.{key}")
    assert seen > 20, "the override pattern found almost nothing: is it still right?"
    assert not bad, "not a config field:\n" + "\n".join(bad)


FILE_SUFFIXES = {"safetensors", "json", "jsonl", "py", "toml", "png", "svg", "log", "pkl", "pt", "md", "txt",
                 "sh"}


def test_every_dotted_field_in_code_names_a_config_field():
    """`training.seq_len`, `checkpoint.initial_load_path = FILE`: a section's name, a dot and a key
    in inline code or a block are a config field (file names such as metrics.jsonl excepted)."""
    fields = config_fields()
    pattern = re.compile(r"(?<![\w./-])(" + "|".join(fields) + r")\.([a-z_][a-z0-9_]*)\b(?![./(-])")
    bad = []
    for path in DOCS:
        for n, text in code_texts(path):
            for section, key in pattern.findall(text):
                if key in FILE_SUFFIXES or (section, key) in PLACEHOLDERS:
                    continue
                if key not in fields[section]:
                    bad.append(f"{rel(path)}:{n}: {section}.{key}")
    assert not bad, "not a config field:\n" + "\n".join(bad)


def test_every_toml_snippet_names_config_fields():
    fields, sources = config_fields(), source_keys()
    bad, seen = [], 0
    for path in DOCS:
        for lang, first, body, _ in check_docs.fenced_blocks(path.read_text()):
            if lang != "toml":
                continue
            seen += 1
            try:
                data = tomllib.loads("\n".join(body))
            except tomllib.TOMLDecodeError as e:
                bad.append(f"{rel(path)}:{first}: not valid TOML: {e}")
                continue
            for section, values in data.items():
                if section == "extends":
                    continue
                if section not in fields:
                    bad.append(f"{rel(path)}:{first}: unknown section [{section}]")
                    continue
                for key, value in values.items():
                    if key not in fields[section]:
                        bad.append(f"{rel(path)}:{first}: unknown key {key!r} in [{section}]")
                    elif (section, key) == ("data", "sources"):
                        bad += [f"{rel(path)}:{first}: unknown key {k!r} in [[data.sources]]"
                                for entry in value for k in entry if k not in sources]
    assert seen >= 1
    assert not bad, "\n".join(bad)


INLINE_TOML = re.compile(r"^\[([a-z_]+)\]\s+`?\s*([a-z_][a-z0-9_]*)")


def test_every_inline_section_key_names_a_config_field():
    """Inline `[checkpoint] initial_load_path = FILE` and `[comm] timeout_s`."""
    fields = config_fields()
    bad = []
    for path in DOCS:
        for n, text in code_texts(path):
            m = INLINE_TOML.match(text.strip())
            if m and m.group(1) in fields and m.group(2) not in fields[m.group(1)]:
                bad.append(f"{rel(path)}:{n}: [{m.group(1)}] {m.group(2)}")
            elif m and m.group(1) not in fields:
                bad.append(f"{rel(path)}:{n}: unknown section [{m.group(1)}]")
    assert not bad, "\n".join(bad)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out, in_block = set(), False
    for line in path.read_text().split("\n"):
        if line.startswith("```"):
            in_block = not in_block
        elif not in_block and line.startswith("#"):
            out.add(slug(line.lstrip("#")))
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


@pytest.mark.parametrize("path", DOCS, ids=rel)
def test_every_relative_link_points_at_what_exists(path):
    bad, in_block = [], False
    for n, line in enumerate(path.read_text().split("\n"), 1):
        if line.startswith("```"):
            in_block = not in_block
        if in_block:
            continue
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):
                continue  # http:, https:, mailto:
            file, _, anchor = target.partition("#")
            dest = (path.parent / file).resolve() if file else path
            if not dest.exists():
                bad.append(f"{rel(path)}:{n}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{rel(path)}:{n}: {target} (no such section)")
    assert not bad, "\n".join(bad)


def test_nothing_cites_outside_the_project():
    bad = []
    for path in DOCS:
        for n, line in enumerate(path.read_text().split("\n"), 1):
            cites = re.search(r"(?i)\btutorial", line) or re.search(r"(?<![\w&])#\d{2,}\b", line)
            if "../shared/" in line or cites:
                bad.append(f"{rel(path)}:{n}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)
