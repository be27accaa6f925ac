"""``torchpar train`` for torchrun (``torchrun ... tests/faulty_train.py train --config ...``), with the
faults and pace the replica-group tests set through the environment:

- ``FAULT=recovery``: every rank of the group kills itself (SIGKILL) halfway through taking a healthy
  group's state — the weights copied, the optimizer state not — after printing ``dying in recovery``;
- ``PACE=file``: while ``file`` exists, each step first sleeps the seconds it holds — twice that in
  the last 20 steps — so that a group trains on at a known pace while others start (a sleep leaves the
  cores to the starting processes, as a GPU's step would) and does not finish before they join."""

import os
import signal
import sys
import time

import torchpar.train as train
from torchpar.commands import main

if os.environ.get("FAULT") == "recovery":
    def _dying(optimizer, state):
        print("dying in recovery", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    train.load_local_state = _dying  # (called by Trainer._recover once the weights are copied)

if os.environ.get("PACE"):
    _plain_step = train.Trainer.train_step

    def _paced_step(self, batches):
        try:
            pause = float(open(os.environ["PACE"]).read())
        except (OSError, ValueError):  # (no file: full speed)
            pause = 0.0
        if self.train_state.step > self.cfg.training.steps - 20:
            pause *= 2
        time.sleep(pause)
        return _plain_step(self, batches)

    train.Trainer.train_step = _paced_step

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
