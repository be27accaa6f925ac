"""Packing documents into training windows, sharded over data-parallel ranks, resumable.

Every rank walks the same global stream: documents in source order (reshuffled each epoch),
each tokenized as BOS + text + EOS, concatenated and cut into non-overlapping windows of
``seq_len + 1`` tokens. Windows are dealt out in groups of ``local_batch_size x dp_degree``:
rank r takes the r-th run of ``local_batch_size`` windows of each group. So a micro-step of the
whole job always covers the same consecutive windows, whatever the layout, and no window is
seen twice or skipped.

The position is kept in global terms — windows consumed, and the (epoch, document, token
offset) where the next window starts — identical on every rank, so it can be restored under
another data-parallel degree.
"""

from __future__ import annotations

import random

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchpar.data.sources import DocumentSource
from torchpar.tokenizer import Tokenizer


class PackedWindows(IterableDataset):
    def __init__(self, source: DocumentSource, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, seed: int):
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} outside 0..{dp_degree - 1}")
        self.source, self.tokenizer = source, tokenizer
        self.window = seq_len + 1
        self.local_batch_size, self.dp_rank, self.dp_degree, self.seed = local_batch_size, dp_rank, dp_degree, seed
        self.position = {"windows_consumed": 0, "epoch": 0, "doc": 0, "offset": 0}

    # -- global stream ------------------------------------------------------------------

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.source)))
        if epoch:  # epoch 0 keeps the source's own (already seeded) order
            random.Random(self.seed * 7919 + epoch).shuffle(order)
        return order

    def _tokens(self, order: list[int], doc: int) -> list[int]:
        text = self.source[order[doc]]
        return self.tokenizer.encode(text) if text.strip() else []

    def _windows(self, pos: dict):
        """Yield (window, position after it) forever from ``pos``."""
        epoch, doc, offset, consumed = pos["epoch"], pos["doc"], pos["offset"], pos["windows_consumed"]
        order = self._order(epoch)
        tokens = self._tokens(order, doc)
        while True:
            out: list[int] = []
            while len(out) < self.window:
                take = tokens[offset: offset + self.window - len(out)]
                out += take
                offset += len(take)
                if offset >= len(tokens):
                    doc, offset = doc + 1, 0
                    if doc == len(order):
                        epoch, doc = epoch + 1, 0
                        order = self._order(epoch)
                    tokens = self._tokens(order, doc)
            consumed += 1
            yield out, {"windows_consumed": consumed, "epoch": epoch, "doc": doc, "offset": offset}

    # -- this rank's share --------------------------------------------------------------

    def __iter__(self):
        info = get_worker_info()
        n_workers, worker = (info.num_workers, info.id) if info else (1, 0)
        group = self.local_batch_size * self.dp_degree
        lo = self.dp_rank * self.local_batch_size
        mine: list[list[int]] = []
        for i, (window, pos) in enumerate(self._windows(dict(self.position))):
            k = i % group
            if lo <= k < lo + self.local_batch_size:
                mine.append(window)
            if k == group - 1:
                # Workers take whole groups in turn by the group's global index; the loader
                # interleaves them back in order.
                group_index = (pos["windows_consumed"] - group) // group
                self.position = pos
                if group_index % n_workers == worker:
                    yield torch.tensor(mine, dtype=torch.long)  # [local_batch, seq_len + 1]
                mine = []

    def state_dict(self) -> dict:
        return dict(self.position)

    def load_state_dict(self, state: dict) -> None:
        self.position = {k: int(state[k]) for k in ("windows_consumed", "epoch", "doc", "offset")}


def build_dataloader(source: DocumentSource, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                     dp_rank: int, dp_degree: int, seed: int, num_workers: int = 0) -> StatefulDataLoader:
    ds = PackedWindows(source, tokenizer, seq_len, local_batch_size, dp_rank, dp_degree, seed)
    return StatefulDataLoader(ds, batch_size=None, num_workers=num_workers,
                              persistent_workers=False, multiprocessing_context="fork" if num_workers else None)
