import torch

from torchpar.models.llama import ADAPTER, FLAVORS, ModelArgs, Transformer

num_params, param_counts = ADAPTER.num_params, ADAPTER.param_counts


def flops_per_token(args, seq):
    return ADAPTER.flops_per_token(args, seq)


def test_param_count_matches_numel_for_every_flavour():
    for name, args in FLAVORS.items():
        with torch.device("meta"):
            model = Transformer(args)
        assert num_params(args) == sum(p.numel() for p in model.parameters()), name


def test_known_sizes():
    assert abs(num_params(FLAVORS["8B"]) - 8.03e9) < 0.01e9
    assert abs(num_params(FLAVORS["70B"]) - 70.55e9) < 0.01e9
    assert abs(num_params(FLAVORS["405B"]) - 405.85e9) < 0.01e9
    assert abs(num_params(FLAVORS["gpt3-175B"]) - 175e9) < 0.5e9


def test_flops_hand_computed():
    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=32)
    # ffn hidden: int(2*256/3)=170 -> 192; per layer matmuls: wq 64*64, wk/wv 64*32 each, wo 64*64, 3*64*192
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192
    matmul = 2 * per_layer + 100 * 64
    seq = 16
    assert args.ffn_hidden == 192
    assert flops_per_token(args, seq) == 3 * (2 * matmul + 2 * 2 * seq * 64 * 2)
    assert param_counts(args)["layer"] == per_layer + 2 * 64


def test_shapes_and_deterministic_init():
    args = FLAVORS["debug"]
    a, b = Transformer(args), Transformer(args)
    a.init_weights(3)
    b.init_weights(3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    c = Transformer(args)
    c.init_weights(4)
    assert not torch.equal(a.layers["0"].attention.wq.weight, c.layers["0"].attention.wq.weight)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    assert a(tokens).shape == (2, 16, args.vocab_size)


def test_meta_build_then_materialize_equals_eager():
    args = FLAVORS["debug"]
    with torch.device("meta"):
        m = Transformer(args)
    m.to_empty(device="cpu")
    m.init_weights(0, buffer_device=torch.device("cpu"))
    e = Transformer(args)
    e.init_weights(0)
    x = torch.randint(0, args.vocab_size, (1, 8))
    assert torch.equal(m(x), e(x))


def test_tie_survives_meta_materialization():
    with torch.device("meta"):
        m = Transformer(FLAVORS["debug-tied"])
    m.to_empty(device="cpu")
    m.tie_weights()
    assert m.output.weight is m.tok_embeddings.weight


def test_pruned_stage_keeps_names_and_init():
    args = FLAVORS["debug"]
    whole = Transformer(args)
    whole.init_weights(0)
    stage = Transformer(args)
    del stage.layers["0"]
    stage.tok_embeddings = None
    stage.init_weights(0)
    assert torch.equal(stage.layers["5"].feed_forward.w1.weight, whole.layers["5"].feed_forward.w1.weight)
    h = torch.randn(1, 8, args.dim)
    assert stage(h).shape == (1, 8, args.vocab_size)


def test_causal_and_tied():
    args = FLAVORS["debug-tied"]
    m = Transformer(args)
    m.init_weights(0)
    assert m.output.weight is m.tok_embeddings.weight
    x = torch.randint(0, args.vocab_size, (1, 12))
    y = x.clone()
    y[0, 8] = (y[0, 8] + 1) % args.vocab_size
    with torch.no_grad():
        assert torch.allclose(m(x)[0, :8], m(y)[0, :8])


def test_shape_overrides_from_config_reach_the_model_and_the_planner():
    import pytest

    from torchpar.config import load_config
    from torchpar.errors import ConfigError
    from torchpar.models import MODELS, model_args
    from torchpar.plan import layout_from_config, state_bytes

    cfg = load_config(
        None,
        [
            "--model.dim",
            "256",
            "--model.n_heads",
            "16",
            "--model.n_kv_heads",
            "8",
            "--model.ffn_dim_multiplier",
            "1.3",
            "--model.rope_theta",
            "5e5",
            "--model.n_layers",
            "3",
        ],
    )
    args = model_args(cfg.model)
    assert (args.dim, args.n_heads, args.n_kv_heads, args.n_layers, args.rope_theta) == (256, 16, 8, 3, 5e5)
    assert args.vocab_size == FLAVORS["debug"].vocab_size  # the rest stays the flavour's
    with torch.device("meta"):
        model = Transformer(args)
    assert num_params(args) == sum(p.numel() for p in model.parameters())
    lay, family, planned = layout_from_config(cfg, 1)
    assert planned == args and state_bytes(family, planned, lay, {})["param_bytes"] == 4 * num_params(args)
    gpt2 = model_args(
        load_config(None, ["--model.name", "gpt2", "--model.dim", "192", "--model.n_heads", "6"]).model
    )
    assert (gpt2.dim, gpt2.n_heads) == (192, 6) and MODELS["gpt2"].num_params(gpt2) > 0
    for overrides, message in (
        (["--model.dim", "100"], "model.dim = 100 is not a multiple of model.n_heads = 8"),
        (["--model.n_kv_heads", "3"], "not a multiple of model.n_kv_heads = 3"),
        (["--model.name", "gpt2", "--model.rope_theta", "5"], "does not apply to the gpt2"),
        (["--model.max_seq_len", "-1"], "model.max_seq_len must be >= 0"),
    ):
        with pytest.raises(ConfigError, match=message):
            model_args(load_config(None, overrides).model)
