"""Pre-tokenized corpora: ``torchpar prepare-data`` writes one, the loader reads it.

A prepared folder holds
  shard-00000.bin           the tokens of documents [0, D) back to back, each BOS + text + EOS
                            (uint16 when the vocabulary fits, else uint32; ``numpy.memmap``-readable)
  shard-00000.lengths.npy   those documents' token counts (int64; 0 = an empty document)
  shard-00000.json          the shard's token count, CRC32 and skipped documents: written last, so
                            a shard without it is redone when an interrupted preparation resumes
  prepare.json              what is being prepared (a resumed preparation must match it)
  manifest.json             written last of all: totals and the fingerprints of the source and
                            the tokenizer (the same ones the on-the-fly path records)
Shards cut the document list at fixed indices, so the bytes do not depend on the number of processes.
A reader keeps the lengths and offsets (16 bytes per document) and maps the shards: the corpus
itself stays on disk and in the page cache.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import sys
import time
import zlib
from collections import OrderedDict
from pathlib import Path

import numpy as np

from torchpar.config import ConfigError

FORMAT = "torchpar-tokens/1"
OPEN_SHARDS = 128  # shard files a reader keeps open
MANIFEST = "manifest.json"


def is_prepared(path: str) -> bool:
    manifest = Path(path).expanduser() / MANIFEST
    return manifest.is_file() and json.loads(manifest.read_text()).get("format") == FORMAT


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    os.replace(tmp, path)


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
        self.manifest, self.name, self.tokenizer = m, m["source"], m["tokenizer"]
        self.skipped: dict[str, int] = m["skipped"]
        dtype, per = np.dtype(m["dtype"]), m["docs_per_shard"]
        self.lengths = np.concatenate([np.load(self.folder / f"shard-{i:05d}.lengths.npy")
                                       for i in range(len(m["shards"]))])
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


# ---------------------------------------------------------------- preparation

_WORK: tuple | None = None  # (source, tokenizer, folder, dtype, docs per shard), inherited by forked workers


def _prepare_shard(i: int) -> dict:
    source, tokenizer, folder, dtype, per = _WORK
    before = dict(source.skipped)
    pieces, lengths = [], []
    for d in range(i * per, min((i + 1) * per, len(source))):
        text = source[d]
        ids = tokenizer.encode(text) if text.strip() else []  # the on-the-fly path's rule
        pieces.append(np.asarray(ids, dtype=dtype))
        lengths.append(len(ids))
    tokens = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    stem = folder / f"shard-{i:05d}"
    for path, write in ((stem.with_suffix(".bin"), lambda f: f.write(tokens.tobytes())),
                        (stem.with_suffix(".lengths.npy"),
                         lambda f: np.save(f, np.asarray(lengths, np.int64)))):
        with open(f"{path}.tmp", "wb") as f:
            write(f)
        os.replace(f"{path}.tmp", path)
    skipped = {k: v - before.get(k, 0) for k, v in source.skipped.items() if v - before.get(k, 0)}
    info = {"tokens": int(tokens.size), "crc": zlib.crc32(tokens.tobytes()), "skipped": skipped}
    _write_json(stem.with_suffix(".json"), info)
    return info


def _shard_done(folder: Path, i: int) -> dict | None:
    stem = folder / f"shard-{i:05d}"
    if not all(stem.with_suffix(s).is_file() for s in (".json", ".bin", ".lengths.npy")):
        return None
    return json.loads(stem.with_suffix(".json").read_text())


def prepare(source, tokenizer, folder: Path, processes: int, docs_per_shard: int,
            quiet: bool = False) -> dict:
    """Tokenize ``source`` into ``folder``; shards already written by an interrupted run are kept.
    Progress goes to stderr unless ``quiet``."""
    global _WORK
    folder.mkdir(parents=True, exist_ok=True)
    identity = {"format": FORMAT, "source": source.name, "documents": source.fingerprint(),
                "tokenizer": tokenizer.fingerprint, "n_documents": len(source),
                "docs_per_shard": docs_per_shard,
                "dtype": "uint16" if tokenizer.n_words <= 2 ** 16 else "uint32"}
    plan = folder / "prepare.json"
    if plan.is_file() and json.loads(plan.read_text()) != identity:
        raise ConfigError(f"--out {folder} holds a preparation of another corpus, tokenizer or "
                          f"--docs-per-shard ({plan}); choose another --out or delete that folder")
    _write_json(plan, identity)
    n_shards = max(1, -(-len(source) // docs_per_shard))
    shards: list[dict | None] = [_shard_done(folder, i) for i in range(n_shards)]
    todo = [i for i, s in enumerate(shards) if s is None]
    if len(todo) < n_shards and not quiet:
        print(f"prepare-data: resuming, {n_shards - len(todo)} of {n_shards} shards already written",
              file=sys.stderr, flush=True)
    _WORK = (source, tokenizer, folder, np.dtype(identity["dtype"]), docs_per_shard)
    started, tokens = time.perf_counter(), 0
    try:
        with mp.get_context("fork").Pool(processes) if processes > 1 and len(todo) > 1 else _Serial() as pool:
            for done, (i, info) in enumerate(zip(todo, pool.imap(_prepare_shard, todo)), 1):
                shards[i], tokens = info, tokens + info["tokens"]
                if not quiet:  # one line, redrawn: shards done, tokens, rate
                    rate = tokens / max(time.perf_counter() - started, 1e-9) / 1e6
                    print(f"\rprepare-data: {done}/{len(todo)} shards, {tokens:,} tokens, "
                          f"{rate:.2f}M tokens/s",
                          end="" if done < len(todo) else "\n", file=sys.stderr, flush=True)
    finally:
        _WORK = None
    skipped: dict[str, int] = {}
    for s in shards:
        for k, v in s["skipped"].items():
            skipped[k] = skipped.get(k, 0) + v
    manifest = {**identity, "shards": shards, "n_tokens": sum(s["tokens"] for s in shards),
                "skipped": skipped}
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


def prepare_main(argv: list[str]) -> int:
    """``torchpar prepare-data``: the corpus that [data] names, tokenized once with the run's tokenizer."""
    from torchpar.config import load_config
    from torchpar.console import ArgumentParser, at_least, output_path
    from torchpar.data.sources import build_source
    from torchpar.tokenizer import Tokenizer, TokenizerError, resolve_path

    p = ArgumentParser(prog="torchpar prepare-data", description=(
        "Tokenize the corpus that the config's [data] section names (dataset, path, split, text_field; "
        "training.seed orders the stdlib corpus) with model.tokenizer_path, into shards that "
        "data.dataset = 'tokenized' with data.path = OUT reads. Resumes an interrupted run."))
    p.add_argument("--config", help="TOML job config (default: built-in defaults)")
    p.add_argument("--out", required=True, help="folder to write")
    p.add_argument("--processes", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    p.add_argument("--docs-per-shard", type=int, default=0,
                   help="documents per shard file; 0 = from the corpus size (about 64 shards, 16 to 65536 "
                        "documents each): the bytes depend on it and the corpus, never on --processes")
    args, overrides = p.parse_known_args(argv)
    at_least("--processes", args.processes, 1)
    at_least("--docs-per-shard", args.docs_per_shard, 0)
    cfg = load_config(args.config, overrides)
    if cfg.data.dataset == "tokenized":
        raise ConfigError("data.dataset = 'tokenized' is already prepared; name the raw corpus to prepare")
    try:
        tokenizer = Tokenizer(resolve_path(cfg.model.tokenizer_path))
    except TokenizerError as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
    folder = output_path("--out", args.out, folder=True)
    source = build_source(cfg.data, cfg.training.seed)
    per = args.docs_per_shard or min(max(-(-len(source) // 64), 16), 65536)
    m = prepare(source, tokenizer, folder, args.processes, per)
    print(f"prepare-data: {m['n_documents']:,} documents, {m['n_tokens']:,} tokens ({m['dtype']}) in "
          f"{len(m['shards'])} shards -> {folder}; skipped {m['skipped'] or 'none'}")
    return 0
