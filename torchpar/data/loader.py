"""Packing documents into training windows, sharded over data-parallel ranks, resumable.

Every rank walks the same global stream. Documents (in source order, reshuffled each epoch) are
dealt to ``lanes`` interleaved readers; each lane tokenizes its documents as BOS + text + EOS,
concatenates them and cuts non-overlapping windows of ``seq_len + 1`` tokens, and window i of
the stream comes from lane i mod lanes — so a batch mixes many files instead of walking one
long file for dozens of steps. Windows are dealt out in groups of ``local_batch_size x dp_degree``:
rank r takes the r-th run of ``local_batch_size`` windows of each group. So a micro-step of the
whole job always covers the same consecutive windows, whatever the layout, and no window is
seen twice or skipped.

The position is kept in global terms — windows consumed, and each lane's (epoch, document,
token offset) where its next window starts — identical on every rank, so it can be restored under
another data-parallel degree or another number of loader workers. :class:`WindowLoader`'s
``state_dict`` is that position (not StatefulDataLoader's per-worker snapshot).
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchpar.config import ConfigError
from torchpar.data.sources import DocumentSource
from torchpar.tokenizer import Tokenizer


class PackedWindows(IterableDataset):
    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int, lanes: int = 64):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_degree - 1}")
        self.source, self.tokenizer = source, tokenizer
        self.window = seq_len + 1
        self.local_batch_size, self.dp_rank, self.dp_degree, self.seed = (local_batch_size, dp_rank,
                                                                          dp_degree, seed)
        self.lanes = lanes
        self.position = {"windows_consumed": 0, "lanes": [[0, 0, 0] for _ in range(lanes)]}

    # -- global stream ------------------------------------------------------------------

    def _lane_docs(self, lane: int, epoch: int) -> list[int]:
        """Lane ``lane`` reads every ``lanes``-th document of the epoch's order."""
        order = list(range(len(self.source)))
        if epoch:  # epoch 0 keeps the source's own (already seeded) order
            random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order[lane::self.lanes] or order  # more lanes than documents: lanes share them

    def _tokens(self, docs: list[int], i: int) -> list[int]:
        text = self.source[docs[i]]
        return self.tokenizer.encode(text) if text.strip() else []

    def _lane_windows(self, lane: int, epoch: int, doc: int, offset: int):
        """Yield (window, (epoch, doc, offset) after it) forever from one lane."""
        docs = self._lane_docs(lane, epoch)
        tokens = self._tokens(docs, doc)
        while True:
            out: list[int] = []
            while len(out) < self.window:
                take = tokens[offset: offset + self.window - len(out)]
                out += take
                offset += len(take)
                if offset >= len(tokens):
                    doc, offset = doc + 1, 0
                    if doc == len(docs):
                        epoch, doc = epoch + 1, 0
                        docs = self._lane_docs(lane, epoch)
                    tokens = self._tokens(docs, doc)
            yield out, (epoch, doc, offset)

    def _windows(self, pos: dict):
        """The global stream: window i comes from lane i mod lanes. Yields (window, position after it)."""
        lanes = [list(p) for p in pos["lanes"]]
        consumed = pos["windows_consumed"]
        streams = [self._lane_windows(j, *lanes[j]) for j in range(self.lanes)]
        while True:
            j = consumed % self.lanes
            window, lanes[j] = next(streams[j])
            consumed += 1
            yield window, {"windows_consumed": consumed, "lanes": [list(p) for p in lanes]}

    # -- this rank's share --------------------------------------------------------------

    def __iter__(self):
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info else (1, 0)
        group = self.local_batch_size * self.dp_degree
        lo = self.dp_rank * self.local_batch_size
        start = self.position["windows_consumed"]
        mine: list[list[int]] = []
        for i, (window, pos) in enumerate(self._windows(dict(self.position))):
            k = i % group
            if lo <= k < lo + self.local_batch_size:
                mine.append(window)
            if k == group - 1:
                # Workers take whole groups in turn, counted from where this iteration started
                # (the loader asks worker 0 first); it interleaves them back in order.
                group_index = (pos["windows_consumed"] - start) // group - 1
                self.position = pos
                if group_index % n_workers == worker:
                    yield torch.tensor(mine, dtype=torch.long)  # [local_batch, seq_len + 1]
                mine = []

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        lanes = [[int(x) for x in lane] for lane in state["lanes"]]
        n = len(self.source)
        # Documents per lane (order[lane::lanes], or every document when that is empty).
        bad = [j for j, (_, doc, _) in enumerate(lanes) if doc >= (len(range(j, n, self.lanes)) or n)]
        if len(lanes) != self.lanes or bad:
            raise ConfigError(
                f"the saved data position ({len(lanes)} lanes) does not fit this corpus of {n} documents "
                f"in data.lanes = {self.lanes}; set data.resume_position = false to read it from its start"
            )
        self.position = {"windows_consumed": int(state["windows_consumed"]), "lanes": lanes}


def data_identity(source: DocumentSource, tokenizer: Tokenizer, seq_len: int, global_batch: int,
                  lanes: int) -> dict:
    """What a saved data position depends on; every checkpoint's manifest records it."""
    return {"source": source.name, "documents": source.fingerprint(), "tokenizer": tokenizer.fingerprint,
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
    yielded; ``load_state_dict`` takes effect at the next ``iter()``."""

    def state_dict(self) -> dict:
        sd = super().state_dict()
        if "_snapshot" in sd:  # worker processes: each reports where its own last group ended
            states = [w["dataset_state"] for w in sd["_snapshot"]["_worker_snapshots"].values()]
        else:
            states = [sd.get("dataset_state")]
        states = [st for st in states if st] or [self.dataset.state_dict()]
        return dict(max(states, key=lambda st: st["windows_consumed"]))

    def load_state_dict(self, state: dict) -> None:
        self.dataset.load_state_dict(state)


def build_dataloader(
    source: DocumentSource,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    seed: int,
    num_workers: int = 0,
    lanes: int = 64,
    pin_memory: bool = False,
) -> WindowLoader:
    """``pin_memory``: batches in page-locked memory, so the copy to a GPU can overlap compute."""
    ds = PackedWindows(source, tokenizer, seq_len, local_batch_size, dp_rank, dp_degree, seed, lanes)
    return WindowLoader(ds, batch_size=None, num_workers=num_workers, pin_memory=pin_memory,
                        persistent_workers=False, multiprocessing_context="fork" if num_workers else None)
