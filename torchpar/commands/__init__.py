"""``torchpar <command>``: every command's argument parsing, ``main`` and exit codes live in this
package, one module per subcommand; nothing below it imports it.

    torchpar <command> [args]      (the console script)
    python -m torchpar <command>   (the same; torchrun starts ranks with ``-m torchpar train``)
"""

from __future__ import annotations

import importlib
import sys

from torchpar.console import run_command
from torchpar.errors import ConfigError, did_you_mean

USAGE = """usage: torchpar <command> [args]

commands:
  train      train a model: torchpar train --config FILE [--section.key value ...]
  prepare-data  tokenize the config's corpus once into shards that data.dataset = 'tokenized' reads
               (resumable: run it again): torchpar prepare-data --config FILE --out DIR [--processes N]
               [--source NAME of [[data.sources]]] [--section.key value ...]
  schedule   draw a pipeline schedule and its bubble:
               torchpar schedule --pp 4 --microbatches 16 --schedule 1F1B [--out FILE.svg]
  export     consolidate a checkpoint into one weights file, or a Hugging Face folder:
               torchpar export --checkpoint DIR --out FILE|DIR [--format torchpar|hf] [--dtype bf16]
  plan       memory, communication, bubble and step time of layouts: torchpar plan --model 8B --gpu H100-80GB
               [--out memory.png]
  plot       draw runs' curves from metrics.jsonl: torchpar plot DUMP_FOLDER [DUMP_FOLDER ...] [--out FILE]
  generate   sample text: torchpar generate --checkpoint DIR|FILE --prompt TEXT [--max-new-tokens N]
  selftest   train the debug model in every layout the devices hold, each against one device:
               torchpar selftest [--nproc N] [--dtype float32,bfloat16]
  config     a DeepSpeed ds_config.json as a torchpar TOML:
               torchpar config from-deepspeed ds_config.json [--model FLAVOR] [--nproc N] > my.toml

--out of prepare-data, export, plan, plot and schedule never replaces an existing file, nor writes into a
folder holding files, that the command did not write there itself (its own corpus resumes, its own export
folder and pictures are rewritten; an existing weights file is always kept): --overwrite allows it.
"""


COMMANDS = {
    "train": ("torchpar.commands.train", "main"),
    "prepare-data": ("torchpar.commands.prepare_data", "prepare_main"),
    "schedule": ("torchpar.commands.schedule", "main"),
    "export": ("torchpar.commands.export", "export_main"),
    "plan": ("torchpar.commands.plan", "main"),
    "config": ("torchpar.commands.config", "main"),
    "generate": ("torchpar.commands.generate", "main"),
    "plot": ("torchpar.commands.plot", "main"),
    "selftest": ("torchpar.commands.selftest", "main"),
}


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in COMMANDS:
        raise ConfigError(f"unknown command {argv[0]!r}.{did_you_mean(argv[0], COMMANDS)} (torchpar --help)")
    module, name = COMMANDS[argv[0]]
    return getattr(importlib.import_module(module), name)(argv[1:])


def main(argv: list[str] | None = None) -> int:
    return run_command(dispatch, argv)


if __name__ == "__main__":
    sys.exit(main())
