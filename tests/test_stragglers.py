"""The straggler check: a rank slowed at its own work (a sleep in its optimizer step) is named in one
record and one warning; a healthy run names none."""

import json
import time
from pathlib import Path

import pytest
import torch
from harness import TINY, spawn_ranks

pytestmark = pytest.mark.slow  # trains in spawned processes


def _worker(rank, world, out, slow_rank):
    from torchpar.config import load_config
    from torchpar.train import Trainer

    cfg = load_config(TINY, ["--training.steps", "6", "--metrics.log_freq", "1", "--parallelism.zero_stage",
                             "3", "--training.local_batch_size", "4", "--metrics.straggler_steps", "2",
                             "--job.dump_folder", f"{out}/run"])
    trainer = Trainer(cfg)
    if rank == slow_rank:  # (its optimizer step, a phase no other rank takes part in, 0.3 s slower)
        step = trainer.model.state.step

        def slow_step():
            time.sleep(0.3)
            step()

        trainer.model.state.step = slow_step
    trainer.train()


@pytest.mark.parametrize("slow_rank", [1, None], ids=["rank 1 slowed", "healthy"])
def test_a_slow_rank_is_named_and_a_healthy_run_names_none(slow_rank):
    out = spawn_ranks(_worker, 2, slow_rank)
    records = [json.loads(line) for line in (Path(out) / "run" / "metrics.jsonl").read_text().splitlines()]
    named = [r for r in records if "straggler" in r]
    if slow_rank is None:
        assert named == []
    else:
        # named once (its streak reaches straggler_steps = 2 at step 2 and goes on), with its times
        assert [r["straggler"] for r in named] == [slow_rank] and named[0]["step"] == 2
        assert named[0]["own_work_s"] > 0.3 > named[0]["median_own_work_s"]
    assert torch.isfinite(torch.tensor([r["loss"] for r in records if "loss" in r])).all()
