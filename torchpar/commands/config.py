"""``torchpar config from-deepspeed``: a DeepSpeed ds_config.json as a torchpar TOML."""

from __future__ import annotations

import json
import sys

from torchpar.console import ArgumentParser, at_least
from torchpar.errors import ConfigError
from torchpar.tools.deepspeed import convert, require_object


def main(argv: list[str]) -> int:

    ap = ArgumentParser(prog="torchpar config", description="Config tools.")
    sub = ap.add_subparsers(dest="command", required=True)
    ds = sub.add_parser("from-deepspeed", help="a DeepSpeed ds_config.json as a torchpar TOML (on stdout)")
    ds.add_argument("file")
    ds.add_argument("--model", default=None, help="model flavour to put in [model]")
    ds.add_argument("--nproc", type=int, default=1, help="data-parallel ranks (DeepSpeed's world size)")
    a = ap.parse_args(argv)
    at_least("--nproc", a.nproc, 1)
    try:
        with open(a.file) as f:
            config = json.load(f)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{a.file}: cannot read it as JSON ({e})") from None
    try:
        require_object("the top level (DeepSpeed's keys)", config)
        text, notes = convert(config, a.nproc, a.model)
    except ConfigError as e:
        raise ConfigError(f"{a.file}: {e}") from None
    for key, why in notes:
        print(f"torchpar: not mapped: {key}: {why}", file=sys.stderr)
    sys.stdout.write(text)
    return 0
