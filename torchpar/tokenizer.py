"""Byte-level BPE tokenizer on tiktoken, plus the small trainer that made the shipped vocabulary.

The rank file format is tiktoken's (and Llama 3's ``tokenizer.model``): one line per token,
``base64(token bytes) rank``, ranks 0..n-1, every single byte present. Special tokens follow
the mergeable ones in Llama 3's order (for its 128000-token file, its ids): BOS = n, EOS = n + 1,
and the chat template's turn markers up to <|eot_id|> = n + 9. The vocabulary a pretraining model
needs ends at EOS (``n_words``); a chat model's at the last marker its template uses.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import json
import zlib
from collections import Counter
from pathlib import Path

import regex
import tiktoken
import tokenizers

# Llama 3's pre-tokenization split pattern.
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Llama 3's special tokens, in the order of their ids after the mergeable ones (n, n + 1, ...).
SPECIALS = (BOS, EOS, "<|reserved_special_token_0|>", "<|reserved_special_token_1|>",
            "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>", "<|start_header_id|>",
            "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>")
BUILTIN = Path(__file__).parent / "assets" / "stdlib_4096.tiktoken"


class TokenizerError(ValueError):
    """A missing or malformed tokenizer file."""


def resolve_path(path: str) -> Path:
    """'builtin', a tiktoken rank file, a Hugging Face ``tokenizers`` file (tokenizer.json), or a
    model folder holding one (a Hugging Face Llama 3 folder has tokenizer.model, or
    original/tokenizer.model; a Qwen folder tokenizer.json alone): the rank file first."""
    if path == "builtin":
        return BUILTIN
    p = Path(path).expanduser()
    if not p.is_dir():
        return p
    for candidate in (p / "tokenizer.model", p / "original" / "tokenizer.model", p / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    raise TokenizerError(f"{p} is a folder without tokenizer.model or tokenizer.json; set "
                         "model.tokenizer_path to a tiktoken rank file or a tokenizers JSON file")


def load_tokenizer(path: str):
    """The tokenizer ``model.tokenizer_path`` names (:func:`resolve_path`): a :class:`Tokenizer`
    for a tiktoken rank file, an :class:`HFTokenizer` for a tokenizers JSON file."""
    p = resolve_path(path)
    return HFTokenizer(p) if p.suffix == ".json" else Tokenizer(p)


def load_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """Read a tiktoken rank file, with one clear error for each way it can be wrong."""
    path = Path(path)
    if not path.is_file():
        raise TokenizerError(f"tokenizer file not found: {path} (set model.tokenizer_path, or 'builtin')")
    ranks: dict[bytes, int] = {}
    for lineno, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TokenizerError(f"{path}:{lineno}: expected 'base64 rank', got {line[:60]!r}")
        try:
            token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
        except (binascii.Error, ValueError):
            raise TokenizerError(f"{path}:{lineno}: not 'base64 rank': {line[:60]!r}") from None
        if token in ranks:
            raise TokenizerError(f"{path}:{lineno}: token {token!r} listed twice")
        ranks[token] = rank
    if not ranks:
        raise TokenizerError(f"{path}: empty tokenizer file")
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be exactly 0..{len(ranks) - 1}, each once")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path}: byte-level BPE needs all 256 single bytes; {len(missing)} missing (e.g. {missing[0]})"
        )
    return ranks


class Tokenizer:
    def __init__(self, path: str | Path, pattern: str = LLAMA3_PATTERN):
        ranks = load_bpe_ranks(path)
        n = len(ranks)
        self.bos_id, self.eos_id = n, n + 1
        self.encoding = tiktoken.Encoding(
            name=Path(path).stem, pat_str=pattern, mergeable_ranks=ranks,
            special_tokens={name: n + i for i, name in enumerate(SPECIALS)})
        self.n_words = n + 2  # (the vocabulary of documents of text: up to EOS)
        # Which tokens a saved data position (token offsets) counts in.
        self.fingerprint = f"{self.n_words} tokens, crc {zlib.crc32(Path(path).read_bytes()):08x}"

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        # Special-token text inside documents is encoded as ordinary text, never as a control id.
        ids = self.encoding.encode_ordinary(text)
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def special(self, name: str) -> int:
        """The id of special token ``name`` (one of :data:`SPECIALS`)."""
        if name not in SPECIALS:
            raise TokenizerError(f"the tokenizer has no special token {name} (its own: "
                                 f"{', '.join(SPECIALS)})")
        return self.encoding.encode_single_token(name)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)


class HFTokenizer:
    """A Hugging Face ``tokenizers`` file (tokenizer.json: Qwen's, a Llama 3 folder's) behind
    :class:`Tokenizer`'s interface. BOS and EOS are tokenizer_config.json's beside it, or
    <|endoftext|> for one it does not name (Qwen names no BOS): a document is BOS + text + EOS, or
    BOS + text where the two are one token (the separator once). Special-token text inside a
    document is encoded as ordinary text, as :class:`Tokenizer` does."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise TokenizerError(f"tokenizer file not found: {path} (set model.tokenizer_path, or 'builtin')")
        try:
            self.tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own exception types
            first = str(e).splitlines()[0][:80] if str(e) else type(e).__name__
            raise TokenizerError(f"{path}: not a tokenizers JSON file ({first})") from None
        self.tok.encode_special_tokens = True  # (special-token text in a document stays text)
        self.specials = {t.content for t in self.tok.get_added_tokens_decoder().values()}
        config = path.with_name("tokenizer_config.json")
        try:
            names = json.loads(config.read_text()) if config.is_file() else {}
        except ValueError:
            raise TokenizerError(f"{config}: not JSON") from None

        def named(key: str, default: str | None) -> int:
            token = names.get(key) or default
            token = token.get("content") if isinstance(token, dict) else token
            found = self.tok.token_to_id(token) if isinstance(token, str) else None
            if found is None:
                raise TokenizerError(f"{path}: no {key} (tokenizer_config.json's {key}, or {default}); a "
                                     "document needs one to start and end with")
            return found

        self.bos_id = named("bos_token", "<|endoftext|>")
        eot = self.tok.token_to_id("<|endoftext|>")
        self.eos_id = eot if eot is not None else named("eos_token", None)
        self.n_words = self.tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = f"{self.n_words} tokens, crc {zlib.crc32(path.read_bytes()):08x}"

    def encode(self, text: str, bos: bool = True, eos: bool = True) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        end = [self.eos_id] if eos and not (bos and self.eos_id == self.bos_id) else []
        return ([self.bos_id] if bos else []) + ids + end

    def special(self, name: str) -> int:
        if name not in self.specials:
            raise TokenizerError(f"the tokenizer has no special token {name}")
        return self.tok.token_to_id(name)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)


# ---------------------------------------------------------------- training (scripts/train_tokenizer.py)

def train_bpe(texts, n_mergeable: int, pattern: str = LLAMA3_PATTERN) -> dict[bytes, int]:
    """Byte-level BPE: repeatedly merge the most frequent adjacent pair inside pre-tokenized pieces.

    Pair counts are kept incrementally with a lazy max-heap, so each merge touches only the words
    that contain the pair. Ties go to the smallest pair of ids, making the result deterministic.
    """
    pat = regex.compile(pattern)
    word_counts: Counter[bytes] = Counter()
    for text in texts:
        word_counts.update(m.encode("utf-8") for m in pat.findall(text))
    words = [list(w) for w in word_counts]
    freqs = list(word_counts.values())
    vocab = {i: bytes([i]) for i in range(256)}
    pair_count: Counter[tuple[int, int]] = Counter()
    where: dict[tuple[int, int], set[int]] = {}
    for wi, w in enumerate(words):
        for pair in zip(w, w[1:]):
            pair_count[pair] += freqs[wi]
            where.setdefault(pair, set()).add(wi)
    heap = [(-c, pair) for pair, c in pair_count.items()]
    heapq.heapify(heap)
    while len(vocab) < n_mergeable and heap:
        neg, pair = heapq.heappop(heap)
        if pair_count.get(pair, 0) != -neg or -neg <= 0:
            continue  # stale entry
        new_id = len(vocab)
        vocab[new_id] = vocab[pair[0]] + vocab[pair[1]]
        changed: set[tuple[int, int]] = set()
        for wi in where.pop(pair, ()):
            w, f = words[wi], freqs[wi]
            for p in zip(w, w[1:]):
                pair_count[p] -= f
                changed.add(p)
            merged, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == pair:
                    merged.append(new_id)
                    i += 2
                else:
                    merged.append(w[i])
                    i += 1
            words[wi] = merged
            for p in zip(merged, merged[1:]):
                pair_count[p] += f
                where.setdefault(p, set()).add(wi)
                changed.add(p)
        pair_count.pop(pair, None)
        for p in changed:
            if pair_count.get(p, 0) > 0:
                heapq.heappush(heap, (-pair_count[p], p))
    return {tok: rank for rank, tok in vocab.items()}


def save_bpe_ranks(ranks: dict[bytes, int], path: str | Path) -> None:
    lines = [
        f"{base64.b64encode(tok).decode()} {rank}"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    Path(path).write_text("\n".join(lines) + "\n")
