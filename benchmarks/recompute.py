"""What each recomputation policy costs and saves on one rank: step time (median over steps after
the first, the options interleaved) and peak memory — measured storage by storage during a real
step, beside the planner's prediction.

    python benchmarks/recompute.py [--flavor debug] [--batch 16] [--seq 256] [--steps 6] [--repeats 2]

Peak = parameters + Adam state + the most bytes alive at once during the step (the tracker the
planner's activation figures are checked with); predicted = `torchpar plan`'s device peak for the
same job. CPU, fp32, one thread.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from torchpar.parallel.recompute import OPTIONS as RECOMPUTE_OPTIONS
from torchpar.parallel.recompute import option_overrides

# name: config overrides, most memory first
OPTIONS = {name: option_overrides(*option) for name, option in RECOMPUTE_OPTIONS.items()}


def step_seconds(overrides: list[str], steps: int, folder: str) -> list[float]:
    from torchpar.config import load_config
    from torchpar.train import Trainer

    trainer = Trainer(load_config("torchpar/assets/selftest.toml", [*overrides, "--job.dump_folder", folder]))
    batches, times = iter(trainer.dataloader), []
    try:
        for step in range(1, steps + 1):
            trainer.train_state.step = step
            t0 = time.perf_counter()
            trainer.train_step(batches)
            trainer.model.state.zero_grad()
            times.append(time.perf_counter() - t0)
    finally:
        trainer.close()
    return times[1:]


def main() -> None:
    from torchpar.config import load_config
    from torchpar.device import init_distributed, shutdown_distributed
    from torchpar.verify import step_peak_check

    ap = argparse.ArgumentParser()
    ap.add_argument("--flavor", default="debug")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(1)
    init_distributed(600, False, True)
    shape = ["--model.flavor", a.flavor, "--training.local_batch_size", str(a.batch), "--training.seq_len",
             str(a.seq), "--validation.enable", "false"]
    times: dict[str, list[float]] = {name: [] for name in OPTIONS}
    peaks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for name, extra in OPTIONS.items():  # interleaved: the machine's drift hits all alike
                times[name] += step_seconds(shape + extra, a.steps, f"{tmp}/{name}{i}".replace(" ", ""))
        for name, extra in OPTIONS.items():
            peaks[name] = step_peak_check(load_config("torchpar/assets/selftest.toml",
                                                      [*shape, *extra, "--job.dump_folder", f"{tmp}/peak"]))
    shutdown_distributed()
    base = statistics.median(times["none"])
    print(f"{a.flavor}, batch {a.batch} x seq {a.seq}, fp32, 1 CPU thread; step time median of "
          f"{a.repeats} x {a.steps - 1} steps")
    print(f"{'recompute':<14} {'step s':>8} {'vs none':>8} {'peak MiB':>9} {'predicted':>10} {'ratio':>6}")
    for name in OPTIONS:
        med, p = statistics.median(times[name]), peaks[name]
        print(f"{name:<14} {med:>8.3f} {med / base:>7.2f}x {p['measured_bytes'] / 2**20:>9.1f} "
              f"{p['predicted_bytes'] / 2**20:>10.1f} {p['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
