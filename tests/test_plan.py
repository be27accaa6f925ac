"""The planner (issue 6): its communication counts against a ledger of a real run, the seeds'
worked examples, search and the command line."""

import json
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from harness import ROOT, TINY, free_port

Z = "--parallelism.zero_stage"
LEDGER_LAYOUTS = {
    "dp2_zero0": [Z, "0", "--training.local_batch_size", "4"],
    "dp2_zero2": [Z, "2", "--training.local_batch_size", "4"],
    "dp2_zero3": [Z, "3", "--training.local_batch_size", "4"],
    "dp2_zero3_accum2": [Z, "3", "--training.local_batch_size", "2", "--training.global_batch_size", "8"],
    "tp2": [Z, "0", "--parallelism.tensor_parallel_degree", "2"],
    "tp2_no_sp_lp": [Z, "0", "--parallelism.tensor_parallel_degree", "2", "--parallelism.sequence_parallel", "false",
                     "--parallelism.loss_parallel", "false"],
}


def _ledger_worker(rank, world, port, out):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from torchpar.config import load_config
    from torchpar.parallel.ledger import CommLedger
    from torchpar.train import Trainer

    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {}
    try:
        for name, overrides in LEDGER_LAYOUTS.items():
            trainer = Trainer(load_config(TINY, overrides + ["--job.dump_folder", f"{out}/{name}"]))
            batches = iter(trainer.dataloader)
            trainer.train_step(batches)  # the first step creates lazy state; measure the second
            trainer.model.state.zero_grad()
            with CommLedger(trainer.dims.mesh) as ledger:
                trainer.train_step(batches)
            results[name] = {"sent": ledger.sent_bytes(), "records": ledger.records, "unknown": ledger.unknown}
    finally:
        if rank == 0:
            torch.save(results, f"{out}/ledger.pt")
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def ledgers():
    out = tempfile.mkdtemp(prefix="torchpar_ledger_")
    mp.start_processes(_ledger_worker, args=(2, free_port(), out), nprocs=2, start_method="spawn")
    return torch.load(f"{out}/ledger.pt", weights_only=False)


@pytest.mark.parametrize("name", list(LEDGER_LAYOUTS))
def test_planner_communication_equals_the_ledger(ledgers, name):
    from torchpar.config import load_config
    from torchpar.plan import PRESETS, communication, layout_from_config

    cfg = load_config(TINY, LEDGER_LAYOUTS[name])
    lay, args = layout_from_config(cfg, 2)
    micro = lay.local_batch_size
    predicted = communication(args, lay, PRESETS["A100-80GB"], cfg.training.seq_len, micro, lay.accum)
    measured = ledgers[name]
    assert not measured["unknown"], measured["unknown"]
    # Each of these layouts uses one mesh dimension besides the world-wide scalars; on 2 ranks
    # that dimension's group is the world group, so compare the total...
    assert sum(c["bytes"] for c in predicted.values()) == pytest.approx(sum(measured["sent"].values()), rel=0, abs=1e-6)
    # ...and that the bytes went over the dimension the planner says.
    dims = set(predicted) - {"world"}
    assert dims == ({"tp"} if "tp2" in name else {"dp", "dp_shard"} & dims) and dims
