"""``torchpar train``: check everything, then train.

    torchpar train --config train_configs/debug_model.toml [--section.key value ...]
    torchrun --nproc-per-node 4 -m torchpar train --config ... (what run_train.sh does)

    --print-config  print the merged config as TOML and exit
    --check         validate config, tokenizer, data, layout and the checkpoint's files for WORLD_SIZE
                    ranks, then exit
"""

from __future__ import annotations

import os
import sys

import torch

from torchpar import device as dev
from torchpar.config import help_text, load_config, to_toml
from torchpar.errors import ConfigError, Preempted, SaveFailed, TrainingStopped
from torchpar.plan import check_memory_cap, predict_for_trainer
from torchpar.plan.compare import StepCheck
from torchpar.preflight import claim_folders, preflight, verify_contents
from torchpar.tools.auto_layout import auto_layout, first_fit, room_of
from torchpar.train import Trainer


def main(argv: list[str]) -> int:
    """The trainer's command; ``torchpar.console.run_command`` turns its errors into one line."""
    config, overrides, print_config, check = parse_train_args(argv, __doc__)
    cfg = load_config(config, overrides)
    if print_config:
        print(to_toml(cfg))
        return 0
    if not check:
        dev.adopt_slurm_environment()  # srun without torchrun: WORLD_SIZE from srun's variables
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if check:
        check_job(cfg, world, int(os.environ.get("NODE_RANK", "0")))
        return 0

    trainer, figures = None, None
    try:
        if cfg.parallelism.layout == "auto":
            cfg, figures = auto_layout(cfg, world)
        # The step time is predicted where auto probed, or where asked (a probe of its own).
        step_check = StepCheck(figures)
        probe = step_check.probe if figures is None and cfg.metrics.predict_step_time else None
        trainer = Trainer(cfg, on_first_step=predict_for_trainer, check_layout=check_memory_cap,
                          on_logged_step=step_check, on_process_group=probe)
        trainer.signals.install()
        trainer.train()  # closes the trainer at its end
    except (TrainingStopped, Preempted, SaveFailed) as e:  # every rank stops at the same step
        if trainer is not None:  # (None: a trial of layout = auto stopped; it closed itself)
            trainer.close()
        if (trainer.rank if trainer is not None else int(os.environ.get("RANK", "0"))) == 0:
            kind = "" if isinstance(e, Preempted) else "error: "
            print(f"torchpar: {kind}{e}", file=sys.stderr, flush=True)
        return e.code
    except BaseException as e:
        if trainer is not None:
            if isinstance(e, torch.OutOfMemoryError):
                trainer.profiler.memory_snapshot("out_of_memory")  # before the process dies
            trainer.close(graceful=False)  # other ranks may be anywhere: no collectives
        raise
    finally:
        dev.shutdown_distributed()  # after the trainer's threads, before the interpreter's exit
    return 0


def check_job(cfg, world: int, node_rank: int = 0, contents: bool = True) -> None:
    """``--check``: config, tokenizer, data, layout, memory cap and the checkpoint's files for
    ``world`` ranks, so that a mistake is one line, not one traceback per rank; with ``contents``
    every byte of the checkpoint and of the prepared corpora read (:func:`verify_contents`).
    Raises ConfigError."""
    if cfg.parallelism.layout == "auto":  # the first layout that fits by memory stands in
        cfg = first_fit(cfg, world, room_of(cfg, world))
    pre = preflight(cfg, world)
    check_memory_cap(cfg, pre.layout, pre.model, pre.args)
    if contents:
        verify_contents(cfg, pre)
    if node_rank == 0:  # other nodes' checks may run after rank 0 took the folder
        claim_folders(cfg, 0).release()  # is another run using the folder?


def check_before_launch(argv: list[str]) -> int:
    """What the launcher checks on each node before torchrun starts a rank (``run_command`` turns
    its errors into one line): ``--check`` without reading every byte. The ranks read the
    checkpoint's CRC32s at the load, each a share; a corpus's were read when it was prepared (and
    by ``--check``). Read whole by every node's launcher at every start, a 70B checkpoint on 64
    nodes was ~54 TB before the first step."""
    config, overrides, _, _ = parse_train_args(argv, __doc__)
    check_job(load_config(config, overrides), int(os.environ.get("WORLD_SIZE", "1")),
              int(os.environ.get("NODE_RANK", "0")), contents=False)
    return 0


def parse_train_args(argv: list[str], usage: str) -> tuple[str | None, list[str], bool, bool]:
    """The trainer's command line: (config file, overrides, --print-config, --check); ``--help``
    prints ``usage`` and every config field."""
    config, rest, print_config, check = None, [], False, False
    i = 0
    while i < len(argv):
        a = argv[i]
        if a in ("-h", "--help"):
            print(usage)
            print(help_text())
            raise SystemExit(0)
        if a == "--print-config":
            print_config = True
        elif a == "--check":
            check = True
        elif a == "--config":
            if i + 1 >= len(argv):
                raise ConfigError("--config needs a file path")
            config = argv[i + 1]
            i += 1
        elif a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return config, rest, print_config, check
