"""Optimizers as parts: the registry and its one-line errors, parameter groups by role, Muon pinned
to torch's, the flat engine's whole-parameter layout, and (spawned) Muon, Adafactor and a dotted
torch.optim class in every layout, equal to one process, with the planner's bytes exact."""

import dataclasses

import pytest
import torch
from harness import TINY, assert_matches, bytes_of, run_layouts, spawn_ranks

from torchpar.config import load_config
from torchpar.errors import ConfigError
from torchpar.models import MODELS
from torchpar.optim import (
    PARAM_GROUPS,
    CompactAdamW,
    Muon,
    build_optimizer,
    check_optimizer,
    ensure_state,
    optimizer_kind,
    param_role,
    rounding_drift,
    state_bytes,
)
from torchpar.parallel.flat import flat_layout

LLAMA = MODELS["llama3"]


def cfg_of(*overrides):
    return load_config(None, list(overrides)).optimizer


def test_muon_is_torchs_muon_on_whole_tensors():
    """torchpar's Muon (which also takes sharded matrices) steps exactly like torch.optim.Muon with
    its bf16 Newton-Schulz iteration, for tall and wide matrices and both lr adjustments."""
    for shape, adjust in (((12, 7), None), ((7, 12), "match_rms_adamw")):
        same_as_torch(shape, adjust)


def same_as_torch(shape, adjust):
    gen = torch.Generator().manual_seed(0)
    a = torch.nn.Parameter(torch.randn(shape, generator=gen))
    b = torch.nn.Parameter(a.detach().clone())
    kw = {"lr": 0.05, "weight_decay": 0.1, "adjust_lr_fn": adjust}
    ours, theirs = Muon([a], ns_dtype="bfloat16", **kw), torch.optim.Muon([b], **kw)
    for _ in range(3):
        g = torch.randn(shape, generator=gen)
        a.grad, b.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()
    assert torch.equal(a, b) and not torch.equal(a, torch.randn(shape, generator=gen))
    assert torch.equal(ours.state[a]["momentum_buffer"], theirs.state[b]["momentum_buffer"])


def test_muon_orthogonalizes_each_matrix_of_a_stack():
    """A stack [experts, rows, cols] steps as its matrices would each as a parameter of its own
    (one batched iteration, so equal within float noise), and --check's stand-ins include stacks."""
    gen = torch.Generator().manual_seed(0)
    stack = torch.nn.Parameter(torch.randn(3, 6, 10, generator=gen))
    alone = [torch.nn.Parameter(m.detach().clone()) for m in stack]
    ours, each = Muon([stack], lr=0.05, weight_decay=0.1), Muon(alone, lr=0.05, weight_decay=0.1)
    for _ in range(2):
        g = torch.randn(3, 6, 10, generator=gen)
        stack.grad = g.clone()
        for p, gi in zip(alone, g):
            p.grad = gi.clone()
        ours.step()
        each.step()
    assert torch.allclose(stack, torch.stack(list(alone)), atol=1e-6)
    with pytest.raises(ValueError, match="matrices and stacks of them"):
        Muon([torch.nn.Parameter(torch.ones(4))])
    check_optimizer(cfg_of("--optimizer.name", "muon"), {("matrix", 3), ("vector", 1)})


def test_roles_and_groups_follow_the_table():
    """Weight decay on matrices only (the hidden ones and the head), lr multipliers by role, and
    decay_all keeps the old behaviour; Muon takes the hidden matrices, AdamW the rest."""
    model = LLAMA.build(LLAMA.args("debug"))
    items = [(n, p, p) for n, p in model.named_parameters()]
    roles = {n: param_role(n, p.dim(), LLAMA) for n, p, _ in items}
    assert roles["tok_embeddings.weight"] == "embedding" and roles["output.weight"] == "head"
    assert roles["norm.weight"] == "vector" and roles["layers.0.attention.wq.weight"] == "matrix"
    mults = cfg_of("--optimizer.embedding_lr_mult", "0.5", "--optimizer.head_lr_mult", "2")
    opt = build_optimizer(items, mults, LLAMA)
    by_role = {g["role"]: g for g in opt.param_groups}
    assert {r: g["weight_decay"] for r, g in by_role.items()} == {
        "matrix": 0.1, "head": 0.1, "embedding": 0.0, "vector": 0.0}
    assert {r: g["lr"] for r, g in by_role.items()} == {
        "matrix": 3e-3, "head": 6e-3, "embedding": 1.5e-3, "vector": 3e-3}
    assert sum(len(g["params"]) for g in opt.param_groups) == len(items)
    old = build_optimizer(items, cfg_of("--optimizer.decay_all", "true"), LLAMA)
    assert {g["weight_decay"] for g in old.param_groups} == {0.1}
    muon = build_optimizer(items, cfg_of("--optimizer.name", "muon", "--optimizer.muon_lr", "0.04"), LLAMA)
    muon_part, adamw_part = muon.parts
    assert isinstance(muon_part, Muon) and isinstance(adamw_part, torch.optim.AdamW)
    muon_roles = [r for r, row in PARAM_GROUPS.items() if row["muon"]]
    assert [g["role"] for g in muon_part.param_groups] == muon_roles
    assert muon_part.param_groups[0]["lr"] == 0.04 and muon.param_groups[0] is muon_part.param_groups[0]


def test_muon_state_round_trips_through_its_state_dict():
    """Muon with AdamW is one optimizer: its state dict holds both parts' state, and loading it
    relinks the parts (a step after the load updates what was loaded)."""
    model = LLAMA.build(LLAMA.args("debug"))
    items = [(n, p, p) for n, p in model.named_parameters()]
    cfg = cfg_of("--optimizer.name", "muon")
    opt = build_optimizer(items, cfg, LLAMA)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    keys = {k for s in opt.state.values() for k in s}
    assert keys == {"momentum_buffer", "step", "exp_avg", "exp_avg_sq"}
    other = build_optimizer(items, cfg, LLAMA)
    other.load_state_dict(opt.state_dict())
    assert all(o.state is other.state for o in other.parts)
    assert all(g is h for g, h in zip(other.param_groups, [g for o in other.parts for g in o.param_groups]))


@pytest.mark.parametrize("overrides, message", [
    (["--optimizer.name", "adamm"], "optimizer.name = 'adamm' is not one of .* Did you mean 'adamw'"),
    (["--optimizer.name", "torch.optim.Nope"], "optimizer.name = 'torch.optim.Nope' cannot be imported"),
    (["--optimizer.name", "torch.nn.Linear"], "is not a torch.optim.Optimizer subclass"),
    (["--optimizer.kwargs", "momentom=0.9", "--optimizer.name", "muon"],
     "unexpected keyword argument 'momentom'"),
    (["--optimizer.kwargs", "adjust_lr_fn=sideways", "--optimizer.name", "muon"], "adjust_lr_fn"),
    (["--optimizer.kwargs", "lr=0.1"], "optimizer.kwargs.lr: set it through \\[optimizer\\] itself"),
])
def test_bad_optimizers_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        check_optimizer(cfg_of(*overrides))


@pytest.mark.parametrize("overrides, message", [
    (["--optimizer.name", "adafactor", "--parallelism.tensor_parallel_degree", "2",
      "--parallelism.zero_stage", "0"],
     "'adafactor' updates whole matrices, which tensor_parallel_degree = 2 keeps as DTensor shards"),
    (["--optimizer.name", "adafactor", "--parallelism.zero_stage", "3"], "zero_stage = 3 keeps as"),
    (["--optimizer.name", "muon", "--parallelism.zero_stage", "3", "--parallelism.cpu_offload", "true"],
     "cpu_offload"),
])
def test_layouts_an_optimizer_cannot_run_are_refused(overrides, message):
    from torchpar.plan import layout_from_config

    with pytest.raises(ConfigError, match=message):
        layout_from_config(load_config(TINY, overrides), 2)


def test_whole_layout_keeps_parameters_whole_and_balanced():
    """Whole-parameter ownership: every parameter the optimizer needs whole lies inside one rank's
    N-th of one bucket, the N-ths are equal, nothing overlaps, padding stays below N x the largest
    parameter of a bucket; the others come first, back to back, cut into buckets as before."""
    sizes = [4096, 64, 64, 4096, 1024, 2048, 2048, 64, 9000, 3, 5, 7]
    needs = [False, False, True, True, True, True, True, False, True, False, True, True]
    for n in (1, 2, 3, 4):
        starts, bounds = flat_layout(sizes, n, 1200, needs)  # (buckets: multiples of n)
        spans = sorted(zip(starts, [s + z for s, z in zip(starts, sizes)], needs))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
        sliced = [(s, e) for s, e, w in spans if not w]
        assert sliced[0][0] == 0 and all(a[1] == b[0] for a, b in zip(sliced, sliced[1:]))  # back to back
        for lo, hi in zip(bounds, bounds[1:]):
            assert (hi - lo) % n == 0
            inside = [(s, e) for s, e, w in spans if w and lo <= s < hi]
            if inside:
                region = (hi - lo) // n
                assert all((s - lo) // region == (e - 1 - lo) // region for s, e in inside)  # whole
                assert hi - lo - sum(e - s for s, e in inside) <= n * max(e - s for s, e in inside)
        assert bounds[-1] >= sum(sizes)
    assert flat_layout(sizes, 4, 1200)[0] == [sum(sizes[:i]) for i in range(len(sizes))]


def test_declared_state_bytes_equal_what_the_optimizers_keep():
    """The planner's per-parameter state bytes (declared per kind, measured for a dotted class)
    equal the bytes the real optimizers allocate, for every role's shape."""
    shapes = {"matrix": (8, 6), "head": (10, 8), "embedding": (10, 8), "vector": (8,)}
    f32 = "float32"
    for name, kwargs, dtype in (("adamw", "", f32), ("muon", "", f32), ("adafactor", "", f32),
                                ("torch.optim.SGD", "momentum=0.9", f32), ("torch.optim.Adagrad", "", f32),
                                ("adamw", "amsgrad=true", "bfloat16"), ("muon", "", "bfloat16")):
        cfg = cfg_of("--optimizer.name", name, *(["--optimizer.kwargs", kwargs] if kwargs else []),
                     "--optimizer.state_dtype", dtype)
        params = {r: torch.nn.Parameter(torch.randn(s)) for r, s in shapes.items()}
        opt = optimizer_kind(cfg).build({r: [p] for r, p in params.items()}, cfg)
        ensure_state(opt)
        for role, p in params.items():
            kept = sum(v.numel() * v.element_size() for v in opt.state[p].values() if v.dim() > 0)
            assert state_bytes(cfg, tuple(p.shape), role) == kept, (name, role)
            if dtype == "bfloat16":  # (every moment, Muon's AdamW part's included)
                assert {v.dtype for v in opt.state[p].values() if v.dim() > 0} == {torch.bfloat16}


def test_compact_adamw_is_torchs_adamw_op_for_op():
    """With float32 moments CompactAdamW steps exactly like torch's AdamW (foreach and for-loop, with
    and without amsgrad), also when a step's parameters are read in several runs (a small CHUNK);
    with bfloat16 moments it stores them as bf16 and stays within their rounding of fp32's."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 7), (3,), (4, 4)]
    start = [torch.randn(s, generator=gen) for s in shapes]
    kw = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.1}
    for amsgrad in (False, True):
        ps = {k: [torch.nn.Parameter(t.clone()) for t in start] for k in ("foreach", "loop", "ours", "bf16")}
        opts = {"foreach": torch.optim.AdamW(ps["foreach"], amsgrad=amsgrad, foreach=True, **kw),
                "loop": torch.optim.AdamW(ps["loop"], amsgrad=amsgrad, foreach=False, **kw),
                "ours": CompactAdamW(ps["ours"], amsgrad=amsgrad, state_dtype=torch.float32, **kw),
                "bf16": CompactAdamW(ps["bf16"], amsgrad=amsgrad, **kw)}
        opts["ours"].CHUNK = opts["bf16"].CHUNK = 30  # (runs of 35, 3 + 16 elements)
        for _ in range(4):
            grads = [torch.randn(s, generator=gen) for s in shapes]
            for key, opt in opts.items():
                for p, g in zip(ps[key], grads):
                    p.grad = g.clone()
                opt.step()
        for theirs in ("foreach", "loop"):
            assert all(torch.equal(a, b) for a, b in zip(ps["ours"], ps[theirs])), (amsgrad, theirs)
        state = opts["bf16"].state[ps["bf16"][0]]
        assert {k: v.dtype for k, v in state.items()} == {
            "step": torch.float32, "exp_avg": torch.bfloat16, "exp_avg_sq": torch.bfloat16,
            **({"max_exp_avg_sq": torch.bfloat16} if amsgrad else {})}
        # 4 steps, each element's update moved by at most 2^-7 of lr per rounded moment
        worst = max((a - b).abs().max().item() for a, b in zip(ps["bf16"], ps["ours"]))
        assert 0 < worst < 4 * 2 * 2 ** -7 * kw["lr"]


def test_moments_load_across_state_dtypes_without_an_fp32_copy():
    """A state dict of fp32 moments loads into bf16 moments (each value cast, nothing else changed)
    and back; bf16 moments load into bf16 moments as the very tensors given (torch's own load would
    first cast them to the parameters' fp32: a whole fp32 copy of the state at a resume)."""
    model = LLAMA.build(LLAMA.args("debug"))
    items = [(n, p, p) for n, p in model.named_parameters()]
    for name in ("adamw", "muon"):
        compact = cfg_of("--optimizer.name", name, "--optimizer.state_dtype", "bfloat16")
        fp32 = build_optimizer(items, cfg_of("--optimizer.name", name), LLAMA)
        bf16 = build_optimizer(items, compact, LLAMA)
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        fp32.step()
        bf16.load_state_dict(fp32.state_dict())
        for p in model.parameters():
            for key, v in fp32.state[p].items():
                want = v if key == "step" else v.to(torch.bfloat16)
                got = bf16.state[p][key]
                assert torch.equal(got, want) and got.dtype == want.dtype
        given = bf16.state_dict()
        again = build_optimizer(items, compact, LLAMA)
        again.load_state_dict(given)
        p = again.param_groups[0]["params"][0]  # (the state dict's parameter 0)
        assert all(again.state[p][k] is v for k, v in given["state"][0].items() if v.dim() > 0)
        back = build_optimizer(items, cfg_of("--optimizer.name", name), LLAMA)
        back.load_state_dict(given)
        assert all(back.state[p][k].dtype == torch.float32 and torch.equal(back.state[p][k], v.float())
                   for k, v in bf16.state[p].items())


# ---------------------------------------------------------------------------- spawned

MUON = ["--optimizer.name", "muon"]
LB, Z = "--training.local_batch_size", "--parallelism.zero_stage"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
ADAFACTOR = ["--optimizer.name", "adafactor", "--optimizer.lr", "0.01"]
SGD = ["--optimizer.name", "torch.optim.SGD", "--optimizer.kwargs", "momentum=0.9,nesterov=true",
       "--optimizer.lr", "0.1"]
# A mixture of experts: Muon orthogonalizes each expert's matrix of a stack [experts, rows, cols].
MOE = [*MUON, "--model.name", "moe"]
# Moments stored in bf16 (AdamW's, Muon's and its AdamW part's), in flat buckets, FSDP2 and TP shards.
BF16M = ["--optimizer.state_dtype", "bfloat16"]
REFS = {"muon": [*MUON, Z, "0"], "adafactor": [*ADAFACTOR, Z, "0"], "sgd": [*SGD, Z, "0"],
        "moe_muon": [*MOE, Z, "0"], "adamw_bf16m": [*BF16M, Z, "0"], "muon_bf16m": [*MUON, *BF16M, Z, "0"],
        "moe_bf16m": [*BF16M, "--model.name", "moe", Z, "0"]}
WORLD2 = {
    **{f"muon/dp2_zero{z}": [*MUON, LB, "4", Z, str(z)] for z in (0, 1, 2, 3)},
    "muon/tp2": [*MUON, *TP2, Z, "0"],
    "muon/pp2": [*MUON, *PP2, Z, "0"],
    "muon/dp2_zero2_bf16": [*MUON, LB, "4", Z, "2", "--training.mixed_precision_param", "bfloat16"],
    "adafactor/dp2_zero1": [*ADAFACTOR, LB, "4", Z, "1"],
    "sgd/dp2_zero2": [*SGD, LB, "4", Z, "2"],
    "sgd/dp2_zero3": [*SGD, LB, "4", Z, "3"],
    # each rank's experts orthogonalized where they are (ep), or each stack whole on its owner (ZeRO-1)
    "moe_muon/ep2_zero3": [*MOE, LB, "4", Z, "3", "--parallelism.expert_parallel_degree", "2"],
    "moe_muon/dp2_zero1": [*MOE, LB, "4", Z, "1"],
    **{f"adamw_bf16m/dp2_zero{z}": [*BF16M, LB, "4", Z, str(z)] for z in (1, 3)},
    "adamw_bf16m/tp2": [*BF16M, *TP2, Z, "0"],
    "adamw_bf16m/pp2": [*BF16M, *PP2, Z, "0"],
    "adamw_bf16m/cp2": [*BF16M, "--parallelism.context_parallel_degree", "2", Z, "2"],
    "muon_bf16m/dp2_zero2": [*MUON, *BF16M, LB, "4", Z, "2"],
    "muon_bf16m/dp2_zero3": [*MUON, *BF16M, LB, "4", Z, "3"],
    "moe_bf16m/ep2_zero3": [*BF16M, "--model.name", "moe", LB, "4", Z, "3",
                            "--parallelism.expert_parallel_degree", "2"],
}
WORLD4 = {
    "muon/dp_shard2_tp2_zero3": [*MUON, LB, "4", *TP2, Z, "3"],
    "muon/dp_shard2_tp2_zero1": [*MUON, LB, "4", *TP2, Z, "1"],
    "muon/hsdp2x2_zero2": [*MUON, LB, "2", "--parallelism.data_parallel_replicate_degree", "2", Z, "2"],
    "adamw_bf16m/dp_shard2_tp2_zero3": [*BF16M, LB, "4", *TP2, Z, "3"],
    "muon_bf16m/dp_shard2_tp2_zero1": [*MUON, *BF16M, LB, "4", *TP2, Z, "1"],
}


def _owner_worker(rank, world, out):
    import json

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    import torchpar.optim as optim

    mesh = init_device_mesh("cpu", (world,))
    group = {**torch.optim.Muon([torch.zeros(1, 1)]).defaults, "ns_dtype": None}
    gen = torch.Generator().manual_seed(0)
    shapes = [(5, 4), (3, 6), (8, 8), (7, 3), (2, 9)]  # uneven rows: a rank may hold none
    params = [distribute_tensor(torch.zeros(s), mesh, [Shard(0)]) for s in shapes]
    updates = [distribute_tensor(torch.randn(*s, generator=gen), mesh, [Shard(0)]) for s in shapes]
    calls, plain = [], optim.newton_schulz
    optim.newton_schulz = lambda g, *a: calls.append(tuple(g.shape)) or plain(g, *a)
    done = optim._owner_orthogonalized(params, updates, group)
    owned = list(calls)
    gathered = [optim.Muon._orthogonalized(u, p, group) for p, u in zip(params, updates)]
    equal = [torch.equal(done[id(p)].full_tensor(), g.full_tensor()) for p, g in zip(params, gathered)]
    with open(f"{out}/owner{rank}.json", "w") as f:
        json.dump({"owned": owned, "equal": equal}, f)


@pytest.mark.slow
def test_muon_orthogonalizes_each_zero3_matrix_once_on_its_owner():
    """Under ZeRO-3 (matrices split by rows) each matrix's Newton-Schulz runs on one rank of the
    shard group (round-robin: 5 matrices on 2 ranks are 3 and 2 runs, not 5 on each), and every
    rank's rows of the result equal those of gathering the matrix on every rank, bit for bit."""
    import json

    out = spawn_ranks(_owner_worker, 2)
    results = [json.loads(open(f"{out}/owner{r}.json").read()) for r in range(2)]
    assert [len(r["owned"]) for r in results] == [3, 2], results
    assert [tuple(s) for s in results[0]["owned"]] == [(5, 4), (8, 8), (2, 9)]
    assert all(all(r["equal"]) for r in results), results


@pytest.fixture(scope="module")
def refs():
    return run_layouts(1, REFS)


@pytest.fixture(scope="module")
def world2():
    return run_layouts(2, WORLD2)


@pytest.fixture(scope="module")
def world4():
    return run_layouts(4, WORLD4)


def check(run, ref, name):
    """The tables' tolerance; bf16 compute against fp32 as the layout tables compare it; moments
    stored in bf16 within the drift of their rounding (optim.rounding_drift)."""
    family, layout = name.split("/")
    if "bf16" in layout:
        bf16, fp32 = run["losses"], ref["losses"]
        assert bf16[-1] < bf16[0] - 0.1  # it learns
        assert max(abs(a - b) for a, b in zip(bf16, fp32)) < 0.05
    else:
        cfg = load_config(TINY, REFS[family]).optimizer
        drift = rounding_drift(cfg, len(ref["losses"]), [tuple(p.shape) for p in ref["params"].values()])
        assert (drift > 0) == ("bf16m" in family)
        assert_matches(run, ref, param_tol=max(1e-5, drift))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD2))
def test_world2_optimizers_match_one_process(world2, refs, name):
    check(world2[name], refs[name.split("/")[0]], name)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(WORLD4))
def test_world4_optimizers_match_one_process(world4, refs, name):
    check(world4[name], refs[name.split("/")[0]], name)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_planner_counts_each_optimizers_state_exactly(world, world2, world4):
    """Per-rank parameter, gradient and optimizer bytes predicted = held, for every optimizer
    and layout above (Muon's momentum for matrices, AdamW's moments for the rest, Adafactor's
    factors, SGD's momentum; whole-parameter ownership's padding)."""
    from torchpar.plan import layout_from_config
    from torchpar.plan import state_bytes as planned

    table, runs = {2: (WORLD2, world2), 4: (WORLD4, world4)}[world]
    for name, overrides in table.items():
        lay, model, args = layout_from_config(load_config(TINY, overrides), world)
        for rank in range(world):
            predicted = planned(model, args, lay, lay.rank_coords(rank))
            for key in ("param", "grad", "optim"):
                assert predicted[f"{key}_bytes"] == bytes_of(runs[name], key)[rank], (name, rank, key)


@pytest.mark.slow
def test_muon_trains_differently_from_adamw(refs):
    """The optimizer name reaches the trainer (Muon's losses are not AdamW's)."""
    adamw = run_layouts(1, {"adamw": [Z, "0"]})["adamw"]
    assert refs["muon"]["losses"][0] == adamw["losses"][0]  # (the first loss precedes any update)
    assert abs(refs["muon"]["losses"][-1] - adamw["losses"][-1]) > 1e-3


def test_config_fields_reach_the_optimizer():
    """A TOML [optimizer.kwargs] table and the command line give the same table."""
    cfg = load_config(None, ["--optimizer.kwargs", 'momentum=0.9,adjust_lr_fn="match_rms_adamw"'])
    assert cfg.optimizer.kwargs == {"momentum": 0.9, "adjust_lr_fn": "match_rms_adamw"}
    bare = load_config(None, ["--optimizer.kwargs", "momentum=0.9,adjust_lr_fn=match_rms_adamw"])
    assert bare.optimizer == cfg.optimizer
    assert dataclasses.replace(cfg.optimizer, kwargs={}) == load_config(None, []).optimizer


def test_a_schedule_restores_its_position_into_other_groups():
    """A checkpoint's schedule (of an optimizer with one group, as before parameter groups) sets
    each group of today's optimizer to its own peak lr x the restored step's factor."""
    from torchpar.optim import build_lr_scheduler, lr_factor

    sched_cfg = load_config(None, []).lr_scheduler
    old_opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], lr=1.0)
    old = build_lr_scheduler(old_opt, sched_cfg, 100)
    for _ in range(7):
        old_opt.step()
        old.step()
    model = LLAMA.build(LLAMA.args("debug"))
    cfg = cfg_of("--optimizer.name", "muon", "--optimizer.embedding_lr_mult", "0.5")
    opt = build_optimizer([(n, p, p) for n, p in model.named_parameters()], cfg, LLAMA)
    new = build_lr_scheduler(opt, sched_cfg, 100)
    new.load_state_dict(old.state_dict())
    factor = lr_factor(7, sched_cfg, 100)
    peaks = {"matrix": cfg.muon_lr, "head": cfg.lr, "embedding": cfg.lr * 0.5, "vector": cfg.lr}
    assert {g["role"]: g["lr"] for g in opt.param_groups} == {r: pytest.approx(p * factor, rel=1e-12)
                                                                for r, p in peaks.items()}
    assert new.last_epoch == 7 and new.get_last_lr() == [g["lr"] for g in opt.param_groups]


def test_rprop_is_declared_to_need_plain_tensors_because_a_dtensor_fails_its_step():
    """Rprop's foreach step calls _foreach_copy_ and its loop an in-place masked write, neither of
    which DTensor takes: ZeRO-3's and TP's shards fail its step, so its Kind says plain_tensors and
    the composition table refuses those layouts (when torch gains the rules, drop the name)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from torchpar.optim import PLAIN_TENSORS_ONLY, kind_of

    for name in PLAIN_TENSORS_ONLY:
        assert kind_of(load_config(None, ["--optimizer.name", f"torch.optim.{name}"]).optimizer).plain_tensors
    assert not kind_of(load_config(None, ["--optimizer.name", "torch.optim.SGD"]).optimizer).plain_tensors
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        for name in sorted(PLAIN_TENSORS_ONLY):
            for foreach in (True, False):
                p = torch.nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)]))
                p.grad = distribute_tensor(torch.full((4, 2), 0.5), mesh, [Shard(0)])
                with pytest.raises((NotImplementedError, RuntimeError)):
                    getattr(torch.optim, name)([p], lr=0.1, foreach=foreach).step()
    finally:
        dist.destroy_process_group()
