"""Sampling from a trained model, single process, on the CPU (or the GPU if there is one).

    torchpar generate --checkpoint DIR|FILE --prompt TEXT [--max-new-tokens N --temperature T --top-k K]

Each new token re-runs the model over the whole context (no KV cache): simple, exact, and
plenty fast for the small models this is meant to inspect.
"""

from __future__ import annotations

import torch


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
