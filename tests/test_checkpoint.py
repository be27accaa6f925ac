"""Checkpoints: exact resume, resharding across layouts, data position, bad checkpoints.

Every run trains the tiny config for 6 steps with a global batch of 8. "Save" runs checkpoint at
step 3 (and 6); "resume" runs start from a step-3 checkpoint — possibly written under another
layout — and train steps 4-6. A resumed run must equal the uninterrupted run bitwise under the
same layout, and within fp32 tolerance under another.
"""

from collections import Counter

import pytest
import torch
from harness import assert_matches, run_layouts

Z = "--parallelism.zero_stage"
LB = "--training.local_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
PP2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule", "1F1B"]
STEPS = ["--training.steps", "6"]


def save(folder, *layout):
    return [*STEPS, *layout, "--checkpoint.enable", "true", "--checkpoint.interval", "3",
            "--checkpoint.folder", str(folder), "--checkpoint.async_mode", "async"]


def resume(folder, *layout):
    return [*save(folder, *layout), "--checkpoint.load_step", "3"]


LAYOUTS = {  # name: (world, overrides)
    "single": (1, [Z, "0"]),
    "dp2_zero3": (2, [LB, "4", Z, "3"]),
    "dp2_zero1": (2, [LB, "4", Z, "1"]),
    "pp2": (2, [*PP2, Z, "0"]),
    "dp4": (4, [LB, "2", Z, "3"]),
    "dp2_tp2": (4, [LB, "4", *TP2, Z, "3"]),
    "pp2_tp2": (4, [*PP2, *TP2, Z, "0"]),
    "pp2_dp2": (4, [*PP2, LB, "4", Z, "3"]),
}
# (saved under, resumed under): exact pairs keep the layout, the rest reshard.
EXACT = [("single", "single"), ("dp2_zero3", "dp2_zero3"), ("pp2", "pp2")]
RESHARD = [("dp4", "dp2_tp2"), ("dp2_tp2", "pp2_dp2"), ("pp2_tp2", "single"), ("dp2_zero1", "dp2_zero3"),
           ("dp2_zero3", "dp4"), ("dp4", "dp2_zero1")]


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
    assert_matches(resumed, ref, tol=1e-5, param_tol=1e-4)
    # The data continue from the same global position: steps 1-3 under the saving layout and
    # 4-6 under the new one cover the uninterrupted run's windows, none twice, none skipped.
    before = windows(runs[f"save:{src}"], steps=3 * 1)
    after = windows(resumed)
    assert max((before + after).values()) == 1
    assert before + after == windows(full)
