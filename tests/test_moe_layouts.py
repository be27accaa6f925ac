"""The mixture-of-experts family trains the same under data, context, tensor, expert and pipeline
parallelism as in one process: losses, final parameters, the routers' figures (the largest load
over the mean, the balancing bias's range), the auxiliary balance loss, and the planner's bytes
per rank.

Routing ties are deterministic: the top k come from a stable sort of score + bias (ties to the
lower expert), and the bias moves from loads summed over every rank, the same numbers in every
layout. The runs use both balancing methods at once (the bias and the auxiliary loss)."""

import pytest
from harness import ROOT, TINY, assert_matches, bytes_of, run_layouts

from torchpar.config import load_config
from torchpar.plan import layout_from_config, state_bytes

pytestmark = pytest.mark.slow  # trains in spawned processes

Z = "--parallelism.zero_stage"
LB = "--training.local_batch_size"
MOE = ["--model.name", "moe", "--model.bias_rate", "0.01", "--model.balance_coeff", "0.01"]
# latent attention; sigmoid scores, a shared expert, route scale 2.5, group-limited routing; one
# multi-token prediction depth (a routed block with its own row of the bias, on the last stage)
DEEPSEEK = ["--model.name", "deepseek_v3", "--model.mtp_depth", "1"]
# gpt-oss's experts (biases, the clamped SwiGLU) and router bias, with its attention (sinks, biases, a
# window in every other layer, YaRN)
GPTOSS = ["--model.name", "gpt_oss"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
BIAS_ONLY = ["--model.balance_coeff", "0"]
BALANCE_ONLY = ["--model.bias_rate", "0"]
EP = "--parallelism.expert_parallel_degree"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
# LoRA on the attention and shared-expert linear layers; the routed experts (stacks, no linear layers)
# and the routers stay frozen
LORA = ["--lora.rank", "4", "--lora.alpha", "8"]


def pp(schedule, *more):
    return ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
            schedule, *more]


DOCS = ["--data.dataset", "files", "--data.path", str(ROOT / "tests" / "data" / "short_docs.jsonl"),
        "--data.document_masking", "true"]
WORLD2 = {
    **{f"dp2_zero{z}": [LB, "4", Z, str(z)] for z in (0, 1, 2, 3)},
    "dp2_zero3_deepseek": [LB, "4", Z, "3", *DEEPSEEK],
    "dp2_zero3_full_recompute": [LB, "4", Z, "3", "--training.activation_checkpoint", "full"],
    "dp2_zero1_selective": [LB, "4", Z, "1", "--training.activation_checkpoint", "selective"],
    "dp2_zero3_docmask": [LB, "4", Z, "3", *DOCS],
    # (the balance term and a capacity act per sequence, which cp splits: the bias alone here)
    "cp2_zero1_bias_only": [*CP2, Z, "1", *BIAS_ONLY],
    # latent attention's rotary key and narrower values through both ways of context parallelism
    "cp2_alltoall_deepseek_docmask_bias_only": [*CP2, "--parallelism.context_parallel_method", "alltoall",
                                                Z, "3", *DEEPSEEK, *BIAS_ONLY, *DOCS],
    "cp2_ring_deepseek_bias_only": [*CP2, "--parallelism.context_parallel_method", "ring", Z, "1", *DEEPSEEK,
                                    *BIAS_ONLY],
    "pp2_1F1B": pp("1F1B", Z, "0"),
    "pp2_Interleaved1F1B_deepseek": pp("Interleaved1F1B", Z, "0", *DEEPSEEK),
    "dp2_zero3_capacity": [LB, "4", Z, "3", "--model.capacity_factor", "1.0"],
    # Experts split over 2 ranks: tokens dispatched by all-to-all, the experts' gradients reduced
    # over the ranks holding the same experts (here none: ep = dp_shard).
    "ep2": [LB, "4", Z, "3", EP, "2"],
    "ep2_deepseek": [LB, "4", Z, "3", EP, "2", *DEEPSEEK],
    "ep2_full_recompute": [LB, "4", Z, "3", EP, "2", "--training.activation_checkpoint", "full"],
    "ep2_selective": [LB, "4", Z, "3", EP, "2", "--training.activation_checkpoint", "selective"],
    "ep2_docmask": [LB, "4", Z, "3", EP, "2", *DOCS],
    "ep2_capacity": [LB, "4", Z, "3", EP, "2", "--model.capacity_factor", "1.0"],
    # Tensor parallelism of the experts' and shared experts' hidden width, without EP.
    "tp2_deepseek": [Z, "3", *TP2, *DEEPSEEK],
    # the experts' biases split over ep (by expert) and tp (the hidden width's; the output bias whole,
    # added once after the partial sums)
    "ep2_gptoss": [LB, "4", Z, "3", EP, "2", *GPTOSS],
    "tp2_gptoss": [Z, "3", *TP2, *GPTOSS],
    "cp2_alltoall_gptoss_bias_only": [*CP2, Z, "1", *GPTOSS, *BIAS_ONLY],
    # frozen experts dispatched over 2 ranks, FSDP2 units with nothing to reduce
    "ep2_lora": [LB, "4", Z, "3", EP, "2", *LORA],
}
WORLD4 = {
    "ep2_dp_shard4": [LB, "2", Z, "3", EP, "2"],  # each expert sharded by ZeRO-3 over 2 ranks
    "ep4": [LB, "2", Z, "3", EP, "4"],
    "ep2_hsdp": [LB, "2", Z, "3", EP, "2", "--parallelism.data_parallel_replicate_degree", "2"],
    "ep2_tp2": [LB, "4", Z, "3", EP, "2", *TP2],
    "ep2_tp2_deepseek": [LB, "4", Z, "3", EP, "2", *TP2, *DEEPSEEK],
    "ep2_tp2_gptoss": [LB, "4", Z, "3", EP, "2", *TP2, *GPTOSS],
    "tp2_dp_shard2_deepseek": [LB, "4", Z, "3", *TP2, *DEEPSEEK],
    "pp2_cp2_deepseek_bias_only": pp("1F1B", Z, "1", *CP2, *DEEPSEEK, *BIAS_ONLY),
    "pp2_ep2_bias_only": pp("1F1B", LB, "4", Z, "3", EP, "2", *BIAS_ONLY),
    "pp2_ep2_balance_only": pp("1F1B", LB, "4", Z, "3", EP, "2", *BALANCE_ONLY),
}


def layouts(table: dict) -> dict:
    return {name: [*MOE, *overrides] for name, overrides in table.items()}


def ref_name(name: str) -> str:
    kinds = [k for k in ("deepseek", "gptoss", "docmask", "capacity", "bias_only", "balance_only", "lora")
             if k in name]
    return "_".join(["ref", *kinds])


@pytest.fixture(scope="module")
def refs():
    return run_layouts(1, layouts({"ref": [Z, "0"], "ref_deepseek": [Z, "0", *DEEPSEEK],
                                   "ref_docmask": [Z, "0", *DOCS],
                                   "ref_capacity": [Z, "0", "--model.capacity_factor", "1.0"],
                                   "ref_bias_only": [Z, "0", *BIAS_ONLY],
                                   "ref_deepseek_bias_only": [Z, "0", *DEEPSEEK, *BIAS_ONLY],
                                   "ref_deepseek_docmask_bias_only": [Z, "0", *DEEPSEEK, *BIAS_ONLY, *DOCS],
                                   "ref_balance_only": [Z, "0", *BALANCE_ONLY],
                                   "ref_gptoss": [Z, "0", *GPTOSS],
                                   "ref_gptoss_bias_only": [Z, "0", *GPTOSS, *BIAS_ONLY],
                                   "ref_lora": [Z, "0", *LORA]}))


@pytest.fixture(scope="module")
def world2():
    return run_layouts(2, layouts(WORLD2))


def figures(run: dict, key: str) -> list[float]:
    return [r[key] for r in run["logged"] if key in r]


@pytest.fixture(scope="module")
def world4():
    return run_layouts(4, layouts(WORLD4))


@pytest.mark.parametrize("name", [*WORLD2, *WORLD4])
def test_moe_layout_matches_one_process(request, refs, name):
    run = request.getfixturevalue("world2" if name in WORLD2 else "world4")[name]
    ref = refs[ref_name(name)]
    assert_matches(run, ref)
    for key in ("moe/max_load", "moe/bias_range", "moe/dropped", "loss/balance"):
        assert (key in run["step1"]) == (key in ref["step1"]), key
        assert figures(run, key) == pytest.approx(figures(ref, key), abs=1e-5), key


def test_balancing_is_on_and_moves(refs):
    """The bias moves (bias_rate 0.01: each expert by 0.01 a step, so the range after step n is
    at most 0.02 n), the balance term is logged near 1 x its coefficient, and only a capacity
    drops tokens."""
    ref = refs["ref"]
    ranges = figures(ref, "moe/bias_range")
    assert len(ranges) == 5 and all(0 < r <= 0.02 * n + 1e-6 for n, r in enumerate(ranges, 1))
    assert all(0.005 < b < 0.05 for b in figures(ref, "loss/balance"))
    assert all(m >= 1 for m in figures(ref, "moe/max_load"))
    assert figures(ref, "moe/dropped") == [0.0] * 5  # dropless; recomputed forwards count nothing
    # (the layouts with full and selective recomputation match these figures above)
    assert all(d > 0 for d in figures(refs["ref_capacity"], "moe/dropped"))


@pytest.mark.parametrize("world", [2, 4])
def test_planner_predicts_every_ranks_moe_bytes_exactly(request, world):
    """Expert stacks counted as (experts, rest) rows: FSDP2 pads the expert dimension; under
    expert parallelism each rank holds experts / ep of them, sharded over the rest."""
    runs = request.getfixturevalue(f"world{world}")
    for name, overrides in layouts(WORLD2 if world == 2 else WORLD4).items():
        lay, model, args = layout_from_config(load_config(TINY, overrides), world)
        for rank in range(world):
            predicted = state_bytes(model, args, lay, lay.rank_coords(rank))
            for key in ("param", "grad", "optim"):
                assert predicted[f"{key}_bytes"] == bytes_of(runs[name], key)[rank], (name, rank, key)
