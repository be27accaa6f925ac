"""One rank's data loader as the data-parallel degree grows: text tokenized on the fly against a
prepared (pre-tokenized) corpus.

    python benchmarks/data_loader.py [--seq-len 2048] [--local-batch 8] [--dps 1,8,64,512] [--copies 32]

A rank of a dp-way job is simulated by its loader alone (the trainer's, rank dp // 2 of dp, no
worker processes unless said): per step it yields local_batch x (seq_len + 1) tokens. On the fly,
the rank tokenizes the whole global stream to find its windows (the stdlib corpus, 9M tokens);
pre-tokenized, it reads only its own windows from a prepared corpus (the stdlib corpus prepared
once, then its shard repeated ``--copies`` times, so that even dp = 512 crosses an epoch only every
few dozen steps, as a real corpus would; the shards sit in the page cache), measured before the
text path so that neither disturbs the other's caches, from the corpus's start and from 1.5 epochs
in (medians of ``--repeats``, the degrees interleaved). Prints the preparation's rate, per dp
degree the time per step and tokens per second of each path, then tokens per second with 0 and 2
loader worker processes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchpar.data import StdlibSource, TokenizedCorpus  # noqa: E402
from torchpar.data import build_dataloader as build_loader  # noqa: E402
from torchpar.data.tokenized import MANIFEST, prepare  # noqa: E402
from torchpar.tokenizer import BUILTIN, Tokenizer  # noqa: E402


def repeated(folder: Path, out: Path, copies: int) -> TokenizedCorpus:
    """A prepared corpus of one shard, as ``copies`` shards (documents repeated, format intact)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    out.mkdir()
    for i in range(copies):
        for suffix in (".bin", ".lengths.npy", ".json"):
            shutil.copyfile(folder / f"shard-00000{suffix}", out / f"shard-{i:05d}{suffix}")
    manifest.update(shards=manifest["shards"] * copies, n_documents=manifest["n_documents"] * copies,
                    n_tokens=manifest["n_tokens"] * copies, documents=f"{copies} x {manifest['documents']}")
    (out / MANIFEST).write_text(json.dumps(manifest))
    return TokenizedCorpus(str(out))


def build_dataloader(*args, start: int = 0, **kwargs):
    """The trainer's loader, at global window ``start`` (a multiple of the global batch)."""
    loader = build_loader(*args, **kwargs)
    if start:
        loader.load_state_dict({"windows_consumed": start, "source_tokens": [0],
                                "sources": [{"windows": start, "lanes": None}]})
    return loader


def time_per_step(loader, budget_s: float, max_steps: int) -> tuple[float, int]:
    """Seconds per batch after the first (which sets up the readers), over up to ``max_steps``
    batches or ``budget_s`` seconds, whichever ends first."""
    it = iter(loader)
    next(it)
    steps, start = 0, time.perf_counter()
    while steps < max_steps and (steps < 2 or time.perf_counter() - start < budget_s):
        next(it)
        steps += 1
    return (time.perf_counter() - start) / steps, steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--local-batch", type=int, default=8)
    p.add_argument("--dps", default="1,8,64,512")
    p.add_argument("--copies", type=int, default=32)
    p.add_argument("--steps", type=int, default=1000, help="pre-tokenized steps timed per dp degree")
    p.add_argument("--budget-s", type=float, default=8.0, help="time spent per on-the-fly measurement")
    p.add_argument("--repeats", type=int, default=5, help="pre-tokenized measurements per degree (median)")
    args = p.parse_args()
    tok, stdlib = Tokenizer(BUILTIN), StdlibSource("train", seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="torchpar_data_bench_"))
    try:
        start = time.perf_counter()
        m = prepare(stdlib, tok, tmp / "prepared", processes=2, docs_per_shard=32, quiet=True)
        took = time.perf_counter() - start
        print(f"prepare-data, 2 processes: {m['n_tokens']:,} tokens in {took:.1f} s = "
              f"{m['n_tokens'] / took / 1e6:.1f}M tokens/s")
        prepare(stdlib, tok, tmp / "one", processes=1, docs_per_shard=len(stdlib), quiet=True)
        big = repeated(tmp / "one", tmp / "big", args.copies)
        print(f"pre-tokenized corpus: {big.manifest['n_tokens']:,} tokens in {args.copies} shards")
        local = args.local_batch * (args.seq_len + 1)
        print(f"\nper rank and step: {args.local_batch} x {args.seq_len + 1} = {local:,} tokens\n")
        dps = [int(x) for x in args.dps.split(",")]
        # Pre-tokenized first, all degrees together: from the corpus's start (epoch 0 keeps the
        # documents in file order, so a small dp reads neighbouring documents) and from 1.5 epochs
        # in (shuffled, where a long run spends its time).
        later = int(big.manifest["n_tokens"] * 1.5 / (args.seq_len + 1)) // (max(dps) * args.local_batch)
        later *= max(dps) * args.local_batch
        runs: dict[tuple[int, int], list[float]] = {}
        for _ in range(args.repeats):  # the degrees interleaved, repeat by repeat; medians
            for start in (0, later):
                for dp in dps:
                    loader = build_dataloader(big, tok, args.seq_len, args.local_batch, dp // 2, dp, seed=0,
                                              start=start)
                    runs.setdefault((dp, start), []).append(time_per_step(loader, 60.0, args.steps)[0])
        tok_ms = {key: statistics.median(times) for key, times in runs.items()}
        print(f"{'dp':>5} | {'on the fly ms/step':>18} {'tokens/s':>12} | {'pre-tokenized ms/step':>21} "
              f"{'tokens/s':>12} | {'1.5 epochs in: ms/step':>22} {'tokens/s':>12}")
        for dp in dps:
            text = build_dataloader(stdlib, tok, args.seq_len, args.local_batch, dp // 2, dp, seed=0)
            t_text, _ = time_per_step(text, args.budget_s, 1000)
            t0, t1 = tok_ms[dp, 0], tok_ms[dp, later]
            print(f"{dp:>5} | {t_text * 1e3:>18.2f} {local / t_text:>12,.0f} | {t0 * 1e3:>21.3f} "
                  f"{local / t0:>12,.0f} | {t1 * 1e3:>22.3f} {local / t1:>12,.0f}")
        lo, hi = min(dps), max(dps)
        print(f"\npre-tokenized time per step, dp {hi} / dp {lo}: {tok_ms[hi, 0] / tok_ms[lo, 0]:.2f} from "
              f"the start, {tok_ms[hi, later] / tok_ms[lo, later]:.2f} 1.5 epochs in")
        print("\nloader workers (tokens/s of the rank's batches):")
        for name, source, dp in (("on the fly", stdlib, 8), ("pre-tokenized", big, 512)):
            row = []
            for workers in (0, 2):
                loader = build_dataloader(source, tok, args.seq_len, args.local_batch, dp // 2, dp, seed=0,
                                          num_workers=workers)
                t, _ = time_per_step(loader, args.budget_s, args.steps)
                row.append(f"{workers} workers {local / t:>12,.0f}")
            print(f"  {name:>13}, dp {dp:>3}: " + " | ".join(row))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
