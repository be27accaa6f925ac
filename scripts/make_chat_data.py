"""Write the small chat set that train_configs/sft_debug.toml fine-tunes on: conversations whose
answers follow from their prompts (reverse, sort, add, count, repeat), some with a system turn,
some of two exchanges, in the messages format of most fine-tuning sets; and, with --short, the
test suite's conversations of one short exchange (a few fit one 33-token window of the tiny job).
Deterministic: torchpar/assets/chat and tests/data/short_chat.jsonl are this script's output.

    python scripts/make_chat_data.py [--out torchpar/assets/chat]
    python scripts/make_chat_data.py --short [--out tests/data]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ("apple river stone cloud green seven table light music paper window garden orange silver "
         "winter summer bridge candle forest planet rocket yellow purple market").split()
SYSTEM = ("You are a careful assistant. Answer with the result only.",
          "Reply briefly and exactly.")


def exchange(rng: random.Random) -> tuple[str, str]:
    """One user request and the answer that follows from it."""
    kind = rng.choice(("reverse", "sort", "add", "count", "repeat"))
    words = rng.sample(WORDS, rng.randint(2, 5))
    if kind == "reverse":
        return f"Reverse these words: {' '.join(words)}", " ".join(reversed(words))
    if kind == "sort":
        return f"Sort these words alphabetically: {' '.join(words)}", " ".join(sorted(words))
    if kind == "add":
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return f"What is {a} plus {b}?", f"{a} plus {b} is {a + b}."
    if kind == "count":
        return f"How many words are in: {' '.join(words)}", f"There are {len(words)} words."
    return f"Repeat after me: {' '.join(words)}", " ".join(words)


def conversation(rng: random.Random) -> dict:
    messages = [{"role": "system", "content": rng.choice(SYSTEM)}] if rng.random() < 0.3 else []
    for _ in range(1 if rng.random() < 0.7 else 2):
        question, answer = exchange(rng)
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def short(rng: random.Random) -> dict:
    a, b = rng.randint(0, 9), rng.randint(0, 9)
    return {"messages": [{"role": "user", "content": f"{a}+{b}?"},
                         {"role": "assistant", "content": str(a + b)}]}


def main() -> None:
    root = Path(__file__).parent.parent
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--short", action="store_true", help="the test suite's short conversations")
    p.add_argument("--out", help="folder (default: torchpar/assets/chat, or tests/data with --short)")
    args = p.parse_args()
    out = Path(args.out or (root / "tests" / "data" if args.short else root / "torchpar" / "assets" / "chat"))
    out.mkdir(parents=True, exist_ok=True)
    if args.short:
        rng = random.Random(2)
        (out / "short_chat.jsonl").write_text("".join(json.dumps(short(rng)) + "\n" for _ in range(400)))
        print(f"{out / 'short_chat.jsonl'}: 400 conversations")
        return
    for name, count, seed in (("train", 1500, 0), ("validation", 150, 1)):
        rng = random.Random(seed)
        lines = [json.dumps(conversation(rng)) for _ in range(count)]
        (out / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
        print(f"{out / name}.jsonl: {count} conversations")


if __name__ == "__main__":
    main()
