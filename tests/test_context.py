"""Context parallelism's pieces on their own: the head-tail split, and attention over a sequence
split across ranks against attention over the whole of it in one process (forward and gradients;
per-document masking and grouped-query heads). The ring path calls torch's private templated ring
attention: these tests fail if its behaviour or names change. Whole training runs under every
layout are in test_layouts.py."""

import json

import pytest
import torch
from harness import spawn_ranks

from torchpar.parallel.context import _order


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_head_tail_chunks_cover_the_sequence_once_with_equal_causal_work(cp):
    seq = 16 * cp
    held = [_order(cp, r, seq, torch.device("cpu")) for r in range(cp)]
    assert torch.equal(torch.cat(held).sort().values, torch.arange(seq))
    n = seq // (2 * cp)
    for r, idx in enumerate(held):  # chunks r and 2cp-1-r, in that order
        assert idx.tolist() == [*range(r * n, (r + 1) * n), *range((2 * cp - 1 - r) * n, (2 * cp - r) * n)]
    work = {int((idx + 1).sum()) for idx in held}  # keys a causal query attends to, summed
    assert len(work) == 1


def _attention_worker(rank, world, out):
    from torchpar.models.common import attention, document_layout
    from torchpar.parallel.context import ContextShard, shard_sequence
    from torchpar.parallel.layout import Layout

    results = []
    for method in ("alltoall", "ring"):
        for docs in (False, True) if method == "alltoall" else (False,):
            for kv_heads in (8, 4):
                lay = Layout(cp=world, cp_method=method)
                lay.build_mesh("cpu")
                gen = torch.Generator().manual_seed(0)
                b, h, seq, hd = 2, 8, 32, 16
                q = torch.randn(b, h, seq, hd, generator=gen, requires_grad=True)
                k, v = (torch.randn(b, kv_heads, seq, hd, generator=gen, requires_grad=True) for _ in "kv")
                documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [0] * 32]) if docs else None
                mask = document_layout(documents, q.dtype, q.device)[1] if docs else None
                ref = attention(q, k, v, mask)
                ref.square().sum().backward()
                local = [shard_sequence(t.detach().transpose(1, 2), lay).transpose(1, 2).requires_grad_()
                         for t in (q, k, v)]
                shard = ContextShard(lay, seq, documents, q.dtype, q.device)
                got = attention(*local, shard)
                got.square().sum().backward()
                idx = _order(world, rank, seq, q.device)
                diffs = [(got - ref[:, :, idx]).abs().max().item()]
                diffs += [(mine.grad - full.grad[:, :, idx]).abs().max().item()
                          for mine, full in zip(local, (q, k, v))]
                positions = (document_layout(documents, q.dtype, q.device)[0] if docs
                             else torch.arange(seq).unsqueeze(0))[:, idx]
                results.append({"case": f"{method} docs={docs} kv_heads={kv_heads}", "diffs": diffs,
                                "positions": torch.equal(shard.positions, positions)})
    if rank == 0:
        with open(f"{out}/attention.json", "w") as f:
            json.dump(results, f)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_attention_over_a_split_sequence_equals_one_process(world):
    """All-to-all attention is exact (it only moves data); ring attention merges partial results by
    log-sum-exp, so it differs by float rounding (2e-6 seen on these sizes)."""
    with open(f"{spawn_ranks(_attention_worker, world)}/attention.json") as f:
        results = json.load(f)
    assert len(results) == 6
    for r in results:
        assert r["positions"], r
        tol = 0.0 if r["case"].startswith("alltoall") else 2e-5
        assert max(r["diffs"]) <= tol, r
