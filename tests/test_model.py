import torch

from torchpar.models import MODELS
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


def test_flops_and_params_with_biases_and_a_window():
    """Biases count as parameters that multiply no activation (no matmul FLOPs); a layer sliding a
    window of w keys counts min(s, 2w) keys of attention where a full one counts s; every
    parameter the model builds is one of the planner's entries, in order, with its shape."""
    from dataclasses import replace

    args = ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=100, multiple_of=32)
    per_layer = 64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 192
    matmul, seq = 2 * per_layer + 100 * 64, 16
    biased = replace(args, attn_bias=True, sliding_window=3)
    assert [biased.window(i) for i in range(2)] == [3, 0]
    assert param_counts(biased)["layer"] == per_layer + 2 * 64 + 64 + 2 * 32 + 64
    assert flops_per_token(biased, seq) == 3 * (2 * matmul + 2 * 2 * (6 + seq) * 64)
    assert flops_per_token(replace(biased, sliding_window=seq), seq) == flops_per_token(args, seq)
    moe = MODELS["moe"]  # (its own count of active FLOPs: the same attention term)
    plain = moe.args("debug")
    assert (moe.flops_per_token(plain, seq) - moe.flops_per_token(replace(plain, sliding_window=3), seq)
            == 3 * 4 * (seq - 6) * plain.q_dim * (plain.n_layers // 2))
    with torch.device("meta"):
        model = Transformer(biased)
    built = [(n.removeprefix("layers.0."), tuple(p.shape)) for n, p in model.named_parameters()
             if n.startswith("layers.0.")]
    assert built == [(n, (r, c) if c > 1 else (r,)) for n, (r, c), _ in ADAPTER.block_params(biased)]
    assert [layer.attention.window for layer in model.layers.values()] == [3, 0]


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


def test_attention_sinks_take_a_share_of_each_softmax_and_nothing_else():
    """With sinks the scores are written out: a sink far below every score is plain attention
    (causal, inside documents given as spans or as a bias, grouped KV heads); a finite sink scales
    each query's output by the share its keys keep, 1 / (1 + exp(sink - logsumexp(scores))), and
    takes a gradient."""
    import torch.nn.functional as F

    from torchpar.models.common import DocumentSpans, attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen)
    k, v = (torch.randn(2, 2, 6, 8, generator=gen) for _ in range(2))
    docs = torch.tensor([[0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    keep = (docs[:, :, None] == docs[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()
    bias = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).unsqueeze(1)
    spans = DocumentSpans(((0, 3, 6), (0, 6)))
    far = torch.full((4,), -1e4)
    for mask in (None, spans, bias):
        assert torch.allclose(attention(q, k, v, mask, far), attention(q, k, v, mask), atol=1e-6)
    sinks = torch.randn(4, generator=gen).requires_grad_()
    got = attention(q, k, v, bias, sinks)
    rep_k, rep_v = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    lse = torch.logsumexp(q @ rep_k.mT / 8 ** 0.5 + bias, dim=-1, keepdim=True)  # [b, h, s, 1]
    kept = torch.sigmoid(lse - sinks.view(1, 4, 1, 1))
    want = F.scaled_dot_product_attention(q, rep_k, rep_v, attn_mask=bias) * kept
    assert torch.allclose(got, want, atol=1e-5)
    got.sum().backward()
    assert sinks.grad is not None and sinks.grad.abs().min() > 0


def test_a_tensor_parallel_plan_key_that_names_nothing_is_one_line():
    """Each key of a family's plan names a module or parameter (or an optional part left out: a
    block without q/k norms or sinks); a misspelt key, which would leave its module replicated
    under TP, is refused in one line, as is a parameter word on a module."""
    from torchpar.models import MODELS
    from torchpar.parallel.tensor import plan_problem

    for family in MODELS.values():
        for flavor in ("debug",):
            args = family.args(flavor)
            with torch.device("meta"):
                model = family.build(args)
            assert plan_problem(model, family.top_plan, "top_plan") is None, family.name
            for i, block in model.layers.items():
                assert plan_problem(block, family.layer_plan(args, int(i)), f"block {i}") is None, family.name
    with torch.device("meta"):
        model = Transformer(ADAPTER.args("debug", attn_sink=True))
    block = model.layers["0"]
    assert plan_problem(block, ADAPTER.block_plan, "block 0") is None
    misspelt = {**ADAPTER.block_plan, "attention.wqq": "colwise"}
    assert plan_problem(block, misspelt, "block 0") == (
        "the tensor-parallel plan's key 'attention.wqq' (block 0) names no module or parameter of "
        "TransformerBlock; correct the key in the model adapter's plan")
    assert "'heads' is a word for a parameter" in plan_problem(block, {"attention.wq": "heads"}, "block 0")
    assert "'colwise' is a word for a module" in plan_problem(block, {"attention.sinks": "colwise"}, "0")


def test_tensor_parallelism_refuses_a_misspelt_plan_key_before_splitting_anything():
    """The trainer's TP path checks the whole plan first: a fork's misspelt key is a ConfigError on
    every rank before the first module is split (a fake 2-rank group)."""
    from dataclasses import replace as copy

    import pytest
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchpar.errors import ConfigError
    from torchpar.parallel.layout import Layout
    from torchpar.parallel.tensor import apply_tensor_parallel

    class Misspelt(type(ADAPTER)):
        feed_forward_plan = {**ADAPTER.feed_forward_plan, "feed_forward.w4": "colwise"}

    args = copy(FLAVORS["debug"], n_layers=2)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        lay = Layout(tp=2)
        lay.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(args)
        with pytest.raises(ConfigError, match="'feed_forward.w4' \\(block 0\\) names no module"):
            apply_tensor_parallel(model, Misspelt(), args, lay.mesh["tp"], False, False)
        assert not any(type(p).__name__ == "DTensor" for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_tensor_parallelism_gives_dtensor_its_generator_without_a_world_broadcast(monkeypatch):
    """Left to itself DTensor makes its generator tracker at its first random op (LoRA's dropout
    on a tensor-parallel input, GPUs only) and broadcasts rank 0's state over the whole world
    there, which pipeline stages reach one after another: a hang. The TP path makes the tracker
    first, without the broadcast (a fake 2-rank group; a CUDA mesh stands in by its device type)."""
    import torch.distributed as dist
    from torch.distributed.tensor import _random as dtensor_random
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchpar.parallel import tensor
    from torchpar.parallel.layout import Layout

    made = []

    class Tracker:  # (torch's needs a GPU)
        def __init__(self, mesh, run_state_sync=True):
            made.append((mesh.device_type, run_state_sync))

    class CudaMesh:
        device_type = "cuda"

    monkeypatch.setattr(dtensor_random, "OffsetBasedRNGTracker", Tracker)
    monkeypatch.setattr(dtensor_random, "_rng_tracker", None)
    tensor.random_without_broadcast(CudaMesh())
    tensor.random_without_broadcast(CudaMesh())  # (once per process)
    assert made == [("cuda", False)] and isinstance(dtensor_random._rng_tracker, Tracker)

    monkeypatch.setattr(dtensor_random, "_rng_tracker", None)
    meshes, real = [], tensor.random_without_broadcast
    monkeypatch.setattr(tensor, "random_without_broadcast", meshes.append)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        lay = Layout(tp=2)
        lay.build_mesh("cpu")
        with torch.device("meta"):
            model = Transformer(ADAPTER.args("debug"))
        tensor.apply_tensor_parallel(model, ADAPTER, ADAPTER.args("debug"), lay.mesh["tp"], True, True)
        assert meshes == [lay.mesh["tp"]]
        real(lay.mesh["tp"])  # (on a CPU mesh: nothing to make)
        assert dtensor_random._rng_tracker is None
    finally:
        dist.destroy_process_group()


def test_a_field_newer_than_the_checkpoint_counts_as_its_default():
    """A checkpoint saved before a model field existed holds the model without it: resuming with
    the field at its default loads, with it set is the one-line shape refusal (not a missing key
    on every rank after the process group is up)."""
    import pytest

    from torchpar.checkpoint.files import check_model_matches
    from torchpar.errors import ConfigError

    args = ADAPTER.args("debug")
    older = {k: v for k, v in args.to_dict().items() if k != "attn_sink"}
    saved = {"model_name": "llama3", "model_flavor": "debug", "model_args": older}
    check_model_matches("checkpoint x", saved, "llama3", "debug", args)
    with pytest.raises(ConfigError, match="attn_sink: saved False vs config True"):
        check_model_matches("checkpoint x", saved, "llama3", "debug", ADAPTER.args("debug", attn_sink=True))


def test_a_checkpoint_loads_under_other_training_weights_but_not_another_shape():
    """What only weighs the loss or steers routing (the prediction depths' weight, a balance
    coefficient, the bias rate, a capacity) may change between a checkpoint and the run resuming it
    (DeepSeek-V3 lowered its prediction weight mid-run); a shape may not, in one line."""
    from dataclasses import replace

    from torchpar.checkpoint.files import check_model_matches
    from torchpar.errors import ConfigError
    from torchpar.models import MODELS

    family = MODELS["deepseek_v3"]
    saved_args = family.args("debug", mtp_depth=1, bias_rate=0.01)
    saved = {"model_name": "deepseek_v3", "model_flavor": "debug", "model_args": saved_args.to_dict()}
    later = replace(saved_args, mtp_weight=0.1, bias_rate=0.0, balance_coeff=0.01, capacity_factor=1.0)
    check_model_matches("ckpt", saved, "deepseek_v3", "debug", later)
    try:
        check_model_matches("ckpt", saved, "deepseek_v3", "debug", replace(saved_args, mtp_depth=2))
        raise AssertionError("a checkpoint of another shape loaded")
    except ConfigError as e:
        assert "mtp_depth: saved 1 vs config 2" in str(e), e
