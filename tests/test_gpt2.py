"""The GPT-2 family: its counts and shapes against the real module, its init, and its forward
against a hand-written reference."""

import math

import pytest
import torch

from torchpar.models import MODELS
from torchpar.models.common import TP_STYLES, canonical_name
from torchpar.models.gpt2 import ADAPTER, FLAVORS, GPT2, GPT2Args

SMALL = GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=100, max_seq_len=32, tie_embeddings=False)


def prune(model: GPT2, first: bool, last: bool, keep: range) -> GPT2:
    """Cut ``model`` down to one pipeline stage, the way a pipeline split does."""
    if not first:
        for name in ADAPTER.first_stage:
            setattr(model, name, None)
    if not last:
        for name in ADAPTER.last_stage:
            setattr(model, name, None)
    for key in list(model.layers.keys()):
        if int(key) not in keep:
            del model.layers[key]
    return model


def as_table(model: GPT2) -> list[tuple[str, tuple[int, int]]]:
    """named_parameters() in stage_params' terms: canonical names, vectors as (n, 1)."""
    return [(canonical_name(n), tuple(p.shape) if p.dim() == 2 else (p.shape[0], 1))
            for n, p in model.named_parameters()]


def test_registered():
    assert MODELS["gpt2"] is ADAPTER
    assert ADAPTER.build(ADAPTER.args("debug", n_layers=2)).args.n_layers == 2


def test_param_count_matches_numel_for_every_flavour():
    for name, args in FLAVORS.items():
        with torch.device("meta"):
            model = GPT2(args)
        assert ADAPTER.num_params(args) == sum(p.numel() for p in model.parameters()), name
        c = ADAPTER.param_counts(args)
        block = model.layers["0"]
        assert c["layer"] == sum(p.numel() for p in block.parameters()), name
        assert c["layer_attention"] == sum(p.numel() for p in block.attn.parameters()), name
        assert c["layer_ffn"] == sum(p.numel() for p in block.mlp.parameters()), name


def test_known_size():
    # GPT-2 small is 124.4M with its 50257-token vocabulary; padding to 50304 adds 47 x 768.
    assert abs(ADAPTER.num_params(FLAVORS["124M"]) - (124.44e6 + 47 * 768)) < 0.01e6


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("first,last,keep", [
    (True, True, range(8)),  # the whole model
    (True, False, range(3)),
    (False, False, range(3, 5)),
    (False, True, range(5, 8)),
])
def test_stage_params_match_named_parameters(tied, first, last, keep):
    args = FLAVORS["debug-tied" if tied else "debug"]
    with torch.device("meta"):
        model = prune(GPT2(args), first, last, keep)
    table = [(n, shape) for n, shape, _ in ADAPTER.stage_params(args, first, last, range(len(keep)))]
    # The adapter names the blocks without their index; the model's are its global layer keys.
    real = [(n.split(".", 2)[2] if n.startswith("layers.") else n, shape) for n, shape in as_table(model)]
    assert table == real


def test_block_params_are_one_block():
    args = FLAVORS["debug"]
    with torch.device("meta"):
        block = GPT2(args).layers["0"]
    real = [(n, tuple(p.shape) if p.dim() == 2 else (p.shape[0], 1)) for n, p in block.named_parameters()]
    assert [(n, s) for n, s, _ in ADAPTER.block_params(args)] == real


def test_tp_dims_follow_the_plan():
    """Every stage_params TP dim is the one its module's TP style implies."""
    expected = {  # style -> (weight dim, bias dim)
        "embedding": (0, None), "head": (0, None), "colwise": (0, 0), "rowwise": (1, None),
        "norm": (None, None),
    }
    with torch.device("meta"):
        model = GPT2(FLAVORS["debug"])
    for name, _, tp_dim in ADAPTER.stage_params(FLAVORS["debug"], True, True, range(1)):
        module, kind = name.rsplit(".", 1)
        style = ADAPTER.top_plan.get(module) or ADAPTER.block_plan[module]
        assert tp_dim == expected[style][kind == "bias"], name
    # The plans name real modules, in the vocabulary of TP styles.
    block = model.layers["0"]
    for path, style in ADAPTER.block_plan.items():
        assert block.get_submodule(path) is not None and style in TP_STYLES, path
    for path, style in ADAPTER.top_plan.items():
        assert getattr(model, path) is not None and style in TP_STYLES, path
    assert set(ADAPTER.first_stage + ADAPTER.last_stage) <= set(ADAPTER.top_plan)


def test_tp_divisors():
    assert ADAPTER.tp_divisors(FLAVORS["debug"]) == {
        "n_heads": 8, "ffn hidden size": 512, "vocab_size": 4096, "max_seq_len": 1024}


def test_flops_hand_computed():
    # per layer: query, key, value, proj 64x64 each; fc 64x256 and proj 256x64 (biases do not count)
    per_layer = 4 * 64 * 64 + 2 * 64 * 256
    assert ADAPTER.matmul_params(SMALL) == (per_layer, 100 * 64)
    seq = 16
    matmul = 2 * per_layer + 100 * 64
    assert ADAPTER.flops_per_token(SMALL, seq) == 3 * (2 * matmul + 2 * 2 * seq * 64 * 2)
    # + biases (4 x 64, 256, 64) + two LayerNorms (weight and bias)
    assert ADAPTER.param_counts(SMALL)["layer"] == per_layer + 4 * 64 + 256 + 64 + 4 * 64
    assert ADAPTER.param_counts(SMALL)["embedding"] == (100 + 32) * 64


def test_init_std_table():
    m = GPT2(SMALL)
    std = 0.02 / math.sqrt(2 * SMALL.n_layers)
    assert m.init_std("layers.1.ln_1.weight") == "ones"
    assert m.init_std("layers.1.ln_2.weight") == "ones"
    assert m.init_std("ln_f.weight") == "ones"
    for bias in ("ln_f.bias", "layers.0.ln_1.bias", "layers.0.attn.query.bias", "layers.0.attn.proj.bias",
                 "layers.0.mlp.fc.bias", "layers.0.mlp.proj.bias"):
        assert m.init_std(bias) == "zeros", bias
    assert m.init_std("wpe.weight") == 0.01
    assert m.init_std("wte.weight") == 0.02
    assert m.init_std("lm_head.weight") == 0.02
    assert m.init_std("layers.0.attn.query.weight") == 0.02
    assert m.init_std("layers.0.mlp.fc.weight") == 0.02
    assert m.init_std("layers.1.attn.proj.weight") == std
    assert m.init_std("layers.1.mlp.proj.weight") == std
    # ... and init_weights uses it.
    m.init_weights(0)
    assert torch.equal(m.layers["1"].ln_2.weight, torch.ones(64))
    assert torch.equal(m.layers["1"].mlp.fc.bias, torch.zeros(256))
    assert abs(m.wpe.weight.std().item() - 0.01) < 0.001


def test_shapes_and_deterministic_init():
    args = FLAVORS["debug"]
    a, b = GPT2(args), GPT2(args)
    a.init_weights(3)
    b.init_weights(3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = GPT2(args)
    c.init_weights(4)
    assert not torch.equal(a.layers["0"].attn.query.weight, c.layers["0"].attn.query.weight)
    assert not torch.equal(a.wpe.weight, c.wpe.weight)
    # Different names draw different numbers under one seed.
    assert not torch.equal(a.layers["0"].attn.query.weight, a.layers["0"].attn.key.weight)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    assert a(tokens).shape == (2, 16, args.vocab_size)


@pytest.mark.parametrize("flavor", ["debug", "debug-tied"])
def test_meta_build_then_materialize_equals_eager(flavor):
    args = FLAVORS[flavor]
    with torch.device("meta"):
        m = GPT2(args)
    m.to_empty(device="cpu")
    m.tie_weights()
    m.init_weights(0, buffer_device=torch.device("cpu"))
    e = GPT2(args)
    e.init_weights(0)
    for (n, p), (_, q) in zip(m.named_parameters(), e.named_parameters()):
        assert torch.equal(p, q), n
    x = torch.randint(0, args.vocab_size, (1, 8))
    with torch.no_grad():
        assert torch.equal(m(x), e(x))


def test_tie_survives_meta_materialization():
    with torch.device("meta"):
        m = GPT2(FLAVORS["debug-tied"])
    assert m.lm_head.weight is m.wte.weight
    m.to_empty(device="cpu")
    m.tie_weights()
    assert m.lm_head.weight is m.wte.weight
    assert m.lm_head.weight.device.type == "cpu"


def test_untied_is_untied():
    m = GPT2(FLAVORS["debug"])
    m.init_weights(0)
    assert m.lm_head.weight is not m.wte.weight
    assert not torch.equal(m.lm_head.weight, m.wte.weight)


def test_pruned_stage_keeps_names_and_init():
    # Untied only: a tied head on a stage without the embedding would draw its own numbers, and the
    # pipeline refuses tied flavours for that reason.
    args = FLAVORS["debug"]
    whole = GPT2(args)
    whole.init_weights(0)
    full = dict(whole.named_parameters())
    splits = [(True, False, range(3)), (False, False, range(3, 5)), (False, True, range(5, 8))]
    for first, last, keep in splits:
        stage = prune(GPT2(args), first, last, keep)
        stage.init_weights(0)
        for n, p in stage.named_parameters():
            assert torch.equal(p, full[n]), n
    # A middle stage takes hidden states and returns them; the last returns logits.
    h = torch.randn(1, 8, args.dim)
    with torch.no_grad():
        assert prune(GPT2(args), False, False, range(3, 5))(h).shape == (1, 8, args.dim)
        assert prune(GPT2(args), False, True, range(5, 8))(h).shape == (1, 8, args.vocab_size)
        assert prune(GPT2(args), True, False, range(3))(torch.zeros(1, 8, dtype=torch.long)).shape == (
            1, 8, args.dim)


def test_stages_chained_equal_the_whole_model():
    args = FLAVORS["debug"]
    whole = GPT2(args)
    whole.init_weights(0)
    stages = [prune(GPT2(args), True, False, range(3)), prune(GPT2(args), False, False, range(3, 5)),
              prune(GPT2(args), False, True, range(5, 8))]
    x = torch.randint(0, args.vocab_size, (2, 12))
    with torch.no_grad():
        h = x
        for stage in stages:
            stage.init_weights(0)
            h = stage(h)
        assert torch.equal(h, whole(x))


@pytest.mark.parametrize("flavor", ["debug", "debug-tied"])
def test_causal(flavor):
    args = FLAVORS[flavor]
    m = GPT2(args)
    m.init_weights(0)
    x = torch.randint(0, args.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % args.vocab_size
    with torch.no_grad():
        a, b = m(x), m(y)
    assert torch.allclose(a[0, :8], b[0, :8])
    assert not torch.allclose(a[0, 8:], b[0, 8:])


# ---------------------------------------------------------------- a hand-written reference


def reference_forward(w: dict[str, torch.Tensor], args: GPT2Args, x: torch.Tensor) -> torch.Tensor:
    """GPT-2 written out from the weights: explicit LayerNorm, softmax attention with a causal
    mask, tanh-GELU. x: token ids [b, s] -> logits [b, s, v]."""

    def layer_norm(t, name):
        mean = t.mean(-1, keepdim=True)
        var = ((t - mean) ** 2).mean(-1, keepdim=True)
        return (t - mean) / torch.sqrt(var + args.norm_eps) * w[f"{name}.weight"] + w[f"{name}.bias"]

    def linear(t, name):
        return t @ w[f"{name}.weight"].T + w[f"{name}.bias"]

    def gelu_tanh(t):
        return 0.5 * t * (1 + torch.tanh(math.sqrt(2 / math.pi) * (t + 0.044715 * t ** 3)))

    b, s = x.shape
    nh, hd = args.n_heads, args.dim // args.n_heads
    h = w["wte.weight"][x] + w["wpe.weight"][:s]
    mask = torch.ones(s, s, dtype=torch.bool).tril()
    for i in range(args.n_layers):
        p = f"layers.{i}"
        a = layer_norm(h, f"{p}.ln_1")
        q, k, v = (linear(a, f"{p}.attn.{n}").reshape(b, s, nh, hd).permute(0, 2, 1, 3)
                   for n in ("query", "key", "value"))
        scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
        probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
        att = (probs @ v).permute(0, 2, 1, 3).reshape(b, s, args.dim)
        h = h + linear(att, f"{p}.attn.proj")
        m = layer_norm(h, f"{p}.ln_2")
        h = h + linear(gelu_tanh(linear(m, f"{p}.mlp.fc")), f"{p}.mlp.proj")
    h = layer_norm(h, "ln_f")
    head = w["wte.weight"] if args.tie_embeddings else w["lm_head.weight"]
    return h @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_matches_reference(tied):
    args = GPT2Args(dim=64, n_layers=2, n_heads=4, vocab_size=100, max_seq_len=32, tie_embeddings=tied)
    model = GPT2(args)
    # Random values everywhere, biases and norms too, so a dropped bias or scale would show.
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
            if n.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.add_(1.0)  # norm scales around 1
    weights = {n: p.detach() for n, p in model.named_parameters()}
    x = torch.randint(0, args.vocab_size, (2, 20), generator=gen)
    with torch.no_grad():
        got, want = model(x), reference_forward(weights, args, x)
    assert got.shape == (2, 20, args.vocab_size)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
