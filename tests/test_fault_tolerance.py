"""Replica groups through torchft: each group a job of its own (its own processes, process group and
layout), a lighthouse in this process deciding each step's quorum, gradients averaged across the
groups; with every group present they train as one job holding all of their data-parallel ranks."""

import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from harness import ROOT, TINY, assert_matches, run_group, run_layouts

pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer  # noqa: E402

from torchpar.config import load_config  # noqa: E402
from torchpar.plan import PRESETS, communication, layout_from_config  # noqa: E402
from torchpar.weights import model_from, open_source  # noqa: E402

pytestmark = pytest.mark.slow  # trains in spawned processes

Z, LB = "--parallelism.zero_stage", "--training.local_batch_size"
TP2 = ["--parallelism.tensor_parallel_degree", "2"]
MOE = ["--model.name", "moe"]
LORA = ["--lora.rank", "4", "--lora.alpha", "8"]
# (world, overrides) of one replica group, and the reference's (one process) besides its batch of 8:
# 2 groups hold 8 windows a step
GROUPS = {"one rank": (1, [Z, "0", LB, "4"], []),
          "zero3 over 2": (2, [Z, "3", LB, "2"], []),
          "tp2": (2, [*TP2, Z, "0", LB, "4"], []),
          "pp2": (2, ["--parallelism.pipeline_parallel_degree", "2", Z, "1", LB, "4"], []),
          "moe ep2": (2, [*MOE, Z, "3", LB, "2", "--parallelism.expert_parallel_degree", "2"], MOE),
          "lora zero3 over 2": (2, [*LORA, Z, "3", LB, "2"], LORA)}


def run_replica_groups(groups: list[tuple[int, list[str]]], min_replicas: int | None = None,
                       ids: list[int] | None = None, n: int | None = None) -> list:
    """Each of ``groups`` ((world, overrides) of a replica group) trained at once, in its own group
    of processes, beside the others, with a lighthouse here; each group's (results, error).
    ``ids``: the groups' replica_id (default 0, 1, ...) of ``n`` (default: as many as given)."""
    n = n or len(groups)
    least = min_replicas or len(groups)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=least, join_timeout_ms=10000)
    ft = ["--fault_tolerance.enable", "true", "--fault_tolerance.replica_groups", str(n),
          "--fault_tolerance.min_replicas", str(least), "--fault_tolerance.lighthouse", lighthouse.address(),
          "--fault_tolerance.timeout_s", "30"]
    try:
        with ThreadPoolExecutor(len(groups)) as pool:
            futures = [pool.submit(run_group, world,
                                   {"group": [*overrides, *ft, "--fault_tolerance.replica_id", str(i)]})
                       for i, (world, overrides) in zip(ids or range(len(groups)), groups)]
            return [f.result() for f in futures]
    finally:
        lighthouse.shutdown()


@pytest.fixture(scope="module")
def references():
    wanted = list(dict.fromkeys(tuple(ref) for _, _, ref in GROUPS.values()))
    runs = run_layouts(1, {str(i): [*ref, Z, "0", LB, "8"] for i, ref in enumerate(wanted)})
    return {ref: runs[str(i)] for i, ref in enumerate(wanted)}


@pytest.mark.parametrize("name", list(GROUPS))
def test_replica_groups_train_as_one_job(references, name):
    """Two replica groups of one layout (one rank; ZeRO-3, TP, a pipeline with ZeRO-1, expert
    parallelism, LoRA), every step committed by both: each group's losses, held-out losses and final
    weights are one process's on the 8 windows both groups read."""
    world, overrides, ref = GROUPS[name]
    for results, error in run_replica_groups([(world, overrides)] * 2):
        assert error is None, error
        assert_matches(results["group"], references[tuple(ref)])
        # ...and each step's payload across the groups is the planner's (2 groups: a ring all-reduce
        # sends its payload once)
        cfg = load_config(TINY, [*overrides, "--fault_tolerance.enable", "true",
                                 "--fault_tolerance.replica_groups", "2"])
        lay, model, args = layout_from_config(cfg, world)
        predicted = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len)["replicas"]
        assert results["group"]["step1"]["replica_bytes"] == predicted["bytes"]


@pytest.mark.parametrize("kind", ["diloco", "localsgd"])
def test_semi_synchronous_groups_meet_as_their_outer_step_says(kind):
    """Two groups train 3 steps each on their own share, then meet once (sync_every = 3): their
    weights after it are the outer step applied to what each group alone reaches in 3 steps on its
    share — LocalSGD their mean, DiLoCo the weights they started from moved by outer Nesterov SGD
    (lr 0.7, momentum 0.9) along the mean of the two moves."""
    job = [Z, "0", LB, "4", "--training.steps", "3", "--validation.enable", "false"]
    # (the weights the groups start from: a step at lr 0 leaves them as they are)
    start = run_layouts(1, {"s": [*job, "--training.steps", "1", "--optimizer.lr", "0"]})["s"]["params"]
    alone = [run_replica_groups([(1, job)], min_replicas=1, ids=[i], n=2)[0] for i in range(2)]
    met = run_replica_groups([(1, [*job, "--fault_tolerance.semi_sync", kind, "--fault_tolerance.sync_every",
                                   "3"])] * 2)
    for results, error in [*alone, *met]:
        assert error is None, error
    ends = [results["group"]["params"] for results, _ in alone]
    for name, s in start.items():
        a, b = (e[name] for e in ends)
        if kind == "localsgd":
            expected = (a + b) / 2
        else:
            move = ((s - a) + (s - b)) / 2
            expected = s - 0.7 * (move + 0.9 * move)  # (at the first sync the momentum is the move itself)
        for results, _ in met:
            torch.testing.assert_close(results["group"]["params"][name], expected, rtol=0, atol=1e-6)
    # ...sending the weights once in 3 steps, as the planner counts them (a third of it per step)
    overrides = [*job, "--fault_tolerance.enable", "true", "--fault_tolerance.replica_groups", "2",
                 "--fault_tolerance.semi_sync", kind, "--fault_tolerance.sync_every", "3"]
    cfg = load_config(TINY, overrides)
    lay, model, args = layout_from_config(cfg, 1)
    per_step = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len)["replicas"]
    per_step = per_step["bytes"]
    sent = [r["replica_bytes"] for r in met[0][0]["group"]["logged"] if "replica_bytes" in r]
    assert sent[:2] == [0, 0] and sent[2] == pytest.approx(3 * per_step)


def test_groups_of_different_layouts_are_one_line():
    """Gradients are averaged piece by piece: a group whose layout differs from the others' is
    refused at the first step on every rank of every group, in one line."""
    out = run_replica_groups([(2, [Z, "3", LB, "2"]), (2, [Z, "1", LB, "2"])])
    for _, error in out:
        assert error is not None and "runs a layout the other groups do not" in str(error)


def _steps(folder: Path) -> list[int]:
    """The steps a run's metrics.jsonl logged a loss for, in order."""
    path = folder / "metrics.jsonl"
    if not path.exists():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r["step"] for r in records if "loss" in r]


def _kill_tree(pid: int) -> None:
    """SIGKILL to ``pid`` and every process under it (torchrun's workers run in sessions of their
    own: killing the agent's process group leaves them)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    todo, tree = [pid], []
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _wait(predicate, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


STEPS = 120  # (about 0.1 s each: the other group trains on through the killed one's start-up, ~8 s)


def test_a_killed_group_is_not_waited_for_and_recovers_live(tmp_path):
    """Two replica groups under torchrun; group 1 is killed (SIGKILL, its whole process group) mid-run:
    group 0 trains on alone without a restart, its steps never going back; group 1, started again,
    joins the next quorum, takes group 0's weights, optimizer state, step and data position live (no
    checkpoint to read: it saves none before the end), and both end with the same weights, bit for
    bit."""
    # (a group silent for a second is dropped from the quorum; a collective waits 5 s at most)
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=10,
                                  heartbeat_timeout_ms=1000)
    runs = tmp_path / "runs"

    def start(i: int) -> subprocess.Popen:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
               "-m", "torchpar", "train", "--config", str(TINY), "--training.steps", str(STEPS),
               "--metrics.log_freq", "1", "--validation.enable", "false", "--job.dump_folder", str(runs),
               "--checkpoint.enable", "true", "--checkpoint.interval", str(STEPS),
               "--checkpoint.async_mode", "off", "--fault_tolerance.enable", "true",
               "--fault_tolerance.replica_groups", "2", "--fault_tolerance.min_replicas", "1",
               "--fault_tolerance.replica_id", str(i), "--fault_tolerance.lighthouse", lighthouse.address(),
               "--fault_tolerance.timeout_s", "5"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / f"group{i}.err", "ab"))

    groups = {0: runs / "replica_0", 1: runs / "replica_1"}
    try:
        first, second = start(0), start(1)
        _wait(lambda: len(_steps(groups[1])) >= 5, 120, "group 1's fifth step")
        _kill_tree(second.pid)
        second.wait()
        at_kill = len(_steps(groups[0]))
        second = start(1)
        assert first.wait(timeout=300) == 0, (tmp_path / "group0.err").read_text()[-3000:]
        assert second.wait(timeout=300) == 0, (tmp_path / "group1.err").read_text()[-3000:]
    finally:
        for p in (first, second):
            if p.poll() is None:
                _kill_tree(p.pid)
        lighthouse.shutdown()
    steps = _steps(groups[0])
    assert steps == sorted(steps) and steps[-1] == STEPS  # never back, never restarted
    recovered = [json.loads(line) for line in (groups[1] / "metrics.jsonl").read_text().splitlines()
                 if '"recovered"' in line]
    # (it rejoined at a step group 0 had reached training alone, through its start-up)
    assert recovered and recovered[-1]["step"] > at_kill + 5
    (meta0, read0), (meta1, read1) = (open_source(g / "checkpoint") for g in groups.values())
    assert meta0["step"] == meta1["step"] == STEPS
    a, b = model_from(meta0, read0)[0], model_from(meta1, read1)[0]
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), name
