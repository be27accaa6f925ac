"""Train the shipped BPE vocabulary on the stdlib corpus's training split.

    python scripts/train_tokenizer.py [--vocab-size 4096] [--max-mb 4] \\
        [--out torchpar/assets/stdlib_4096.tiktoken]

``--vocab-size`` counts the two special tokens (BOS, EOS), so 4096 gives 4094 mergeable ranks
and a model vocabulary of exactly 4096. Deterministic: the same interpreter gives the same file.
"""

import argparse
import time

from torchpar.data.sources import StdlibSource
from torchpar.tokenizer import BUILTIN, save_bpe_ranks, train_bpe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--max-mb", type=float, default=4.0, help="training text budget, in MB of source")
    ap.add_argument("--out", default=str(BUILTIN))
    args = ap.parse_args()
    source = StdlibSource("train", seed=0)
    texts, size = [], 0
    for i in range(len(source)):
        text = source[i]
        texts.append(text)
        size += len(text)
        if size >= args.max_mb * 1e6:
            break
    t0 = time.time()
    ranks = train_bpe(texts, args.vocab_size - 2)
    save_bpe_ranks(ranks, args.out)
    print(
        f"trained {len(ranks)} ranks (+2 specials) on {len(texts)} files, {size / 1e6:.1f} MB, in "
        f"{time.time() - t0:.0f}s -> {args.out}"
    )


if __name__ == "__main__":
    main()
