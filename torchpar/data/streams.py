"""One source's stream of training windows, and the mixture that interleaves several sources.

A source's documents (in source order in epoch 0, reshuffled in each later epoch) are dealt to
``lanes`` interleaved readers; lane j reads every lanes-th document of the epoch's order, as
BOS + text + EOS back to back, and cuts windows of ``seq_len + 1`` tokens. Window k of the source
is lane (k mod lanes)'s (k div lanes)-th window, so a batch mixes many documents. Two readers
produce the same windows:

- :class:`TextStream` tokenizes as it goes, so reaching window k means reading every window
  before it (every rank walks the whole stream);
- :class:`TokenStream` reads a prepared corpus whose document lengths it knows, so it finds
  window k arithmetically and reads only the windows asked for.

A lane's position is (epoch, index in the lane's documents, token offset) where its next window
starts; both readers report it alike, so a position saved by one resumes in the other.
"""

from __future__ import annotations

import bisect
import math
from fractions import Fraction

import numpy as np

from torchpar.errors import ConfigError


def _keys(seed: int, epoch: int, count: int) -> list[int]:
    """``count`` 64-bit keys from (seed, epoch): splitmix64 steps."""
    state, out = (seed * 0x9E3779B97F4A7C15 + epoch * 0xD1B54A32D192ED03) % 2 ** 64, []
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) % 2 ** 64
        z = ((state ^ (state >> 30)) * 0xBF58476D1CE4E5B9) % 2 ** 64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2 ** 64
        out.append(z ^ (z >> 31))
    return out


def _mix(x: np.ndarray, keys: np.ndarray, bits: int) -> np.ndarray:
    """A keyed bijection of [0, 2**bits), in place: rounds of XOR with a key, multiplication by an
    odd key and an xorshift, each invertible modulo 2**bits."""
    mask, shift = np.uint64((1 << bits) - 1), np.uint64(max(1, bits // 2))
    for add, mul in keys.reshape(-1, 2):
        x ^= add & mask
        np.multiply(x, mul | np.uint64(1), out=x)
        x &= mask
        x ^= x >> shift
    return x


def lane_size(n: int, lane: int, lanes: int) -> int:
    """How many documents a lane reads per epoch: every lanes-th, or all when it has none of its
    own (more lanes than documents)."""
    return len(range(lane, n, lanes)) if lane < n else n


def lane_docs(n: int, seed: int, epoch: int, wanted: list[int], lanes: int) -> list[np.ndarray]:
    """The documents each ``wanted`` lane reads in an epoch, in order: every ``lanes``-th place of
    the epoch's order (with more lanes than documents, lanes share them all). The order is the
    source's own (already seeded) in epoch 0, then a permutation by (seed, epoch) that gives any
    place's document directly (a keyed bijection, cycle-walked into range): a reader computes only
    its lanes' documents, so an epoch costs it its lanes' share of the corpus, not all of it."""
    places = [np.arange(j, n, lanes, dtype=np.int64) if j < n else np.arange(n, dtype=np.int64)
              for j in wanted]
    if not epoch:
        return places
    bits = max(1, (n - 1).bit_length())
    keys = np.array(_keys(seed, epoch, 6), dtype=np.uint64)
    docs = _mix(np.concatenate(places).astype(np.uint64), keys, bits)  # all lanes in one pass
    walking = np.flatnonzero(docs >= n)
    while walking.size:  # a bijection of [0, 2**bits) applied again until it lands in [0, n)
        docs[walking] = moved = _mix(docs[walking], keys, bits)
        walking = walking[moved >= n]
    return np.split(docs.astype(np.int64), np.cumsum([len(p) for p in places])[:-1])


def no_tokens(source: str) -> str:
    return f"{source}: its documents are all empty; choose a corpus with text (data.dataset / data.path)"


class TextStream:
    """Windows of a text source, tokenized as they are read."""

    def __init__(self, source, tokenizer, window: int, seed: int, lanes: int, position: dict):
        self.source, self.tokenizer = source, tokenizer
        self.window, self.seed, self.lanes = window, seed, lanes
        self.k = position["windows"]
        self.lane_pos = [list(p) for p in position["lanes"]]
        self.readers = [self._lane(j, *self.lane_pos[j]) for j in range(lanes)]

    def _tokens(self, docs, i: int) -> list[int]:
        return self.source.tokens(int(docs[i]), self.tokenizer)

    def _lane(self, lane: int, epoch: int, doc: int, offset: int):
        """Yield (window, (epoch, doc, offset) after it) forever from one lane."""
        docs = lane_docs(len(self.source), self.seed, epoch, [lane], self.lanes)[0]
        tokens, empty = self._tokens(docs, doc), 0
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
                        docs = lane_docs(len(self.source), self.seed, epoch, [lane], self.lanes)[0]
                    tokens = self._tokens(docs, doc)
                    empty = 0 if tokens else empty + 1
                    if empty > 10 * len(self.source):  # else it would wait forever for a token
                        raise ConfigError(no_tokens(self.source.name))
            yield out, (epoch, doc, offset)

    def take(self, count: int, keep, owner: tuple[int, int] = (0, 1)) -> dict[int, np.ndarray]:
        """The next ``count`` windows; returns those whose offset (0..count-1) is in ``keep``.
        ``owner`` = (w, n): only lanes j with j mod n = w are read (one of n loader workers)."""
        out = {}
        for i in range(count):
            j = self.k % self.lanes
            self.k += 1
            if j % owner[1] != owner[0]:
                continue
            window, self.lane_pos[j] = next(self.readers[j])
            if i in keep:
                out[i] = np.asarray(window, dtype=np.int64)
        return out

    def position(self) -> dict:
        return {"windows": self.k, "lanes": [list(p) for p in self.lane_pos]}


class TokenStream:
    """Windows of a prepared corpus, each read directly: the cost of a window does not depend on
    how many windows come before it (or on how many ranks share the stream)."""

    def __init__(self, corpus, window: int, seed: int, lanes: int, position: dict):
        self.corpus, self.window, self.seed, self.lanes = corpus, window, seed, lanes
        if not corpus.lengths.any():
            raise ConfigError(no_tokens(corpus.name))
        # The last explicit position (a resume's; the "anchor" of a later lazy one): each lane's
        # (epoch, document, offset) at k0, turned into lane tokens when the lane is first read, so
        # that after a resume with another window length lane j's m-th window starts at
        # base[j] + (m - windows it had given at k0) x window. None: every window had this length.
        anchor = position.get("anchor") or position
        self.k0, self.saved, self._base = anchor["windows"], anchor["lanes"], {}
        if self.k0 == 0 and self.saved is not None and not any(map(any, self.saved)):
            self.saved = None
        self.k = position["windows"]
        # Per lane, and only for the lanes this rank reads: its documents and their end offsets in
        # its last two epochs, and the lane token where each epoch starts.
        self._lanes: list[dict[int, tuple]] = [{} for _ in range(lanes)]
        self._starts: list[list[int]] = [[0] for _ in range(lanes)]

    def _lane(self, e: int, lane: int) -> tuple[np.ndarray, np.ndarray]:
        """The lane's documents in epoch ``e`` and the lane token where each ends."""
        if e not in self._lanes[lane]:
            # The lanes this reader uses that reach epoch e next are computed in one pass.
            wanted = [j for j, c in enumerate(self._lanes) if j == lane or (c and max(c) == e - 1)]
            for j, docs in zip(wanted, lane_docs(len(self.corpus), self.seed, e, wanted, self.lanes)):
                cache = self._lanes[j]
                if len(cache) >= 2:
                    del cache[min(cache)]
                cache[e] = docs, np.cumsum(self.corpus.lengths[docs])
        return self._lanes[lane][e]

    def _doc_start(self, docs: np.ndarray, ends: np.ndarray, i: int) -> int:
        """The lane token (within its epoch) where the lane's i-th document starts."""
        return int(ends[i]) - int(self.corpus.lengths[docs[i]])

    def _epoch_start(self, lane: int, e: int) -> int:
        starts = self._starts[lane]
        while len(starts) <= e:
            # A lane whose documents are all empty in an epoch skips it, as the text reader does.
            starts.append(starts[-1] + int(self._lane(len(starts) - 1, lane)[1][-1]))
        return starts[e]

    def _locate(self, lane: int, p: int) -> tuple[int, int, int, int]:
        """The lane's token ``p``: (epoch, token within it, index of the document holding it in the
        lane's documents, the token where that document starts)."""
        starts = self._starts[lane]
        while p >= starts[-1]:
            self._epoch_start(lane, len(starts))  # the start of one more epoch
        e = bisect.bisect_right(starts, p) - 1
        q = p - starts[e]
        docs, ends = self._lane(e, lane)
        i = int(np.searchsorted(ends, q, side="right"))
        return e, q, i, self._doc_start(docs, ends, i)

    @staticmethod
    def _given(lane: int, k: int, lanes: int) -> int:
        """Windows lane ``lane`` has given when the stream has given ``k``."""
        return max(0, -(-(k - lane) // lanes))

    def _token(self, lane: int, m: int) -> int:
        """Where the lane's m-th window starts, in lane tokens."""
        if lane not in self._base:
            if self.saved is None:  # every window so far had this length
                self._base[lane] = self._given(lane, self.k0, self.lanes) * self.window
            else:
                e, d, o = self.saved[lane]
                docs, ends = self._lane(e, lane)
                self._base[lane] = self._epoch_start(lane, e) + self._doc_start(docs, ends, d) + o
        return self._base[lane] + (m - self._given(lane, self.k0, self.lanes)) * self.window

    def _read(self, k: int) -> np.ndarray:
        lane = k % self.lanes
        epoch, q, i, _ = self._locate(lane, self._token(lane, k // self.lanes))
        pieces, need = [], self.window
        while need:
            docs, ends = self._lane(epoch, lane)
            while need and i < len(ends):
                start = self._doc_start(docs, ends, i)
                take = min(int(ends[i]) - q, need)
                pieces.append(self.corpus.tokens(int(docs[i]), q - start, q - start + take))
                need, q, i = need - take, q + take, i + 1
            epoch, q, i = epoch + 1, 0, 0
        return np.concatenate(pieces).astype(np.int64)

    def take(self, count: int, keep, owner: tuple[int, int] = (0, 1)) -> dict[int, np.ndarray]:
        out = {i: self._read(self.k + i) for i in sorted(keep) if i < count}  # (keep is this owner's)
        self.k += count
        return out

    def _lane_position(self, lane: int) -> list[int]:
        """Where the lane's next window starts, as :class:`TextStream` counts it: the document
        after the last one read from once it is finished."""
        p = self._token(lane, self._given(lane, self.k, self.lanes))  # tokens the lane has given
        if p == 0:
            return [0, 0, 0]
        epoch, q, i, start = self._locate(lane, p - 1)
        docs, ends = self._lane(epoch, lane)
        if q + 1 < ends[i]:
            return [epoch, i, q + 1 - start]
        return [epoch + 1, 0, 0] if i + 1 == len(docs) else [epoch, i + 1, 0]

    def position(self, lanes: bool = False) -> dict:
        """Lanes cost a search each: they are worked out only for a position that is saved (from
        this one, which names its anchor, by another stream)."""
        if lanes:
            return {"windows": self.k, "lanes": [self._lane_position(j) for j in range(self.lanes)]}
        if self.saved is None:
            return {"windows": self.k, "lanes": None}
        return {"windows": self.k, "lanes": None, "anchor": {"windows": self.k0, "lanes": self.saved}}


class Mixture:
    """Which source global window g comes from. Weights become exact integer counts per period of
    ``period`` windows (70/30 -> 7 and 3 in every 10), spread evenly inside it, so the mixture is
    exact over every period and window g's source and its index in that source are arithmetic."""

    def __init__(self, weights: list[float]):
        rounded = [Fraction(w / sum(weights)).limit_denominator(10 ** 4) for w in weights]
        if not all(rounded):
            raise ConfigError(f"data.sources weights {weights}: each must be at least 1/10000 of their sum")
        shares = [f / sum(rounded) for f in rounded]
        self.period = math.lcm(*(s.denominator for s in shares))
        if self.period > 10 ** 6:
            raise ConfigError(f"data.sources weights {weights} need a period of {self.period} windows to be "
                              "exact; round them (e.g. to percent)")
        self.counts = [int(s * self.period) for s in shares]
        self.slot_source, self.slot_index = [], []  # per slot of the period: source, its index there
        before = [0] * len(weights)
        for i in range(self.period):  # each slot to the source furthest behind its share
            s = max(range(len(weights)),
                    key=lambda s: ((i + 1) * self.counts[s] - before[s] * self.period, -s))
            self.slot_source.append(s)
            self.slot_index.append(before[s])
            before[s] += 1
        self.prefix = np.zeros((len(weights), self.period + 1), dtype=np.int64)
        for i, s in enumerate(self.slot_source):
            self.prefix[:, i + 1] = self.prefix[:, i]
            self.prefix[s, i + 1] += 1

    def locate(self, g: int) -> tuple[int, int]:
        """(source, index of the window in that source) of global window g."""
        cycle, slot = divmod(g, self.period)
        s = self.slot_source[slot]
        return s, cycle * self.counts[s] + self.slot_index[slot]

    def before(self, g: int) -> list[int]:
        """How many of the first g global windows each source gave."""
        cycle, slot = divmod(g, self.period)
        return [cycle * c + int(self.prefix[s, slot]) for s, c in enumerate(self.counts)]
