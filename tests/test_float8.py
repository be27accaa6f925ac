"""FP8 training through torchao ([quantize]): which layers convert and which never do, the size
rule, the one-line refusals, and (spawned) every layout under both recipes against the FP8
one-process run whose micro-batches hold the same rows (so the same scales), with the planner's
bytes."""

import dataclasses
import types

import pytest
import torch
from harness import TINY, assert_matches, bytes_of, run_layouts

from torchpar.config import load_config
from torchpar.errors import ConfigError
from torchpar.models import MODELS
from torchpar.parallel.float8 import (
    check_float8,
    convert,
    describe,
    float8_layers,
    float8_weights,
    gathered_in_float8,
    padded_groups,
    too_small,
)
from torchpar.plan import layout_from_config, state_bytes
from torchpar.selftest import bounds


def quantize(*overrides):
    return load_config(None, ["--quantize.float8", "tensorwise", "--quantize.skip_small", "false",
                              *overrides]).quantize


def meta_model(name: str, flavor: str = "debug"):
    model = MODELS[name]
    with torch.device("meta"):
        return model, model.build(model.args(flavor))


def test_the_blocks_linear_layers_convert_and_nothing_else():
    """Every linear layer of the blocks becomes torchao's Float8Linear under its own name (so
    plans, engines and checkpoints see the same parameters); the embedding, the head and a mixture
    of experts' router (quantize.exclude's default) stay; the routed experts' stacks are no
    nn.Linear and stay too."""
    from torchao.float8.float8_linear import Float8Linear

    for name in ("llama3", "moe"):
        model, module = meta_model(name)
        before = {k: (v.shape, v.dtype) for k, v in module.state_dict().items()}
        convert(module, model, quantize(), all_gather=False)
        converted = {n for n, m in module.named_modules() if isinstance(m, Float8Linear)}
        linear = {n for n, m in module.named_modules() if isinstance(m, torch.nn.Linear)}
        assert converted and all(n.startswith("layers.") for n in converted)
        assert linear - converted == ({"output", *(n for n in linear if n.endswith(".gate"))})
        assert {k: (v.shape, v.dtype) for k, v in module.state_dict().items()} == before
    model, module = meta_model("llama3")
    only = float8_layers(module, model, quantize("--quantize.modules", "layers.*.feed_forward.*"))
    assert only and all(".feed_forward." in n for n, _ in only)
    assert not float8_layers(module, model, quantize("--quantize.modules", "output,tok_embeddings"))


def routed_experts(recipe: str, *overrides):
    """A 2-block mixture of experts on the CPU, converted; its routed block's expert module."""
    model = MODELS["moe"]
    args = dataclasses.replace(model.args("debug"), n_layers=2)
    torch.manual_seed(0)
    module = model.build(args)
    convert(module, model, quantize("--quantize.float8", recipe, *overrides), all_gather=False)
    return module, module.layers["1"].feed_forward.experts


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_each_routed_experts_product_is_a_float8_linears(recipe):
    """The routed experts' products run in FP8: each expert's SwiGLU equals the one of three
    torchao Float8Linear layers holding its matrices, forward and backward, bit for bit, whether
    the module takes its grouped-GEMM path or its loop; and they are not the fp32 products."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    _, experts = routed_experts(recipe)
    assert experts.run.float8 == recipe
    counts = torch.tensor([10, 0, 17, 13, 3, 0, 5, 16])  # (an expert with no row, one of 3)
    x = torch.randn(int(counts.sum()), 128)
    grads = {}
    for grouped in (True, False):
        rows = x.clone().requires_grad_()
        out = experts(rows, counts, grouped=grouped)
        out.square().sum().backward()
        grads[grouped] = (out.detach(), rows.grad, *(p.grad.clone() for p in experts.parameters()))
        experts.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False]))
    out, x_grad, *w_grads = grads[True]
    config = Float8LinearConfig.from_recipe_name(recipe)
    start = 0
    for i, n in enumerate(counts.tolist()):
        if not n:  # (torchao's matmul takes no empty input: the module skips it)
            assert not any(grad[i].any() for grad in w_grads)
            continue
        layers = {}
        for name in ("w1", "w3", "w2"):
            w = getattr(experts, name)[i].detach()  # [in, out]
            linear = torch.nn.Linear(*w.shape, bias=False)
            linear.weight.data.copy_(w.t())
            layers[name] = Float8Linear.from_float(linear, config=config)
        rows = x[start:start + n].clone().requires_grad_()
        ref = layers["w2"](torch.nn.functional.silu(layers["w1"](rows)) * layers["w3"](rows))
        ref.square().sum().backward()
        mine = slice(start, start + n)
        assert torch.equal(ref.detach(), out[mine]) and torch.equal(rows.grad, x_grad[mine])
        for name, grad in zip(("w1", "w3", "w2"), w_grads):
            assert torch.equal(layers[name].weight.grad.t(), grad[i]), (i, name)
        start += n
    fp32 = experts.run.__wrapped__(x, counts, experts.w1, experts.w3, experts.w2).detach()
    assert ((out - fp32).norm() / fp32.norm()).item() > 1e-2


class MatmulCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Matrix products run (each FP8 one is an ``aten.mm`` of torchao's tensors)."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten.mm.default
        return func(*args, **(kwargs or {}))


def forward_backward(module, x: torch.Tensor, *more) -> tuple:
    """Output, input gradient, products run and elements saved for backward of ``module(x, *more)``."""
    rows, saved = x.clone().requires_grad_(), []
    with MatmulCount() as count, torch.autograd.graph.saved_tensors_hooks(
            lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = module(rows, *more)
        out.square().sum().backward()
    return out.detach(), rows.grad, count.n, sum(saved)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_a_frozen_fp8_layer_makes_no_weight_gradient(recipe):
    """LoRA's frozen base in FP8: torchao's matmul makes the weight's gradient whether or not
    anything asks for it (a third product, and the input kept for it). A frozen layer's output and
    input gradient are torchao's bit for bit, from two products instead of three, keeping the
    weight alone; a frozen routed expert's likewise."""
    import copy

    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear import Float8Linear

    from torchpar.parallel.float8 import frozen_matmuls

    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 32)
    config = Float8LinearConfig.from_recipe_name(recipe)
    torchao_s, ours = (Float8Linear.from_float(copy.deepcopy(linear), config=config).requires_grad_(False)
                       for _ in range(2))
    frozen_matmuls(ours)
    x = torch.randn(3, 5, 64)
    (ref, ref_grad, ref_mm, ref_saved), (out, grad, mm, saved) = (forward_backward(m, x)
                                                                  for m in (torchao_s, ours))
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)
    assert (ref_mm, mm, ref_saved - saved) == (3, 2, x.numel())

    _, experts = routed_experts(recipe)
    counts = torch.tensor([10, 0, 17, 13, 3, 0, 5, 16])
    x = torch.randn(int(counts.sum()), 128)
    ref, ref_grad, ref_mm, _ = forward_backward(experts, x, counts)
    out, grad, mm, _ = forward_backward(experts.requires_grad_(False), x, counts)
    assert torch.equal(out, ref) and torch.equal(grad, ref_grad)
    assert (ref_mm, mm) == (3 * 3 * 8, 2 * 3 * 8)  # (three matrices of 8 experts; empty ones plain)


def test_padding_each_experts_rows_to_16_keeps_the_product():
    """torchao's grouped FP8 GEMM takes groups starting at multiples of 16 rows and column-major
    matrices: padded_groups hands any GEMM exactly that, and gives back the unpadded product and
    its gradients (a plain grouped GEMM in its place on the CPU)."""
    counts = torch.tensor([10, 0, 17, 13, 16])
    x = torch.randn(int(counts.sum()), 32, requires_grad=True)
    stack = torch.randn(5, 32, 48, requires_grad=True)
    seen = []

    def gemm(a, b, offs):
        seen.append((offs.tolist(), b.stride()))
        return torch._grouped_mm(a, b, offs=offs)

    ends = torch.cumsum(counts, 0).to(torch.int32)
    out, ref = padded_groups(x, stack, ends, gemm), torch._grouped_mm(x, stack, offs=ends)
    assert seen == [([16, 16, 48, 64, 80], (32 * 48, 1, 32))]
    torch.testing.assert_close(out, ref)
    grad = torch.randn_like(ref)
    for a, b in zip(torch.autograd.grad(out, (x, stack), grad), torch.autograd.grad(ref, (x, stack), grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                    reason="torchao's grouped FP8 GEMM (triton kernels, torch._scaled_grouped_mm) needs "
                           "a CUDA GPU of compute capability 9.0")
def test_torchaos_grouped_fp8_gemm_is_the_loops_product():
    """On a Hopper GPU the experts' grouped FP8 GEMM (rowwise) gives what the per-expert loop of
    rowwise FP8 matmuls gives, within bf16's rounding of their different summation orders."""
    from torchpar.parallel.float8 import _stack_class

    stack = _stack_class("rowwise")
    counts = torch.tensor([40, 0, 17, 130], device="cuda")
    x = torch.randn(int(counts.sum()), 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16) * 0.02
    ends = torch.cumsum(counts, 0).to(torch.int32)
    grouped = torch._grouped_mm(x, w.as_subclass(stack), offs=ends)
    loop = torch.cat([stack.matmul(x[s:e], w[i]) for i, (s, e) in enumerate(zip([0, *ends[:-1].tolist()],
                                                                                 ends.tolist()))])
    torch.testing.assert_close(grouped, loop, rtol=2e-2, atol=2e-2)


def test_the_planner_and_the_start_up_note_count_the_routed_experts():
    """The planner's FP8 FLOPs count each expert stack's elements per expert times the experts a
    token reaches (top 2 of the debug model's 8); ZeRO-3 gathers them in the compute dtype. The
    start-up note names the converted experts, or their staying in fp32 when excluded. An expert
    stack too narrow on each tensor-parallel rank is refused in one line."""
    lay, model, args = layout_from_config(load_config(TINY, [*fp8("tensorwise"), "--model.name", "moe",
                                                             "--parallelism.zero_stage", "3"]), 1)
    weights = float8_weights(model, args, lay)
    for w in ("w1", "w3", "w2"):
        assert weights[f"layers.1.feed_forward.experts.{w}"] == 128 * 64 * 2
    assert "layers.0.feed_forward.w1.weight" in weights and not any("gate" in k for k in weights)
    assert lay.float8_all_gather and not any(".experts." in k for k in gathered_in_float8(model, args, lay))
    module, _ = routed_experts("rowwise")
    note = types.SimpleNamespace(float8="rowwise", zero_stage=3, float8_all_gather=False,
                                 param_dtype="float32")
    assert describe([module], note, True, torch.device("cpu")) == (
        "FP8 (rowwise) matmuls in this rank's 11 linear layers and routed experts of 1 block, all-gathered "
        "in float32; the experts by one FP8 matmul per expert (torchao's grouped FP8 GEMM needs CUDA compute "
        "capability 9.0)")
    module, _ = routed_experts("rowwise", "--quantize.exclude", "*.gate,*.experts")
    assert describe([module], note, True, torch.device("cpu")).endswith(
        "11 linear layers, all-gathered in float32; the routed experts stay in float32 (quantize.modules or "
        "quantize.exclude)")
    with pytest.raises(ConfigError, match=r"the expert stack layers\.1\.feed_forward\.experts\.w1 is 128 x 8 "
                                          r"\(in x out\) per expert on each of 8 tensor-parallel ranks.*add "
                                          r"'\*\.experts' to quantize\.exclude"):
        check_float8(model, args, lay.quantize, tp=8)


def test_layers_too_small_to_gain_are_left_by_the_stated_rule():
    """torchao's rule (N out, K in): Llama 3 8B's attention keys (1024 x 4096) stay in tensorwise,
    its queries (4096 x 4096) and feed-forward convert; rowwise also leaves the queries (N <= 4096
    and K <= 2048 does not hold: they convert) but not a 2048-wide output."""
    assert too_small("tensorwise", 1024, 4096) and not too_small("tensorwise", 4096, 4096)
    assert not too_small("tensorwise", 14336, 4096) and not too_small("tensorwise", 4096, 14336)
    assert too_small("rowwise", 1024, 4096) and too_small("rowwise", 2048, 8192)
    assert not too_small("rowwise", 4096, 4096) and too_small("rowwise", 4096, 2048)
    model, module = meta_model("llama3")  # (the debug model: every layer small)
    assert not float8_layers(module, model, quantize("--quantize.skip_small", "true"))


@pytest.mark.parametrize("overrides, message", [
    (["--model.name", "moe", "--quantize.exclude", ""],
     r"layer layers\.1\.feed_forward\.router\.gate is 8 x 128 \(out x in\), and FP8 matmuls need both "
     "multiples of 16"),
    (["--quantize.float8", "rowwize"], "quantize.float8 = 'rowwize' is not one of .* Did you mean 'rowwise'"),
])
def test_what_fp8_cannot_take_is_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        layout_from_config(load_config(TINY, [*fp8("tensorwise"), *overrides]), 1)


def test_a_gpu_without_fp8_tensor_cores_is_one_line(monkeypatch):
    """An A100 (compute capability 8.0) is refused before launch; an H100 (9.0) is not."""
    from torchpar import device

    monkeypatch.setattr(device, "device_type", lambda: "cuda")
    monkeypatch.setattr(device, "device_name", lambda: "NVIDIA A100-SXM4-80GB")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert "A100-SXM4-80GB (compute capability 8.0) has no FP8 tensor cores" in device.float8_matmuls()
    with pytest.raises(ConfigError, match="quantize.float8 = 'tensorwise': NVIDIA A100.* no FP8 tensor"):
        layout_from_config(load_config(TINY, fp8("tensorwise")), 1, "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert device.float8_matmuls() is None


def test_the_planner_prices_fp8_matmuls_at_the_fp8_peak():
    """Llama 3 8B on 8 H100s under tensorwise FP8 (the size rule leaves the keys and values): the
    converted layers' 6 FLOPs per weight element and token run at the FP8 peak (1,979 TFLOP/s), the
    rest at bf16's; an A100 (no FP8 peak) prices the step as without FP8; LoRA's frozen base makes
    fewer products."""
    from torchpar.plan import PRESETS, plan

    job = ["--model.flavor", "8B", "--training.seq_len", "4096", "--training.local_batch_size", "1",
           "--parallelism.zero_stage", "3"]
    plain, model, args = layout_from_config(load_config(TINY, job), 8, "cuda")
    fp8_lay = layout_from_config(load_config(TINY, [*job, "--quantize.float8", "tensorwise"]), 8, "cuda")[0]
    converted = args.n_layers * (2 * 4096 * 4096 + 3 * 4096 * 14336)  # wq, wo, w1, w2, w3
    assert sum(float8_weights(model, args, fp8_lay).values()) == converted
    tokens, h100 = 8 * 4096, PRESETS["H100-80GB"]
    saved = 6 * converted * tokens / 8 / 0.5 * (1 / 989e12 - 1 / 1979e12)
    def compute(lay, cluster):
        return plan(model, args, lay, cluster, 4096).compute_s

    assert compute(plain, h100) - compute(fp8_lay, h100) == pytest.approx(saved, rel=1e-9)
    a100 = PRESETS["A100-80GB"]
    assert compute(fp8_lay, a100) == compute(plain, a100)
    # LoRA from block 16 on: the frozen base's products are 2 FLOPs per element and token before
    # it (forward alone), 4 from it (no weight gradient), never 6.
    lora = [*job, "--lora.rank", "16", "--lora.modules", "layers.16.*,layers.17.*"]
    plain, fp8_lay = (layout_from_config(load_config(TINY, [*lora, *more]), 8, "cuda")[0]
                      for more in ([], ["--quantize.float8", "tensorwise"]))
    saved = (2 * 16 + 4 * 16) * converted / args.n_layers * tokens / 8 / 0.5 * (1 / 989e12 - 1 / 1979e12)
    assert compute(plain, h100) - compute(fp8_lay, h100) == pytest.approx(saved, rel=1e-9)


def test_a_probed_gpu_prices_fp8_at_its_measured_rate_times_the_datasheets_ratio():
    """layout = "auto" plans on a probed machine: its FP8 peak is the measured bf16 rate times the
    GPU's datasheet FP8 / bf16 ratio (2 on Hopper), none on a GPU without FP8 or a CPU."""
    from torchpar.device import fp8_gain

    assert fp8_gain("NVIDIA H100 80GB HBM3") == pytest.approx(1979 / 989)
    assert fp8_gain("NVIDIA H200") == pytest.approx(1979 / 989)
    assert fp8_gain("NVIDIA B200") == pytest.approx(2.0)
    assert fp8_gain("NVIDIA A100-SXM4-80GB") == fp8_gain("CPU") == 0


def test_layout_auto_searches_with_fp8_when_the_job_asks():
    """The search (layout = "auto") prices every candidate with the job's FP8: Llama 3 8B on 2
    H100s, each layout tensorwise, its ZeRO-3 ones gathering in FP8, the best faster than without."""
    from dataclasses import replace

    from torchpar.plan import PRESETS, search

    model = MODELS["llama3"]
    args, cluster = model.args("8B"), replace(PRESETS["H100-80GB"], gpus_per_node=2)
    q = load_config(None, ["--quantize.float8", "tensorwise"]).quantize
    plans = search(model, args, cluster, 8, 4096, quantize=q)
    assert plans and all(p.layout["float8"] == "tensorwise" for p in plans)
    assert {p.layout["float8_all_gather"] for p in plans} == {True, False}  # (ZeRO-3, the others)
    assert all(p.layout["float8_all_gather"] == (p.layout["zero_stage"] == 3) for p in plans)
    assert plans[0].tokens_per_sec > search(model, args, cluster, 8, 4096)[0].tokens_per_sec


def test_the_plan_command_searches_with_fp8(capsys):
    """``torchpar plan --model 8B --float8 tensorwise --json``: every layout it prints is FP8's, and
    the best is faster than without on 2 H100s."""
    import json

    from torchpar.commands import main

    best = {}
    for float8 in ("off", "tensorwise"):
        assert main(["plan", "--model", "8B", "--gpu", "H100-80GB", "--gpus-per-node", "2", "--top", "3",
                     "--json", "--float8", float8]) == 0
        plans = json.loads(capsys.readouterr().out)
        assert plans and {p["layout"]["float8"] for p in plans} == {float8}
        best[float8] = plans[0]["tokens_per_sec"]
    assert best["tensorwise"] > best["off"]


# ---------------------------------------------------------------------------- spawned


@pytest.mark.slow
def test_the_start_up_note_says_what_runs_in_fp8(tmp_path):
    """One step of a mixture of experts under FP8: the start-up lines name the recipe, the layers
    and expert modules converted and how the experts run."""
    from harness import cli
    from test_train import env

    job = ["train", "--config", str(TINY), *fp8("rowwise"), "--model.name", "moe", "--training.steps", "1",
           "--parallelism.zero_stage", "0", "--job.dump_folder", str(tmp_path / "out")]
    r = cli(job, env(tmp_path))
    assert r.returncode == 0, r.stderr
    # (2 blocks: 4 attention layers each, the dense block's feed-forward 3, the routed block's router left)
    assert ("torchpar: FP8 (rowwise) matmuls in this rank's 11 linear layers and routed experts of 1 block; "
            "the experts by one FP8 matmul per expert (torchao's grouped FP8 GEMM needs CUDA compute "
            "capability 9.0)") in r.stdout, r.stdout


Z, LB, G = "--parallelism.zero_stage", "--training.local_batch_size", "--training.global_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
MOE = ["--model.name", "moe"]
RECIPES = ("tensorwise", "rowwise")
# (name: reference, overrides): the reference is the one-process run whose micro-batches hold the
# rows each rank's micro-batch holds, so every tensor's scale covers the same values (a pipeline's
# microbatch of 1 row; a data-parallel rank's 4 or 2 of the 8). Under expert parallelism an expert
# computes the rows both ranks send it, all 8 at once, while each rank's linear layers see their 4:
# the ep2 cell puts the experts alone in FP8, against the one process holding all 8 rows. Context
# parallelism has no such reference (each rank scales its half of every sequence):
# selftest.FLOAT8_OTHER_SCALES bounds it.
EXPERTS_ONLY = ["--quantize.modules", "*.experts"]
ONE = {"one": [Z, "0"], "acc4": [Z, "0", LB, "4", G, "8"], "acc2": [Z, "0", LB, "2", G, "8"],
       "mb1": [Z, "0", LB, "1", G, "8"], "moe_experts": [*MOE, *EXPERTS_ONLY, Z, "0", LB, "8", G, "8"]}
WORLD2 = {
    "dp2_zero1": ("acc4", [LB, "4", Z, "1"]),
    "dp2_zero3": ("acc4", [LB, "4", Z, "3"]),  # (tensorwise: weights all-gathered in FP8)
    "tp2": ("one", [*TP2, Z, "0"]),
    "pp2": ("mb1", ["--parallelism.pipeline_parallel_degree", "2", Z, "0"]),
    "cp2": ("one", ["--parallelism.context_parallel_degree", "2", Z, "2"]),
    "ep2": ("moe_experts", [*MOE, *EXPERTS_ONLY, LB, "4", Z, "3",
                            "--parallelism.expert_parallel_degree", "2"]),
    "dp2_selective_compile": ("acc4", [LB, "4", Z, "3", "--training.activation_checkpoint", "selective",
                                       "--training.compile", "true"]),
}
WORLD4 = {
    "dp2_tp2_zero3": ("acc4", [LB, "4", *TP2, Z, "3"]),
    "hsdp2x2": ("acc2", [LB, "2", "--parallelism.data_parallel_replicate_degree", "2", Z, "3"]),
}


def fp8(recipe: str) -> list[str]:
    return ["--quantize.float8", recipe, "--quantize.skip_small", "false", "--model.n_layers", "2"]


@pytest.fixture(scope="module")
def runs():
    out = run_layouts(1, {"fp32": [Z, "0", "--model.n_layers", "2"],
                          **{f"{r}/{n}": [*fp8(r), *o] for r in RECIPES for n, o in ONE.items()}})
    for world, table in ((2, WORLD2), (4, WORLD4)):
        jobs = {f"{r}/{n}": [*fp8(r), *o] for r in RECIPES for n, (_, o) in table.items()}
        out.update(run_layouts(world, jobs))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_is_what_trains(runs, recipe):
    """The FP8 run is not the fp32 one (its matmuls did run in FP8): apart by more than the
    layouts' bound."""
    one, fp32 = runs[f"{recipe}/one"], runs["fp32"]
    worst = max(((one["params"][k] - v).norm() / v.norm()).item() for k, v in fp32["params"].items()
                if v.dim() >= 2)
    assert worst > 2 * bounds("cpu", "float32", float8=recipe, same_scales=True)["param_tol"]


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"{r}/{n}" for r in RECIPES for n in {**WORLD2, **WORLD4}])
def test_layouts_match_the_fp8_one_process_run(runs, name):
    recipe, layout = name.split("/")
    world, (reference, overrides) = next((w, t[layout]) for w, t in ((2, WORLD2), (4, WORLD4)) if layout in t)
    run, ref = runs[name], runs[f"{recipe}/{reference}"]
    assert_matches(run, ref, **bounds("cpu", "float32", float8=recipe, same_scales=layout != "cp2"))
    lay, model, args = layout_from_config(load_config(TINY, [*fp8(recipe), *overrides]), world)
    assert lay.float8_all_gather == (recipe == "tensorwise" and lay.zero_stage == 3)
    for rank in range(world):
        predicted = state_bytes(model, args, lay, lay.rank_coords(rank))
        for key in ("param", "grad", "optim"):
            assert predicted[f"{key}_bytes"] == bytes_of(run, key)[rank], (rank, key)
