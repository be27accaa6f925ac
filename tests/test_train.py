"""End to end: the real entry points in real processes (a new interpreter for ``python -m torchpar``
and the ``torchpar`` script here; the other files' runs of them are forked, see ``run``)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import ROOT, TINY, cli

pytestmark = pytest.mark.slow  # trains in spawned processes


def env(tmp_path, **extra):
    e = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path), "WANDB_MODE": "offline",
         "WANDB_SILENT": "true", **extra}
    e.pop("RANK", None)
    e.pop("WORLD_SIZE", None)
    return e


def run(cmd, tmp_path, fresh: bool = False, **extra):
    """``cmd`` in the repository root with ``env(tmp_path, **extra)``. ``python -m torchpar ...``,
    ``torchpar ...`` and ``python -c SCRIPT ...`` run forked from the ranks' server (harness.cli)
    unless ``fresh``: a new interpreter, as anything else gets."""
    argv = (cmd[3:] if cmd[:3] == [sys.executable, "-m", "torchpar"] else
            cmd[1:] if cmd[:1] == ["torchpar"] else None)
    if argv is not None and not fresh:
        return cli(argv, env(tmp_path, **extra), timeout=600)
    if cmd[:2] == [sys.executable, "-c"] and not fresh:
        return cli(cmd[3:], env(tmp_path, **extra), timeout=600, script=cmd[2])
    return subprocess.run(
        cmd, cwd=ROOT, env=env(tmp_path, **extra), capture_output=True, text=True, timeout=600
    )


def records(folder, kind="loss"):
    """The training records (kind "loss") or the evaluations ("val_loss") of metrics.jsonl."""
    lines = [json.loads(line) for line in (Path(folder) / "metrics.jsonl").read_text().splitlines()]
    return [x for x in lines if kind in x]


def test_single_process_loss_falls_and_logs_everything(tmp_path):
    out = tmp_path / "run"
    r = run([sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--training.steps", "40",
             "--training.seq_len", "64", "--metrics.log_freq", "10", "--job.dump_folder", str(out),
             "--validation.enable", "true", "--validation.freq", "25", "--validation.steps", "2"], tmp_path,
            fresh=True)
    assert r.returncode == 0, r.stderr
    recs = records(out)
    assert [x["step"] for x in recs] == [1, 10, 20, 30, 40]
    val = records(out, "val_loss")
    assert [x["step"] for x in val] == [25, 40] and val[1]["val_loss"] < val[0]["val_loss"]
    assert "step    40  val_loss" in r.stdout
    for key in ("loss", "grad_norm", "lr", "tokens_per_sec", "step_s", "mfu", "elapsed_s", "mem_rss_gib",
                "param_bytes", "grad_bytes", "optim_bytes"):
        assert key in recs[0], key
    assert 0 < recs[-1]["mfu"] < 1 and recs[-1]["tokens_per_sec"] > 0
    assert recs[-1]["tokens_per_sec"] * recs[-1]["step_s"] == pytest.approx(8 * 64)  # a step's tokens
    # steps 11-20 (no evaluation between): ten steps' time
    assert 10 * recs[2]["step_s"] == pytest.approx(recs[2]["elapsed_s"] - recs[1]["elapsed_s"], rel=0.05)
    assert recs[-1]["loss"] < recs[0]["loss"] - 1.5
    assert "step    40  loss" in r.stdout


def test_wandb_offline_writes_the_run(tmp_path):
    out = tmp_path / "wb"
    r = run(
        [sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--training.steps", "3",
         "--metrics.enable_wandb", "true", "--metrics.wandb_run_name", "offline-test", "--job.dump_folder",
         str(out), "--validation.enable", "true"],
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    runs = list((out / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    log = next(runs[0].glob("run-*.wandb")).read_bytes()  # the offline run's protobuf record log
    for key in (
        b"offline-test",
        b"loss",
        b"grad_norm",
        b"tokens_per_sec",
        b"mfu",
        b"param_bytes",
        b"val_loss",
    ):
        assert key in log, key
    first = records(out)[0]
    assert repr(first["loss"]).encode() in log  # the logged value itself, not only its name


def test_run_train_sh_two_processes_end_to_end(tmp_path):
    out = tmp_path / "torchrun"
    r = run(["./run_train.sh", "--training.steps", "4", "--training.seq_len", "64", "--metrics.log_freq", "2",
             "--parallelism.tensor_parallel_degree", "2", "--job.dump_folder", str(out)], tmp_path, NGPU="2",
            LOG_RANK="0,1")  # both ranks' output, so a failure shows the rank that failed
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = records(out)
    assert [x["step"] for x in recs] == [1, 2, 4]
    assert len(recs[0]["param_bytes_per_rank"]) == 2
    assert [x["step"] for x in records(out, "val_loss")] == [4]  # the default config evaluates after the last
    assert "world 2 = pp 1 x dp_replicate 1 x dp_shard 1 x tp 2" in r.stdout
    # a run says what torchpar says: no library's warning reaches the console (torch's deprecated
    # slicing of a flattened mesh and torchdata's set_vital did, in every run)
    assert "Warning" not in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]


def test_user_error_under_torchrun_is_one_line(tmp_path):
    r = run(["./run_train.sh", "--parallelism.tensor_parallel_degree", "3"], tmp_path, NGPU="2")
    assert r.returncode != 0
    assert ("torchpar: error: parallelism: the other degrees (tensor_parallel_degree=3) multiply to 3"
            in r.stderr)
    assert "Traceback" not in r.stderr


def test_print_config_and_help(tmp_path):
    r = run(
        [sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--print-config",
         "--training.steps", "9"],
        tmp_path,
    )
    assert r.returncode == 0 and "[training]\nsteps = 9\n" in r.stdout
    r = run(["torchpar", "train", "--help"], tmp_path, fresh=True)  # the installed script
    assert (
        r.returncode == 0
        and "--optimizer.weight_decay (float, default 0.1): Decoupled weight decay, of matrices" in r.stdout
        and "--optimizer.kwargs (dict, default {}): Further keyword arguments" in r.stdout
    )
    r = run([sys.executable, "-m", "torchpar", "train", "--training.stepz", "3"], tmp_path)
    assert r.returncode == 2 and "Did you mean 'steps'" in r.stderr and "Traceback" not in r.stderr


def test_validation_on_local_files(tmp_path):
    """[validation] path: held-out files beside the training files, evaluated under the trainer."""
    (tmp_path / "train.txt").write_text("def f(x):\n    return x + 1\n" * 200)
    (tmp_path / "held.jsonl").write_text(
        "".join(json.dumps({"text": f"class C{i}:\n    pass\n"}) + "\n" for i in range(50))
    )

    def held_out_losses(path, folder):
        r = run(
            [sys.executable, "-m", "torchpar", "train", "--config", str(TINY), "--training.steps", "3",
             "--training.seq_len", "32", "--data.dataset", "files", "--data.path",
             str(tmp_path / "train.txt"), "--validation.enable", "true", "--validation.path", str(path),
             "--validation.freq", "2", "--job.dump_folder", str(tmp_path / folder)],
            tmp_path,
        )
        assert r.returncode == 0, r.stderr
        return records(tmp_path / folder, "val_loss")

    val = held_out_losses(tmp_path / "held.jsonl", "held")
    assert [x["step"] for x in val] == [2, 3] and all(0 < x["val_loss"] < 10 for x in val)
    # Evaluating the training file instead gives other numbers: the held-out files were read.
    same = held_out_losses(tmp_path / "train.txt", "same")
    assert abs(same[0]["val_loss"] - val[0]["val_loss"]) > 1e-3


def test_the_old_entry_point_says_how_to_train(tmp_path):
    """``python -m torchpar.train`` (scripts copied from the first releases) trains nothing: it
    says which command does, and exits 2 instead of 0."""
    r = run([sys.executable, "-m", "torchpar.train", "--config", str(TINY)], tmp_path)
    assert r.returncode == 2, r.stderr
    assert "torchpar train --config" in r.stderr and "run_train.sh" in r.stderr
    assert "Traceback" not in r.stderr
