"""Checkpoint files end to end: atomic saves, keep_latest_k, async mode, interrupted
saves, bad checkpoints, export / initial_load_path, generate, and surviving a killed rank."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from harness import ROOT, TINY
from test_train import env, run

pytestmark = pytest.mark.slow  # trains in spawned processes

TRAIN = [sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--training.seq_len", "32"]


def train(tmp_path, folder, *more, **env):
    return run([*TRAIN, "--job.dump_folder", str(folder), "--checkpoint.enable", "true", *more], tmp_path,
               **env)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """6 steps, a checkpoint every 2 (async), keep the newest 2."""
    tmp = tmp_path_factory.mktemp("trained")
    r = train(tmp, tmp / "run", "--training.steps", "6", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "2", "--checkpoint.async_mode", "async")
    assert r.returncode == 0, r.stderr
    return tmp / "run"


def copy_run(trained, tmp_path) -> Path:
    dst = tmp_path / "run"
    shutil.copytree(trained, dst)
    return dst


def test_saves_are_complete_and_pruned(trained):
    ck = trained / "checkpoint"
    assert sorted(d.name for d in ck.iterdir()) == ["step-00000004", "step-00000006"]
    manifest = json.loads((ck / "step-00000006" / "torchpar.json").read_text())
    assert manifest["step"] == 6 and manifest["tokens_seen"] == 6 * 8 * 32
    assert manifest["model_flavor"] == "debug" and "[checkpoint]" in manifest["config"]
    for name, (size, _) in manifest["files"].items():
        assert (ck / "step-00000006" / name).stat().st_size == size
    assert ".metadata" in manifest["files"]
    # An async save is finalized steps later; its manifest still describes the step it saved.
    earlier = json.loads((ck / "step-00000004" / "torchpar.json").read_text())
    assert earlier["step"] == 4 and earlier["tokens_seen"] == 4 * 8 * 32


def folder_digest(folder: Path) -> dict:
    """Every file under ``folder`` with its bytes' hash: to show that nothing in it changed."""
    import hashlib

    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


def test_interrupted_save_is_removed_and_anything_else_left_alone(trained, tmp_path):
    """Only a .partial folder that torchpar started (its marker inside) is removed; a complete-
    looking folder without a manifest, or a .partial without the marker, is reported and kept."""
    from torchpar.checkpoint import PARTIAL_MARKER

    run_dir = copy_run(trained, tmp_path)
    partial = run_dir / "checkpoint" / "step-00000008.partial"
    partial.mkdir()
    (partial / PARTIAL_MARKER).write_text("step 8\n")
    (partial / "__0_0.distcp").write_bytes(b"half a checkpoint")
    foreign = run_dir / "checkpoint" / "step-00000009.partial"  # not torchpar's
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    no_manifest = run_dir / "checkpoint" / "step-00000010"  # a manifest deleted by hand
    shutil.copytree(run_dir / "checkpoint" / "step-00000006", no_manifest)
    (no_manifest / "torchpar.json").unlink()
    kept = {d: folder_digest(d) for d in (foreign, no_manifest)}
    r = train(tmp_path, run_dir, "--training.steps", "7")
    assert r.returncode == 0, r.stderr
    assert "ignoring incomplete checkpoint" in r.stderr and "step-00000008.partial" in r.stderr
    assert "step-00000010 has no manifest" in r.stderr and "left alone" in r.stderr
    assert "resumed from" in r.stdout and "step-00000006 at step 6" in r.stdout
    assert "step     7  loss" in r.stdout
    assert not partial.exists()
    assert {d: folder_digest(d) for d in kept} == kept


def test_resume_from_an_older_step_keeps_the_newer_checkpoints(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    newer = folder_digest(run_dir / "checkpoint" / "step-00000006")
    r = train(tmp_path, run_dir, "--training.steps", "8", "--checkpoint.interval", "2",
              "--checkpoint.keep_latest_k", "2", "--checkpoint.load_step", "4")
    assert r.returncode == 0, r.stderr
    assert "starts at step 4" in r.stderr and "later checkpoints (steps 6)" in r.stderr
    (aside,) = (run_dir / "checkpoint").glob("superseded-*-from-step-4")
    assert folder_digest(aside / "step-00000006") == newer  # the old timeline's step 6, untouched
    assert sorted(d.name for d in (run_dir / "checkpoint").glob("step-*")) == [
        "step-00000006",
        "step-00000008",
    ]
    branch = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if '"branch"' in x]
    assert branch == [{"step": 4, "event": "branch", "branch_from_step": 4, "moved_steps": [6],
                       "moved_to": str(aside)}]


def test_a_restarted_job_that_asked_for_a_step_goes_on_from_its_own_latest(trained, tmp_path):
    """A job started with checkpoint.load_step 4 branches there and saves steps 6 and 8; torchrun's
    restart or a SLURM requeue runs the same command line again: it resumes from the job's own
    step 8 (it went back to step 4 and set its own later checkpoints aside, at every restart).
    Another job asking for a step goes back to it."""
    run_dir = copy_run(trained, tmp_path)
    job = ["--checkpoint.interval", "2", "--checkpoint.keep_latest_k", "2", "--checkpoint.load_step", "4"]
    first = train(tmp_path, run_dir, "--training.steps", "8", *job, SLURM_JOB_ID="41")
    assert first.returncode == 0 and "starts at step 4" in first.stderr, first.stderr
    ours = folder_digest(run_dir / "checkpoint" / "step-00000008")
    again = train(tmp_path, run_dir, "--training.steps", "10", *job, SLURM_JOB_ID="41",
                  SLURM_RESTART_COUNT="1")
    assert again.returncode == 0, again.stderr
    assert "at step 8" in again.stdout and "starts at step" not in again.stderr
    assert len(list((run_dir / "checkpoint").glob("superseded-*"))) == 1  # (the first start's)
    steps = sorted(d.name for d in (run_dir / "checkpoint").glob("step-*"))
    assert steps == ["step-00000008", "step-00000010"]
    assert folder_digest(run_dir / "checkpoint" / "step-00000008") == ours
    job[-1] = "8"  # (step 4 is pruned by now)
    other = train(tmp_path, run_dir, "--training.steps", "12", *job, SLURM_JOB_ID="42",
                  SLURM_RESTART_COUNT="1")
    assert other.returncode == 0 and "later checkpoints (steps 10)" in other.stderr, other.stderr


def test_keep_latest_k_never_deletes_this_runs_checkpoints_for_older_ones(trained, tmp_path):
    """A fresh start (load_step 0) in a folder holding steps 4 and 6 of an earlier run: those are
    set aside, and keep_latest_k keeps this run's newest, not the earlier run's higher steps."""
    run_dir = copy_run(trained, tmp_path)
    before = folder_digest(run_dir / "checkpoint")
    r = train(tmp_path, run_dir, "--training.steps", "3", "--checkpoint.interval", "1",
              "--checkpoint.keep_latest_k", "2", "--checkpoint.load_step", "0")
    assert r.returncode == 0, r.stderr
    assert sorted(d.name for d in (run_dir / "checkpoint").glob("step-*")) == [
        "step-00000002",
        "step-00000003",
    ]
    (aside,) = (run_dir / "checkpoint").glob("superseded-*-from-step-0")
    assert folder_digest(aside) == before


def test_one_run_per_dump_folder(trained, tmp_path):
    from torchpar.preflight import RunLock

    run_dir = copy_run(trained, tmp_path)
    held = RunLock(run_dir)  # as a live run's rank 0 holds it
    try:
        before = folder_digest(run_dir)
        for extra in (["--check", "--training.steps", "7"], ["--training.steps", "7"]):
            r = train(tmp_path, run_dir, *extra)
            expect_error(r, f"job.dump_folder {run_dir} is in use by another run", f"pid {os.getpid()}")
        assert folder_digest(run_dir) == before
    finally:
        held.release()
    r = train(tmp_path, run_dir, "--training.steps", "7")  # a lock of a process that ended is no lock
    assert r.returncode == 0, r.stderr


def expect_error(r, *fragments, code=2):
    assert r.returncode == code, r.stdout + r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("torchpar: error: "), r.stderr
    for f in fragments:
        assert f in line, line


def test_resume_with_another_sequence_length_and_batch_says_so(trained, tmp_path):
    run_dir = copy_run(trained, tmp_path)
    r = train(tmp_path, run_dir, "--training.steps", "8", "--training.seq_len", "16",
              "--training.local_batch_size", "4")
    assert r.returncode == 0, r.stderr
    assert "training.seq_len 32 -> 16 since the checkpoint" in r.stderr
    assert "global batch 8 -> 4 sequences since the checkpoint" in r.stderr
    manifest = json.loads((run_dir / "checkpoint" / "step-00000008" / "torchpar.json").read_text())
    assert manifest["tokens_seen"] == 6 * 8 * 32 + 2 * 4 * 16
    assert manifest["data"]["seq_len"] == 16 and manifest["data"]["global_batch"] == 4


def test_another_corpus_is_refused_unless_the_position_is_reset(trained, tmp_path):
    (tmp_path / "doc.txt").write_text("def f():\n    return 1\n" * 50)
    corpus = ["--data.dataset", "files", "--data.path", str(tmp_path / "doc.txt")]
    run_dir = copy_run(trained, tmp_path)
    before = folder_digest(run_dir / "checkpoint")
    expect_error(train(tmp_path, run_dir, "--training.steps", "7", *corpus),
                 "data.dataset / data.path", "another corpus (stdlib:train there, files here)",
                 "data.resume_position = false")
    assert folder_digest(run_dir / "checkpoint") == before
    r = train(tmp_path, run_dir, "--training.steps", "7", *corpus, "--data.resume_position", "false")
    assert r.returncode == 0 and "the data is read from its start" in r.stderr, r.stderr
    assert "resumed from" in r.stdout and (run_dir / "checkpoint" / "step-00000007").is_dir()


def test_export_then_train_from_it_and_generate(trained, tmp_path):
    out = tmp_path / "model.pt"
    r = run(["torchpar", "export", "--checkpoint", str(trained), "--out", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr
    weights = torch.load(out, weights_only=True)
    meta = json.loads(out.with_name("model.pt.json").read_text())
    assert meta["step"] == 6 and meta["model_flavor"] == "debug"
    bf16 = tmp_path / "model_bf16.pt"
    assert (
        run(
            ["torchpar", "export", "--checkpoint", str(trained / "checkpoint" / "step-00000006"), "--out",
             str(bf16), "--dtype", "bf16"],
            tmp_path,
        ).returncode
        == 0
    )
    small = torch.load(bf16, weights_only=True)
    assert all(v.dtype == torch.bfloat16 and torch.equal(v, weights[k].bfloat16()) for k, v in small.items())
    # Start a new run from the exported weights; with lr 0 its final checkpoint holds them unchanged.
    fresh = tmp_path / "fresh"
    r = train(tmp_path, fresh, "--checkpoint.initial_load_path", str(out), "--training.steps", "1",
              "--optimizer.lr", "0", "--optimizer.weight_decay", "0")
    assert r.returncode == 0, r.stderr
    again = tmp_path / "again.pt"
    assert (
        run(["torchpar", "export", "--checkpoint", str(fresh), "--out", str(again)], tmp_path).returncode == 0
    )
    reloaded = torch.load(again, weights_only=True)
    assert reloaded.keys() == weights.keys()
    assert all(torch.equal(reloaded[k], weights[k]) for k in weights)
    first_loss = json.loads((fresh / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert first_loss < 8.5  # trained weights, not a fresh init (which starts at ~8.8 = ln 4096 + noise)
    # A weights file of another shape is refused before training.
    expect_error(
        train(
            tmp_path, tmp_path / "bad", "--checkpoint.initial_load_path", str(out), "--model.n_layers", "4"
        ),
        "weights file",
        "another shape",
    )
    # Sampling: greedy is deterministic and the same from the checkpoint and the fp32 export.
    cmd = ["torchpar", "generate", "--prompt", "import os\n", "--max-new-tokens", "12", "--temperature", "0"]
    a = run([*cmd, "--checkpoint", str(trained)], tmp_path)
    b = run([*cmd, "--checkpoint", str(out)], tmp_path)
    assert a.returncode == 0, a.stderr
    assert a.stdout == b.stdout and a.stdout.startswith("import os\n") and len(a.stdout) > len("import os\n")


def _rank_pids(local_rank: int, folder: Path) -> list[int]:
    """The training processes of ``local_rank`` of the run writing ``folder`` (never another run's:
    a user's training on the same machine is left alone)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes()
            environ = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"torchpar\0train\0" in cmd
            and b"--nproc-per-node" not in cmd  # (the launcher's agent, which names the ranks' command)
            and str(folder).encode() in cmd
            and f"LOCAL_RANK={local_rank}".encode() in environ
        ):
            pids.append(int(d.name))
    return pids


def assert_same_weights(tmp_path, ref: Path, other: Path) -> None:
    """The latest checkpoints of two runs hold bitwise equal weights (compared as exports)."""
    a = run(["torchpar", "export", "--checkpoint", str(ref), "--out", str(tmp_path / "a.pt")], tmp_path)
    b = run(["torchpar", "export", "--checkpoint", str(other), "--out", str(tmp_path / "b.pt")], tmp_path)
    assert a.returncode == b.returncode == 0
    wa, wb = (torch.load(tmp_path / "a.pt", weights_only=True),
              torch.load(tmp_path / "b.pt", weights_only=True))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# The killed-rank and SIGTERM runs: 2 ranks, 30 steps of the debug model (their windows for a kill or a
# stop are counted in steps, and its eight layers make them long enough).
TWO_RANKS = ["--training.steps", "30", "--training.seq_len", "32", "--training.local_batch_size", "4",
             "--parallelism.zero_stage", "3", "--checkpoint.enable", "true", "--metrics.log_freq", "1"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    """The run that the killed-rank and SIGTERM runs must end equal to: the same 30 steps, never
    stopped, saved at the end (how often a run saves changes no weight)."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    r = run(["./run_train.sh", *TWO_RANKS, "--checkpoint.interval", "100", "--job.dump_folder",
             str(tmp / "ref")], tmp, NGPU="2")
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "ref"


def test_killed_rank_is_restarted_and_resumes_from_the_async_save_written_just_before(tmp_path,
                                                                                      uninterrupted):
    """An asynchronous save is a checkpoint as soon as its files are written, not at the next save
    point: SIGKILL one rank between two save points (after the async save of step 10 was written,
    before step 20); torchrun restarts the group, which resumes from step 10 and ends with the
    weights of an uninterrupted run. (Running the same command again after a kill takes the same
    path: the restarted ranks' preflight.)"""
    steps = [*TWO_RANKS, "--checkpoint.interval", "10", "--checkpoint.async_mode", "async"]
    folder = tmp_path / "killed"
    proc = subprocess.Popen(["./run_train.sh", *steps, "--job.dump_folder", str(folder)], cwd=ROOT,
                            env=env(tmp_path, NGPU="2", MAX_RESTARTS="1", LOG_RANK="0,1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    saved, at, committed = folder / "checkpoint" / "step-00000010", None, False
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline and at is None:
        if saved.exists() or _last_step(folder) >= 19:
            at, committed = _last_step(folder), (saved / "torchpar.json").exists()
            for pid in _rank_pids(1, folder):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=300)
    assert at is not None and at < 20, f"the run reached step {at} before a rank could be killed"
    assert committed, f"step 10 was not committed by step {at}"
    assert proc.returncode == 0, (out + err)[-4000:]
    assert f"resumed from {saved} at step 10" in out, out[-3000:]
    assert_same_weights(tmp_path, uninterrupted, folder)


def test_sigterm_saves_and_the_resumed_run_is_bitwise_the_same(tmp_path, uninterrupted):
    """SIGTERM to the launcher mid-run (what SLURM sends before a kill): every rank finishes the same
    step, a checkpoint of it is written, the ranks exit with 128 + 15 and one line; running the same
    command again ends with the weights of an uninterrupted run, bit for bit."""
    steps = [*TWO_RANKS, "--checkpoint.interval", "100"]
    folder = tmp_path / "stopped"
    cmd = ["./run_train.sh", *steps, "--job.dump_folder", str(folder)]
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env(tmp_path, NGPU="2", LOG_RANK="0,1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 300
    while proc.poll() is None and time.time() < deadline:
        metrics = folder / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 5:
            proc.send_signal(signal.SIGTERM)  # run_train.sh is torchrun by now (exec)
            break
        time.sleep(0.05)
    out, err = proc.communicate(timeout=300)
    stopped = [line for line in err.splitlines() if "stopped by SIGTERM after step" in line]
    assert stopped, (out + err)[-4000:]
    step = int(stopped[0].split("after step ")[1].split(";")[0])
    assert 5 <= step < 30 and f"step-{step:08d}" in stopped[0]
    assert "KeyboardInterrupt" not in err and err.count("torchpar: stopped by SIGTERM") == 1  # rank 0 says it
    assert proc.returncode == 128 + signal.SIGTERM and "ChildFailedError" not in err, err[-3000:]
    assert sorted(d.name for d in (folder / "checkpoint").glob("step-*")) == [f"step-{step:08d}"]
    again = run(cmd, tmp_path, NGPU="2")
    assert again.returncode == 0 and f"resumed from {folder}/checkpoint/step-{step:08d}" in again.stdout, \
        again.stderr[-3000:]
    assert_same_weights(tmp_path, uninterrupted, folder)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_a_stop_signal_to_one_process_saves_and_exits_128_plus_its_number_with_one_line(tmp_path, stop):
    """SIGTERM, and SIGHUP (the terminal or ssh session that started the run went away), save the
    step the run is at and exit with 128 + the signal's number and one line."""
    folder = tmp_path / "run"
    proc = subprocess.Popen(
        [
            *TRAIN,
            "--job.dump_folder",
            str(folder),
            "--checkpoint.enable",
            "true",
            "--training.steps",
            "500",
            "--metrics.log_freq",
            "1",
        ],
        cwd=ROOT,
        env=env(tmp_path),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while time.time() < deadline and not ((folder / "metrics.jsonl").exists() and
                                          len((folder / "metrics.jsonl").read_text().splitlines()) >= 3):
        time.sleep(0.05)
    proc.send_signal(stop)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + stop, err[-3000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith(
        f"torchpar: stopped by {stop.name} after"
    )
    (saved,) = (folder / "checkpoint").glob("step-*")
    assert saved.name in err.strip().splitlines()[-1]


def _last_step(folder: Path) -> int:
    lines = (folder / "metrics.jsonl").read_text().splitlines() if (folder / "metrics.jsonl").exists() else []
    return max([json.loads(line).get("step", 0) for line in lines if line.endswith("}")] or [0])


def test_a_save_interrupted_after_its_files_is_committed_at_the_next_start(tmp_path):
    """The process dies between a save's last file and its commit (manifest, rename): the next
    start finds every file written and listed, commits the folder instead of deleting it, and resumes
    from it to the weights of an uninterrupted run."""
    steps = ["--training.steps", "6", "--checkpoint.interval", "2"]
    ref = train(tmp_path, tmp_path / "ref", *steps)
    assert ref.returncode == 0, ref.stderr[-3000:]
    folder = tmp_path / "cut"
    die_at_second_commit = (
        "import os, sys\n"
        "import torchpar.checkpoint.checkpointer as c\n"
        "commit, seen = c.commit, []\n"
        "def cut(partial, manifest):\n"
        "    seen.append(partial)\n"
        "    return commit(partial, manifest) if len(seen) < 2 else os._exit(9)\n"
        "c.commit = cut\n"
        "from torchpar.console import run_command\n"
        "from torchpar.commands.train import main\n"
        "sys.exit(run_command(main, sys.argv[1:]))\n")
    cut = run([sys.executable, "-c", die_at_second_commit, *TRAIN[4:], "--job.dump_folder", str(folder),
               "--checkpoint.enable", "true", *steps], tmp_path)
    assert cut.returncode == 9, cut.stderr[-3000:]
    partial = folder / "checkpoint" / "step-00000004.partial"
    assert partial.is_dir() and not (folder / "checkpoint" / "step-00000004").exists()
    again = train(tmp_path, folder, *steps)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "interrupted after every file was written" in again.stderr
    assert f"committed checkpoint {folder}/checkpoint/step-00000004" in again.stdout
    assert "at step 4" in again.stdout and not partial.exists()
    assert sorted(d.name for d in (folder / "checkpoint").iterdir()) == ["step-00000004", "step-00000006"]
    assert_same_weights(tmp_path, tmp_path / "ref", folder)


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A save that cannot be written (here: a file-size limit of 1 MiB, set with setrlimit as any
    user can, so the checkpoint's data file fails to grow, as on a full disk) stops the run with one
    line naming the step, the OS's reason and the intact checkpoint; the earlier checkpoint is
    unchanged, and the next start removes the partial save and resumes from it."""
    import resource

    folder = tmp_path / "run"
    first = train(tmp_path, folder, "--training.steps", "2", "--checkpoint.interval", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    kept = folder_digest(folder / "checkpoint" / "step-00000002")

    def limit_file_size():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    for mode in ("off", "async"):
        r = subprocess.run([*TRAIN, "--job.dump_folder", str(folder), "--checkpoint.enable", "true",
                            "--training.steps", "4", "--checkpoint.interval", "2", "--checkpoint.async_mode",
                            mode], cwd=ROOT, env=env(tmp_path), capture_output=True, text=True, timeout=300,
                           preexec_fn=limit_file_size)
        assert r.returncode == 1, r.stderr[-3000:]
        assert "Traceback" not in r.stderr, r.stderr[-3000:]
        line = r.stderr.strip().splitlines()[-1]
        assert line.startswith("torchpar: error: the checkpoint save of step 4") and "MiB free there" in line
        assert f"{folder}/checkpoint/step-00000002 (intact)" in line, line
        assert folder_digest(folder / "checkpoint" / "step-00000002") == kept
        assert (folder / "checkpoint" / "step-00000004.partial").is_dir()
    again = train(tmp_path, folder, "--training.steps", "4", "--checkpoint.interval", "2")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "ignoring incomplete checkpoint" in again.stderr and "at step 2" in again.stdout
    assert not (folder / "checkpoint" / "step-00000004.partial").exists()


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5), (1, 9), (6, 1)])
def test_flat_ranges_become_contiguous_boxes_that_cover_them_once(shape):
    """A contiguous run of a tensor's flattened values, as the ZeRO 0-2 engine saves it: boxes
    (DCP chunks) whose elements are exactly that run, each contiguous in memory, at most two per
    dimension; for every run of every tensor shape."""
    import math

    from torchpar.parallel.flat_state import boxes

    values = torch.arange(math.prod(shape)).view(shape)
    n = values.numel()
    for a in range(n + 1):
        for b in range(a, n + 1):
            found = boxes(shape, a, b)
            assert len(found) <= 2 * len(shape)
            covered = []
            for first, offsets, sizes in found:
                box = values[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                flat = box.reshape(-1).tolist()
                assert flat == list(range(first, first + len(flat))), (shape, a, b, offsets, sizes)
                covered += flat
            assert covered == list(range(a, b)), (shape, a, b, found)
