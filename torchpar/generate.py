"""Sampling from a trained model, single process, on the CPU (or the GPU if there is one).

    torchpar generate --checkpoint DIR|FILE --prompt TEXT [--max-new-tokens N --temperature T --top-k K]

Each new token re-runs the model over the whole context (no KV cache): simple, exact, and
plenty fast for the small models this is meant to inspect.
"""

from __future__ import annotations

import sys

import torch

from torchpar.errors import ConfigError


@torch.no_grad()
def sample(model, tokens: list[int], max_new_tokens: int, temperature: float, top_k: int, stop: int | None,
           generator: torch.Generator) -> list[int]:
    """Extend ``tokens``; temperature 0 = greedy. Returns only the new tokens."""
    device = next(model.parameters()).device
    out: list[int] = []
    for _ in range(max_new_tokens):
        context = (tokens + out)[-model.args.max_seq_len:]
        logits = model(torch.tensor([context], device=device))[0, -1].float().cpu()  # [v]
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k > 0:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if nxt == stop:
            break
        out.append(nxt)
    return out


def main(argv: list[str] | None = None) -> int:
    from torchpar.console import ArgumentParser, at_least
    from torchpar.device import local_device
    from torchpar.tokenizer import Tokenizer, TokenizerError, resolve_path
    from torchpar.weights import load_model

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
    model, meta = load_model(a.checkpoint)
    try:
        tokenizer = Tokenizer(resolve_path(a.tokenizer or meta.get("tokenizer_path", "builtin")))
    except TokenizerError as e:
        raise ConfigError(f"--tokenizer: {e}") from None
    model.to(local_device())
    prompt = tokenizer.encode(a.prompt, bos=True, eos=False)
    new = sample(model, prompt, a.max_new_tokens, a.temperature, a.top_k, tokenizer.eos_id,
                 torch.Generator().manual_seed(a.seed))
    print(a.prompt + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    from torchpar.console import run_command

    sys.exit(run_command(main))
