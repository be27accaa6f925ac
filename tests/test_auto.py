"""parallelism.layout = "auto": the machine probe, the planner's choice and its trials, and the run's
predicted-against-measured step time."""

import json
import os
from pathlib import Path

import pytest
import torch
from harness import TINY, assert_matches, run_layouts, spawn_ranks

from torchpar.config import load_config
from torchpar.errors import ConfigError
from torchpar.models import MODELS
from torchpar.plan.communication import communication
from torchpar.plan.estimate import memory_of
from torchpar.plan.layout import Cluster, layout_from_config
from torchpar.plan.probe import cluster_of, fit
from torchpar.plan.search import search
from torchpar.tools.auto_layout import first_fit, global_batch, plan_candidates, room_of

GLOBAL = ["--training.global_batch_size", "8"]
# What makes a layout (beside what the config brings along: bucket size, dtypes)
LAYOUT_KEYS = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "cp_method", "zero_stage", "local_batch_size",
               "accum", "microbatch_size", "activation_checkpoint", "activation_checkpoint_every", "schedule",
               "stages_per_rank", "layers_per_stage")


def search_plans(cfg, cluster):
    """Every layout the search prices for ``cfg`` on ``cluster`` (its CPU ranks)."""
    model, args = MODELS[cfg.model.name], MODELS[cfg.model.name].args(cfg.model.flavor)
    return search(model, args, cluster, global_batch(cfg, cluster.world), cfg.training.seq_len, "float32",
                  1.0, "cpu", cfg.optimizer)


def test_the_fit_recovers_latency_and_bandwidth():
    for latency, bw in ((2e-4, 1e9), (0.0, 5e9), (3e-5, 2e11)):
        points = [(x, latency + x / bw) for x in (4e3, 3.2e4, 2.6e5, 2e6, 8e6)]
        got = fit(points)
        assert got[0] == pytest.approx(latency, abs=1e-9) and got[1] == pytest.approx(bw, rel=1e-6)


def test_measured_collectives_charge_latency_per_call_and_bytes_over_bandwidth():
    """A probed machine's table: each collective costs its latency per call (ZeRO 0-2: per bucket)
    plus its bytes over its bandwidth; without a table the datasheet bandwidth, no latency."""
    cfg = load_config(TINY, ["--parallelism.zero_stage", "1"])
    lay, model, args = layout_from_config(cfg, 2)
    base = Cluster(2, 80e9, 1e12, 4e9, 1e9, 1e12)
    table = {"intra:2": {"all_reduce": [1e-3, 2e9], "all_gather": [5e-4, 1e9]}}
    plain = communication(model, args, lay, base, 32)
    timed = communication(model, args, lay, Cluster(2, 80e9, 1e12, 4e9, 1e9, 1e12, collectives=table), 32)
    dims = ("dp", "dp_shard")  # (the reduction's and the gather's)
    assert {d: plain[d]["bytes"] for d in dims} == {d: timed[d]["bytes"] for d in dims}
    assert plain["dp"]["seconds"] == pytest.approx(plain["dp"]["bytes"] / 4e9)
    from torchpar.plan.layout import flat_rank_layout
    buckets = len(flat_rank_layout(model, args, lay, 0)[3]) - 1
    assert buckets > 1  # (the tiny job's bucket_mb makes several)
    # ZeRO-1 on 2 ranks: the gradients all-reduced, the owned halves all-gathered, bucket by bucket
    elements = flat_rank_layout(model, args, lay, 0)[3][-1]
    reduce_bytes, gather_bytes = 4 * elements * 2 * 1 / 2, 4 * elements * 1 / 2
    expected = buckets * 1e-3 + reduce_bytes / 2e9 + buckets * 5e-4 + gather_bytes / 1e9
    assert timed["dp"]["seconds"] + timed["dp_shard"]["seconds"] == pytest.approx(expected, rel=1e-9)


def test_ranks_sharing_cores_pay_for_the_bubble_only_where_too_few_are_busy():
    """4 ranks on 2 cores (half a core each): while a rank idles in the pipeline's bubble the others
    take its core, so the step loses wall time only for the part of the bubble that leaves fewer
    busy ranks than cores; compute and communication are unchanged."""
    from dataclasses import replace

    from torchpar.plan.estimate import plan

    cfg = load_config(TINY, ["--parallelism.pipeline_parallel_degree", "2",
                             "--parallelism.pipeline_parallel_microbatch_size", "4"])
    lay, model, args = layout_from_config(cfg, 2)
    own = Cluster(2, 80e9, 1e12, 4e9, 1e9, 1e12)
    alone = plan(model, args, lay, own, 32)
    assert alone.bubble > 0.25
    for share in (0.5, 0.9):
        shared = plan(model, args, lay, replace(own, cores_per_rank=share), 32)
        assert shared.compute_s == alone.compute_s and shared.bubble == alone.bubble  # (the schedule's)
        assert alone.bubble_s == pytest.approx(alone.compute_s * alone.bubble / (1 - alone.bubble))
        idle = max(0.0, 1 - (1 - alone.bubble) / share)  # the share of the step no busy rank fills
        assert shared.bubble_s == pytest.approx(shared.compute_s * idle / (1 - idle))
        assert shared.step_s == pytest.approx(alone.step_s - alone.bubble_s + shared.bubble_s)


def test_every_candidate_is_the_layout_the_trainer_builds():
    """config_of(candidate) resolves, as the trainer would, to the planned layout (degrees, ZeRO,
    recomputation, batch, schedule) — on 4 ranks, every kind of layout the search makes (HSDP
    included)."""
    cfg = load_config(TINY, ["--training.global_batch_size", "16"])
    cands, _ = plan_candidates(cfg, 4, room_of(cfg, 4), keep=10**6)
    kinds = {(c.plan.layout["pp"], c.plan.layout["tp"], c.plan.layout["cp"], c.plan.layout["dp_replicate"])
             for c in cands}
    assert {(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 1), (4, 1, 1, 1), (1, 1, 1, 2)} <= kinds
    for c in cands:
        lay = layout_from_config(c.cfg, 4)[0].to_dict()
        assert {k: lay[k] for k in LAYOUT_KEYS} == {k: c.plan.layout[k] for k in LAYOUT_KEYS}, c.name
        assert c.cfg.training.global_batch_size == 16


def test_nothing_fits_is_one_line_naming_the_memory_needed():
    """The full search and the first-fit scan (the check before launch) say the same line, naming
    the same smallest layout."""
    cfg = load_config(TINY, ["--parallelism.layout", "auto", "--training.memory_cap_gib", "0.001",
                             "--training.seq_len", "512"])
    said, line = [], (r"parallelism.layout = 'auto': no layout of llama3 debug fits 2 rank\(s\) of 0.00 "
                      r"GiB .* needs 0\.\d\d GiB\. Add ranks, raise training.memory_cap_gib")
    for scan in (plan_candidates, first_fit):
        with pytest.raises(ConfigError, match=line) as e:
            scan(cfg, 2, room_of(cfg, 2))
        said.append(str(e.value))
    assert said[0] == said[1]


def test_a_layout_that_fits_only_as_the_search_builds_it_is_no_fit(monkeypatch):
    """Where every layout fits as the search builds it but none as the trainer resolves it (its own
    bucket size, say), the first-fit scan says the one line naming the smallest, not an IndexError."""
    from torchpar.tools import auto_layout

    calls = []

    def alternating(*a, **k):  # the search's layout fits; the trainer's resolution of it does not
        calls.append(1)
        memory, _ = memory_of(*a, **k)
        return memory, len(calls) % 2 == 1

    monkeypatch.setattr(auto_layout, "memory_of", alternating)
    cfg = load_config(TINY, ["--parallelism.layout", "auto"])
    with pytest.raises(ConfigError, match=r"no layout of llama3 debug fits 2 rank\(s\) .* the smallest \(pp"):
        first_fit(cfg, 2, room_of(cfg, 2))


def test_the_first_fit_is_a_layout_that_fits_as_the_trainer_builds_it(monkeypatch):
    """The check before launch prices memory alone and stops at the first layout that fits (the
    most sharded and recomputed first): one the trainer accepts and the full search ranks among
    those that fit, found after pricing a few layouts of the hundreds there are."""
    from torchpar.plan.estimate import plan
    from torchpar.tools import auto_layout

    priced = []
    monkeypatch.setattr(auto_layout, "memory_of", lambda *a, **k: priced.append(1) or memory_of(*a, **k))
    cfg = load_config(TINY, ["--parallelism.layout", "auto", "--training.global_batch_size", "16",
                             "--training.memory_cap_gib", "0.05"])
    room = room_of(cfg, 4)
    job = first_fit(cfg, 4, room)
    lay, model, args = layout_from_config(job, 4)
    assert plan(model, args, lay, room, job.training.seq_len).fits
    fitting = [p for p in search_plans(cfg, room) if p.fits]
    mine = {k: v for k, v in lay.to_dict().items() if k in LAYOUT_KEYS}
    assert mine in [{k: p.layout[k] for k in LAYOUT_KEYS} for p in fitting]
    assert len(priced) <= 4 < len(fitting)


def test_auto_replaces_the_layout_fields_and_keeps_the_global_batch():
    cfg = load_config(TINY, ["--parallelism.layout", "auto", "--parallelism.tensor_parallel_degree", "2"])
    cands, _ = plan_candidates(cfg, 4, room_of(cfg, 4))
    for c in cands:
        assert c.cfg.parallelism.layout == "manual"
        assert c.cfg.training.global_batch_size == 8 * 4  # (0 in the config: local x every rank)


def test_the_probe_splits_one_communicator_per_partition_where_nccl_is_bound(monkeypatch):
    """At 512 ranks, 8 a node: with the default group's NCCL communicator bound to a device, each
    partition's groups come from one split_group call (9 calls, every group of the partition in
    it) — not 511 new_group calls on every rank; without one, a new group per group."""
    from torchpar.plan import probe as pr

    splits = []

    class Bound:
        bound_device_id = torch.device("cuda", 0)

    monkeypatch.setattr(pr.dist.distributed_c10d, "_get_default_group", lambda: Bound())
    monkeypatch.setattr(pr.dist, "split_group",
                        lambda parent, groups, timeout: splits.append(groups) or "mine")
    monkeypatch.setattr(pr.dist, "new_group", lambda *a, **k: pytest.fail("a new group per group"))
    partitions = pr._partitions(512, 8)
    assert all(pr._my_group(groups) == ("mine", ["mine"]) for _, groups in partitions)
    assert splits == [groups for _, groups in partitions] and len(splits) == 9
    assert sum(len(groups) for groups in splits) == 511

    made = []
    monkeypatch.setattr(pr.dist.distributed_c10d, "_get_default_group", lambda: object())
    monkeypatch.setattr(pr.dist, "new_group", lambda ranks, timeout: made.append(ranks) or tuple(ranks))
    monkeypatch.setattr(pr.dist, "get_rank", lambda: 5)
    mine, to_destroy = pr._my_group([[0, 1, 2, 3], [4, 5, 6, 7]])
    assert mine == (4, 5, 6, 7) and made == [[0, 1, 2, 3], [4, 5, 6, 7]] and len(to_destroy) == 2


def test_the_model_probe_shrinks_its_tokens_to_the_memory_it_may_use():
    """The model probe's runs (one and two blocks, one block on more sequences) at the longest
    sequence (at most MAX_PROBE_TOKENS) whose largest run fits: the job's with room, halved to
    what fits, none below 512 tokens; the bytes grow with the tokens."""
    from torchpar.plan.probe import MAX_PROBE_TOKENS, probe_tokens

    model, args = MODELS["llama3"], MODELS["llama3"].args("debug")
    assert MAX_PROBE_TOKENS >= 2048 == args.max_seq_len
    full, need = probe_tokens(model, args, 2048, torch.float32, float("inf"))
    small, need_small = probe_tokens(model, args, 1024, torch.float32, float("inf"))
    assert (full, small) == (2048, 1024) and need_small < need
    assert probe_tokens(model, args, 2048, torch.float32, need_small) == (1024, need_small)
    assert probe_tokens(model, args, 2048, torch.float32, need_small - 1)[0] == 512
    assert probe_tokens(model, args, 2048, torch.float32, 1e5)[0] == 0


def test_the_probe_keeps_the_jobs_device_precision_and_memory_cap(tmp_path, monkeypatch):
    """A probe on one rank leaves the device and its fp32 precision as the job set them (TF32 was
    turned on by a cold cache, whatever training.tf32 said); under a memory cap too small for one
    block the model probe does not run (the matmul rate stands in, and the figures say why); the
    cache is keyed by the cluster, not by rank 0's host."""
    import torch.distributed as dist

    from torchpar import device as dev
    from torchpar.plan import probe as pr

    monkeypatch.setattr(dev, "local_device", lambda *a, **k: pytest.fail("the probe set the device and TF32"))
    monkeypatch.setenv("SLURM_CLUSTER_NAME", "c1")
    model, args = MODELS["llama3"], MODELS["llama3"].args("debug")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        figures = pr.probe(torch.float32, model, args, 32, tmp_path, memory_cap_gib=1e-4)
        assert "not run: one block on 512 tokens needs" in figures["model_probe"], figures.get("model_probe")
        assert figures["model_tokens"] == 0 and figures["model_flops"] == figures["matmul_flops"]
        monkeypatch.setattr(pr.socket, "gethostname", lambda: "another-node-of-c1")
        assert pr.probe(torch.float32, model, args, 32, tmp_path, memory_cap_gib=1e-4)["cached"]
    finally:
        dist.destroy_process_group()


def test_only_a_job_that_asks_for_the_step_time_prediction_probes(monkeypatch):
    """torchpar train probes the machine (a collective, seconds, device memory) only with
    metrics.predict_step_time; layout = 'auto' hands over its own figures."""
    from torchpar.commands import train as command

    seen = []

    class Recorded:
        def __init__(self, cfg, on_process_group=None, **kwargs):
            seen.append(on_process_group)
            self.signals = type("S", (), {"install": lambda self: None})()

        def train(self):
            return []

    monkeypatch.setattr(command, "Trainer", Recorded)
    assert command.main(["--config", str(TINY)]) == 0
    assert command.main(["--config", str(TINY), "--metrics.predict_step_time", "true"]) == 0
    assert seen[0] is None and seen[1].__self__.figures is None and seen[1].__name__ == "probe"


# ------------------------------------------------------------------ spawned ranks

def _probe_worker(rank, world, out):
    from torchpar.plan.probe import probe

    model = MODELS["llama3"]
    args = model.args("debug")
    first = probe(torch.float32, model, args, 32, Path(out), fresh=True)
    second = probe(torch.float32, model, args, 32, Path(out), fresh=True)
    cached = probe(torch.float32, model, args, 32, Path(out))
    if rank == 0:
        Path(out, "probes.json").write_text(json.dumps([first, second, cached]))


@pytest.mark.slow
def test_the_probe_measures_what_the_model_needs_and_is_stable_enough_to_rank():
    """Two probes on 2 ranks: every figure positive; the second within 2x of the first for the
    model's rate and for the compute time it predicts for a micro-step (8 blocks, 8 sequences: rate
    and fixed costs together), within 3x for the matmul rate, the memory bandwidth and the time of
    each collective at 1 MiB (the band a 2-core machine shared with other work keeps); the cache
    returns the last."""
    import shutil

    out = spawn_ranks(_probe_worker, 2)
    try:
        first, second, cached = json.loads(Path(out, "probes.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    for key, band in (("model_flops", 2), ("matmul_flops", 3), ("memory_bw", 3)):
        assert first[key] > 0 and 1 / band <= second[key] / first[key] <= band, (key, first[key], second[key])
    model, tokens = MODELS["llama3"], 8 * 32
    flops = model.flops_per_token(model.args("debug"), 32) * tokens

    def micro_step(f):
        return f["forward_overhead_s"] + 8 * f["block_overhead_s"] + flops / f["model_flops"]
    assert 1 / 2 <= micro_step(second) / micro_step(first) <= 2, (micro_step(first), micro_step(second))
    assert 0 < first["cores_per_rank"] <= 1 and cluster_of(first).cores_per_rank == first["cores_per_rank"]
    assert set(first["collectives"]) == {"intra:2"}
    for kind, (latency, bw) in first["collectives"]["intra:2"].items():
        assert latency >= 0 and bw > 0
        again = second["collectives"]["intra:2"][kind]
        t1, t2 = latency + 2**20 / bw, again[0] + 2**20 / again[1]
        assert 1 / 3 <= t2 / t1 <= 3, (kind, t1, t2)
    assert cached["cached"] and cached["collectives"] == second["collectives"]


def _auto_worker(rank, world, out, overrides):
    import torch.distributed as dist

    from torchpar.plan.compare import StepCheck
    from torchpar.selftest import full_parameters
    from torchpar.tools.auto_layout import auto_layout
    from torchpar.train import Trainer

    said = []
    cfg = load_config(TINY, [*overrides, "--job.dump_folder", f"{out}/run"])
    os.environ["SLURM_JOB_ID"] = "7"  # (a job, so that its restart is one)
    chosen, figures = auto_layout(cfg, world, say=said.append)
    os.environ["SLURM_RESTART_COUNT"] = "1"  # (the job requeued: the same command again)
    again, _ = auto_layout(cfg, world, say=said.append)
    del os.environ["SLURM_RESTART_COUNT"], os.environ["SLURM_JOB_ID"]
    trainer = Trainer(chosen, on_logged_step=StepCheck(figures))
    from torchpar.parallel import layout as layouts

    meshes = [list(key) for key in layouts._MESHES]  # (the trials' others released)
    timeouts = sorted({trainer.layout.mesh.get_group(d)._get_backend(torch.device("cpu")).options._timeout
                       .total_seconds() for d in layouts.MESH_DIMS})
    losses = trainer.train()
    params = [None] * world
    dist.all_gather_object(params, full_parameters(trainer.model.parts))
    if rank == 0:
        torch.save({k: v for p in params for k, v in p.items()}, Path(out, "params.pt"))
        records = [json.loads(line) for line in Path(out, "run", "metrics.jsonl").read_text().splitlines()]
        Path(out, "auto.json").write_text(json.dumps({
            "losses": losses, "said": said, "records": [r for r in records if "loss" in r],
            "trials": sorted(p.name for p in Path(out, "run", "auto_trials").iterdir()),
            "layout": trainer.layout.to_dict(), "meshes": meshes,
            "mesh_key": list(trainer.layout.mesh_key("cpu")), "timeouts": timeouts,
            "timeout_s": cfg.comm.timeout_s, "again": again == chosen}))


@pytest.mark.slow
def test_auto_with_trials_trains_equal_to_one_process():
    """layout = auto with 2 trials on 2 ranks: two candidates trained for 2 steps each, the fastest
    measured kept (the report says which, and whether the planner agreed), then the run trains the
    same losses as one process; every logged step after the first has the predicted and the
    measured step time. A restart of the job (SLURM's requeue) takes the same layout, no trial run."""
    import shutil

    overrides = [*GLOBAL, "--parallelism.layout", "auto", "--parallelism.auto_trials", "2",
                 "--parallelism.auto_trial_steps", "2"]
    out = spawn_ranks(_auto_worker, 2, overrides)
    try:
        got = json.loads(Path(out, "auto.json").read_text())
        params = torch.load(Path(out, "params.pt"))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    assert got["trials"] == ["trial_1", "trial_2"]
    # The job's restart trains what its first start chose, without the search and the trials.
    assert got["again"] and sum("trial 1/2" in s for s in got["said"]) == 1
    assert any("this restart of the job trains the layout its first start chose" in s for s in got["said"])
    assert got["meshes"] == [got["mesh_key"]]  # every group of a trial's other mesh destroyed
    assert got["timeouts"] == [got["timeout_s"]]  # the mesh's groups take comm.timeout_s, not c10d's
    said = "\n".join(got["said"])
    assert "trial 1/2" in said and "trial 2/2" in said
    assert "the trials agreed with the planner" in said or "the trials disagreed with the planner" in said
    report = next(s for s in got["said"] if "predicted" in s and "measured" in s and "chosen" in s)
    table = [line for line in report.splitlines() if line.strip()[:1].isdigit()]
    measured = [float(line.split(" s ")[1].split()[0]) for line in table[:2]]
    chosen = next(i for i, line in enumerate(table) if line.endswith("chosen"))
    assert measured[chosen] == min(measured)
    ref = run_layouts(1, {"ref": [*GLOBAL, "--parallelism.zero_stage", "0"]})["ref"]
    assert_matches({"losses": got["losses"], "params": params, "val_losses": ref["val_losses"]}, ref)
    later = [r for r in got["records"] if r["step"] > 1]
    assert later and all(r["predicted_step_s"] > 0 and r["measured_step_s"] > 0 for r in later)


def _fake_trainer(margin: float):
    """What StepCheck reads of a trainer: the job, its layout, model and throughput clock."""
    import contextlib
    from types import SimpleNamespace

    cfg = load_config(TINY, ["--parallelism.zero_stage", "0", "--metrics.prediction_margin", str(margin)])
    lay, model, args = layout_from_config(cfg, 2)
    return SimpleNamespace(cfg=cfg, layout=lay, model_family=model, args=args, rank=0,
                           global_tokens=8 * 2 * 32, model=SimpleNamespace(pipeline=None),
                           throughput=SimpleNamespace(aside=contextlib.nullcontext))


FIGURES = {"world": 2, "per_node": 2, "device_memory": 8e9, "host_memory": 16e9, "matmul_flops": 5e10,
           "model_flops": 2e10, "memory_bw": 3e10, "block_overhead_s": 1e-3, "forward_overhead_s": 2e-3,
           "device": "CPU", "cores_per_rank": 1.0,
           "collectives": {"intra:2": {"all_reduce": [1e-3, 1e9], "all_gather": [5e-4, 1e9]}}}


def test_the_run_logs_predicted_and_measured_step_time_and_warns_once_naming_the_term(capfd):
    from torchpar.plan.compare import StepCheck

    trainer = _fake_trainer(1.0)
    check = StepCheck(dict(FIGURES))
    first = check(trainer, {"step": 1, "step_s": 1.0})
    predicted = first["predicted_step_s"]
    assert predicted > 0 and "measured_step_s" not in first  # the first step warms up
    assert first["predicted_compute_s"] + first["predicted_communication_s"] == pytest.approx(predicted)
    on_time = check(trainer, {"step": 10, "step_s": 1.5 * predicted, "time_reduce_clip_s": 0.0})
    assert on_time["measured_step_s"] == pytest.approx(1.5 * predicted)
    assert "warning" not in capfd.readouterr().err  # within a factor of 2
    slow = 3 * predicted  # three times the prediction, the excess in the reduction phase
    record = {"step": 20, "step_s": slow, "time_reduce_clip_s": 2 * predicted}
    got = check(trainer, record)
    assert got["measured_communication_s"] == pytest.approx(2 * predicted)
    err = capfd.readouterr().err
    assert "a factor of 3.00" in err and "most of it is communication" in err
    check(trainer, {**record, "step": 30})
    assert "warning" not in capfd.readouterr().err  # once


def _schedule_worker(rank, world, out):
    from torchpar.parallel.pipeline import schedule_order

    orders = {name: schedule_order(name, 4, 8, v)[0] for name, v in (("1F1B", 1), ("Interleaved1F1B", 2),
                                                                      ("ZBVZeroBubble", 2))}
    torch.save(orders, Path(out, f"orders{rank}.pt"))


@pytest.mark.slow
def test_the_planner_builds_pipeline_schedules_inside_a_running_job():
    """`auto` plans inside a job: a 4-stage schedule built on each rank of a 2-rank job (no group
    made on the job's ranks) is the schedule built outside any job."""
    import shutil

    from torchpar.parallel.pipeline import schedule_order

    out = spawn_ranks(_schedule_worker, 2)
    try:
        inside = [torch.load(Path(out, f"orders{r}.pt"), weights_only=False) for r in range(2)]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    for name, v in (("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2)):
        assert inside[0][name] == inside[1][name] == schedule_order(name, 4, 8, v)[0], name
