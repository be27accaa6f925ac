"""What looking inside a run costs: training time of the same run with the per-step breakdown
off and on, and with the communication ledger on, interleaved, medians of a few repeats.

    python benchmarks/observability.py [--repeats 3] [--steps 100] [--nproc 2] [--layout "OVERRIDES"]

(--layout "--parallelism.pipeline_parallel_degree 2 --parallelism.zero_stage 0": a pipeline, whose
logged steps also time every schedule action for the measured bubble.)

Prints seconds of training (metrics.jsonl's elapsed_s at the last step, start-up excluded) per
setting and the ratio to "off". Runs on this machine's CPU through run_train.sh.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {
    "off": ["--metrics.log_step_breakdown", "false"],
    "breakdown": ["--metrics.log_step_breakdown", "true"],
    "breakdown + communication": ["--metrics.log_step_breakdown", "true",
                                  "--metrics.log_communication", "true"],
}


def train_seconds(extra: list[str], steps: int, nproc: int, folder: Path) -> float:
    cmd = ["./run_train.sh", "--training.steps", str(steps), "--metrics.log_freq",
           "10", "--job.dump_folder", str(folder), *extra]
    env = {**os.environ, "NGPU": str(nproc), "CONFIG_FILE": "torchpar/assets/selftest.toml"}
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True)
    last = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()][-1]
    return last["elapsed_s"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--layout", default="", help="config overrides for the layout (default: ZeRO-3 over dp)")
    a = ap.parse_args()
    layout = shlex.split(a.layout)
    times = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for name, extra in SETTINGS.items():  # interleaved, so drifts of the machine hit all alike
                folder = Path(tmp) / f"{name}{i}".replace(" ", "")
                times[name].append(train_seconds(layout + extra, a.steps, a.nproc, folder))
    base = statistics.median(times["off"])
    print(f"{a.steps} steps of the tiny model on {a.nproc} CPU ranks ({a.layout or 'ZeRO-3'}), logged every "
          f"10 steps; median of {a.repeats}:")
    for name, values in times.items():
        med = statistics.median(values)
        print(f"  {name:<28} {med:7.2f} s  ({med / base:.3f} x off)")


if __name__ == "__main__":
    main()
