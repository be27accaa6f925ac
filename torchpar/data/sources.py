"""Document sources: indexable lists of texts. Every problem is reported when the source is
built (before any process group exists), never in the middle of training."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import random
import sysconfig
import zlib
from pathlib import Path

from torchpar.console import warn
from torchpar.data.chat import TEMPLATES, ChatTemplate, messages_of, pack
from torchpar.data.tokenized import TokenizedCorpus, is_prepared
from torchpar.errors import ConfigError
from torchpar.loss import NO_LOSS

VALIDATION_PERCENT = 3  # stdlib files whose path hashes into this bucket form the held-out split


class DocumentSource:
    """``len(source)`` documents, ``source[i]`` -> text; ``skipped`` counts what was left out and why.
    Each source's ``fingerprint()`` names its documents and their order, so a resume can tell
    whether a saved position (documents by index) still applies."""

    def __init__(self, name: str):
        self.name = name
        self.skipped: dict[str, int] = {}

    def _skip(self, why: str) -> None:
        self.skipped[why] = self.skipped.get(why, 0) + 1

    def tokens(self, i: int, tokenizer) -> list[int]:
        """Document ``i``'s token ids, as training reads them (BOS + text + EOS; none for an empty
        text): the one rule of the on-the-fly reader and of ``prepare-data``."""
        text = self[i]
        return tokenizer.encode(text) if text.strip() else []


class StdlibSource(DocumentSource):
    """The running interpreter's standard-library ``.py`` files (every Python ships them).

    Order: sorted relative paths, then a fixed shuffle by ``seed``; ``split`` 'validation' holds
    the ~3% of files whose path CRC falls in a fixed bucket, 'train' the rest. Files that are not
    valid UTF-8 (a few test fixtures are deliberately broken) are skipped and counted. The
    corpus differs slightly between Python versions; within one interpreter it is fixed.
    """

    def __init__(self, split: str, seed: int, root: str | None = None):
        super().__init__(f"stdlib:{split}")
        if split not in ("train", "validation"):
            raise ConfigError(f"data.split = {split!r}: the stdlib corpus has 'train' and 'validation'")
        root_path = Path(root or sysconfig.get_paths()["stdlib"])
        rel = []
        for folder, subfolders, names in os.walk(root_path):
            # Installed packages are not the standard library: not walked at all (a glob that
            # filtered them afterwards read every file of every package, seconds at each start).
            subfolders[:] = [d for d in subfolders if d not in ("site-packages", "dist-packages")]
            rel += [Path(folder, n).relative_to(root_path).as_posix() for n in names if n.endswith(".py")]
        rel.sort()
        held_out = [r for r in rel if zlib.crc32(r.encode()) % 100 < VALIDATION_PERCENT]
        chosen = held_out if split == "validation" else [r for r in rel if r not in set(held_out)]
        random.Random(seed).shuffle(chosen)
        self.root, self.files = root_path, chosen
        if not chosen:
            raise ConfigError(f"no standard-library sources found under {root_path}")

    def fingerprint(self) -> str:
        return f"{len(self.files)} files, crc {zlib.crc32(chr(10).join(self.files).encode()):08x}"

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> str:
        try:
            text = (self.root / self.files[i]).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            self._skip("not UTF-8")
            return ""
        if not text.strip():
            self._skip("empty")
        return text


class FileSource(DocumentSource):
    """Local ``.txt`` files (one document each) and ``.jsonl`` files (one document per line, text
    under ``text_field``). Paths and globs are comma-separated. Everything is read once up front so
    a bad file fails here: bad UTF-8, a NUL byte (a binary or UTF-16 file), a line that is not JSON,
    lacks the field or holds a non-string there -> error naming the file and line; empty files and
    empty texts are skipped and counted, and so are JSON nulls (with a warning: a null is
    usually a gap in the data). A NUL written as the JSON escape \\u0000 is text like any other
    character: the byte-level tokenizer encodes it."""

    def __init__(self, paths: str, text_field: str):
        super().__init__("files")
        self.docs: list[str] = []
        nulls: list[str] = []  # where each null text is
        for f, text in read_files(paths):
            if f.suffix != ".jsonl":
                self._add(text)
                continue
            for where, value in jsonl_records(f, text, text_field, "data.text_field"):
                if value is None:
                    nulls.append(where)
                    self._skip("null")
                elif not isinstance(value, str):
                    raise ConfigError(f"{where}: field '{text_field}' is not a string "
                                      f"({json.dumps(value)[:40]}); set data.text_field to the text's "
                                      "field or fix the record")
                else:
                    self._add(value)
        if nulls:

            warn(f"skipped {len(nulls)} record(s) whose \"{text_field}\" is null (the first at {nulls[0]})")
        if not self.docs:
            raise ConfigError(f"data.path {paths!r}: no non-empty documents (skipped: {self.skipped})")

    def _add(self, text: str) -> None:
        if text.strip():
            self.docs.append(text)
        else:
            self._skip("empty")

    def fingerprint(self) -> str:
        crc = 0
        for doc in self.docs:
            crc = zlib.crc32(doc.encode(), crc)
        return f"{len(self.docs)} documents, crc {crc:08x}"

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: int) -> str:
        return self.docs[i]


def read_files(paths: str) -> list[tuple[Path, str]]:
    """(file, text) of every file that ``paths`` (comma-separated paths or globs) names, read once:
    one line for a pattern that matches nothing, a NUL byte (a binary or UTF-16 file) or bad UTF-8."""
    files: list[Path] = []
    for pattern in (p.strip() for p in paths.split(",") if p.strip()):
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise ConfigError(f"data.path: {pattern!r} matches no file")
        files += [Path(m) for m in matches if Path(m).is_file()]
    out = []
    for f in files:
        raw = f.read_bytes()
        if b"\0" in raw:
            raise ConfigError(f"{f}: a NUL byte at byte {raw.index(0)} (a binary or UTF-16 file?); "
                              "convert it to UTF-8 text or remove it from data.path")
        try:
            out.append((f, raw.decode("utf-8")))
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{f}: not valid UTF-8 at byte {e.start}; convert the file or remove it from data.path"
            ) from None
    return out


def jsonl_records(f: Path, text: str, field: str, setting: str):
    """(file:line, the record's ``field``) of each non-blank line of JSONL file ``f`` (its
    ``text``); one line for a line that is not JSON or a record without the field (``setting``
    names the config field that chooses it)."""
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{f}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{where}: not a JSON object ({e.msg})") from None
        if not isinstance(record, dict) or field not in record:
            keys = list(record)[:5] if isinstance(record, dict) else type(record).__name__
            raise ConfigError(f"{where}: no field '{field}' (has {keys}); set {setting}")
        yield where, record[field]


class ChatSource(DocumentSource):
    """Conversations of local ``.jsonl`` files (``data.format = 'chat'``), rendered by ``template``
    with ``tokenizer`` and packed whole into windows of ``window`` tokens (torchpar.data.chat): its
    documents are those windows. Everything is read, checked and rendered up front, so a bad record
    fails here (one line naming its file and line); a conversation with no assistant turn is
    skipped and counted. A corpus too large to render at every start is prepared once
    (``torchpar prepare-data``), and each rank then reads only its windows."""

    def __init__(self, paths: str, field: str, template: ChatTemplate, tokenizer, window: int, too_long: str):
        super().__init__("chat")
        template.vocab_size(tokenizer)  # (one line for a tokenizer without the template's markers)
        conversations = []
        for f, text in read_files(paths):
            if f.suffix != ".jsonl":
                raise ConfigError(f"{f}: data.format = 'chat' reads .jsonl files of conversations; remove it "
                                  "from data.path")
            for where, value in jsonl_records(f, text, field, "data.messages_field"):
                messages = messages_of(value, field, template, where)
                if messages is None:
                    self._skip("no assistant turn")
                else:
                    conversations.append(template.render(messages, tokenizer))
        if not conversations:
            raise ConfigError(f"data.path {paths!r}: no conversation with an assistant turn (skipped: "
                              f"{self.skipped})")
        self.bins, counts = pack(conversations, window, too_long, tokenizer.eos_id | NO_LOSS)
        if counts["dropped"]:
            self.skipped["longer than a window"] = counts["dropped"]
        self.template, self.window, self.too_long = template.name, window, too_long
        self.conversations, self.truncated = len(conversations) - counts["dropped"], counts["truncated"]
        tokens = sum(min(len(c), window) for c in conversations)
        self.padding = 1 - tokens / self.bins.size if self.bins.size else 0.0
        self.targets = float((self.bins[:, 1:] < NO_LOSS).mean()) if self.bins.size else 0.0

    def fingerprint(self) -> str:
        return (f"{len(self.bins)} windows of {self.window} tokens ({self.template} template, "
                f"{self.too_long}), crc {zlib.crc32(self.bins.tobytes()):08x}")

    def __len__(self) -> int:
        return len(self.bins)

    def tokens(self, i: int, tokenizer) -> list[int]:
        return self.bins[i].tolist()

    def describe(self) -> str:
        """The start-up note: what the windows hold."""
        cut = f", {self.truncated} truncated to a window" if self.truncated else ""
        left = f", {sum(self.skipped.values())} left out ({self.skipped})" if self.skipped else ""
        return (f"{self.conversations} conversations ({self.template} template) in {len(self.bins)} windows"
                f"{cut}{left}; {self.padding:.0%} of the tokens padding, {self.targets:.0%} loss targets")


class HFSource(DocumentSource):
    """A Hugging Face ``datasets`` dataset (optional dependency: ``pip install torchpar[hf]``).

    ``path`` is a hub name or a local data file / folder; local ``.jsonl``/``.json``/``.txt``/``.parquet``
    files load through the matching builder, so nothing is downloaded for them."""

    BUILDERS = {".jsonl": "json", ".json": "json", ".txt": "text", ".parquet": "parquet", ".csv": "csv"}

    def __init__(self, path: str, split: str, text_field: str):
        super().__init__(f"hf:{path}")
        try:
            import datasets
        except ImportError:
            raise ConfigError(
                "data.dataset = 'hf' needs the 'datasets' package: pip install 'torchpar[hf]'"
            ) from None
        builder = self.BUILDERS.get(Path(path).suffix)
        try:
            if builder and Path(path).exists():
                ds = datasets.load_dataset(builder, data_files=path, split="train")
            else:
                ds = datasets.load_dataset(path, split=split)
        except Exception as e:  # datasets raises many types; the user needs the message
            raise ConfigError(f"data.path {path!r}: could not load with datasets: {e}") from None
        if text_field not in ds.column_names:
            raise ConfigError(
                f"data.path {path!r}: no column '{text_field}' (columns: {ds.column_names}); set "
                "data.text_field"
            )
        self.dataset, self.text_field = ds, text_field

    def fingerprint(self) -> str:
        # datasets hashes a dataset's content and transforms into _fingerprint
        return f"{len(self.dataset)} rows, {getattr(self.dataset, '_fingerprint', 'unknown')}"

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> str:
        text = self.dataset[i][self.text_field]
        if not text:
            self._skip("empty")
        return text or ""


def chat_data(cfg) -> bool:
    """Whether the [data] section ``cfg`` reads conversations (some source's ``format`` is 'chat'):
    its tokens then carry loss masks."""
    return any(spec.format == "chat" for _, spec, _ in source_specs(cfg))


def loss_masked(source) -> bool:
    """Whether ``source``'s tokens may carry NO_LOSS bits: conversations (``format`` 'chat'), read
    on the fly or prepared (whose documents are windows); None (no source) is not."""
    return bool(getattr(source, "window", 0))


def build_source(cfg, seed: int, tokenizer=None, window: int = 0):
    """``cfg`` is the [data] section (or one of its sources); conversations (``format`` 'chat')
    are rendered with ``tokenizer`` and packed into windows of ``window`` tokens."""

    if cfg.dataset == "tokenized" or (cfg.dataset == "files" and is_prepared(cfg.path)):
        corpus = TokenizedCorpus(cfg.path)
        if (cfg.format == "chat") != bool(corpus.window):
            raise ConfigError(f"data.path {cfg.path!r} was prepared with data.format = "
                              f"{'chat' if corpus.window else 'text'}; set data.format to that, or prepare "
                              "it again")
        if corpus.window and corpus.window != window:
            raise ConfigError(f"data.path {cfg.path!r} holds conversations packed into windows of "
                              f"{corpus.window} tokens (training.seq_len = {corpus.window - 1}), not "
                              f"{window}; set training.seq_len to that, or prepare the corpus again with "
                              "this one")
        return corpus
    if cfg.format == "chat":
        if cfg.dataset != "files":
            raise ConfigError(f"data.format = 'chat' reads local .jsonl files (data.dataset = 'files') or a "
                              f"corpus prepared from them, not data.dataset = {cfg.dataset!r}")
        return ChatSource(cfg.path, cfg.messages_field, TEMPLATES[cfg.chat_template], tokenizer, window,
                          cfg.chat_too_long)
    if cfg.dataset == "stdlib":
        return StdlibSource(cfg.split, seed)
    if cfg.dataset == "files":
        return FileSource(cfg.path, cfg.text_field)
    return HFSource(cfg.path, cfg.split, cfg.text_field)


SOURCE_KEYS = ("dataset", "path", "text_field", "split", "weight", "name", "format", "messages_field")


def source_specs(cfg) -> list[tuple[str, object, float]]:
    """(name, [data] section for that source, weight) of each source: [[data.sources]] entries, or
    the [data] section itself. Every mistake in an entry is one line naming it."""
    if not cfg.sources:
        return [(cfg.dataset if cfg.dataset == "stdlib" else f"{cfg.dataset}:{cfg.path}", cfg, 1.0)]
    specs = []
    for i, entry in enumerate(cfg.sources):
        where = f"data.sources[{i}]"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}: expected a table ([[data.sources]]), got {entry!r}")
        unknown = sorted(set(entry) - set(SOURCE_KEYS))
        if unknown:
            raise ConfigError(f"{where}: unknown key {unknown[0]!r}; a source has {', '.join(SOURCE_KEYS)}")
        weight = entry.get("weight")
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight > 0:
            raise ConfigError(f"{where}: weight must be a number > 0, got {weight!r}")
        fields = {k: v for k, v in entry.items() if k not in ("weight", "name")}
        bad = [k for k, v in fields.items() if not isinstance(v, str)]
        if bad:
            raise ConfigError(f"{where}.{bad[0]} must be a string, got {fields[bad[0]]!r}")
        spec = dataclasses.replace(cfg, sources=[], **fields)
        if spec.dataset not in ("stdlib", "files", "hf", "tokenized"):
            raise ConfigError(f"{where}.dataset = {spec.dataset!r} is not one of stdlib, files, hf, "
                              "tokenized")
        if spec.format not in ("text", "chat"):
            raise ConfigError(f"{where}.format = {spec.format!r} is not 'text' or 'chat'")
        if spec.dataset != "stdlib" and not spec.path:
            raise ConfigError(f"{where}.path is required when its dataset is '{spec.dataset}'")
        name = str(entry.get("name") or (spec.dataset if spec.dataset == "stdlib" else Path(spec.path).name))
        specs.append((name, spec, float(weight)))
    names = [n for n, _, _ in specs]
    if len(set(names)) < len(names):
        raise ConfigError(f"data.sources: names {names} repeat; give each source its own `name`")
    return specs
