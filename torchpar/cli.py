"""``torchpar <command>``: train, schedule, export, generate."""

from __future__ import annotations

import sys

USAGE = """usage: torchpar <command> [args]

commands:
  train      train a model: torchpar train --config FILE [--section.key value ...]
  schedule   draw a pipeline schedule and its bubble:
               torchpar schedule --pp 4 --microbatches 16 --schedule 1F1B
  export     consolidate a checkpoint into one weights file, or a Hugging Face folder:
               torchpar export --checkpoint DIR --out FILE|DIR [--format torchpar|hf] [--dtype bf16]
  plan       memory, communication, bubble and step time of layouts: torchpar plan --model 8B --gpu H100-80GB
  generate   sample text: torchpar generate --checkpoint DIR|FILE --prompt TEXT [--max-new-tokens N]
  config     a DeepSpeed ds_config.json as a torchpar TOML:
               torchpar config from-deepspeed ds_config.json [--model FLAVOR] [--nproc N] > my.toml
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    command, rest = argv[0], argv[1:]
    if command == "train":
        from torchpar.train import main as train_main

        return train_main(rest)
    if command == "schedule":
        from torchpar.tools.schedule import main as schedule_main

        return schedule_main(rest)
    if command == "export":
        from torchpar.weights import export_main

        return export_main(rest)
    if command == "plan":
        from torchpar.plan import main as plan_main

        return plan_main(rest)
    if command == "config":
        from torchpar.tools.deepspeed import main as config_main

        return config_main(rest)
    if command == "generate":
        from torchpar.generate import main as generate_main

        return generate_main(rest)
    print(f"torchpar: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
