"""Expert parallelism's pieces: the regrouping of arrived rows, the all-to-all bytes against a ledger
of a real run (routing pinned to balanced by the bias), and memory that stays flat over steps with
recomputation. (Its layouts against one process: test_moe_layouts.py.)"""

import ctypes
import gc
import sys

import pytest
import torch
from harness import TINY, spawn_ranks

from torchpar.parallel.experts import regroup

Z = "--parallelism.zero_stage"
EP2 = ["--model.name", "moe", "--training.local_batch_size", "4", Z, "3",
       "--parallelism.expert_parallel_degree", "2"]
LEDGER_LAYOUTS = {
    "ep2": EP2,
    "ep2_full": [*EP2, "--training.activation_checkpoint", "full"],
}
MEMORY_LAYOUTS = {
    "ep2_full": [*EP2, "--training.activation_checkpoint", "full", "--training.steps", "20"],
    "ep2_selective": [*EP2, "--training.activation_checkpoint", "selective", "--training.steps", "20"],
}


def test_regroup_orders_arrived_rows_by_expert_then_source():
    # Arrival (source-major): s0e0 [0], s0e1 [1 2], s1e0 [3 4 5], s1e1 [6].
    sizes = torch.tensor([[1, 2], [3, 1]])
    assert regroup(sizes, 7).tolist() == [0, 3, 4, 5, 1, 2, 6]
    assert regroup(torch.tensor([[0, 0], [0, 2]]), 2).tolist() == [0, 1]  # empty blocks
    assert regroup(torch.zeros(2, 3, dtype=torch.long), 0).tolist() == []


def _balance(trainer) -> None:
    """Every token goes to experts 0 and 4 (a bias far above any score): one on each of the two
    ep ranks, so each rank sends exactly half its rows away, the planner's assumption."""
    bias = trainer.routing.bias
    bias.zero_()
    bias[:, [0, 4]] = 10.0
    trainer.routing.sync()


def heap_bytes() -> int:
    """Bytes the C heap has handed out and not taken back (glibc's mallinfo2: small blocks and
    mmapped large ones, where CPU tensors live)."""
    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                          "usmblks", "fsmblks", "uordblks", "fordblks",
                                                          "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def net_cpu_bytes(fn) -> int:
    """Bytes ``fn`` leaves allocated on the heap (after it, less before)."""
    gc.collect()
    before = heap_bytes()
    fn()
    gc.collect()
    return heap_bytes() - before


class HostReads:
    """Counts the host's reads of tensor values (each a wait for the device on a GPU) made inside
    expert parallelism's forward (by its frames' names), as a torch function mode."""

    READS = {"tolist", "item", "__int__", "__bool__", "__float__", "__index__"}

    def __enter__(self):
        from torch.overrides import TorchFunctionMode

        counter = self

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                if getattr(func, "__name__", "") in HostReads.READS:
                    frame = sys._getframe(1)
                    while frame is not None and frame.f_code.co_name != "expert_parallel_forward":
                        frame = frame.f_back
                    counter.count += frame is not None
                return func(*args, **(kwargs or {}))

        self.count, self.mode = 0, Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)


def _worker(rank, world, out):
    from torchpar.config import load_config
    from torchpar.parallel.ledger import CommLedger
    from torchpar.train import Trainer

    results = {"ledger": {}, "memory": {}, "reads": {}}
    try:
        for name, overrides in LEDGER_LAYOUTS.items():
            trainer = Trainer(load_config(TINY, overrides + ["--job.dump_folder", f"{out}/{name}"]))
            _balance(trainer)
            batches = iter(trainer.dataloader)
            trainer.train_step(batches)  # the first step creates lazy state; measure the second
            trainer.model.state.zero_grad()
            with CommLedger(trainer.layout.mesh, experts_view=trainer.layout.experts_view,
                            views=trainer.layout.views) as ledger:
                trainer.train_step(batches)
            results["ledger"][name] = {"sent": ledger.sent_bytes(), "records": ledger.records,
                                       "unknown": ledger.unknown}
            trainer.model.state.zero_grad()
            with HostReads() as reads:
                trainer.train_step(batches)
            results["reads"][name] = reads.count
        for name, overrides in MEMORY_LAYOUTS.items():
            trainer = Trainer(load_config(TINY, overrides + ["--job.dump_folder", f"{out}/m_{name}"]))
            batches = iter(trainer.dataloader)
            # (the first steps grow the heap by some 400 KB each, a dense model's as much: the
            # allocator's and Python's warm-up; then it stays within tens of KB)
            for _ in range(8):
                trainer.train_step(batches)
            steps = net_cpu_bytes(lambda: [trainer.train_step(batches) for _ in range(6)])
            kept = []  # a leak on purpose: each step's graph kept alive by its loss
            # (the first frees the last step's gradients: its zero_grad)
            leaky = [net_cpu_bytes(lambda: kept.append(_leaky_step(trainer, batches))) for _ in range(3)][1:]
            results["memory"][name] = {"steps": steps, "leaky": leaky}
    finally:
        if rank == 0:
            torch.save(results, f"{out}/experts.pt")


def _leaky_step(trainer, batches):
    """A forward and backward whose graph outlives the step (retain_graph, its loss kept)."""
    batch = next(batches).to(trainer.device)
    logits = trainer.model.parts[0](batch[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch[:, 1:].flatten())
    loss.backward(retain_graph=True)
    trainer.model.state.zero_grad()
    return loss


@pytest.fixture(scope="module")
def measured():
    return torch.load(f"{spawn_ranks(_worker, 2)}/experts.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEDGER_LAYOUTS))
def test_all_to_all_bytes_equal_the_ledger(measured, name):
    """The planner's bytes per mesh dimension equal the ledger's: the experts' all-to-alls (counts,
    rows out and back, their gradients, again for a recomputed forward) and ZeRO-3's units, the
    experts' apart."""
    from torchpar.config import load_config
    from torchpar.plan import PRESETS, communication, layout_from_config

    cfg = load_config(TINY, LEDGER_LAYOUTS[name])
    lay, model, args = layout_from_config(cfg, 2)
    predicted = communication(model, args, lay, PRESETS["A100-80GB"], cfg.training.seq_len)
    ledger = measured["ledger"][name]
    assert not ledger["unknown"], ledger["unknown"]
    sent = sum(b for dim, kind, b, n in ledger["records"] if kind == "all_to_all" and dim == "ep")
    assert sent > 0 and sent == pytest.approx(predicted["ep"]["bytes"], rel=1e-9)
    # On 2 ranks every dimension's group is the world's (the ledger names it by one of them):
    # the totals.
    assert sum(c["bytes"] for c in predicted.values()) == pytest.approx(sum(ledger["sent"].values()),
                                                                        rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LEDGER_LAYOUTS))
def test_expert_parallelism_reads_the_host_once_per_moe_forward(measured, name):
    """One read of device values per MoE block's forward under EP (the split sizes, which the
    all-to-all needs on the host): the debug flavour's 3 MoE blocks, one micro-step. (A forward
    recomputed in backward reads once more; the mode does not see inside the recomputation.)"""
    assert measured["reads"][name] == 3, measured["reads"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MEMORY_LAYOUTS))
def test_memory_stays_flat_over_steps_under_recomputation(measured, name):
    """Steps 9-14 together leave less on the heap than one step that keeps its graph (the growth
    reported of other trainers' expert parallelism under recomputation), which the same
    measurement sees: a leak of that kind would leave six graphs."""
    steps, leaky = measured["memory"][name]["steps"], measured["memory"][name]["leaky"]
    print(name, "net heap bytes of six steps:", steps, "of a step keeping its graph:", leaky)
    assert min(leaky) > 1_000_000, leaky
    assert steps < min(leaky), (steps, leaky)
