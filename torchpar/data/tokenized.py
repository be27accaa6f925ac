"""Pre-tokenized corpora: ``torchpar prepare-data`` writes one, the loader reads it.

A prepared folder holds
  shard-00000.bin           the tokens of documents [0, D) back to back, each BOS + text + EOS
                            (uint16 when the vocabulary fits, else uint32; ``numpy.memmap``-readable)
  shard-00000.lengths.npy   those documents' token counts (int64; 0 = an empty document)
  shard-00000.json          the shard's token count, CRC32, largest token id and skipped documents:
                            written last, so a shard without it is redone when an interrupted
                            preparation resumes
  prepare.json              what is being prepared (a resumed preparation must match it); written
                            first, it also marks the folder as a corpus's own, so a rerun resumes
                            there while a folder of other files is refused (torchpar.outputs)
  manifest.json             written last of all: totals, the largest token id and the fingerprints
                            of the source and the tokenizer (the same ones the on-the-fly path records)
Shards cut the document list at fixed indices, so the bytes do not depend on the number of processes.
A reader keeps the lengths and offsets (16 bytes per document) and maps the shards: the corpus
itself stays on disk and in the page cache.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import sys
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from torchpar.errors import ConfigError
from torchpar.loss import NO_LOSS
from torchpar.outputs import replacing, write_text

FORMAT = "torchpar-tokens/1"
OPEN_SHARDS = 128  # shard files a reader keeps open
MANIFEST = "manifest.json"
PLAN = "prepare.json"


def _format_of(path: Path) -> str | None:
    """The ``format`` key of a JSON file, or None (absent, unreadable, not torchpar's)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data.get("format") if isinstance(data, dict) else None


def is_prepared(path: str) -> bool:
    return _format_of(Path(path).expanduser() / MANIFEST) == FORMAT


def is_own_folder(folder: Path) -> bool:
    """A folder that prepare-data wrote, finished or interrupted (its prepare.json is written first)."""
    return _format_of(folder / PLAN) == FORMAT or is_prepared(str(folder))


def _write_json(path: Path, data: dict) -> None:
    write_text(path, json.dumps(data, indent=1, sort_keys=True))


class TokenizedCorpus:
    """Documents of a prepared folder by index: ``length(d)`` and ``tokens(d, a, b)``. ``name`` and
    ``fingerprint()`` are those of the source it was prepared from, so a checkpoint's data position
    carries over between the on-the-fly and the pre-tokenized path."""

    def __init__(self, path: str):
        self.folder = Path(path).expanduser()
        if not is_prepared(path):
            raise ConfigError(f"data.path {path!r} is not a prepared corpus (no {MANIFEST} of format "
                              f"{FORMAT}); write one with `torchpar prepare-data --config ... --out {path}`")
        m = json.loads((self.folder / MANIFEST).read_text())
        try:
            self.manifest, self.name, self.tokenizer = m, m["source"], m["tokenizer"]
            self.skipped: dict[str, int] = m["skipped"]
            self.window = int(m.get("window", 0))  # a chat corpus's: each document is one window
            dtype, per = np.dtype(m["dtype"]), m["docs_per_shard"]
            self.lengths = np.concatenate([np.load(self.folder / f"shard-{i:05d}.lengths.npy")
                                           for i in range(len(m["shards"]))])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"data.path {path!r}: a damaged prepared corpus ({type(e).__name__}: {e}); "
                              "prepare the corpus again") from None
        if len(self.lengths) != m["n_documents"]:
            raise ConfigError(f"data.path {path!r}: the shards hold {len(self.lengths)} documents, the "
                              f"manifest {m['n_documents']}; prepare the corpus again")
        # Where each document starts inside its shard.
        starts = np.zeros(len(self.lengths), dtype=np.int64)
        for i, shard in enumerate(m["shards"]):
            lo, hi = i * per, min((i + 1) * per, len(self.lengths))
            starts[lo + 1:hi] = np.cumsum(self.lengths[lo:hi - 1])
            size = (self.folder / f"shard-{i:05d}.bin").stat().st_size
            if size != shard["tokens"] * dtype.itemsize:
                raise ConfigError(f"data.path {path!r}: shard {i} has {size} bytes, the manifest says "
                                  f"{shard['tokens'] * dtype.itemsize}; prepare the corpus again")
        self.starts, self.per, self.dtype = starts, per, dtype
        self._files: OrderedDict[int, int] = OrderedDict()  # shard -> open descriptor, last used last

    def fingerprint(self) -> str:
        return self.manifest["documents"]

    def __len__(self) -> int:
        return len(self.lengths)

    def tokens(self, d: int, a: int, b: int) -> np.ndarray:
        """Tokens a..b of document d. A positioned read (a copy out of the page cache) costs the
        same wherever the window lies; a memory map would fault in new pages for every window of
        a rank whose windows lie far apart (a large dp degree) and not for one whose lie close."""
        shard = d // self.per
        if shard in self._files:
            self._files.move_to_end(shard)
        else:
            if len(self._files) >= OPEN_SHARDS:  # a large corpus must not use up the descriptors
                os.close(self._files.popitem(last=False)[1])
            self._files[shard] = os.open(self.folder / f"shard-{shard:05d}.bin", os.O_RDONLY)
        size = self.dtype.itemsize
        data = os.pread(self._files[shard], (b - a) * size, int(self.starts[d] + a) * size)
        return np.frombuffer(data, dtype=self.dtype)


def verify_prepared(corpus: TokenizedCorpus, vocab_size: int, checksums: bool = True) -> None:
    """Check a prepared corpus before training reads it; raises ConfigError (one line) on the first
    problem. The preflight of every start calls it with ``checksums=False``, ``torchpar train
    --check`` with ``checksums=True``.

    Always (cheap, from the manifest alone): the largest token id the manifest records is below
    ``vocab_size`` (an id beyond it would fail inside the embedding, on every rank). Shard sizes
    were already checked when ``corpus`` was opened.
    With ``checksums``: every shard is read once, its CRC32 against the manifest's, and its
    largest id against ``vocab_size`` (this also covers corpora prepared before the manifest
    recorded the largest id)."""
    where, fix = f"prepared corpus {corpus.folder}", "prepare the corpus again (torchpar prepare-data)"
    max_id = corpus.manifest.get("max_id")
    if max_id is not None and max_id >= vocab_size:
        raise ConfigError(f"{where} holds token ids up to {max_id}, beyond the model's vocab_size "
                          f"{vocab_size}; {fix} with this model's tokenizer, or choose a model whose "
                          "vocab_size covers it")
    if not checksums:
        return
    chunk = 1 << 24  # tokens read at once
    for i, shard in enumerate(corpus.manifest["shards"]):
        path = corpus.folder / f"shard-{i:05d}.bin"
        data = np.memmap(path, dtype=corpus.dtype, mode="r") if shard["tokens"] else np.zeros(0, corpus.dtype)
        crc, top = 0, -1
        for a in range(0, data.size, chunk):
            piece = np.asarray(data[a:a + chunk])
            crc, top = zlib.crc32(piece.tobytes(), crc), max(top, largest_id(piece))
        if crc != shard["crc"]:
            raise ConfigError(f"{where}: {path.name} fails its CRC32 check (corrupted); {fix}")
        if top >= vocab_size:
            raise ConfigError(f"{where}: {path.name} holds token id {top}, beyond the model's vocab_size "
                              f"{vocab_size}; {fix} with this model's tokenizer")


def largest_id(tokens: np.ndarray) -> int:
    """The largest token id among ``tokens`` (their NO_LOSS bits cleared); -1 for none."""
    if not tokens.size:
        return -1
    return int((tokens % NO_LOSS).max()) if tokens.dtype.itemsize >= 4 else int(tokens.max())


# ---------------------------------------------------------------- preparation

_WORK: tuple | None = None  # (source, tokenizer, folder, dtype, docs per shard), inherited by forked workers


def _prepare_shard(i: int) -> dict:
    source, tokenizer, folder, dtype, per = _WORK
    before = dict(source.skipped)
    pieces, lengths = [], []
    for d in range(i * per, min((i + 1) * per, len(source))):
        ids = source.tokens(d, tokenizer)  # (the on-the-fly reader's rule)
        pieces.append(np.asarray(ids, dtype=dtype))
        lengths.append(len(ids))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    stem = folder / f"shard-{i:05d}"
    for path, write in ((stem.with_suffix(".bin"), lambda f: f.write(tokens.tobytes())),
                        (stem.with_suffix(".lengths.npy"),
                         lambda f: np.save(f, np.asarray(lengths, np.int64)))):
        with replacing(path) as tmp, open(tmp, "wb") as f:
            write(f)
    skipped = {k: v - before.get(k, 0) for k, v in source.skipped.items() if v - before.get(k, 0)}
    info = {"tokens": int(tokens.size), "crc": zlib.crc32(tokens.tobytes()), "skipped": skipped,
            "max_id": largest_id(tokens)}
    _write_json(stem.with_suffix(".json"), info)
    return info


def _shard_done(folder: Path, i: int) -> dict | None:
    stem = folder / f"shard-{i:05d}"
    if not all(stem.with_suffix(s).is_file() for s in (".json", ".bin", ".lengths.npy")):
        return None
    try:
        info = json.loads(stem.with_suffix(".json").read_text())
    except ValueError:
        return None
    return info if isinstance(info, dict) and "max_id" in info else None  # else redone (older layout)


def _ignore_interrupts() -> None:
    """Pool workers leave Ctrl-C to the parent, which stops them: one message, not one per worker."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _remove_partial_writes(folder: Path) -> None:
    """Shard files whose write never finished (``replacing``'s temporary files): never read; a
    rerun writes those shards again."""
    for tmp in folder.glob("shard-*.tmp"):
        tmp.unlink(missing_ok=True)


def n_shards(n_documents: int, docs_per_shard: int) -> int:
    return max(1, -(-n_documents // docs_per_shard))


def prepare(source, tokenizer, folder: Path, processes: int, docs_per_shard: int,
            quiet: bool = False) -> dict:
    """Tokenize ``source`` into ``folder``; shards already written by an interrupted run are kept.
    Progress goes to stderr unless ``quiet``. Interrupted (Ctrl-C), it leaves the shards it
    finished, and a rerun goes on from them."""
    global _WORK
    folder.mkdir(parents=True, exist_ok=True)
    window = getattr(source, "window", 0)  # a chat source's: its documents are windows, masks in bit 31
    identity = {"format": FORMAT, "source": source.name, "documents": source.fingerprint(),
                "tokenizer": tokenizer.fingerprint, "n_documents": len(source),
                "docs_per_shard": docs_per_shard,
                "dtype": "uint16" if tokenizer.n_words <= 2 ** 16 and not window else "uint32"}
    if window:
        identity["window"] = window
    plan = folder / PLAN
    if _format_of(plan) == FORMAT and json.loads(plan.read_text()) != identity:
        raise ConfigError(f"--out {folder} holds a preparation of another corpus, tokenizer or "
                          f"--docs-per-shard ({plan}); choose another --out or delete that folder")
    _write_json(plan, identity)
    count = n_shards(len(source), docs_per_shard)
    shards: list[dict | None] = [_shard_done(folder, i) for i in range(count)]
    todo = [i for i, s in enumerate(shards) if s is None]
    if len(todo) < count and not quiet:
        print(f"prepare-data: resuming, {count - len(todo)} of {count} shards already written",
              file=sys.stderr, flush=True)
    _WORK = (source, tokenizer, folder, np.dtype(identity["dtype"]), docs_per_shard)
    started, tokens, drawn = time.perf_counter(), 0, False
    pool = (mp.get_context("fork").Pool(processes, initializer=_ignore_interrupts)
            if processes > 1 and len(todo) > 1 else _Serial())
    try:
        with pool:
            for done, (i, info) in enumerate(zip(todo, pool.imap(_prepare_shard, todo)), 1):
                shards[i], tokens = info, tokens + info["tokens"]
                if not quiet:  # one line, redrawn: shards done, tokens, rate
                    rate = tokens / max(time.perf_counter() - started, 1e-9) / 1e6
                    drawn = done < len(todo)
                    print(f"\rprepare-data: {done}/{len(todo)} shards, {tokens:,} tokens, "
                          f"{rate:.2f}M tokens/s",
                          end="" if drawn else "\n", file=sys.stderr, flush=True)
    except KeyboardInterrupt:
        # The pool's exit terminated its workers (SIGTERM, no clean-up of their own): a shard
        # being written when its worker died is left as a temporary file.
        _remove_partial_writes(folder)
        if drawn:  # the message that follows starts on a line of its own
            print(file=sys.stderr, flush=True)
        raise
    finally:
        _WORK = None
    skipped: dict[str, int] = {}
    for s in shards:
        for k, v in s["skipped"].items():
            skipped[k] = skipped.get(k, 0) + v
    manifest = {**identity, "shards": shards, "n_tokens": sum(s["tokens"] for s in shards),
                "max_id": max(s["max_id"] for s in shards), "skipped": skipped}
    _write_json(folder / MANIFEST, manifest)
    return manifest


class _Serial:
    """A pool of one: the work in this process (no fork for a small corpus or --processes 1)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def imap(self, fn, items):
        return map(fn, items)
