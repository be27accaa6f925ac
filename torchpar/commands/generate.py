"""``torchpar generate``: sample text from a checkpoint or an exported weights file."""

from __future__ import annotations

import sys

import torch

from torchpar.adapters import open_merged
from torchpar.console import ArgumentParser, at_least
from torchpar.device import local_device
from torchpar.errors import ConfigError
from torchpar.generate import sample
from torchpar.tokenizer import TokenizerError, load_tokenizer
from torchpar.weights import model_from


def main(argv: list[str] | None = None) -> int:

    ap = ArgumentParser(prog="torchpar generate", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint", required=True, help="checkpoint step folder, checkpoint/dump folder, or export file"
    )
    ap.add_argument("--prompt", required=True)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--top-k", type=int, default=50)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--tokenizer", default=None, help="tiktoken file; default: the one the model was trained with"
    )
    a = ap.parse_args(sys.argv[1:] if argv is None else argv)
    at_least("--max-new-tokens", a.max_new_tokens, 0)
    at_least("--temperature", a.temperature, 0)  # 0 = greedy
    at_least("--top-k", a.top_k, 0)  # 0 = no top-k cut
    model, meta, _ = model_from(*open_merged(a.checkpoint))  # (a LoRA checkpoint: its adapters merged)
    try:
        tokenizer = load_tokenizer(a.tokenizer or meta.get("tokenizer_path", "builtin"))
    except TokenizerError as e:
        raise ConfigError(f"--tokenizer: {e}") from None
    model.to(local_device())
    prompt = tokenizer.encode(a.prompt, bos=True, eos=False)
    new = sample(model, prompt, a.max_new_tokens, a.temperature, a.top_k, tokenizer.eos_id,
                 torch.Generator().manual_seed(a.seed))
    print(a.prompt + tokenizer.decode(new))
    return 0
