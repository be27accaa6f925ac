"""The planner: its communication counts against a ledger of a real run, the tutorials'
worked examples, search and the command line."""

import json
import os
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from harness import ROOT, TINY, cli, side_by_side, spawn_ranks

from torchpar.errors import ConfigError
from torchpar.parallel.recompute import OPTIONS, option_overrides

Z = "--parallelism.zero_stage"
CP2 = ["--parallelism.context_parallel_degree", "2"]
MLA_FLAVOR = ["--model.flavor", "debug-mla"]
MTP = ["--model.mtp_depth", "2"]
LEDGER_LAYOUTS = {
    "dp2_zero0": [Z, "0", "--training.local_batch_size", "4"],
    "dp2_zero2": [Z, "2", "--training.local_batch_size", "4"],
    "dp2_zero3": [Z, "3", "--training.local_batch_size", "4"],
    "dp2_zero3_accum2": [Z, "3", "--training.local_batch_size", "2", "--training.global_batch_size", "8"],
    "dp2_zero3_accum2_unsharded": [Z, "3", "--training.local_batch_size", "2", "--training.global_batch_size",
                                   "8", "--parallelism.zero3_reduce_every_microstep", "false"],
    "tp2": [Z, "0", "--parallelism.tensor_parallel_degree", "2"],
    "tp2_no_sp_lp": [Z, "0", "--parallelism.tensor_parallel_degree", "2", "--parallelism.sequence_parallel",
                     "false", "--parallelism.loss_parallel", "false"],
    "pp2": [Z, "0", "--parallelism.pipeline_parallel_degree", "2"],  # rank 0: the first stage's sends
    # Conversations: each step all-reduces the count of its loss targets (an int64) beside the loss;
    # a z-loss's term rides with the step's other figures.
    "dp2_zero3_chat_zloss": [Z, "3", "--training.local_batch_size", "4", "--data.dataset", "files",
                             "--data.format", "chat",
                             "--data.path", str(ROOT / "tests/data/short_chat.jsonl"),
                             "--model.vocab_size", "4104", "--loss.z_loss", "1e-4"],
    # LoRA: FSDP2 reduce-scatters the adapters' gradients alone (its units still gather the frozen
    # base); the flat engine's buckets hold the adapters alone
    "dp2_zero3_lora": [Z, "3", "--training.local_batch_size", "4", "--lora.rank", "4"],
    "dp2_zero2_lora": [Z, "2", "--training.local_batch_size", "4", "--lora.rank", "4"],
    # ...and under TP its pieces a split layer leaves whole (A beside a column-wise weight, B beside a
    # row-wise one, and both beside the prediction depths' token-wise projection under sequence
    # parallelism) all-reduce their gradients once a step; the frozen norms none. No gradient flows
    # before the first adapter: not into the embedding, nor through the frozen modules before it
    # (attention, when the feed-forward layers alone are adapted; whole blocks, latents, routed
    # experts and shared ones); a pipeline stage before it gets none back.
    "tp2_lora": [Z, "0", "--parallelism.tensor_parallel_degree", "2", "--lora.rank", "4"],
    "tp2_no_sp_lp_lora_ffn": [Z, "0", "--parallelism.tensor_parallel_degree", "2",
                              "--parallelism.sequence_parallel", "false", "--parallelism.loss_parallel",
                              "false", "--lora.rank", "4", "--lora.modules", "layers.*.feed_forward.*"],
    "tp2_deepseek_lora_top": [Z, "0", "--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree",
                              "2", "--lora.rank", "4", "--lora.modules", "layers.2.*"],
    "tp2_mtp_lora": [Z, "0", *MTP, "--parallelism.tensor_parallel_degree", "2", "--lora.rank", "4"],
    # (a prediction depth's join runs before its block: adapted, the block's input gets a gradient)
    "tp2_mtp_lora_depth": [Z, "0", *MTP, "--parallelism.tensor_parallel_degree", "2", "--lora.rank", "4",
                           "--lora.modules", "layers.8.*"],
    "pp2_mtp_lora_top": [Z, "0", *MTP, "--parallelism.pipeline_parallel_degree", "2", "--lora.rank", "4",
                         "--lora.modules", "layers.7.*"],
    # (and no context-parallel exchange in backward, nor a recomputation, nor FSDP2's gather for
    # backward — but the one its prefetch issues for the block before the first adapter)
    "cp2_zero3_full_lora_top": [Z, "3", *CP2, "--training.activation_checkpoint", "full", "--lora.rank", "4",
                                "--lora.modules", "layers.5.*"],
    "cp2_ring_lora_top": [Z, "0", *CP2, "--parallelism.context_parallel_method", "ring", "--lora.rank", "4",
                          "--lora.modules", "layers.5.*"],
    # Context parallelism: all-to-alls around attention (twice over for the recomputed blocks), or
    # the ring's key/value passes and their gradients' passes back.
    "cp2": [Z, "0", *CP2],
    "cp2_zero3_full_every2": [Z, "3", *CP2, "--training.activation_checkpoint", "full",
                              "--training.activation_checkpoint_every", "2"],
    "cp2_ring_zero2": [Z, "2", *CP2, "--parallelism.context_parallel_method", "ring"],
    "cp2_ring_selective": [Z, "1", *CP2, "--parallelism.context_parallel_method", "ring",
                           "--training.activation_checkpoint", "selective"],
    # Latent attention: the latents' and rotary key's gradients summed over tp in backward; q, k
    # and narrower values through the all-to-alls, values widened to the keys' width on the ring.
    "tp2_mla": [Z, "0", *MLA_FLAVOR, "--parallelism.tensor_parallel_degree", "2"],
    "tp2_no_sp_lp_mla": [Z, "0", *MLA_FLAVOR, "--parallelism.tensor_parallel_degree", "2",
                         "--parallelism.sequence_parallel", "false", "--parallelism.loss_parallel", "false"],
    "cp2_mla": [Z, "0", *MLA_FLAVOR, *CP2],
    # A mixture of experts: routed experts' rows and shared experts' partial sums all-reduced (none
    # for shared experts the flavour leaves out).
    "tp2_moe": [Z, "0", "--model.name", "moe", "--parallelism.tensor_parallel_degree", "2"],
    "tp2_no_sp_lp_moe": [Z, "0", "--model.name", "moe", "--parallelism.tensor_parallel_degree", "2",
                         "--parallelism.sequence_parallel", "false", "--parallelism.loss_parallel", "false"],
    # (with a query latent: the attention's input gradient comes back summed, no reduction of it)
    "tp2_deepseek": [Z, "0", "--model.name", "deepseek_v3", "--parallelism.tensor_parallel_degree", "2"],
    "tp2_no_sp_lp_deepseek": [Z, "0", "--model.name", "deepseek_v3",
                              "--parallelism.tensor_parallel_degree", "2", "--parallelism.sequence_parallel",
                              "false", "--parallelism.loss_parallel", "false"],
    "cp2_ring_mla": [Z, "1", *MLA_FLAVOR, *CP2, "--parallelism.context_parallel_method", "ring"],
    # Multi-token prediction: the depths' blocks on the last stage, their tokens embedded and the
    # head (and loss parallelism's reductions) run again per depth, their embeddings sent between
    # stages beside the hidden states.
    "tp2_mtp": [Z, "0", *MTP, "--parallelism.tensor_parallel_degree", "2"],
    "tp2_no_sp_lp_mtp": [Z, "0", *MTP, "--parallelism.tensor_parallel_degree", "2",
                         "--parallelism.sequence_parallel", "false", "--parallelism.loss_parallel", "false"],
    "pp2_mtp": [Z, "0", *MTP, "--parallelism.pipeline_parallel_degree", "2"],
    "cp2_mtp": [Z, "3", *MTP, *CP2],
    # FP8: tensorwise weights all-gathered in FP8 (1 byte an element) and their scales' all-reduce
    # after the step; rowwise gathers in the compute dtype
    **{f"dp2_zero3_fp8_{recipe}": [Z, "3", "--training.local_batch_size", "4", "--quantize.float8", recipe,
                                   "--quantize.skip_small", "false"] for recipe in ("tensorwise", "rowwise")},
}


# On four ranks (pp 2 x tp 2): a pipeline's sends under sequence parallelism carry each tp rank's
# share of the tokens; under LoRA no gradient goes back to a stage (here two, interleaved) before
# the first adapter, nor flows through the frozen blocks before it on a later stage.
LEDGER_LAYOUTS_4 = {
    "pp2_tp2_Interleaved1F1B_lora_top": [Z, "0", "--parallelism.pipeline_parallel_degree", "2",
                                         "--parallelism.tensor_parallel_degree", "2",
                                         "--parallelism.pipeline_parallel_schedule", "Interleaved1F1B",
                                         "--lora.rank", "4", "--lora.modules", "layers.5.*"],
}


def _ledger_worker(rank, world, out, layouts):
    from torchpar.config import load_config
    from torchpar.parallel.ledger import CommLedger
    from torchpar.train import Trainer

    results = {}
    try:
        for name, overrides in layouts.items():
            trainer = Trainer(load_config(TINY, overrides + ["--job.dump_folder", f"{out}/{name}"]))
            batches = iter(trainer.dataloader)
            trainer.train_step(batches)  # the first step creates lazy state; measure the second
            trainer.model.state.zero_grad()
            with CommLedger(trainer.layout.mesh, views=trainer.layout.views) as ledger:
                trainer.train_step(batches)
            results[name] = {
                "sent": ledger.sent_bytes(),
                "records": ledger.records,
                "unknown": ledger.unknown,
            }
    finally:
        torch.save(results, f"{out}/ledger{rank}.pt")


@pytest.fixture(scope="module")
def ledgers():
    return _ledgers(LEDGER_LAYOUTS, 2)


def _ledgers(layouts: dict, world: int) -> dict:
    """Each layout's ledger on rank 0 and, under ``"last"``, on the last rank (a pipeline's last
    stage)."""
    out = spawn_ranks(_ledger_worker, world, layouts)
    first, last = (torch.load(f"{out}/ledger{rank}.pt", weights_only=False) for rank in (0, world - 1))
    return {name: {**first[name], "last": last[name]} for name in first}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEDGER_LAYOUTS))
def test_planner_communication_equals_the_ledger(ledgers, name):
    from torchpar.config import load_config
    from torchpar.plan import PRESETS, communication, layout_from_config

    cfg = load_config(TINY, LEDGER_LAYOUTS[name])
    lay, model, args = layout_from_config(cfg, 2)
    predicted = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len)
    measured = ledgers[name]
    assert not measured["unknown"], measured["unknown"]
    # Each of these layouts uses one mesh dimension besides the world-wide scalars; on 2 ranks
    # that dimension's group is the world group, so compare the total...
    assert sum(c["bytes"] for c in predicted.values()) == pytest.approx(
        sum(measured["sent"].values()), rel=0, abs=1e-6
    )
    # ...and that the bytes went over the dimension the planner says.
    if "pp2" in name:  # the last stage's sends: the gradients back (none to a stage with nothing trained)
        at_last = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len, pp_rank=1)
        assert sum(c["bytes"] for c in at_last.values()) == pytest.approx(
            sum(measured["last"]["sent"].values()), rel=0, abs=1e-6)
    dims = set(predicted) - {"world"}
    expected = ({"tp"} if "tp2" in name else {"pp"} if "pp2" in name
                else {"cp", lay.reduce_dim, lay.shard_dim} & dims if "cp2" in name
                else {"dp", "dp_shard"} & dims)
    assert dims == expected and dims
    if "cp2" in name:  # the exchanges themselves, kind by kind
        sent = sum(b for dim, kind, b, n in measured["records"] if kind == "all_to_all")
        assert sent == pytest.approx(predicted["cp"]["bytes"], rel=1e-9)


@pytest.mark.slow
def test_planner_pipeline_and_tensor_parallel_communication_equals_the_ledger_on_four_ranks():
    """Both stages' sends (rank 0: the first stage's tp rank 0; rank 3: the last's tp rank 1)."""
    from torchpar.config import load_config
    from torchpar.plan import PRESETS, communication, layout_from_config

    ledgers = _ledgers(LEDGER_LAYOUTS_4, 4)
    for name, overrides in LEDGER_LAYOUTS_4.items():
        cfg = load_config(TINY, overrides)
        lay, model, args = layout_from_config(cfg, 4)
        for pp_rank, measured in ((0, ledgers[name]), (1, ledgers[name]["last"])):
            assert not measured["unknown"], measured["unknown"]
            predicted = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len, pp_rank)
            assert sum(c["bytes"] for c in predicted.values()) == pytest.approx(
                sum(measured["sent"].values()), rel=0, abs=1e-6), (name, pp_rank)


def measured_state_bytes(overrides: list[str], world: int, rank: int) -> dict:
    """Build one rank of the real trainer's model and optimizer on a fake process group with
    fake tensors (shapes, no storage), run a forward and backward through its hooks, create
    the optimizer state, and read the bytes back as the trainer logs them."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchpar.config import load_config
    from torchpar.optim import OptimizerFactory, ensure_state
    from torchpar.plan import layout_from_config
    from torchpar.tools.shapes import build_shapes_only

    cfg = load_config(TINY, overrides)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        layout, family, args = layout_from_config(cfg, world)
        layout.build_mesh("cpu")
        model, fake_mode = build_shapes_only(family, args, layout, OptimizerFactory(cfg.optimizer, family))
        first = set(family.first_stage)
        with fake_mode:
            for part in model.parts:
                has_first = any(getattr(part, name, None) is not None for name in first)
                x = torch.zeros(1, 8, dtype=torch.long) if has_first else torch.zeros(1, 8, args.dim)
                out = part(x).float().sum()
                if out.requires_grad:  # (a stage that trains nothing has no backward)
                    out.backward()
            model.state.reduce_gradients()
            grads = model.state.state_bytes()["grad_bytes"]
            ensure_state(model.state.optimizer)
            return {**model.state.state_bytes(), "grad_bytes": grads}
    finally:
        dist.destroy_process_group()


def _pp(n):
    return ["--parallelism.pipeline_parallel_degree", str(n)]


def _tp(n):
    return ["--parallelism.tensor_parallel_degree", str(n)]


def test_a_stage_without_adapters_under_zero2_and_hsdp_holds_what_the_planner_says():
    """pp 2 x HSDP (2 replicas x 2 shards) x ZeRO-2, adapters on the last block alone: the first
    stage trains nothing. Its engine reduces nothing (it averaged a gradient shard it never made
    over the replicas: a crash at the first step), and the planner prices its empty gradient
    storage (a max over no buckets: a crash as the trainer started). Rank 0, in a fake 8-rank world."""
    from torchpar.config import load_config
    from torchpar.plan import PRESETS, layout_from_config, plan, state_bytes
    from torchpar.plan.estimate import rank_memory

    overrides = [Z, "2", *_pp(2), "--parallelism.data_parallel_replicate_degree", "2",
                 "--parallelism.data_parallel_shard_degree", "2", "--model.n_layers", "4",
                 "--lora.rank", "4", "--lora.modules", "layers.3.*"]
    cfg = load_config(TINY, overrides)
    lay, model, args = layout_from_config(cfg, 8)
    assert lay.rank_coords(0)["pp"] == 0
    measured = measured_state_bytes(overrides, 8, 0)
    assert measured == state_bytes(model, args, lay, lay.rank_coords(0))
    assert measured["grad_bytes"] == measured["optim_bytes"] == 0 < measured["param_bytes"]
    assert rank_memory(model, args, lay, cfg.training.seq_len, 0)["grad_bytes"] == 0
    # (priced as the trainer's first step prices it, with a GPU's overlap: no bucket to divide by)
    assert plan(model, args, lay, PRESETS["H100-80GB"], cfg.training.seq_len).step_s > 0


BIG = {  # name: (world, overrides, ranks to build)
    "8B_dp8_tp8_zero3": (64, ["--model.flavor", "8B", *_tp(8), Z, "3"], [0, 9, 63]),
    "8B_dp8_tp8_zero1": (64, ["--model.flavor", "8B", *_tp(8), Z, "1"], [0, 37]),
    "70B_tp8_pp8_dp8": (
        512,
        ["--model.flavor", "70B", *_tp(8), *_pp(8), Z, "3"],
        [0, 64 * 3 + 9, 64 * 7 + 63],
    ),
    "405B_tp8_pp16_dp8": (
        1024,
        ["--model.flavor", "405B", *_tp(8), *_pp(16), Z, "3", "--parallelism.pipeline_parallel_schedule",
         "GPipe"],
        [0, 64 * 8 + 5, 64 * 15 + 63],
    ),
}


@pytest.mark.slow  # (each rank is built in a spawned process)
@pytest.mark.parametrize("name", BIG)
def test_planner_bytes_equal_the_real_model_at_scale(name):
    """8B on 64 ranks, 70B on 512 as tp8 x pp8 x dp8, 405B on 1,024: each sampled rank (first,
    middle and last pipeline stages; varied tp and dp coordinates) holds exactly the bytes the
    planner predicts."""
    from torchpar.config import load_config
    from torchpar.plan import layout_from_config, state_bytes

    world, overrides, ranks = BIG[name]
    # The default bucket size: the tiny job's 1 MB would give the flat engine thousands of buckets,
    # each a few fake-tensor ops per parameter it touches.
    overrides = [*overrides, "--training.seq_len", "8", "--training.local_batch_size", "8",
                 "--parallelism.bucket_mb", "25"]
    lay, model, args = layout_from_config(load_config(TINY, overrides), world)
    # A fresh process per rank (DTensor caches meshes of a destroyed process group), forked from the
    # ranks' server, which has imported torch and the trainer (a new interpreter takes seconds).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torchpar.selftest"])  # (the server's, where it is not running yet)
    with ctx.Pool(2, maxtasksperchild=1) as pool:
        measured = pool.starmap(measured_state_bytes, [(overrides, world, rank) for rank in ranks])
    for rank, got in zip(ranks, measured):
        assert got == state_bytes(model, args, lay, lay.rank_coords(rank)), rank


# ---------------------------------------------------------------- the tutorials' worked examples


@pytest.fixture(scope="module")
def seeds():
    from torchpar.plan.seeds import seed_examples

    return {
        e["example"].split(" ")[0]
        + ("-qkv" if "QKV" in e["example"] else "")
        + ("-64" if "64 GPUs" in e["example"] else ""): e["exact"]
        for e in seed_examples()
    }


def test_seed_bert_large_data_parallel(seeds):
    e = seeds["BERT-Large"]
    n = 340e6
    assert e["fp16_params_MB"] == e["fp16_grads_MB"] == 680  # what the seed says
    assert e["adam_moments_GB"] == pytest.approx(2.72)  # "about 2.7 GB"
    assert e["total_mixed_precision_GB"] == pytest.approx(16 * n / 1e9)  # the seed's ~4 GB omits fp32 master
    assert e["allreduce_sent_per_gpu_MB"] == pytest.approx(2 * 7 / 8 * 680)  # ring, not 680 x 8
    assert e["allreduce_ms"] == pytest.approx(2 * 7 / 8 * 680e6 / 300e9 * 1e3)
    assert e["comm_share"] < 0.05  # the seed's conclusion holds


def test_seed_gpt3_memory_and_qkv_shard(seeds):
    d, L, V = 12288, 96, 50304
    n = L * (12 * d * d + 2 * d) + 2 * V * d + d  # by hand: blocks, embedding + head, final norm
    e = seeds["GPT-3"]
    assert e["params"] == n and e["fp16_weights_GB"] == pytest.approx(2 * n / 1e9)  # ~350 GB
    assert e["mixed_precision_adam_TB"] == pytest.approx(16 * n / 1e12) and e["mixed_precision_adam_TB"] > 1.2
    q = seeds["GPT-3-qkv"]
    assert q["qkv_fp16_MB"] == pytest.approx(12288 * 36864 * 2 / 1e6)
    assert q["shard_cols"] == 4608 and q["shard_fp16_MB"] == pytest.approx(12288 * 4608 * 2 / 1e6)


def test_seed_pipeline_bubble_and_3d_layout(seeds):
    e = seeds["PP"]
    assert e["bubble_GPipe"] == pytest.approx(3 / 19, abs=1e-12) and e["bubble_1F1B"] == pytest.approx(
        3 / 19, abs=1e-12
    )
    assert e["microbatch_size"] == 128
    g = seeds["175B-64"]
    d = 12288
    assert g["params_per_gpu_middle_stage"] == 24 * (
        12 * d * d // 8 + 2 * d
    )  # TP shards matmuls, norms stay whole
    assert g["mixed_precision_GB_no_zero"] > 80 > g["mixed_precision_GB_zero1"]


def test_seed_deepspeed_batch_arithmetic(seeds):
    from torchpar.errors import ConfigError
    from torchpar.parallel.layout import grad_accum_steps

    e = seeds["DeepSpeed"]
    assert e["accumulation"] == 2 and e["global_batch"] == 32
    with pytest.raises(ConfigError, match="not a multiple of 16"):
        grad_accum_steps(4, 40, dp=4)


# ---------------------------------------------------------------- activations, search, command line


# (family, flavour, batch, seq): two sequence lengths of the debug and of the ~125M flavours.
ACTIVATION_MODELS = [("llama3", "debug", 4, 64), ("llama3", "debug", 2, 256), ("gpt2", "debug", 4, 64),
                     ("gpt2", "debug", 2, 256), ("llama3", "125M", 1, 128), ("gpt2", "124M", 1, 128),
                     ("llama3", "125M", 1, 384), ("gpt2", "124M", 1, 384)]
# gpt-oss's attention (sinks, biases, a window in every other layer): the planner traces a sliding
# block, the larger kind (its mask and its repeated KV heads), for every block
GPT_OSS = ("llama3", "debug-gptoss", 4, 64)
# latent attention: its latents and the shared rotary key held whole on every tp rank; without and
# with a query latent (a flavour's shape overrides follow its name)
MLA = ("llama3", "debug-mla", 4, 64)
MLA_Q = ("llama3", "debug-mla q_lora_rank=64", 4, 64)
# mixtures of experts: a dense block and routed ones (each kind traced), the experts' grouped GEMMs
# kept by selective recomputation; under TP each rank runs the routed module whole with its share of
# the experts' width; DeepSeek-V3's shared experts and latent attention
MOE_MODELS = [("moe", "debug", 4, 64), ("deepseek_v3", "debug", 4, 64)]
ACTIVATION_MODELS += [GPT_OSS, MLA, MLA_Q, *MOE_MODELS]


def _activation_worker(rank, world, out, cases):
    from torchpar.models import MODELS
    from torchpar.parallel.layout import Layout
    from torchpar.verify import activation_check

    results = []
    for family, flavor, batch, seq, sp, policy, every, *context in cases:
        model = MODELS[family]
        # (a context-parallel method: the ranks are cp, else tp)
        degrees = {"cp": world, "cp_method": context[0]} if context else {"tp": world}
        lay = Layout(**degrees, sequence_parallel=sp, loss_parallel=world > 1, activation_checkpoint=policy,
                     activation_checkpoint_every=every, local_batch_size=batch)
        lay.build_mesh("cpu")
        name, *shape = flavor.split()
        shape = {k: int(v) for k, v in (field.split("=") for field in shape)}
        r = activation_check(model, model.args(name, **shape), lay, batch, seq)
        dims = f"cp{world} {context[0]}" if context else f"tp{world}"
        results.append({"case": [family, flavor, batch, seq, dims, "sp" if sp else "", policy, every],
                        "block_ratios": r["block_ratios"], "ratio": r["ratio"], "bytes": r["measured_bytes"]})
    if rank == 0:
        with open(f"{out}/activations.json", "w") as f:
            json.dump(results, f)


def _measured(worker, world: int, cases: list, file: str) -> list:
    """``worker``'s results of ``cases`` (it writes them to ``file``); on one rank, in two
    processes side by side."""
    def run(part):
        with open(f"{spawn_ranks(worker, world, part)}/{file}") as f:
            return json.load(f)

    return side_by_side(run, cases) if world == 1 else run(cases)


def _activation_ratios(world, cases):
    results = _measured(_activation_worker, world, cases, "activations.json")
    for r in results:
        blocks = " ".join(f"{x:.3f}" for x in r["block_ratios"])
        print(*r["case"], "blocks", blocks, f"whole {r['ratio']:.3f}")
    return results


@pytest.mark.slow
def test_activations_predicted_from_structure_match_one_process():
    """Bytes each block, and the whole forward + loss, hold for backward on one process: the
    planner's meta-device trace against the real fp32 model on the CPU, for every recomputation
    policy, both families, two sequence lengths and the ~125M flavours."""
    cases = [(*m, False, *p) for m in ACTIVATION_MODELS for p in OPTIONS.values()]
    results = _activation_ratios(1, cases)
    for r in results:
        assert all(0.9 <= x <= 1.1 for x in r["block_ratios"]) and 0.9 <= r["ratio"] <= 1.1, r
    # Less memory for more recomputation, in the order the planner's search offers them.
    for m in range(len(ACTIVATION_MODELS)):
        held = {tuple(r["case"][-2:]): r["bytes"] for r in results[len(OPTIONS) * m: len(OPTIONS) * (m + 1)]}
        assert held[("none", 1)] > held[("selective", 1)] > held[("full", 1)], held
        assert held[("none", 1)] > held[("full", 2)] > held[("full", 1)], held


@pytest.mark.slow
def test_activations_predicted_under_tensor_and_sequence_parallelism():
    """The same on one rank of TP = 2, with and without sequence parallelism (loss parallel on):
    the trace of one tp = 1 block divided by the rules of the modules' TP styles."""
    cases = [(*m, sp, policy, 1) for m in (*ACTIVATION_MODELS[:5], GPT_OSS, MLA, MLA_Q, *MOE_MODELS)
             for sp in (False, True) for policy in ("none", "selective", "full")]
    for r in _activation_ratios(2, cases):
        assert all(0.9 <= x <= 1.1 for x in r["block_ratios"]) and 0.9 <= r["ratio"] <= 1.1, r


@pytest.mark.slow
def test_activations_predicted_under_context_parallelism():
    """The same on one rank of cp = 2 (each holds half of every sequence), all-to-all and ring
    attention: the trace of one block at half the sequence (the ring keeps its own KV heads)."""
    cases = [(*m, False, policy, 1, method) for m in (*ACTIVATION_MODELS[:4], GPT_OSS, MLA, MLA_Q)
             for policy in ("none", "selective", "full") for method in ("alltoall", "ring")
             if m != GPT_OSS or method == "alltoall"]  # (the ring refuses sinks and windows)
    for r in _activation_ratios(2, cases):
        assert all(0.9 <= x <= 1.1 for x in r["block_ratios"]) and 0.9 <= r["ratio"] <= 1.1, r


def _lora_activation_worker(rank, world, out, cases):
    from torchpar.models import MODELS
    from torchpar.parallel.layout import Layout
    from torchpar.verify import activation_check

    model = MODELS["llama3"]
    args = model.args("debug", n_layers=4)
    results = []
    for modules, policy, sp in cases:
        lora = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, modules=[modules], exclude=["*.gate"])
        lay = Layout(tp=world, sequence_parallel=sp, loss_parallel=world > 1, activation_checkpoint=policy,
                     local_batch_size=2, lora_rank=4, lora=lora)
        lay.build_mesh("cpu")
        r = activation_check(model, args, lay, 2, 64)
        results.append({"case": [modules, policy, world, sp], **{k: r[k] for k in (
            "block_ratios", "measured_blocks", "predicted_blocks", "ratio")}})
    if rank == 0:
        with open(f"{out}/activations.json", "w") as f:
            json.dump(results, f)


@pytest.mark.slow
def test_activations_predicted_under_lora():
    """Under LoRA a frozen weight keeps nothing for its own gradient, and nothing before the first
    adapted layer keeps anything: the planner traces the block with its adapters and frozen base.
    Every layer, attention's alone, the last block's, one block's feed-forward; each policy; one
    process and tp 2 with sequence parallelism; with adapters in every block, each policy holding
    less than the one before. (Where
    the first adapted block is recomputed, its kept input is the previous block's output: the
    measurement counts it there, the planner in the block that keeps it — the pair's sum is
    compared.)"""
    patterns = ("layers.*", "layers.*.attention.*", "layers.3.*", "layers.2.feed_forward.*")
    first = {"layers.3.*": 3, "layers.2.feed_forward.*": 2}
    for world, sp in ((1, False), (2, True)):
        cases = [(m, policy, sp) for m in patterns for policy in ("none", "selective", "full")]
        results = _measured(_lora_activation_worker, world, cases, "activations.json")
        for r in results:
            blocks = " ".join(f"{x:.3f}" for x in r["block_ratios"])
            print(*r["case"], "blocks", blocks, f"whole {r['ratio']:.3f}")
            measured, predicted = r["measured_blocks"], r["predicted_blocks"]
            k = first.get(r["case"][0], 0)
            if k:  # nothing held before the block before the first adapted one; that pair summed
                assert measured[:k - 1] == predicted[:k - 1] == [0] * (k - 1), r
                measured = [measured[k - 1] + measured[k], *measured[k + 1:]]
                predicted = [predicted[k - 1] + predicted[k], *predicted[k + 1:]]
            assert all(0.9 <= m / p <= 1.1 for m, p in zip(measured, predicted)), r
            assert 0.95 <= r["ratio"] <= 1.05, r
        # Less memory for more recomputation under LoRA too, adapters in every block: selective
        # recomputes their low-rank products (it kept them with the matmuls', above what no
        # recomputation holds).
        for m in patterns[:2]:
            held = [sum(r["measured_blocks"]) for r in results if r["case"][0] == m]
            assert held[0] > held[1] > held[2], (m, world, held)


def _peak_worker(rank, world, out, cases):
    from torchpar.config import load_config
    from torchpar.verify import step_peak_check

    results = []
    for overrides, option in cases:
        cfg = load_config(TINY, [*overrides, *option_overrides(*option), "--job.dump_folder",
                                 f"{out}/run", "--validation.enable", "false"])
        results.append(step_peak_check(cfg))
    with open(f"{out}/peaks.json", "w") as f:
        json.dump(results, f)


@pytest.mark.slow
def test_recomputation_peak_memory_of_a_real_step_against_the_planner():
    """A real training step whose activations dominate (batch 8 x 256 tokens): the most bytes
    alive at once, plus parameters and Adam state, falls in the order none > selective >
    every-2 > full, and the planner's device peak is within 10% of each, in the same order; with
    multi-token prediction too."""
    shapes = {f"{family} debug": ["--model.name", family, "--training.local_batch_size", "8",
                                  "--training.seq_len", "256"] for family in ("llama3", "gpt2")}
    # (two prediction depths: two more blocks, each depth's logits and log-softmax)
    shapes["llama3 debug mtp2"] = [*shapes["llama3 debug"], *MTP]
    cases = [(overrides, option) for overrides in shapes.values() for option in OPTIONS.values()]
    peaks = iter(_measured(_peak_worker, 1, cases, "peaks.json"))
    for shape in shapes:
        rows = [next(peaks) for _ in OPTIONS]
        print(shape, [f"{r['measured_bytes'] / 2**20:.1f}/{r['predicted_bytes'] / 2**20:.1f}" for r in rows])
        assert all(0.9 <= r["ratio"] <= 1.1 for r in rows), rows
        for key in ("measured_bytes", "predicted_bytes"):
            assert all(a[key] > b[key] for a, b in zip(rows, rows[1:])), (shape, key, rows)


def run_plan(*args):
    return cli(["plan", *args], dict(os.environ))


@pytest.mark.slow
def test_plan_command_json_and_exact_config():
    r = run_plan("--config", str(TINY), "--nproc", "2", "--gpu", "A100-80GB", "--json")
    assert r.returncode == 0, r.stderr
    (p,) = json.loads(r.stdout)
    assert set(p) == {"layout", "memory", "communication", "bubble", "compute_s", "bubble_s", "step_s",
                      "tokens_per_sec", "mfu", "fits"}
    assert p["layout"]["dp_shard"] == 2 and p["layout"]["zero_stage"] == 3 and p["fits"]
    assert {"param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "logits_bytes", "gathered_bytes",
            "unsharded_grad_bytes", "cpu_bytes", "total_bytes", "host_bytes_per_node", "startup_peak",
            "checkpoint_peak"} == set(p["memory"])
    assert p["memory"]["param_bytes"] == 10494464 // 2  # the debug model's fp32 bytes, halved by ZeRO-3
    r = run_plan("--model", "bogus")
    assert r.returncode == 2 and "torchpar: error: --model 'bogus' is not a llama3 flavour" in r.stderr


def test_search_follows_the_tutorials_reasoning():
    from torchpar.models import MODELS
    from torchpar.plan import PRESETS, explain, search

    a100 = PRESETS["A100-80GB"]
    model = MODELS["llama3"]
    # 8B on one node of 8 x A100-80GB: data parallel + ZeRO alone fits, and wins.
    args = model.args("8B")
    plans = search(model, args, a100, 64, 4096)
    best = plans[0]
    assert best.fits and best.layout["tp"] == 1 and best.layout["pp"] == 1
    assert "1. data parallel + ZeRO alone" in explain(model, args, plans, a100)
    assert "-> fits" in explain(model, args, plans, a100)
    # 70B on the same node: 16 bytes x 70.6B / 8 > 80 GB, so nothing without offload fits.
    args = model.args("70B")
    plans = search(model, args, a100, 64, 4096)
    assert all(p.layout["cpu_offload"] for p in plans if p.fits) and plans[0].fits
    text = explain(model, args, plans, a100)
    assert "2. + tensor parallel inside a node" in text and "5. + CPU offload" in text
    # A node with 512 GB of host memory cannot hold the 1.13 TB of offloaded 70B state: nothing fits.
    pcie = PRESETS["PCIe-Ethernet"]
    offloaded = [p for p in search(model, args, pcie, 64, 4096) if p.layout["cpu_offload"]]
    assert offloaded and not any(p.fits for p in offloaded)
    assert min(p.memory["host_bytes_per_node"] for p in offloaded) > pcie.host_memory
    assert "offload needs 1129.01 GB of host memory per node, 460.80 GB usable" in explain(
        model, args, offloaded, pcie)
    # Ranked by estimated throughput among those that fit.
    fitting = [p for p in plans if p.fits]
    assert all(x.tokens_per_sec >= y.tokens_per_sec for x, y in zip(fitting, fitting[1:]))


def test_the_search_keeps_sharding_inside_a_node_when_nodes_talk_slowly():
    """Llama-3 1B on 4 nodes of 8 GPUs joined by Ethernet: sharding over a node's 8 ranks,
    replicated over the 4 nodes (HSDP), is the fastest layout that fits — its gathers stay on the
    node's fast link and only the reduced shard crosses nodes; sharding over all 32 is slower.
    (ZeRO-2, whose all-reduce over the replicas overlaps backward piece by piece, is ahead of
    ZeRO-3, which gathers every block twice a step.)"""
    from dataclasses import replace

    from torchpar.models import MODELS
    from torchpar.plan import PRESETS, search

    model, cluster = MODELS["llama3"], replace(PRESETS["PCIe-Ethernet"], nodes=4)
    plans = [p for p in search(model, model.args("1B"), cluster, 128, 4096) if p.fits]
    best = plans[0].layout
    assert (best["dp_replicate"], best["dp_shard"], best["zero_stage"]) == (4, 8, 2)
    flat = next(p for p in plans if p.layout == {**best, "dp_replicate": 1, "dp_shard": 32})
    assert flat.step_s > plans[0].step_s


def test_among_equally_fast_layouts_the_search_ranks_the_leanest_first():
    """Where every exchange hides behind compute, many layouts are predicted equally fast (Llama-3
    1B on 8 H100s: hundreds of ties); the first of them is what `layout = "auto"` launches, so it
    is the one needing the least memory, then the one whose communication takes the least time."""
    from dataclasses import replace

    from torchpar.models import MODELS
    from torchpar.plan import PRESETS, search
    from torchpar.plan.estimate import device_peak

    model = MODELS["llama3"]
    plans = [p for p in search(model, model.args("1B"), replace(PRESETS["H100-80GB"], nodes=1), 32, 4096)
             if p.fits]

    def link_s(p):
        return sum(c["seconds"] for c in p.communication.values())

    ties = [(a, b) for a, b in zip(plans, plans[1:]) if a.tokens_per_sec == b.tokens_per_sec]
    assert len(ties) > 100
    assert all((device_peak(a.memory), link_s(a)) <= (device_peak(b.memory), link_s(b)) for a, b in ties)
    assert any(device_peak(a.memory) < device_peak(b.memory) for a, b in ties)


def test_search_splits_a_long_sequence_over_ranks():
    """Llama-3 8B with 128k-token sequences on 8 x H100: the fastest layout that fits splits each
    sequence over ranks (cp), and a layout's activations per rank fall with the split."""
    from torchpar.models import MODELS
    from torchpar.plan import PRESETS, explain, search
    from torchpar.plan.search import describe_layout

    model, h100, seq = MODELS["llama3"], PRESETS["H100-80GB"], 131072
    args = model.args("8B", max_seq_len=seq)
    plans = search(model, args, h100, 8, seq)
    best = next(p for p in plans if p.fits)
    assert best.layout["cp"] > 1 and best.layout["cp_method"] == "alltoall"
    assert f"fastest that fits: {describe_layout(best.layout)}" in explain(model, args, plans, h100)
    same = {p.layout["cp"]: p.memory["activation_bytes"] for p in plans
            if p.layout["tp"] == 1 and p.layout["pp"] == 1 and p.layout["zero_stage"] == 3
            and p.layout["dp_replicate"] == 1
            and not p.layout["cpu_offload"] and p.layout["activation_checkpoint"] == "full"
            and p.layout["activation_checkpoint_every"] == 1 and p.layout["local_batch_size"] == 1}
    assert sorted(same) == [1, 2, 4, 8]
    assert all(same[c] == pytest.approx(same[1] / c, rel=0.01) for c in same), same


def test_the_memory_cap_refuses_what_one_rank_cannot_hold():
    """train_configs/long_context.toml: 8k-token sequences under a 0.4 GiB cap fit when split over 4
    ranks and are refused on one, with the figure it would need."""
    from torchpar.config import load_config
    from torchpar.plan import check_memory_cap, layout_from_config

    config = ROOT / "train_configs" / "long_context.toml"
    check_memory_cap(load_config(config, []), *layout_from_config(load_config(config, []), 4))
    one = load_config(config, ["--parallelism.context_parallel_degree", "1"])
    with pytest.raises(ConfigError, match=r"memory_cap_gib = 0.4: this layout needs 1.08 GiB"):
        check_memory_cap(one, *layout_from_config(one, 1))


def test_the_search_leaves_out_schedules_too_long_to_build(capfd):
    """Pipeline layouts of more microbatches than a schedule is built for are left out, with a
    warning; the others, and every layout without a pipeline, are still searched."""
    from torchpar.models import MODELS
    from torchpar.parallel.pipeline import MAX_MICROBATCHES
    from torchpar.plan import PRESETS, search

    model = MODELS["llama3"]
    plans = search(model, model.args("debug"), PRESETS["H100-80GB"], 4096, 128)
    micro = [p.layout["local_batch_size"] // p.layout["microbatch_size"] for p in plans if p.layout["pp"] > 1]
    assert micro and max(micro) <= MAX_MICROBATCHES
    assert any(p.layout["pp"] == 1 and p.layout["accum"] > MAX_MICROBATCHES for p in plans)
    assert f"more than {MAX_MICROBATCHES} microbatches per step (up to 4,096" in capfd.readouterr().err


def test_hardware_overrides_are_figures_not_switches():
    """--gpus-per-node 0 used to mean the preset's 8; every override given is used as given."""
    import argparse

    from torchpar.commands.plan import _cluster, _parser
    from torchpar.errors import ConfigError

    def cluster(*argv) -> argparse.Namespace:
        return _cluster(_parser().parse_args(["--model", "8B", *argv]))

    assert cluster("--gpus-per-node", "4", "--memory-gb", "40").gpus_per_node == 4
    assert cluster().gpus_per_node == 8 and cluster("--memory-gb", "40").memory == 40e9
    for flag in ("--gpus-per-node", "--memory-gb", "--peak-tflops", "--inter-gbps"):
        with pytest.raises(ConfigError, match=flag):
            cluster(flag, "0")


def test_microbatches_in_flight_per_schedule():
    """Activations held at once, in whole-stage microbatches, from each schedule's own order:
    GPipe keeps all m; 1F1B up to p on the first stage, one fewer per stage after; interleaved
    1F1B p(1 + (p-1)/(p v)) on the first (Narayanan et al. 2021); ZBV p on every rank."""
    from torchpar.plan import Layout, in_flight

    def held(schedule, v):
        lay = Layout(pp=4, local_batch_size=16, schedule=schedule, stages_per_rank=v)
        return [in_flight(lay, 16, r) for r in range(4)]

    assert held("GPipe", 1) == [16] * 4
    assert held("1F1B", 1) == [4, 3, 2, 1]
    assert held("Interleaved1F1B", 2)[0] == 4 * (1 + 3 / (4 * 2))
    assert held("ZBVZeroBubble", 2) == [4] * 4


def test_released_meshes_free_their_groups_and_are_not_built_again():
    """After auto's trials, the meshes of the layouts not chosen lose their process groups (on a
    cluster, NCCL communicators with their buffers): the kept mesh keeps every group, the others'
    go, and an equal mesh cannot be built again in the process (DTensor's caches name the old one).
    On a fake process group of 8 ranks, with a flattened and an unflattened (experts') view."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchpar.parallel.layout import MESH_DIMS, Layout, release_meshes

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        count = lambda: len(dist.distributed_c10d._world.pg_map)  # noqa: E731
        kept, other, experts = Layout(dp_shard=8), Layout(dp_shard=4, tp=2), Layout(dp_shard=4, cp=2, ep=2)
        start = count()
        kept.build_mesh("cpu")
        after_kept = count()
        other.build_mesh("cpu")
        experts.build_mesh("cpu")
        assert count() > after_kept > start
        Layout(dp_shard=8).build_mesh("cpu")  # equal degrees: no new group
        built = count()
        assert release_meshes(keep=Layout(dp_shard=8)) == built - after_kept
        assert count() == after_kept
        live = set(dist.distributed_c10d._world.pg_map)
        assert all(kept.mesh.get_group(dim) in live for dim in MESH_DIMS)
        with pytest.raises(RuntimeError, match="released"):
            Layout(dp_shard=4, tp=2).build_mesh("cpu")
    finally:
        dist.destroy_process_group()


def test_jobs_on_equal_meshes_share_each_submesh_object():
    """torch makes a new DeviceMesh object at every slicing, equal to the last; DTensor's caches
    compare meshes by value, so an earlier job's cached result on an equal mesh carries that job's
    object into this one, and a compiled block under TP then failed to trace ("_get_submesh is not
    an OpOverload") after two TP jobs in the process. Every submesh a layout hands out (a dimension,
    several, a flattened view, the experts' view) is one object per mesh, whichever Layout asks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchpar.parallel.layout import Layout

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        first, second = Layout(dp_shard=2, tp=2, cp=2), Layout(dp_shard=2, tp=2, cp=2)
        experts = [Layout(dp_shard=4, tp=2, ep=2, dp_replicate=1) for _ in range(2)]
        for lay in (first, second, *experts):
            lay.build_mesh("cpu")
        assert first.mesh is second.mesh
        for name in ("tp", "cp", "pp", "dp", "dp_shard_cp", ("dp_shard", "cp")):
            assert first.submesh(name) is second.submesh(name), name
        assert first.dp_mesh is second.dp_mesh
        assert experts[0].expert_mesh is experts[1].expert_mesh
        assert experts[0].expert_dp_mesh is experts[1].expert_dp_mesh
    finally:
        dist.destroy_process_group()



def test_the_planners_bytes_follow_which_layers_lora_adapts():
    """Two LoRA jobs of one rank that adapt different layers hold different bytes: the planner's
    remembered answers are keyed by the adapted layers, not the rank alone."""
    from torchpar.config import load_config
    from torchpar.models.lora import adapted_layers, spec
    from torchpar.plan import layout_from_config, state_bytes

    def planned(modules):
        cfg = load_config(TINY, ["--lora.rank=4", "--lora.modules", modules])
        lay, model, args = layout_from_config(cfg, 1)
        adapted = adapted_layers(model, args, spec(cfg.lora))
        learned = sum(4 * (out + inp) for out, inp in adapted.values())
        got = state_bytes(model, args, lay, lay.rank_coords(0))
        assert got["grad_bytes"] == 4 * learned, modules
        return got

    assert planned("layers.*.attention.*") != planned("layers.*.feed_forward.*")


def test_a_rank_with_no_adapter_saves_and_loads_no_optimizer_state():
    """A pipeline stage LoRA leaves without adapters updates nothing: under FSDP2 its optimizer
    state is empty (torch's state-dict helpers refuse such an optimizer), and the planner's peaks
    for it are the frozen base and one empty bucket."""
    from torch import nn

    from torchpar.config import load_config
    from torchpar.parallel.flat import bucket_elements
    from torchpar.parallel.fsdp import FSDPState
    from torchpar.plan import layout_from_config, state_bytes
    from torchpar.plan.layout import transient_bytes

    frozen = nn.Linear(4, 4).requires_grad_(False)
    state = FSDPState([frozen], torch.optim.AdamW([{"params": []}]), tp=1)
    assert state.optimizer_state_dict() == {}
    state.load_optimizer_state_dict({})

    cfg = load_config(TINY, ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.zero_stage", "1",
                             "--lora.rank=4", "--lora.modules", "layers.7.*"])
    lay, model, args = layout_from_config(cfg, 2)
    held = state_bytes(model, args, lay, {"pp": 0})
    assert held["param_bytes"] > 0 and held["grad_bytes"] == held["optim_bytes"] == 0
    peak = transient_bytes(model, args, lay, 0)["checkpoint_peak"]
    assert peak == held["param_bytes"] + 4 * bucket_elements(lay)


# The first adapted layer's block and module for each pattern, and that module's layers that read
# its (frozen) input.
FIRST_ADAPTED = {"layers.*": (0, "attention", ("wq", "wk", "wv")),
                 "layers.2.*": (2, "attention", ("wq", "wk", "wv")),
                 "layers.3.feed_forward.*": (3, "feed_forward", ("w1", "w3"))}


@pytest.mark.parametrize("modules", [None, *FIRST_ADAPTED])
def test_flops_per_token_are_what_forward_and_backward_run(modules):
    """The FLOPs MFU and the planner divide by, against torch's FLOP counter over a real forward
    and backward (attention's CPU kernels counted as the planner counts them: the full square,
    backward 2 x forward). Exact without LoRA; with it, what runs before the first adapted layer
    runs forward alone (adapting the last block alone costs about a third of training every
    block), exact but for the input gradients of the layers that read the first adapted module's
    frozen input, which autograd skips and the planner still counts."""
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    from torchpar.models import MODELS
    from torchpar.models.lora import A, add_adapters, flops_per_token, freeze_base, spec

    def forward(q, k, v, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(q, k, v)

    def backward(grad, q, k, v, *args, out_shape=None, **kwargs):
        return 2 * sdpa_flop_count(q, k, v)

    ops = torch.ops.aten
    cpu_kernels = {ops._scaled_dot_product_flash_attention_for_cpu: forward,
                   ops._scaled_dot_product_flash_attention_for_cpu_backward: backward}
    llama = MODELS["llama3"]
    args, seq = llama.args("debug", n_layers=4), 64
    adapters = None
    if modules:
        adapters = SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, modules=[modules], exclude=["*.gate"])
    with torch.device("meta"):
        model = llama.build(args)
    if adapters:
        add_adapters(model, llama, adapters)
    model.to_empty(device="cpu")
    model.init_weights(0)
    if adapters:
        freeze_base(model)
    with FlopCounterMode(display=False, custom_mapping=cpu_kernels) as counter:
        model(torch.randint(0, args.vocab_size, (1, seq))).float().sum().backward()
    spared = 0
    if adapters:
        block, module, readers = FIRST_ADAPTED[modules]
        layers = [model.layers[str(block)].get_submodule(f"{module}.{name}") for name in readers]
        spared = 2 * seq * sum(layer.weight.numel() + getattr(layer, A).numel() for layer in layers)
    predicted = flops_per_token(llama, args, seq, spec(adapters) if adapters else None) * seq
    assert predicted - spared == counter.get_total_flops()


def test_full_recomputation_reruns_no_block_before_the_first_adapter():
    """Blocks that run no backward recompute nothing: with the last of 8 blocks adapted alone,
    full recomputation costs an eighth of what it costs every block trained."""
    from torchpar.config import load_config
    from torchpar.plan import layout_from_config, recompute_flops_per_token

    def recompute(*lora_args):
        cfg = load_config(TINY, ["--training.activation_checkpoint", "full", *lora_args])
        lay, model, args = layout_from_config(cfg, 1)
        assert args.n_layers == 8
        return recompute_flops_per_token(model, args, lay, cfg.training.seq_len)

    assert recompute("--lora.rank=4", "--lora.modules", "layers.7.*") * 8 == recompute() > 0


def test_an_adapted_block_compiles_in_one_graph_and_recomputes_its_low_rank_products():
    """LoRA's forward hook marks its low-rank term for selective recomputation (eager: the products
    are recomputed, not kept with the matmuls') without breaking a compiled block's graph."""
    from torch.utils.checkpoint import CheckpointPolicy

    from torchpar.models import MODELS
    from torchpar.models.lora import add_adapters, in_low_rank
    from torchpar.parallel import recompute

    llama = MODELS["llama3"]
    args = llama.args("debug", n_layers=1)
    with torch.device("meta"):
        model = llama.build(args)
    add_adapters(model, llama, SimpleNamespace(rank=4, alpha=8.0, dropout=0.0, modules=["layers.*"],
                                               exclude=[]))
    layer = model.layers["0"].attention.wq
    seen = []

    def spy(ctx, op, *a, **kw):
        seen.append((op, in_low_rank(), recompute._policy(ctx, op, *a, **kw)))
        return CheckpointPolicy.PREFER_RECOMPUTE

    x = torch.randn(2, 8, args.dim, device="meta")
    with torch.utils.checkpoint.create_selective_checkpoint_contexts(spy)[0]:
        layer(x)
    mms = [(low, policy) for op, low, policy in seen if op is torch.ops.aten.mm.default]
    assert mms == [(False, CheckpointPolicy.MUST_SAVE), (True, CheckpointPolicy.PREFER_RECOMPUTE),
                   (True, CheckpointPolicy.PREFER_RECOMPUTE)], mms
    # compiled as the trainer compiles a recomputed block, on a thread that never ran the hook
    # eagerly: one graph, forward and backward
    recompute.apply_recompute(model, "selective")
    model.to_empty(device="cpu")
    model.init_weights(0)
    block = torch.compile(model.layers["0"], backend="aot_eager", fullgraph=True)
    h = torch.randn(2, 8, args.dim, requires_grad=True)
    with ThreadPoolExecutor(1) as fresh:
        fresh.submit(lambda: block(h, *model.block_args(None), None).sum().backward()).result()
