"""The divergence guard: a non-finite step is never applied, non-finite weights are never saved."""

import math
import sys

import torch
from test_checkpoint_files import TRAIN, expect_error
from test_train import records, run

# torchpar.train's own main, with the loss of the third forward turned into NaN (a poisoned batch).
POISON = """
import sys
import torchpar.train as t
plain, calls = t.cross_entropy_sum, [0]
def poisoned(logits, targets):
    calls[0] += 1
    loss = plain(logits, targets)
    return loss * float("nan") if calls[0] == 3 else loss
t.cross_entropy_sum = poisoned
sys.exit(t.main(sys.argv[1:]))
"""


def poisoned_run(tmp_path, folder, *more):
    return run([sys.executable, "-c", POISON, *TRAIN[3:], "--job.dump_folder", str(folder),
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


def test_infinite_learning_rate_never_saves_its_weights(tmp_path):
    """The first update with lr = inf makes the weights non-finite while its loss and gradient
    norm were finite: the save after it refuses, so no checkpoint exists."""
    r = run([*TRAIN, "--job.dump_folder", str(tmp_path / "run"), "--checkpoint.enable", "true",
             "--checkpoint.interval", "1", "--optimizer.lr", "inf", "--training.steps", "3"], tmp_path)
    expect_error(r, "step 1: the updated weights are not finite", "last good checkpoint: none", code=3)
    assert not list((tmp_path / "run" / "checkpoint").glob("step-*"))
