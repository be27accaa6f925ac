"""Context parallelism's pieces on their own: the head-tail split, and attention over a sequence
split across ranks against attention over the whole of it in one process (forward and gradients;
per-document masking and grouped-query heads). The ring path calls torch's private templated ring
attention: these tests fail if its behaviour or names change. Whole training runs under every
layout are in test_layouts.py."""

import json

import pytest
import torch
import torch.nn.functional as F
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


def _cuda_ring_worker(rank, world, out):
    from torchpar.parallel.context import _ring_attention
    from torchpar.parallel.layout import Layout

    lay = Layout(cp=world, cp_method="ring")
    lay.build_mesh("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results = {}
    for dtype, kv_heads in ((torch.float32, 8), (torch.bfloat16, 8), (torch.bfloat16, 2)):
        q, k, v = (torch.randn(2, h, 64, 32, generator=gen, device="cuda", dtype=dtype).requires_grad_()
                   for h in (8, kv_heads, kv_heads))
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads < 8)
        ref.float().square().sum().backward()
        full = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        got = _ring_attention(q, k, v, lay.mesh["cp"])
        got.float().square().sum().backward()
        pairs = [(got, ref), *((t.grad, g) for t, g in zip((q, k, v), full))]
        results[f"{dtype} kv{kv_heads}"] = [((a - b).abs().max() / b.abs().max()).item() for a, b in pairs]
    with open(f"{out}/ring_cuda.json", "w") as f:
        json.dump(results, f)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's ring kernels (memory-efficient attention "
                    "and its backward, with their dropout-seed arguments) run on a GPU only")
def test_the_ring_drives_cudas_kernels():
    """On one GPU (a ring of one rank): the memory-efficient kernel's forward and backward as the
    ring calls them, against SDPA, in fp32 and bf16, and with grouped KV heads (repeated for the
    kernel, their gradients folded back); errors relative to the largest value."""
    with open(f"{spawn_ranks(_cuda_ring_worker, 1)}/ring_cuda.json") as f:
        results = json.load(f)
    assert max(results["torch.float32 kv8"]) < 1e-4, results
    assert max(results["torch.bfloat16 kv8"]) < 3e-2 and max(results["torch.bfloat16 kv2"]) < 3e-2, results


def test_ring_on_gpus_needs_half_chunks_of_32_tokens():
    """CUDA's memory-efficient kernel pads its log-sum-exp to 32 tokens, which torch's ring merges
    by halves of the local sequence: a layout for GPUs is refused unless they are multiples of 32;
    on CPUs (the flash kernel, no padding) any even split runs."""
    from harness import TINY

    from torchpar.config import load_config
    from torchpar.errors import ConfigError
    from torchpar.plan import layout_from_config

    ring = ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method", "ring"]
    with pytest.raises(ConfigError, match="multiple of 64 x context_parallel_degree = 128"):
        layout_from_config(load_config(TINY, ring), 2, "cuda")
    assert layout_from_config(load_config(TINY, ring), 2, "cpu")[0].cp == 2
    assert layout_from_config(load_config(TINY, [*ring, "--training.seq_len", "128"]), 2, "cuda")[0].cp == 2
