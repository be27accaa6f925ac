"""Document attention through varlen attention (CUDA) against the per-document calls (CPU).

The index arithmetic runs on the CPU: the packed layout's cu_seqlens and longest document against
the spans, and varlen attention emulated by one SDPA call per packed sequence, which must give the
per-document path's outputs and gradients. The real kernel is checked where a CUDA GPU is.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from torchpar.config import load_config
from torchpar.models import adapter, common, model_args
from torchpar.models.llama import FLAVORS, TransformerBlock, rope_tables

CPU = torch.device("cpu")
CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="varlen_attn needs a CUDA GPU; the CPU tests emulate it")

# Each token's document [b, s], non-decreasing along a row, as packed windows are.
BATCHES = {
    "one document": [[0] * 8],
    "one document a row, the same id": [[0] * 8, [0] * 8],
    "a token each": [list(range(8))],
    "ragged": [[0, 0, 0, 1, 1, 2, 2, 2], [5, 5, 6, 6, 6, 6, 6, 6], [7, 8, 8, 8, 8, 8, 8, 9]],
    "one token at the row end": [[0] * 7 + [1], [2] * 8],
    "a document across the row end": [[3, 3, 3, 4], [4, 4, 5, 5]],
}


def packed(documents: torch.Tensor, monkeypatch) -> common.PackedDocuments:
    """What document_layout builds on a GPU where varlen attention runs, here on the CPU."""
    monkeypatch.setattr(common, "_varlen_serves", lambda device, dtype: True)
    docs = common.document_layout(documents, torch.float32, CPU)[1]
    assert isinstance(docs, common.PackedDocuments)
    return docs


@pytest.fixture
def emulated(monkeypatch) -> list:
    """common's varlen_attn replaced by the emulator; the list counts its calls."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return emulated_varlen(*args, **kwargs)

    monkeypatch.setattr(common, "varlen_attn", counted)
    return calls


def emulated_varlen(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, window_size=(-1, -1),
                    enable_gqa=False, scale=None):
    """varlen_attn for the calls common makes, as one causal SDPA call per packed sequence: query
    [T, h, hd], key and value [T, h_kv, hd] -> [T, h, hd]."""
    assert cu_seq_q.dtype == torch.int32 and cu_seq_k is cu_seq_q and scale is None
    left, right = window_size
    assert right == 0 and (left == -1 or left >= 0)  # causal, or a window of left + 1 keys
    assert enable_gqa == (query.shape[1] != key.shape[1])
    assert enable_gqa is False or common.VARLEN_GROUPS_HEADS, "this torch's varlen_attn has no enable_gqa"
    cuts = cu_seq_q.tolist()
    assert cuts[0] == 0 and cuts[-1] == query.shape[0] == key.shape[0]
    assert max_q == max_k == max(e - a for a, e in zip(cuts, cuts[1:]))
    # Contiguous [1, h, len, hd], as the per-document path calls the kernel: the same rounding.
    def band(n: int):  # (None: causal)
        return None if left == -1 else torch.ones(n, n, dtype=torch.bool).tril().triu(-left)

    parts = [F.scaled_dot_product_attention(*(t[a:e].transpose(0, 1).contiguous().unsqueeze(0)
                                              for t in (query, key, value)), attn_mask=band(e - a),
                                            is_causal=left == -1, enable_gqa=enable_gqa)[0].transpose(0, 1)
             for a, e in zip(cuts, cuts[1:])]  # [len, h, hd] each
    return torch.cat(parts)


def expected_sequences(documents: torch.Tensor) -> tuple[list[int], int]:
    """cu_seqlens and the longest sequence counted from the ids: a row's end ends a sequence."""
    b, s = documents.shape
    rowwise = documents + torch.arange(b).unsqueeze(1) * (int(documents.max()) + 1)  # unique per row
    lengths = torch.unique_consecutive(rowwise.flatten(), return_counts=True)[1]
    return [0, *lengths.cumsum(0).tolist()], int(lengths.max())


def qkv(b: int, s: int, heads: int, kv_heads: int, hd: int = 8, dtype=torch.float32, device=CPU):
    """q [b, h, s, hd], k and v [b, h_kv, s, hd], transposed from [b, s, h, hd] as the models
    pass them, requiring gradients."""
    gen = torch.Generator(device=device).manual_seed(0)
    return [torch.randn(b, s, h, hd, generator=gen, device=device, dtype=dtype).transpose(1, 2)
            .detach().requires_grad_() for h in (heads, kv_heads, kv_heads)]


@pytest.mark.parametrize("name", BATCHES)
def test_cu_seqlens_and_longest_match_the_spans(name, monkeypatch):
    documents = torch.tensor(BATCHES[name])
    docs = packed(documents, monkeypatch)
    cu_seqlens, longest = expected_sequences(documents)
    assert docs.cu_seqlens.dtype == torch.int32
    assert docs.cu_seqlens.tolist() == cu_seqlens and docs.max_len == longest
    # The pure function of the spans alone gives the same.
    again, most = common.varlen_layout(common.DocumentSpans(docs.cuts))
    assert again.tolist() == cu_seqlens and most == longest


def test_pack_and_unpack_are_views_of_the_projections():
    base = torch.randn(3, 8, 4, 16)  # [b, s, h, hd], as a projection's output is
    q = base.transpose(1, 2)  # [b, h, s, hd]
    flat = common.pack(q)
    assert flat.shape == (24, 4, 16) and flat.data_ptr() == base.data_ptr() and flat.is_contiguous()
    assert torch.equal(flat[8 + 5], base[1, 5])  # row 1, token 5
    back = common.unpack(flat, 3)
    assert back.shape == q.shape and torch.equal(back, q) and back.data_ptr() == base.data_ptr()


@pytest.mark.parametrize("groups_heads", [True, False], ids=["enable_gqa", "repeated_kv"])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("name", BATCHES)
def test_emulated_varlen_equals_the_per_document_calls(name, kv_heads, groups_heads, emulated, monkeypatch):
    """The varlen path (this layout, the emulated kernel, this unpacking) gives the per-document
    path's outputs and gradients, grouped query heads included: by the kernel's enable_gqa, or
    (torch 2.11's signature has none) by K and V repeated to the query heads."""
    monkeypatch.setattr(common, "VARLEN_GROUPS_HEADS", groups_heads)
    documents = torch.tensor(BATCHES[name])
    docs = packed(documents, monkeypatch)
    b, s = documents.shape
    results = []
    for mask in (docs, common.DocumentSpans(docs.cuts)):  # varlen, then per document
        q, k, v = qkv(b, s, 4, kv_heads)
        out = common.attention(q, k, v, mask)
        out.square().sum().backward()
        results.append([out.detach(), q.grad, k.grad, v.grad])
    assert len(emulated) == 1
    for a, b_ in zip(*results):  # repeated K/V: their gradients summed over the copies in another order
        assert torch.allclose(a, b_, rtol=0, atol=1e-6 * b_.abs().max()), (a - b_).abs().max()


def test_cpu_keeps_the_per_document_calls():
    documents = torch.tensor(BATCHES["ragged"])
    assert not common._varlen_serves(CPU, torch.bfloat16)
    assert type(common.document_layout(documents, torch.float32, CPU)[1]) is common.DocumentSpans


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_model_through_emulated_varlen_equals_the_cpu_path(family, emulated, monkeypatch):
    """Whole models (Llama's grouped query heads, GPT-2's full heads): the same logits and gradients
    through the varlen path as through the CPU's per-document calls."""
    documents = torch.tensor([[0] * 5 + [1] * 20 + [2] * 7, [3] * 32, [4, 5, 6, 7] * 8]).sort(1).values
    tokens = torch.randint(0, 4096, documents.shape, generator=torch.Generator().manual_seed(0))
    model = adapter(family).build(model_args(load_config(None, ["--model.name", family]).model))
    model.init_weights(0)
    results = []
    for varlen in (False, True):
        if varlen:
            monkeypatch.setattr(common, "_varlen_serves", lambda device, dtype: True)
        model.zero_grad()
        logits = model(tokens, documents=documents)
        logits.square().mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(emulated) == model.args.n_layers  # the varlen run's blocks only
    (a, grads_a), (b, grads_b) = results
    assert (a - b).abs().max() < 1e-5
    assert all(torch.allclose(x, y, atol=1e-6) for x, y in zip(grads_a, grads_b))


def test_a_compiled_block_takes_new_documents_without_a_graph_break():
    """On the meta device (the custom op's shape function, no kernel): a Llama block compiles in
    one graph with the varlen call, forward and backward, and new documents every batch compile it
    once more (dynamic in the number of documents and the longest), then never again."""
    args = FLAVORS["debug"]
    b, s = 2, 32
    with torch.device("meta"):
        block = TransformerBlock(args)
        h = torch.randn(b, s, args.dim, requires_grad=True)
    cos, sin = (t.to("meta")[:s].expand(b, s, -1) for t in rope_tables(args))
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    counters.clear()
    for n, longest in [(3, 20), (5, 9), (4, 17), (9, 6), (2, 31)]:
        docs = common.PackedDocuments((), torch.empty(n + 1, dtype=torch.int32, device="meta"), longest)
        out = compiled(h, cos, sin, docs)
        assert out.shape == (b, s, args.dim)
        out.sum().backward()
    assert counters["stats"]["unique_graphs"] == 2


# ---------------------------------------------------------------- on a CUDA GPU


@CUDA
@pytest.mark.parametrize("kv_heads", [8, 2])
def test_varlen_attn_equals_the_per_document_calls(kv_heads):
    """The real kernel in bf16 against the per-document calls in fp32 on the same inputs."""
    device = torch.device("cuda", torch.cuda.current_device())
    documents = torch.tensor([[0] * 100 + [1] * 900 + [2] * 24, [3] * 1024, [4, 5] * 512]).sort(1).values
    docs = common.document_layout(documents, torch.bfloat16, device)[1]
    assert isinstance(docs, common.PackedDocuments), "varlen_attn should serve bf16 on a CUDA GPU"
    assert docs.cu_seqlens.device == device and docs.cu_seqlens.tolist() == expected_sequences(documents)[0]
    results = []
    for dtype, mask in ((torch.bfloat16, docs), (torch.float32, common.DocumentSpans(docs.cuts))):
        q, k, v = qkv(3, 1024, 8, kv_heads, hd=64, dtype=torch.bfloat16, device=device)
        out = common.attention(*(t.to(dtype) for t in (q, k, v)), mask)
        out.float().square().sum().backward()
        results.append([out.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()])
    # Elementwise: a long document's outputs are small, a whole-tensor bound would hide them.
    for what, a, b in zip(("out", "dq", "dk", "dv"), *results):
        assert torch.allclose(a, b, rtol=2e-2, atol=1e-2 * b.abs().max()), what


@CUDA
def test_fp32_on_a_gpu_falls_back_to_the_per_document_calls():
    """The flash kernel takes fp16/bf16 only: fp32 gets the per-document calls (and a warning)."""
    device = torch.device("cuda", torch.cuda.current_device())
    documents = torch.tensor(BATCHES["ragged"])
    assert type(common.document_layout(documents, torch.float32, device)[1]) is common.DocumentSpans


@CUDA
def test_compiled_block_on_a_gpu_equals_eager():
    """A Llama block compiled whole (inductor, no graph break) with the varlen call, over batches
    of other documents (the second compiles it dynamic), gives eager's output and input gradient."""
    device = torch.device("cuda", torch.cuda.current_device())
    args = FLAVORS["debug"]
    block = TransformerBlock(args).to(device, torch.bfloat16)
    compiled = torch.compile(block, fullgraph=True)
    b, s = 2, 256
    for cut in (17, 200, 90):
        documents = (torch.arange(s) >= cut).long().expand(b, s).contiguous()
        positions, docs = common.document_layout(documents, torch.bfloat16, device)
        assert isinstance(docs, common.PackedDocuments)
        cos, sin = (t.to(device)[positions] for t in rope_tables(args))
        results = []
        for run in (compiled, block):
            h = torch.randn(b, s, args.dim, device=device, dtype=torch.bfloat16,
                            generator=torch.Generator(device).manual_seed(cut)).requires_grad_()
            out = run(h, cos, sin, docs)
            out.float().square().mean().backward()
            results.append((out.detach().float(), h.grad.float()))
        for a, e in zip(*results):
            assert torch.allclose(a, e, rtol=2e-2, atol=2e-2 * e.abs().max()), cut


@CUDA
@pytest.mark.parametrize("documented", [False, True])
def test_varlen_attn_with_a_window_equals_attention_written_out(documented):
    """The real kernel's window in bf16 (every row one sequence without documents; each document
    one with them) against the definition in fp32 on the same inputs: a window of 128 keys, as
    gpt-oss's sliding layers have, over rows of 1,024."""
    device = torch.device("cuda", torch.cuda.current_device())
    documents = (torch.tensor([[0] * 300 + [1] * 724, [2] * 1024]) if documented
                 else torch.zeros(2, 1024, dtype=torch.long))
    mask = common.document_layout(documents, torch.bfloat16, device)[1] if documented else None
    assert not documented or isinstance(mask, common.PackedDocuments)
    q, k, v = qkv(2, 1024, 8, 2, hd=64, dtype=torch.bfloat16, device=device)
    got = common.attention(q, k, v, mask, None, 128).float()
    want = reference_attention(*(t.detach().float().cpu() for t in (q, k, v)), documents, 128)
    assert torch.allclose(got.cpu(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


def test_selective_recomputation_keeps_the_varlen_kernels_output():
    """The varlen op is among the ops whose outputs selective recomputation keeps, like SDPA's
    kernels: backward must not run attention again."""
    import torch

    from torchpar.parallel.recompute import kept_ops

    assert torch.ops.torch_attn._varlen_attn.default in kept_ops()
    assert torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default in kept_ops()


def reference_attention(q, k, v, documents, window: int = 0, sinks=None):
    """Attention written out from its definition: query i of a row sees key j of the same document
    with j <= i (and i - j < window, with one), its softmax over those scores and its sink."""
    b, h, s, hd = q.shape
    k, v = (t.repeat_interleave(h // t.shape[1], dim=1) for t in (k, v))
    i, j = torch.arange(s).view(s, 1), torch.arange(s).view(1, s)
    seen = (j <= i) & ((i - j < window) if window else True)
    seen = seen & (documents.unsqueeze(2) == documents.unsqueeze(1))  # [b, s, s]
    scores = (q @ k.transpose(-2, -1) * hd ** -0.5).masked_fill(~seen.unsqueeze(1), float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, h, 1, 1).expand(b, h, s, 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :s] @ v


@pytest.mark.parametrize("path", ["no documents", "spans", "dense bias", "varlen (emulated)"])
@pytest.mark.parametrize("sinks", [False, True])
def test_a_sliding_window_sees_each_query_and_the_keys_before_it(path, sinks, emulated, monkeypatch):
    """A window of w keys (each query and the w - 1 before it, inside its document) on every path
    attention takes, with grouped heads and with sinks: output and gradients equal attention written
    out from its definition; a window as long as the row is plain causal attention."""
    documents = torch.tensor([[0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1], [2] * 12])
    if path == "no documents":
        documents = torch.zeros_like(documents)
    q, k, v = qkv(2, 12, 4, 2)
    head_sinks = torch.randn(4, requires_grad=True) if sinks else None
    if path == "no documents":
        mask = None
    elif path == "varlen (emulated)":
        mask = packed(documents, monkeypatch)
    else:
        monkeypatch.setattr(common, "PER_DOCUMENT_MAX", 8 if path == "spans" else 0)
        mask = common.document_layout(documents, torch.float32, CPU)[1]
        assert isinstance(mask, common.DocumentSpans if path == "spans" else torch.Tensor)
    for window in (3, 12):
        got = common.attention(q, k, v, mask, head_sinks, window)
        want = reference_attention(q, k, v, documents, window, head_sinks)
        torch.testing.assert_close(got, want)
        grads = torch.autograd.grad(got.square().sum(), [q, k, v])
        torch.testing.assert_close(grads, torch.autograd.grad(want.square().sum(), [q, k, v]))
    if path == "spans" and sinks:  # (each token's document, made once for the batch: not per layer)
        made = mask._ids
        common.attention(q, k, v, mask, head_sinks, 3)
        assert made is not None and mask._ids is made
    if path == "varlen (emulated)" and not sinks:
        assert len(emulated) == 2  # (the window went to the kernel)
    if path == "no documents" and not sinks:  # on a GPU: each row one sequence of the varlen kernel
        monkeypatch.setattr(common, "_varlen_serves", lambda device, dtype: True)
        torch.testing.assert_close(common.attention(q, k, v, None, None, 3),
                                   reference_attention(q, k, v, documents, 3))
        assert len(emulated) == 1
    causal = common.attention(q, k, v, mask, head_sinks)
    torch.testing.assert_close(common.attention(q, k, v, mask, head_sinks, 12), causal)
