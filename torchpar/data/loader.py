"""This rank's training windows of the global stream, resumable under any layout.

The global stream is one source's windows (see :mod:`torchpar.data.streams`), or several
sources' interleaved by a :class:`Mixture`. Windows are dealt out in groups of
``local_batch_size x dp_degree``: rank r takes the r-th run of ``local_batch_size`` windows of
each group. So a micro-step of the whole job always covers the same consecutive windows,
whatever the layout, and no window is seen twice or skipped. From a prepared corpus a rank reads
only its own windows; from text it tokenizes the whole stream to find them.

The position is kept in global terms — windows consumed, and per source its windows consumed and
each lane's (epoch, document, token offset) — identical on every rank, so it can be restored under
another data-parallel degree, another number of loader workers, or the other reader of the same
corpus. :class:`WindowLoader`'s ``state_dict`` is that position (not StatefulDataLoader's
per-worker snapshot).
"""

from __future__ import annotations

import warnings

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchpar.data.streams import Mixture, TextStream, TokenStream, lane_size
from torchpar.data.tokenized import TokenizedCorpus
from torchpar.errors import ConfigError
from torchpar.loss import token_ids
from torchpar.tokenizer import Tokenizer


def as_list(sources) -> list:
    """One source, or a mixture's list of them, as a list."""
    return list(sources) if isinstance(sources, (list, tuple)) else [sources]


class PackedWindows(IterableDataset):
    """This rank's windows of the global stream: ``sources`` (one, or several mixed by ``weights``),
    each a text source read through :class:`TextStream` or a prepared corpus through :class:`TokenStream`."""

    def __init__(self, sources, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int, lanes: int = 64,
                 weights: list[float] | None = None):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_degree - 1}")
        self.sources = as_list(sources)
        self.mixture = Mixture(weights or [1.0] * len(self.sources))
        self.tokenizer, self.window = tokenizer, seq_len + 1
        self.local_batch_size, self.dp_rank, self.dp_degree, self.seed = (local_batch_size, dp_rank,
                                                                          dp_degree, seed)
        self.lanes = lanes
        self.position = {"windows_consumed": 0, "source_tokens": [0] * len(self.sources),
                         "sources": [{"windows": 0, "lanes": [[0, 0, 0] for _ in range(lanes)]}
                                     for _ in self.sources]}

    def _streams(self, pos: dict) -> list:
        return [TokenStream(src, self.window, self.seed, self.lanes, p) if isinstance(src, TokenizedCorpus)
                else TextStream(src, self.tokenizer, self.window, self.seed, self.lanes, p)
                for src, p in zip(self.sources, pos["sources"])]

    def __iter__(self):
        """This rank's batches [local_batch, seq_len + 1]. In a loader worker, for each step the
        rows from the lanes it owns (lane mod workers = its id) with their places in the batch:
        each worker tokenizes or reads only its lanes, and :class:`WindowLoader` joins the parts."""
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info else (1, 0)
        group, b = self.local_batch_size * self.dp_degree, self.local_batch_size
        pos = dict(self.position)
        streams, g = self._streams(pos), pos["windows_consumed"]
        tokens = list(pos["source_tokens"])
        while True:
            first = self.mixture.before(g)
            counts = [n - f for n, f in zip(self.mixture.before(g + group), first)]
            wanted = [self.mixture.locate(g + self.dp_rank * b + i) for i in range(b)]
            places = [i for i, (_, k) in enumerate(wanted) if k % self.lanes % n_workers == worker]
            keep = [{wanted[i][1] - first[s] for i in places if wanted[i][0] == s}
                    for s in range(len(streams))]
            got = [stream.take(n, kept, (worker, n_workers))
                   for stream, n, kept in zip(streams, counts, keep)]
            g += group
            tokens = [t + n * (self.window - 1) for t, n in zip(tokens, counts)]
            self.position = {"windows_consumed": g, "sources": [s.position() for s in streams],
                             "source_tokens": tokens}
            rows = [got[s][k - first[s]] for s, k in (wanted[i] for i in places)]
            rows = torch.from_numpy(np.stack(rows) if rows else np.zeros((0, self.window), np.int64))
            yield rows if info is None else (torch.tensor(places, dtype=torch.long), rows)

    def state_dict(self) -> dict:
        return dict(self.position)

    def with_lanes(self, state: dict) -> dict:
        """``state`` with each prepared source's lane positions worked out, as a checkpoint keeps
        them (so that the text reader of the same corpus can resume it too)."""
        def full(src, p):
            if p["lanes"] is not None:
                return p
            return TokenStream(src, self.window, self.seed, self.lanes, p).position(lanes=True)

        return {**state, "sources": [full(src, p) for src, p in zip(self.sources, state["sources"])]}

    def load_state_dict(self, state: dict) -> None:
        if "lanes" in state:  # saved by a single-source version: the one source's position
            state = {"windows_consumed": state["windows_consumed"], "source_tokens": [0],
                     "sources": [{"windows": state["windows_consumed"], "lanes": state["lanes"]}]}
        state = self.with_lanes(state) if len(state["sources"]) == len(self.sources) else state
        sources = [{"windows": int(p["windows"]), "lanes": [[int(x) for x in lane] for lane in p["lanes"]]}
                   for p in state["sources"]]
        for src, p in zip(self.sources, sources):
            n = len(src)
            bad = [j for j, (_, doc, _) in enumerate(p["lanes"]) if doc >= lane_size(n, j, self.lanes)]
            if len(sources) != len(self.sources) or len(p["lanes"]) != self.lanes or bad:
                raise ConfigError(
                    f"the saved data position ({len(sources)} source(s), {len(p['lanes'])} lanes) does not "
                    f"fit {src.name} ({n} documents) in data.lanes = {self.lanes}; set "
                    "data.resume_position = false to read it from its start")
        self.position = {"windows_consumed": int(state["windows_consumed"]), "sources": sources,
                         "source_tokens": [int(t) for t in state["source_tokens"]]}


def document_ids(tokens: torch.Tensor, bos_id: int) -> torch.Tensor:
    """Each token's document inside its packed window [b, s]: every document starts with BOS (text
    never encodes to it; a chat prompt's BOS carries the NO_LOSS bit), and the tokens before a
    window's first BOS belong to document 0."""
    return (token_ids(tokens) == bos_id).cumsum(dim=1)


def data_identity(sources, tokenizer: Tokenizer, seq_len: int, global_batch: int, lanes: int,
                  weights: list[float] | None = None) -> dict:
    """What a saved data position depends on; every checkpoint's manifest records it. A prepared
    corpus reports the source it was made from, so either reader resumes the other's position."""
    sources = as_list(sources)
    if len(sources) == 1:
        source, documents = sources[0].name, sources[0].fingerprint()
    else:
        source = " + ".join(f"{w:g} x {s.name}" for s, w in zip(sources, weights))
        documents = "; ".join(s.fingerprint() for s in sources)
    return {"source": source, "documents": documents, "tokenizer": tokenizer.fingerprint,
            "lanes": lanes, "seq_len": seq_len, "global_batch": global_batch}


def resume_notes(saved: dict | None, now: dict, resume_position: bool) -> list[str]:
    """Resuming under changed data settings: a line for each change that the saved position
    survives (sequence length, batch size), ConfigError for one it cannot (another corpus,
    tokenizer or number of lanes: its document indices and token offsets would mean nothing)."""
    if not resume_position:
        return ["data.resume_position = false: the data is read from its start"]
    if saved is None:  # written before checkpoints recorded it: load_state_dict still checks the range
        return []
    fields = {"source": ("corpus", "data.dataset / data.path"),
              "documents": ("corpus", "data.dataset / data.path"),
              "tokenizer": ("tokenizer", "model.tokenizer_path"), "lanes": ("number of lanes", "data.lanes")}
    for key, (what, field) in fields.items():
        if saved[key] != now[key]:
            raise ConfigError(
                f"{field}: the checkpoint's data position is in another {what} ({saved[key]} there, "
                f"{now[key]} here) and cannot apply; set data.resume_position = false to read the data from "
                "its start (the model, optimizer and step are still restored)"
            )
    notes = []
    if saved["seq_len"] != now["seq_len"]:
        notes.append(f"training.seq_len {saved['seq_len']} -> {now['seq_len']} since the checkpoint: each "
                     "lane goes on from its saved document and token, in windows of the new length")
    if saved["global_batch"] != now["global_batch"]:
        notes.append(f"global batch {saved['global_batch']} -> {now['global_batch']} sequences since the "
                     "checkpoint: the data goes on at the first unread window, each step now taking "
                     f"{now['global_batch']}")
    return notes


class WindowLoader(StatefulDataLoader):
    """A StatefulDataLoader whose state is the global stream position after the last batch it
    yielded; ``load_state_dict`` takes effect at the next ``iter()``. With worker processes it joins
    each step's parts (one per worker, in worker order) into the batch. ``pin_batches``: batches in
    page-locked memory (the joined batch with workers, else the loader's own pinning)."""

    def __init__(self, dataset: PackedWindows, pin_batches: bool = False, **kwargs):
        with warnings.catch_warnings():
            # torchdata 0.11 calls torch.set_vital, which torch deprecates: a line in every run
            # that no user can act on.
            warnings.filterwarnings("ignore", message="'set_vital' is deprecated", category=UserWarning)
            super().__init__(dataset, pin_memory=pin_batches and not kwargs.get("num_workers"), **kwargs)
        self.pin_batches = pin_batches

    def __iter__(self):
        parts = super().__iter__()
        if not self.num_workers:
            yield from parts
            return
        b = self.dataset.local_batch_size
        while True:
            # Joined in numpy: a torch op here would wake the intra-op thread pool, whose spinning
            # threads take the CPU the workers need.
            batch = np.empty((b, self.dataset.window), dtype=np.int64)
            for places, rows in (next(parts) for _ in range(self.num_workers)):
                batch[places.numpy()] = rows.numpy()
            yield torch.from_numpy(batch).pin_memory() if self.pin_batches else torch.from_numpy(batch)

    def position(self) -> dict:
        """The position after the last batch yielded, without the prepared sources' lane
        positions (see :meth:`state_dict`): windows consumed, per source, tokens per source."""
        if self._iterator is None:  # nothing iterated (making an iterator here would fork workers)
            return self.dataset.state_dict()
        sd = super().state_dict()
        if "_snapshot" not in sd:
            return sd.get("dataset_state") or self.dataset.state_dict()
        # Workers: all are at the same step; each knows the lanes it owns.
        snapshots = sd["_snapshot"]["_worker_snapshots"]
        states = [snapshots[f"worker_{w}"]["dataset_state"] for w in range(len(snapshots))]
        merged = dict(states[0])
        merged["sources"] = [
            {**p, "lanes": None if p["lanes"] is None else
             [states[j % len(states)]["sources"][s]["lanes"][j] for j in range(len(p["lanes"]))]}
            for s, p in enumerate(states[0]["sources"])]
        return merged

    def state_dict(self) -> dict:
        return self.dataset.with_lanes(self.position())

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)
        # The next iter() starts from it in fresh workers: an iterator made before (a state_dict()
        # call makes one) has forked its workers with the old position.
        self._iterator, self._initial_iter_for_state_dict = None, False


def build_dataloader(
    sources,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    num_workers: int = 0,
    lanes: int = 64,
    pin_memory: bool = False,
    weights: list[float] | None = None,
) -> WindowLoader:
    """``sources``: one source or a mixture's list, with ``weights``. ``pin_memory``: batches in
    page-locked memory, so the copy to a GPU can overlap compute."""
    ds = PackedWindows(sources, tokenizer, seq_len, local_batch_size, dp_rank, dp_degree, seed, lanes,
                       weights)
    return WindowLoader(ds, pin_batches=pin_memory, batch_size=None, num_workers=num_workers,
                        persistent_workers=False, multiprocessing_context="fork" if num_workers else None)
