"""The divergence guard: a non-finite step is never applied, non-finite weights are never saved."""

import json
import math
import sys
from types import SimpleNamespace

import pytest
import torch
from harness import TINY, spawn_ranks
from test_checkpoint_files import TRAIN, expect_error
from test_train import records, run

from torchpar.guard import DivergenceGuard

pytestmark = pytest.mark.slow  # trains in spawned processes

# torchpar train's own main, with the loss of the third forward turned into NaN (a poisoned batch).
POISON = """
import sys
import torchpar.train as t
from torchpar.commands.train import main
plain, calls = t.training_loss, [0]
def poisoned(logits, targets, z_loss=0.0, scales=(1.0, 1.0)):
    calls[0] += 1
    loss, ce, z = plain(logits, targets, z_loss, scales)
    nan = float("nan") if calls[0] == 3 else 1.0
    return loss * nan, ce * nan, z
t.training_loss = poisoned
sys.exit(main(sys.argv[1:]))
"""


def poisoned_run(tmp_path, folder, *more):
    return run([sys.executable, "-c", POISON, *TRAIN[4:], "--job.dump_folder", str(folder),
                "--checkpoint.enable", "true", "--checkpoint.interval", "1", "--checkpoint.async_mode", "off",
                "--training.steps", "5", *more], tmp_path)


def finite_checkpoint(path) -> bool:
    from torchpar.weights import load_model

    model, _ = load_model(path)
    return all(torch.isfinite(p).all() for p in model.parameters())


def test_nan_batch_stops_the_run_before_its_update(tmp_path):
    r = poisoned_run(tmp_path, tmp_path / "run")
    expect_error(r, "step 3: non-finite loss nan", "last good checkpoint:", "step-00000002", code=3)
    steps = sorted(d.name for d in (tmp_path / "run" / "checkpoint").glob("step-*"))
    assert steps[-1] == "step-00000002" and finite_checkpoint(tmp_path / "run" / "checkpoint" / steps[-1])


def test_nan_batch_is_skipped_and_training_goes_on(tmp_path):
    r = poisoned_run(tmp_path, tmp_path / "run", "--training.on_divergence", "skip")
    assert r.returncode == 0, r.stderr
    assert "step 3 skipped: non-finite loss nan" in r.stderr
    lines = [x for x in records(tmp_path / "run", "skipped_steps")]
    assert lines == [{"step": 3, "skipped_steps": 1, "skip_reason": lines[0]["skip_reason"]}]
    losses = {x["step"]: x["loss"] for x in records(tmp_path / "run")}
    assert math.isnan(losses[3]) and all(math.isfinite(losses[s]) for s in (1, 2, 4, 5))
    assert finite_checkpoint(tmp_path / "run" / "checkpoint" / "step-00000005")


def test_a_dead_model_stops_after_ten_steps_skipped_in_a_row(tmp_path):
    """lr = 1e6 without clipping kills the model at step 1 (from step 2 the loss sits at ln V and no
    parameter gets a gradient): under 'skip' the run stops at the 10th skipped step, not at its end
    with exit 0."""
    dead = ["--optimizer.lr", "1e6", "--training.max_norm", "0", "--training.on_divergence", "skip"]
    r = run([*TRAIN, "--job.dump_folder", str(tmp_path / "run"), *dead, "--training.steps", "30"], tmp_path)
    expect_error(r, "step 11: gradient norm 0", "10 steps skipped in a row", code=3)
    assert [x["skipped_steps"] for x in records(tmp_path / "run", "skipped_steps")] == list(range(1, 10))


def saved_tensors(folder) -> dict:
    """A checkpoint's model and optimizer tensors by key."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, folder.parent / "whole.pt")
    sd = torch.load(folder.parent / "whole.pt", weights_only=False)
    (folder.parent / "whole.pt").unlink()
    return {f"{part}.{k}": v for part in ("model", "optimizer") for k, v in sd[part].items()
            if torch.is_tensor(v)}


def test_an_optimizer_without_a_fused_kernel_is_guarded_on_the_host(tmp_path):
    """Muon (with AdamW for the rest) has no found_inf input: the host reads each step's figures
    before its update and skips it there, leaving weights and both optimizers' state untouched
    (the checkpoint after the skipped step 3 equals the one after step 2, bitwise)."""
    r = poisoned_run(tmp_path, tmp_path / "run", "--training.on_divergence", "skip",
                     "--optimizer.name", "muon", "--training.steps", "3")
    assert r.returncode == 0 and "step 3 skipped: non-finite loss nan" in r.stderr, r.stderr
    root = tmp_path / "run" / "checkpoint"
    before, after = saved_tensors(root / "step-00000002"), saved_tensors(root / "step-00000003")
    assert any(k.endswith("momentum_buffer") for k in before) and any(k.endswith("exp_avg") for k in before)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before), [k for k in before
                                                                   if not torch.equal(before[k], after[k])]


def test_infinite_learning_rate_never_saves_its_weights(tmp_path):
    """The first update with lr = 1e39 (a finite float, infinite in fp32; the config refuses inf
    itself) makes the weights non-finite while its loss and gradient norm were finite: the save
    after it refuses, so no checkpoint exists."""
    r = run([*TRAIN, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "true",
             "--checkpoint.interval", "1", "--optimizer.lr", "1e39", "--training.steps", "3"], tmp_path)
    expect_error(r, "step 1: the updated weights are not finite", "last good checkpoint: none", code=3)
    assert not list((tmp_path / "run" / "checkpoint").glob("step-*"))


def test_a_late_read_still_stops_before_anything_after_the_step_is_saved(tmp_path):
    """Nothing forces a read at step 3 (no log, no save due): the host learns of it during step 4,
    before step 4's update and its save."""
    r = poisoned_run(tmp_path, tmp_path / "run", "--checkpoint.interval", "2", "--metrics.log_freq", "10")
    expect_error(r, "step 3: non-finite loss nan", "step-00000002", code=3)
    assert [d.name for d in (tmp_path / "run" / "checkpoint").glob("step-*")] == ["step-00000002"]


def test_skipping_on_the_device_equals_skipping_on_the_host(tmp_path):
    """Fused AdamW drops step 3 in its kernel and the host reads it a step later; foreach waits to
    read it first. Both continue from the same weights, with the same learning rates."""
    last = {}
    for impl in ("fused", "foreach"):
        r = poisoned_run(tmp_path, tmp_path / impl, "--training.on_divergence", "skip",
                         "--checkpoint.interval", "10", "--metrics.log_freq", "10",
                         "--optimizer.implementation", impl)
        assert r.returncode == 0 and "step 3 skipped: non-finite loss nan" in r.stderr, r.stderr
        assert [x["step"] for x in records(tmp_path / impl, "skipped_steps")] == [3]
        last[impl] = records(tmp_path / impl)[-1]
    assert last["fused"]["step"] == 5 and math.isfinite(last["fused"]["loss"])
    assert abs(last["fused"]["loss"] - last["foreach"]["loss"]) < 1e-5
    assert last["fused"]["lr"] == last["foreach"]["lr"]


def _pending_worker(rank, world, out, impl):
    from torchpar.config import load_config
    from torchpar.train import Trainer

    overrides = ["--optimizer.implementation", impl, "--job.dump_folder", f"{out}/run"]
    trainer = Trainer(load_config(TINY, overrides))
    batches, read = iter(trainer.dataloader), []
    for step in (1, 2, 3):
        trainer.train_state.step = step
        trainer.train_step(batches)
        read.append([s for s, *_ in trainer.guard.pending])
    trainer.close()
    if rank == 0:
        with open(f"{out}/pending.json", "w") as f:
            json.dump({"read": read, "losses": len(trainer.losses)}, f)


@pytest.mark.parametrize("impl, unread", [("fused", [[1], [2], [3]]), ("foreach", [[], [], []])])
def test_a_step_leaves_its_own_figures_unread(impl, unread):
    """On the device path a step ends with its own figures still unread (the host read the one
    before): the loop never waits for the step it has just queued."""
    out = spawn_ranks(_pending_worker, 2, impl)
    with open(f"{out}/pending.json") as f:
        got = json.load(f)
    assert got == {"read": unread, "losses": 3 - len(unread[-1])}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_an_unlogged_step_never_waits_for_the_gpu(tmp_path):
    code = (
        "import torch, torchpar.train as t\n"
        "from torchpar.config import load_config\n"
        f"tr = t.Trainer(load_config({str(TINY)!r}, ['--job.dump_folder', {str(tmp_path / 'run')!r}]))\n"
        "b = iter(tr.dataloader)\n"
        "for step in (1, 2):\n"
        "    tr.train_state.step = step; tr.train_step(b)\n"
        "torch.cuda.set_sync_debug_mode('error')\n"
        "tr.train_state.step = 3; tr.train_step(b)\n"
        "torch.cuda.set_sync_debug_mode(0); tr.close()\n"
    )
    r = run([sys.executable, "-c", code], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_step_not_applied_for_another_reason_is_read_but_not_judged():
    """Replica groups whose step did not commit: its figures (a failed average can leave a gradient
    norm of 0, or anything) are read and logged, never a divergence; the same figures of an applied
    step are."""
    tr = SimpleNamespace(loss_spike_factor=0.0, loss_spike_window=4)
    guard = DivergenceGuard(tr, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1))
    dead = torch.tensor([5.0, 0.0, 0.0])  # (loss, gradient norm 0, no stop)
    guard.record(1, dead, judged=False)
    guard.record(2, dead)
    (s1, *_, not_judged), (s2, *_, judged) = guard.settle(2)
    assert (s1, not_judged) == (1, None)
    assert s2 == 2 and "gradient norm 0" in judged
