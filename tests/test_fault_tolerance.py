"""Replica groups through torchft: each group a job of its own (its own processes, process group and
layout), a lighthouse in this process deciding each step's quorum, gradients averaged across the
groups; with every group present they train as one job holding all of their data-parallel ranks."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from harness import ROOT, TINY, assert_matches, run_group, run_layouts, spawn_ranks

pytest.importorskip("torchft")
from torchft._torchft import LighthouseServer  # noqa: E402

from torchpar.config import load_config  # noqa: E402
from torchpar.data import build_dataloader  # noqa: E402
from torchpar.fault_tolerance import OuterStep  # noqa: E402
from torchpar.parallel.zero import local  # noqa: E402
from torchpar.plan import PRESETS, communication, layout_from_config  # noqa: E402
from torchpar.preflight import preflight  # noqa: E402
from torchpar.selftest import full_parameters  # noqa: E402
from torchpar.train import Trainer  # noqa: E402
from torchpar.weights import model_from, open_source, resolve_checkpoint  # noqa: E402

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
          "cp2": (2, ["--parallelism.context_parallel_degree", "2", Z, "2", LB, "4"], []),
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
    """Two replica groups of one layout (one rank; ZeRO-3, TP, a pipeline with ZeRO-1, context
    parallelism with ZeRO-2, expert parallelism, LoRA), every step committed by both: each group's
    losses, held-out losses and final weights are one process's on the 8 windows both groups read."""
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


SEMI_JOB = [Z, "0", LB, "4", "--training.steps", "6", "--validation.enable", "false"]
SEMI = {  # name: (kind, sync_every, fragments, fragment_alpha); outer lr 0.7 and momentum 0.9 (defaults)
    "diloco": ("diloco", 2, 1, 0.0),
    "streaming diloco": ("diloco", 4, 2, 0.25),
    "localsgd": ("localsgd", 3, 1, 0.0),
}


def _semi_overrides(kind: str, every: int, fragments: int, alpha: float) -> list[str]:
    return ["--fault_tolerance.semi_sync", kind, "--fault_tolerance.sync_every", str(every),
            "--fault_tolerance.fragments", str(fragments), "--fault_tolerance.fragment_alpha", str(alpha)]


def _simulation(rank, world, out, cases: dict) -> None:
    """Two replica groups of each case simulated in one process, from the algorithms' definitions:
    two trainers, each on its group's share of the data, stepped in turn; every sync_every /
    fragments steps the fragment due (fragment f: the f-th of equal runs of the weights in order)
    is synced — LocalSGD: the two groups' mean; DiLoCo: outer Nesterov SGD on the weights of the
    fragment's last sync along the mean of the two moves since — and each trainer keeps
    fragment_alpha of its own weights."""
    results = {}
    for name, (kind, every, k, alpha) in cases.items():
        trainers = []
        for g in range(2):
            cfg = load_config(TINY, [*SEMI_JOB, "--job.dump_folder", f"{out}/{name}{g}"])
            t, pre, tr = Trainer(cfg), preflight(cfg, 1), cfg.training
            t.batches = iter(build_dataloader(pre.sources, t.tokenizer, tr.seq_len, tr.local_batch_size, g, 2,
                                              tr.seed, 0, cfg.data.lanes, False, pre.shares))
            trainers.append(t)

        def flat(t):
            return torch.cat([local(w).detach().reshape(-1) for w in t.model.state.weights()])

        start = flat(trainers[0]).clone()
        buf, n = torch.zeros_like(start), start.numel()
        for step in range(1, cfg.training.steps + 1):
            for t in trainers:
                t.train_state.step = step
                t.train_step(t.batches)
                t._settle(step)
                t.model.state.zero_grad()
            if step % (every // k):
                continue
            f = (step // (every // k) - 1) % k
            part = slice(f * n // k, (f + 1) * n // k)
            nows = [flat(t)[part] for t in trainers]
            if kind == "localsgd":
                start[part] = (nows[0] + nows[1]) / 2
            else:
                move = ((start[part] - nows[0]) + (start[part] - nows[1])) / 2
                buf[part] = 0.9 * buf[part] + move
                start[part] -= 0.7 * (move + 0.9 * buf[part])
            for t, now in zip(trainers, nows):
                whole = flat(t)
                whole[part] = (1 - alpha) * start[part] + alpha * now
                at = 0
                with torch.no_grad():
                    for w in t.model.state.weights():
                        local(w).view(-1).copy_(whole[at: at + local(w).numel()])
                        at += local(w).numel()
                t.model.state.load_model_state_dict({})
        results[name] = [{"losses": t.losses, "params": full_parameters(t.model.parts)} for t in trainers]
        for t in trainers:
            t.close()
    torch.save(results, f"{out}/simulation.pt")


def test_semi_synchronous_groups_equal_their_simulation():
    """DiLoCo (sync every 2 steps), streaming DiLoCo (2 fragments, one every 2 steps, a quarter of
    the group's own weights kept) and LocalSGD (every 3 steps): two groups of 6 steps each equal their
    simulation in one process — each group's losses and weights — and each sync sends the bytes
    the planner counts (its share of them per step)."""
    sim = torch.load(f"{spawn_ranks(_simulation, 1, SEMI)}/simulation.pt")
    for name, case in SEMI.items():
        job = [*SEMI_JOB, *_semi_overrides(*case)]
        runs = run_replica_groups([(1, job)] * 2)
        for g, (results, error) in enumerate(runs):
            assert error is None, error
            assert results["group"]["losses"] == pytest.approx(sim[name][g]["losses"], abs=1e-6), name
            for key, x in sim[name][g]["params"].items():
                torch.testing.assert_close(results["group"]["params"][key], x, rtol=0, atol=1e-6)
        cfg = load_config(TINY, [*job, "--fault_tolerance.enable", "true",
                                 "--fault_tolerance.replica_groups", "2"])
        lay, model, args = layout_from_config(cfg, 1)
        per_step = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len)
        per_step = per_step["replicas"]["bytes"]
        sent = {r["step"]: r["replica_bytes"] for r in runs[0][0]["group"]["logged"] if "replica_bytes" in r}
        period = case[1] // case[2]
        assert sorted(sent) == list(range(1, 7)), name  # (every step logged)
        for step, nbytes in sent.items():
            expected = pytest.approx(period * per_step, rel=1e-5) if step % period == 0 else 0
            assert nbytes == expected, (name, step)


def test_the_outer_step_state_resumes_bitwise(tmp_path):
    """A streaming DiLoCo group (ZeRO-3 over 2 ranks, 2 fragments, one every 2 steps) saved at step
    3, between two meetings, and resumed from there ends as the run that went on: each rank's
    weights of the last meetings, outer momentum and count of meetings (whose turn the fragments
    take) are in the checkpoint."""
    job = [Z, "3", LB, "2", "--training.steps", "6", "--validation.enable", "false",
           *_semi_overrides("diloco", 4, 2, 0.25), "--checkpoint.enable", "true",
           "--checkpoint.interval", "3",
           "--checkpoint.folder", str(tmp_path / "ckpt"), "--checkpoint.async_mode", "off"]
    (whole, error), = run_replica_groups([(2, job)], min_replicas=1, n=2)
    assert error is None, error
    (resumed, error), = run_replica_groups([(2, [*job, "--checkpoint.load_step", "3"])], min_replicas=1, n=2)
    assert error is None, error
    assert resumed["group"]["losses"] == whole["group"]["losses"][3:]
    for name, x in whole["group"]["params"].items():
        assert torch.equal(resumed["group"]["params"][name], x), name


def test_groups_resumed_from_different_steps_line_up_at_their_first_commit(tmp_path):
    """A whole job started again with its groups' checkpoints at different steps (one group was
    down when the other saved): each group counts its commits from its checkpoint's step, so the
    one behind recovers the other's state at the first quorum, and both end as one. (Counting
    from 0, both went on from their own weights and averaged gradients of different ones.)"""
    job = [Z, "0", LB, "4", "--validation.enable", "false", "--checkpoint.enable", "true",
           "--checkpoint.interval", "2", "--checkpoint.async_mode", "off", "--checkpoint.keep_latest_k", "0"]
    job += ["--checkpoint.folder", str(tmp_path)]  # (each group's in replica_<id> inside)
    (_, error), = run_replica_groups([(1, [*job, "--training.steps", "4"])], min_replicas=1, n=2)
    assert error is None, error
    shutil.copytree(tmp_path / "replica_0", tmp_path / "replica_1")
    groups = [(1, [*job, "--training.steps", "6", "--checkpoint.load_step", str(step)]) for step in (2, 4)]
    (behind, error_a), (ahead, error_b) = run_replica_groups(groups)
    assert error_a is None and error_b is None, (error_a, error_b)
    assert any(r.get("event") == "recovered" for r in behind["group"]["logged"])
    for name, x in ahead["group"]["params"].items():
        assert torch.equal(behind["group"]["params"][name], x), name


def test_a_synchronous_group_resumes_its_count_of_commits_not_its_steps():
    """A group's steps include those the quorum did not commit; the count of commits (torchft's)
    is kept in the checkpoint and a resume counts from it; a checkpoint without it (older, or
    trained without replica groups) from the step."""
    from torchpar.fault_tolerance import CommitCount

    count = CommitCount()
    assert count.resume_at(10) == 10
    count.count.fill_(9)  # (10 steps, one of them not committed)
    again = CommitCount()
    again.load_state_dict(count.state_dict())
    assert again.resume_at(10) == 9
    older = CommitCount()
    older.load_state_dict({})
    assert older.resume_at(10) == 10


class _Meeting:
    """ReplicaGroups at a meeting, as a group that joins late sees it: the others have committed
    ``count`` meetings, and the average comes back as ``moved`` (a joining group's own is zeroed)."""

    def __init__(self, count: int, moved: float):
        self.count, self.moved = count, moved

    def start_step(self) -> None:
        pass

    def meetings(self) -> int:
        return self.count

    def average(self, tensors: list[torch.Tensor]) -> None:
        for t in tensors:
            t.fill_(self.moved)

    def commit(self) -> bool:
        self.count += 1
        return True


def test_an_average_copies_each_dtypes_pieces_to_the_host_once(monkeypatch):
    """The groups average over gloo, so a GPU rank's gradient pieces go to the host and back: in
    one copy each way per dtype, not one per piece (each waits for the device). The pieces —
    strided views, two dtypes — get the average back in place, and the one-hot names the groups."""
    from torchpar.fault_tolerance import ReplicaGroups

    class Manager:  # (the other group sent the same pieces doubled, and the same one-hot and fingerprint)
        def allreduce(self, flat):
            (flat[:-4] if flat.dtype == torch.float32 else flat).mul_(1.5)
            return SimpleNamespace(wait=lambda: None)

        def errored(self):
            return None

        def num_participants(self):
            return 2

    groups = object.__new__(ReplicaGroups)
    groups.manager, groups.replica_id, groups.groups, groups.payload = Manager(), 1, 2, 0
    groups.describe("dp 2")
    weights = torch.arange(12.0).view(3, 4)
    pieces = [weights[:, 1], weights[2:], torch.ones(5, dtype=torch.bfloat16)]
    hosts = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: hosts.append(t.numel()) or real(t, *a, **k))
    groups.average(pieces)
    assert sorted(hosts) == [5, 3 + 4]  # (bf16: 5 elements; fp32: the column and the row)
    assert torch.equal(weights[:, 1], 1.5 * torch.tensor([1.0, 5.0, 9.0]))
    assert torch.equal(weights[2], 1.5 * torch.tensor([8.0, 9.0, 10.0, 11.0]))
    assert weights[0, 0] == 0 and torch.equal(pieces[2], torch.full((5,), 1.5, dtype=torch.bfloat16))
    assert groups.members == [1]


def test_a_late_group_meets_over_the_others_fragment():
    """Streaming DiLoCo's fragment is the groups' count of meetings, not the group's own: a group
    that has met nobody yet, meeting others who have met 5 times, syncs the second of 2 fragments
    (outer lr 1, no momentum: the fragment's start moves by the average move) and counts 6."""
    ft = SimpleNamespace(semi_sync="diloco", fragment_alpha=0.0, outer_lr=1.0, outer_momentum=0.0,
                         fragments=2, sync_every=4)
    weights = [torch.arange(4.0), torch.arange(4.0, 6.0)]  # (6 elements: fragments 0-2 and 3-5)
    outer = OuterStep(ft, weights, rank=0)
    for w in weights:
        w.add_(5.0)  # (its own steps since)
    assert outer.sync(_Meeting(5, moved=2.0), weights)
    flat = torch.cat(weights)
    torch.testing.assert_close(flat[:3], torch.arange(3.0) + 5.0)  # (fragment 0: its own)
    torch.testing.assert_close(flat[3:], torch.arange(3.0, 6.0) - 2.0)  # (fragment 1: start - 2)
    assert int(outer.meetings) == 6


def test_groups_of_different_layouts_are_one_line():
    """Gradients are averaged piece by piece: a group whose layout differs from the others' is
    refused at the first step on every rank of every group, in one line."""
    out = run_replica_groups([(2, [Z, "3", LB, "2"]), (2, [Z, "1", LB, "2"])])
    for _, error in out:
        assert error is not None and "runs a layout the other groups do not" in str(error)


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


STEPS = 60
GROUP = [Z, "3", LB, "2"]  # each replica group: ZeRO-3 over 2 ranks, 2 windows each


def _reference(rank, world, out, schedule: list, groups: int) -> None:
    """One process trained as the replica groups were: at each step on the windows the groups in
    ``schedule[step - 1]`` read (their 4 each), an uncommitted step (None) reading its windows and
    applying nothing — the reference for a run whose membership changed."""
    steps = str(len(schedule))
    cfg = load_config(TINY, [Z, "0", LB, "2", "--training.steps", steps, "--metrics.log_freq", steps,
                             "--validation.enable", "false", "--job.dump_folder", f"{out}/ref"])
    trainer, pre, tr = Trainer(cfg), preflight(cfg, 1), cfg.training
    dp = 2  # (a group's data-parallel ranks: group g's rank i reads shard g x dp + i)
    readers = [iter(build_dataloader(pre.sources, trainer.tokenizer, tr.seq_len, tr.local_batch_size, shard,
                                     groups * dp, tr.seed, 0, cfg.data.lanes, False, pre.shares))
               for shard in range(groups * dp)]
    per_group, losses = trainer.global_tokens * dp, {}
    for members in schedule:
        trainer.train_state.step += 1
        windows = [next(r) for r in readers]
        if members is None:
            trainer.lr_scheduler.step()
            continue
        trainer.global_tokens = per_group * len(members)
        trainer.train_step(iter([torch.cat([windows[g * dp + i] for g in members for i in range(dp)])]))
        trainer._settle(trainer.train_state.step)
        losses[trainer.train_state.step] = trainer.losses[-1]
        trainer.model.state.zero_grad()
    torch.save({"losses": losses, "params": full_parameters(trainer.model.parts)}, f"{out}/ref.pt")
    trainer.close()


def _committed(records: list[dict]) -> dict[int, list[int]]:
    """The steps a group's metrics say it committed, each with the groups taking part (logged as
    they change; a restarted group logs them at its first committed step)."""
    out, uncommitted, taking_part = {}, set(), None
    for r in records:
        taking_part = r.get("replica_members", taking_part)
        if "uncommitted_steps" in r:
            uncommitted.add(r["step"])
        elif "loss" in r and r["step"] not in uncommitted:
            out[r["step"]] = taking_part
    return out


def _records(folder: Path) -> list[dict]:
    path = folder / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [json.loads(line) for line in lines if line.strip()]


class TorchrunGroups:
    """Replica groups, each a torchrun job of ``nproc`` ranks (tests/faulty_train.py: ``torchpar
    train`` with faults and a pace), beside a lighthouse in this process; their folders under
    ``tmp_path``/runs. As a context: on a failure, each group's last lines are printed; at the end,
    every group still running is killed and the lighthouse stops."""

    def __init__(self, tmp_path: Path, n: int, nproc: int, steps: int, overrides: list[str]):
        # (a group silent for a second is dropped from the quorum; a collective waits 5 s at most; a
        # quorum waits 2 s for a group that is late to it — longer than a step, so that a group one
        # step behind, which recovers and then trains, is not left out again and again)
        self.lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=2000,
                                           quorum_tick_ms=10, heartbeat_timeout_ms=1000)
        self.tmp, self.n, self.procs, self.pace = tmp_path, n, {}, tmp_path / "pace"
        runs = tmp_path / "runs"
        self.folders = {i: runs / f"replica_{i}" for i in range(n)}
        self.args = [str(ROOT / "tests" / "faulty_train.py"), "train", "--config", str(TINY), *overrides,
                     "--training.steps", str(steps), "--metrics.log_freq", "1", "--validation.enable",
                     "false", "--job.dump_folder", str(runs), "--checkpoint.enable", "true",
                     "--checkpoint.interval", str(steps), "--checkpoint.async_mode", "off",
                     "--fault_tolerance.enable", "true", "--fault_tolerance.replica_groups", str(n),
                     "--fault_tolerance.min_replicas", "1", "--fault_tolerance.lighthouse",
                     self.lighthouse.address(), "--fault_tolerance.timeout_s", "5"]
        self.nproc = nproc

    def start(self, i: int, fault: str = "") -> None:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(self.nproc), *self.args, "--fault_tolerance.replica_id", str(i)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}",
               "FAULT": fault, "PACE": str(self.pace)}
        out = open(self.tmp / f"group{i}.out", "ab")
        self.procs[i] = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True, stdout=out,
                                         stderr=subprocess.STDOUT)

    def kill(self, i: int) -> None:
        _kill_tree(self.procs[i].pid)
        self.procs[i].wait()

    def records(self, i: int) -> list[dict]:
        return _records(self.folders[i])

    def steps(self, i: int) -> list[int]:
        return [r["step"] for r in self.records(i) if "loss" in r]

    def members(self, i: int = 0) -> list[int]:
        """The groups taking part in group ``i``'s last committed step."""
        return ([r["replica_members"] for r in self.records(i) if "replica_members" in r] or [[]])[-1]

    def finish(self) -> None:
        """Full speed, and every group to its last step."""
        self.pace.unlink()
        for i, p in self.procs.items():
            assert p.wait(timeout=300) == 0, (self.tmp / f"group{i}.out").read_text()[-3000:]

    def models(self) -> list[dict]:
        """Each group's final weights, read from its checkpoint."""
        return [model_from(*open_source(g / "checkpoint"))[0].state_dict() for g in self.folders.values()]

    def __enter__(self):
        return self

    def __exit__(self, kind, error, trace):
        if kind is not None:
            for i in range(self.n):  # (what each group printed last, beside the failure)
                out = self.tmp / f"group{i}.out"
                lines = out.read_text(errors="replace").splitlines() if out.exists() else []
                tail = [line for line in lines if "Warning" not in line][-15:]
                print(f"--- group {i} ---", *tail, sep="\n")
        for p in self.procs.values():
            if p.poll() is None:
                _kill_tree(p.pid)
        self.lighthouse.shutdown()


def test_groups_killed_mid_step_and_in_recovery_rejoin_live(tmp_path):
    """Three replica groups (ZeRO-3 over 2 ranks each) under torchrun. Groups 1 and 2 join group 0's
    run; group 1 is killed (SIGKILL, every process) mid-step, then group 2: group 0 trains on alone,
    without a restart, its steps never going back. Group 1 started again dies halfway through taking
    group 0's state; started once more, it recovers live beside group 2 (no checkpoint: none is saved
    before the end), and all three end with the same weights, bit for bit. Group 0's losses and
    weights are those of one process trained, step by step, on the windows of the groups that
    committed each step."""
    with TorchrunGroups(tmp_path, 3, 2, STEPS, GROUP) as run:
        run.pace.write_text("0.5")  # (the groups' pace while others start)
        run.start(0)
        _wait(lambda: run.steps(0), 120, "group 0's first step")
        run.start(1)
        run.start(2)
        _wait(lambda: run.members() == [0, 1, 2], 120, "groups 1 and 2 joining")
        at = run.steps(0)[-1]
        _wait(lambda: run.steps(0)[-1] >= at + 2, 60, "group 0's steps with the others")
        run.kill(1)
        _wait(lambda: run.members() == [0, 2], 60, "group 0's steps without group 1")
        run.kill(2)
        run.start(1, fault="recovery")
        assert run.procs[1].wait(timeout=120) != 0
        assert "dying in recovery" in (tmp_path / "group1.out").read_text()
        run.start(1)
        run.start(2)
        _wait(lambda: run.members() == [0, 1, 2], 120, "groups 1 and 2 recovering")
        run.finish()
    logged = run.steps(0)
    assert logged == sorted(logged) and logged[-1] == STEPS  # never back, never restarted
    records = run.records(0)
    changes = [(r["step"], r["replica_members"]) for r in records if "replica_members" in r]
    # (group 0 trained steps alone, with all three and with two)
    assert {(0,), (0, 2), (0, 1, 2)} <= {tuple(m) for _, m in changes}
    models = run.models()
    for other in models[1:]:
        for name, x in models[0].items():
            assert torch.equal(x, other[name]), name
    # ...and group 0's run is one process's given the same membership per step: that of the groups
    # that committed it (a group whose step failed recovers the others' update at the next quorum)
    schedule: dict[int, list[int]] = {}
    for g in range(3):
        for step, taking_part in _committed(run.records(g)).items():
            assert schedule.setdefault(step, taking_part) == taking_part, (step, taking_part)
    out = spawn_ranks(_reference, 1, [schedule.get(s) for s in range(1, STEPS + 1)], 3)
    ref = torch.load(f"{out}/ref.pt")
    mine = _committed(records)
    losses = {r["step"]: r["loss"] for r in records if "loss" in r and r["step"] in mine}
    assert losses == pytest.approx({s: ref["losses"][s] for s in losses}, abs=1e-4)
    for name, x in ref["params"].items():  # (60 AdamW steps of ZeRO-3's sums against one process's)
        assert torch.linalg.norm(models[0][name].float() - x) <= 1e-3 * torch.linalg.norm(x), name


def _outer_state(folder: Path) -> dict[str, torch.Tensor]:
    """The outer step's state (every rank's weights of the last meetings, momentum, count of
    meetings) in a group's last checkpoint."""
    _, read = open_source(folder / "checkpoint")
    saved = dcp.FileSystemReader(str(resolve_checkpoint(folder / "checkpoint"))).read_metadata()
    return {key: read(key) for key in saved.state_dict_metadata if key.startswith("outer.")}


def test_a_streaming_diloco_group_killed_recovers_at_the_next_meeting(tmp_path):
    """Two streaming DiLoCo groups (one rank each; 2 fragments, one every 2 steps) under torchrun:
    group 1 is killed mid-run and started again; at its first meeting it takes from group 0 the
    weights, the inner optimizer's state, the weights of the last meetings, the outer momentum, the
    count of meetings (so it meets over the others' fragment, whatever its own step), the step and
    the data position. At the end both hold the same outer state, bit for bit, having met over the
    same fragments since, and group 0's steps never went back."""
    diloco = _semi_overrides("diloco", 4, 2, 0.0)
    with TorchrunGroups(tmp_path, 2, 1, 50, [Z, "0", LB, "4", *diloco]) as run:
        run.pace.write_text("0.2")
        run.start(0)
        run.start(1)
        _wait(lambda: run.members() == [0, 1], 120, "both groups meeting")
        run.kill(1)
        _wait(lambda: run.members() == [0], 60, "group 0 meeting alone")
        recovered = sum(r.get("event") == "recovered" for r in run.records(1))
        run.start(1)
        _wait(lambda: run.members() == [0, 1] and
              sum(r.get("event") == "recovered" for r in run.records(1)) > recovered, 120, "group 1 back")
        run.finish()
    logged = run.steps(0)
    assert logged == sorted(logged) and logged[-1] == 50
    a, b = (_outer_state(folder) for folder in run.folders.values())
    assert a.keys() == b.keys() and "outer.rank0.meetings" in a and any(".momentum." in k for k in a)
    assert int(a["outer.rank0.meetings"]) >= 50 // 2 - 2  # (a meeting every 2 steps; a failed one or two)
    for key, x in a.items():
        assert torch.equal(x, b[key]), key
