"""Checkpoints: exact resume, resharding across layouts, data position, bad checkpoints.

Every run trains the tiny config for 6 steps with a global batch of 8. "Save" runs checkpoint at
step 3 (and 6); "resume" runs start from a step-3 checkpoint — possibly written under another
layout — and train steps 4-6. A resumed run must equal the uninterrupted run bitwise under the
same layout, and within fp32 tolerance under another.
"""

from collections import Counter

import pytest
import torch
from harness import LAYERS, TINY, assert_matches, run_layouts

from torchpar.config import load_config
from torchpar.optim import rounding_drift

pytestmark = pytest.mark.slow  # trains in spawned processes

Z = "--parallelism.zero_stage"
LB = "--training.local_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
STEPS = ["--training.steps", "6", *LAYERS]
MUON = ["--optimizer.name", "muon"]
CP2 = ["--parallelism.context_parallel_degree", "2"]
# A mixture of experts with both balancing methods: the routing bias is saved beside the weights.
MOE = ["--model.name", "moe", "--model.bias_rate", "0.01", "--model.balance_coeff", "0.01"]
BF16M = ["--optimizer.state_dtype", "bfloat16"]
# FP8 (tensorwise: weights all-gathered in FP8, their scales recomputed after a load)
FP8 = ["--quantize.float8", "tensorwise", "--quantize.skip_small", "false"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8"]  # (its checkpoints: the adapters alone)


def save(folder, *layout):
    return [*STEPS, *layout, "--checkpoint.enable", "true", "--checkpoint.interval", "3",
            "--checkpoint.folder", str(folder), "--checkpoint.async_mode", "async"]


def resume(folder, *layout):
    return [*save(folder, *layout), "--checkpoint.load_step", "3"]


LAYOUTS = {  # name: (world, overrides)
    "single": (1, [Z, "0"]),
    "dp2_zero3": (2, [LB, "4", Z, "3"]),
    "dp2_zero1": (2, [LB, "4", Z, "1"]),
    # bf16 parameters over the fp32 master: the checkpoint holds the master, so resume is exact
    "dp2_zero2_bf16": (2, [LB, "4", Z, "2", "--training.mixed_precision_param", "bfloat16"]),
    "pp2": (2, [*PP2, Z, "0"]),
    "dp4": (4, [LB, "2", Z, "3"]),
    "dp2_tp2": (4, [LB, "4", *TP2, Z, "3"]),
    "pp2_tp2": (4, [*PP2, *TP2, Z, "0"]),
    "pp2_dp2": (4, [*PP2, LB, "4", Z, "3"]),
    # ZeRO 0-2 save each rank's share of its owned pieces (replicas split them) and load them in place
    "dp2_zero0": (2, [LB, "4", Z, "0"]),
    "hsdp_zero2": (4, [LB, "2", Z, "2", "--parallelism.data_parallel_replicate_degree", "2"]),
    "dp2_tp2_zero1": (4, [LB, "4", *TP2, Z, "1"]),
    # Optimizers other than AdamW: Muon's momentum (whole parameters owned under ZeRO 1, DTensor
    # shards under ZeRO-3 x TP) beside AdamW's moments; Adafactor's row and column factors.
    "muon_single": (1, [*MUON, Z, "0"]),
    "muon_dp2_zero1": (2, [*MUON, LB, "4", Z, "1"]),
    "muon_dp2_tp2": (4, [*MUON, LB, "4", *TP2, Z, "3"]),
    "adafactor_dp2_zero2": (2, ["--optimizer.name", "adafactor", LB, "4", Z, "2"]),
    # Context parallelism: both ranks see the same sequences (one data position); ZeRO over cp.
    "cp2": (2, [*CP2, Z, "2"]),
    "cp2_ring_zero3": (2, [*CP2, "--parallelism.context_parallel_method", "ring", Z, "3"]),
    "moe_single": (1, [*MOE, Z, "0"]),
    "moe_dp2_zero3": (2, [*MOE, LB, "4", Z, "3"]),
    "moe_pp2": (2, [*MOE, *PP2, Z, "0"]),
    # Expert parallelism: each rank saves its experts' shards; a resume under another degree
    # reads the experts it now holds.
    "moe_ep2": (2, [*MOE, LB, "4", Z, "3", "--parallelism.expert_parallel_degree", "2"]),
    "moe_ep4": (4, [*MOE, LB, "2", Z, "3", "--parallelism.expert_parallel_degree", "4"]),
    # Moments stored in bf16: saved as bf16 from flat buckets and FSDP2 shards; loaded from fp32
    # moments (each cast) or into fp32 ones
    "bf16m_dp2_zero1": (2, [*BF16M, LB, "4", Z, "1"]),
    "bf16m_dp2_zero3": (2, [*BF16M, LB, "4", Z, "3"]),
    "muon_bf16m_dp2_tp2": (4, [*MUON, *BF16M, LB, "4", *TP2, Z, "3"]),
    "fp8_dp2_zero3": (2, [*FP8, LB, "4", Z, "3"]),
    "fp8_pp2_dp2": (4, [*FP8, *PP2, LB, "4", Z, "3"]),
    # LoRA: the adapters and their optimizer state saved, the frozen base rebuilt from the seed
    "lora_single": (1, [*LORA, Z, "0"]),
    "lora_dp2_zero3": (2, [*LORA, LB, "4", Z, "3"]),
    "lora_dp2_zero1": (2, [*LORA, LB, "4", Z, "1"]),
    "lora_tp2": (2, [*LORA, *TP2, Z, "0"]),
    "lora_base_pp2": (2, [*LORA, "--lora.save_base", "true", *PP2, Z, "2"]),  # the base saved too
}
# (saved under, resumed under): exact pairs keep the layout, the rest reshard.
EXACT = [("single", "single"), ("dp2_zero3", "dp2_zero3"), ("pp2", "pp2"),
         ("dp2_zero2_bf16", "dp2_zero2_bf16"), ("muon_dp2_zero1", "muon_dp2_zero1"),
         ("adafactor_dp2_zero2", "adafactor_dp2_zero2"), ("cp2", "cp2"), ("moe_dp2_zero3", "moe_dp2_zero3"),
         ("moe_ep2", "moe_ep2"), ("bf16m_dp2_zero1", "bf16m_dp2_zero1"),
         ("bf16m_dp2_zero3", "bf16m_dp2_zero3"), ("fp8_dp2_zero3", "fp8_dp2_zero3"),
         ("fp8_pp2_dp2", "fp8_pp2_dp2"), ("lora_dp2_zero3", "lora_dp2_zero3"),
         ("lora_dp2_zero1", "lora_dp2_zero1"), ("lora_base_pp2", "lora_base_pp2")]
RESHARD = [("dp4", "dp2_tp2"), ("dp2_tp2", "pp2_dp2"), ("pp2_tp2", "single"), ("dp2_zero1", "dp2_zero3"),
           ("dp2_zero3", "dp4"), ("dp4", "dp2_zero1"), ("dp2_zero0", "dp4"), ("hsdp_zero2", "single"),
           ("dp2_tp2_zero1", "dp2_zero1"), ("muon_dp2_zero1", "muon_dp2_tp2"),
           ("muon_dp2_tp2", "muon_single"), ("cp2", "single"), ("single", "cp2_ring_zero3"),
           ("moe_pp2", "moe_single"), ("moe_ep2", "moe_single"), ("moe_ep2", "moe_ep4"),
           # Across state dtypes the uninterrupted run rounded (or did not round) the moments of
           # steps 1-3, the resumed one once at its load: within the rounding's drift of 3 steps
           # (optim.rounding_drift; AdamW's 4.7e-5, under the 1e-4 of every pair; Muon's 7e-4 at its
           # lr 0.02); moments not loaded at all put the weights ~lr apart.
           ("bf16m_dp2_zero3", "bf16m_dp2_zero1"), ("dp2_zero3", "bf16m_dp2_zero1"),
           ("bf16m_dp2_zero1", "dp4"), ("muon_dp2_zero1", "muon_bf16m_dp2_tp2"),
           ("lora_dp2_zero3", "lora_tp2"), ("lora_dp2_zero1", "lora_single")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    saved = {name for pair in EXACT + RESHARD for name in pair[:1]}
    by_world: dict[int, dict] = {}
    for name in sorted(saved):
        world, layout = LAYOUTS[name]
        by_world.setdefault(world, {})[f"save:{name}"] = save(root / name, *layout)
    out = {}
    for world, table in sorted(by_world.items()):
        out.update(run_layouts(world, table))
    by_world = {}
    for src, dst in EXACT + RESHARD:
        world, layout = LAYOUTS[dst]
        by_world.setdefault(world, {})[f"{src}->{dst}"] = resume(root / src, *layout)
    # The uninterrupted run of each resumed layout that is not also a saved one.
    for dst in {dst for _, dst in RESHARD} - saved:
        world, layout = LAYOUTS[dst]
        by_world.setdefault(world, {})[f"save:{dst}"] = [*STEPS, *layout]
    for world, table in sorted(by_world.items()):
        out.update(run_layouts(world, table))
    out["root"] = root
    return out


def windows(run, steps=None):
    """Every window trained on, over all data-parallel ranks (the first ``steps`` steps if given)."""
    batches = [b for per_rank in run["windows"].values() for b in (per_rank[:steps] if steps else per_rank)]
    return Counter(w for b in batches for w in b)


@pytest.mark.parametrize("src,dst", EXACT, ids=[f"{a}" for a, _ in EXACT])
def test_resume_is_bitwise_exact(runs, src, dst):
    full, resumed = runs[f"save:{src}"], runs[f"{src}->{dst}"]
    assert resumed["losses"] == full["losses"][3:]  # exactly equal floats
    for name, value in full["params"].items():
        assert torch.equal(resumed["params"][name], value), name


@pytest.mark.parametrize("src,dst", RESHARD, ids=[f"{a}->{b}" for a, b in RESHARD])
def test_resume_under_another_layout(runs, src, dst):
    full, resumed = runs[f"save:{dst}"], runs[f"{src}->{dst}"]
    ref = {"losses": full["losses"][3:], "params": full["params"], "val_losses": full["val_losses"]}
    shapes = [tuple(p.shape) for p in full["params"].values()]
    drift = max(rounding_drift(load_config(TINY, LAYOUTS[n][1]).optimizer, 3, shapes) for n in (src, dst))
    assert_matches(resumed, ref, tol=1e-5, param_tol=max(1e-4, drift))
    # The data continue from the same global position: steps 1-3 under the saving layout and
    # 4-6 under the new one cover the uninterrupted run's windows, none twice, none skipped.
    before = windows(runs[f"save:{src}"], steps=3 * 1)
    after = windows(resumed)
    assert max((before + after).values()) == 1
    assert before + after == windows(full)


def test_lora_checkpoints_hold_the_adapters_alone(runs):
    """Without lora.save_base a checkpoint holds the adapters and their optimizer state, none of the
    frozen base (rebuilt at a resume); with it, the base weights too."""
    from torch.distributed.checkpoint import FileSystemReader

    from torchpar.checkpoint import complete_checkpoints

    def keys(name):
        folder = complete_checkpoints(runs["root"] / name)[3]
        return set(FileSystemReader(str(folder)).read_metadata().state_dict_metadata)

    alone, with_base = keys("lora_dp2_zero3"), keys("lora_base_pp2")
    adapter = "model.layers.0.attention.wq.lora_a"
    assert adapter in alone and adapter in with_base
    assert not any(k.startswith("model.") and not k.endswith(("lora_a", "lora_b")) for k in alone)
    assert not any(k.startswith("optimizer.") and ".lora_" not in k and "state." in k for k in alone)
    assert "model.layers.0.attention.wq.weight" in with_base and "model.tok_embeddings.weight" in with_base


def test_each_rank_checksums_its_files_and_the_manifest_has_all(runs):
    """Four ranks wrote each checkpoint; every rank checksummed its own files in its writer thread
    and rank 0 gathered them: the manifest lists every file of the folder with its size and CRC32."""
    from torchpar.checkpoint import MANIFEST, complete_checkpoints, read_manifest
    from torchpar.checkpoint.files import file_crc32

    for name in ("dp4", "dp2_tp2"):
        for folder in complete_checkpoints(runs["root"] / name).values():
            listed = read_manifest(folder)["files"]
            on_disk = {f.name: [f.stat().st_size, file_crc32(f)] for f in folder.iterdir()
                       if f.name != MANIFEST}
            assert listed == on_disk and {f"__{r}_0.distcp" for r in range(4)} <= set(listed), folder


def test_async_snapshot_is_host_memory_with_the_dtensor_layout(tmp_path):
    """The async save's snapshot: host tensors (never a second copy on the mesh's device), each
    DTensor with its mesh, placements and global shape, independent of the live state, and a DCP
    save/load round trip of it restores the values — also for parameters that are views into one
    flat buffer, as the ZeRO 0-2 engine's are. A second save copies into the same host buffers
    (allocated once per run), with the new values."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    from torchpar.checkpoint.checkpointer import HostStaging

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        flat = torch.arange(20, dtype=torch.float32)
        view = DTensor.from_local(flat[4:16].view(3, 4), mesh, [Shard(0)], run_check=False)
        state = {"model": {"w": view, "b": DTensor.from_local(flat[:4], mesh, [Replicate()])},
                 "step": 7, "rows": [torch.ones(2)]}
        staging = HostStaging(pin=False)
        first = staging.stage(state)
        held = staging.nbytes()
        assert held == (12 + 4 + 2) * 4
        flat.add_(1000)
        snap = staging.stage(state)  # the same buffers, this save's values
        assert staging.nbytes() == held
        assert snap["model"]["w"].to_local().data_ptr() == first["model"]["w"].to_local().data_ptr()
        flat.sub_(1000)
        snap = staging.stage(state)
        w = snap["model"]["w"]
        assert isinstance(w, DTensor) and w.to_local().device.type == "cpu"
        assert (w.device_mesh, w.placements, w.shape, w.stride()) == (mesh, view.placements, view.shape,
                                                                      view.stride())
        flat.add_(100)  # training goes on: the snapshot keeps the values of the save
        assert torch.equal(w.to_local(), torch.arange(4, 16, dtype=torch.float32).view(3, 4))
        assert snap["step"] == 7 and torch.equal(snap["rows"][0], torch.ones(2))
        dcp.save(snap, checkpoint_id=str(tmp_path))
        target = {"model": {"w": DTensor.from_local(torch.zeros(3, 4), mesh, [Shard(0)]),
                            "b": DTensor.from_local(torch.zeros(4), mesh, [Replicate()])},
                  "step": 0, "rows": [torch.zeros(2)]}
        dcp.load(target, checkpoint_id=str(tmp_path))
        assert torch.equal(target["model"]["w"].to_local(), w.to_local())
        assert torch.equal(target["model"]["b"].to_local(), torch.arange(4, dtype=torch.float32))
    finally:
        dist.destroy_process_group()
