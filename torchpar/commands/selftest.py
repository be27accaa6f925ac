"""``torchpar selftest``: train a job (the debug model's, or yours) in every layout the devices hold,
each against one device."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from torchpar import device as dev
from torchpar.config import load_config, parse_overrides
from torchpar.console import ArgumentParser, at_least
from torchpar.errors import ConfigError, did_you_mean
from torchpar.selftest import BASE, LAYOUTS, format_rows, selftest


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="torchpar selftest", description=__doc__.split("\n\n")[0],
                       epilog="Further arguments --section.key value (or --section.key=value) override "
                              "the job, as --set does, for the one-device run and every layout.")
    p.add_argument("--config", default=str(BASE),
                   help="the job to check (default: the debug model's few steps, "
                        "torchpar/assets/selftest.toml); keep it small: every layout trains it")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override the job, e.g. --set model.attn_sink=true (repeatable)")
    p.add_argument("--nproc", type=int, default=dev.default_nproc(),
                   help="processes (one per GPU); default: every visible GPU, else 2 CPU ranks")
    p.add_argument("--dtype", default="float32,bfloat16" if dev.device_type() == "cuda" else "float32",
                   help="comma-separated compute dtypes to test (default: both on GPUs, float32 on CPU)")
    p.add_argument("--layout", action="append", default=[], metavar="NAME=OVERRIDES",
                   help="an extra layout on --nproc processes, e.g. "
                        "tp4='--parallelism.tensor_parallel_degree 4'")
    p.add_argument("--only", default="", metavar="NAME,...",
                   help="only these built-in layouts (and the one-device reference), e.g. zero3,tp2_sp_lp")
    p.add_argument("--json", default="", help="also write the rows to this JSON file")
    a, rest = p.parse_known_args(argv)
    overrides = []
    for item in a.set:
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"--set {item!r}: write section.key=value, e.g. --set model.attn_sink=true")
        overrides.append("--" + item)
    for key, value in parse_overrides(rest):
        overrides += [f"--{key}", value]
    load_config(a.config, overrides)  # (a wrong field or value: its one line now, not in every run)
    at_least("--nproc", a.nproc, 1)
    only = [n.strip() for n in a.only.split(",") if n.strip()] or None
    for name in only or []:
        if name not in {n for w, n, _ in LAYOUTS if w <= a.nproc}:
            raise ConfigError(f"--only {name!r} is not a built-in layout of at most {a.nproc} process(es)."
                              f"{did_you_mean(name, [n for w, n, _ in LAYOUTS if w <= a.nproc])}")
    dtypes = [d.strip() for d in a.dtype.split(",")]
    for d in dtypes:
        if d not in ("float32", "bfloat16"):
            raise ConfigError(f"--dtype {d!r}: use float32, bfloat16 or both, comma-separated")
    if dev.device_type() == "cuda" and a.nproc > dev.default_nproc():
        raise ConfigError(f"--nproc {a.nproc}: this machine has {dev.default_nproc()} GPU(s)")
    extra = {}
    for spec in a.layout:
        name, sep, layout = spec.partition("=")
        if not sep or not name:
            raise ConfigError(f"--layout {spec!r}: write NAME='--section.key value ...'")
        extra[name] = shlex.split(layout)
    job = "the debug job" if a.config == str(BASE) else a.config
    print(f"torchpar selftest: {a.nproc} process(es) on {dev.device_name()}, torch {torch.__version__}; "
          f"{job}{' with ' + ' '.join(overrides) if overrides else ''}: each layout's losses, held-out "
          "losses and parameters against one device's", flush=True)
    rows = selftest(a.nproc, dtypes, extra, base=a.config, only=only, overrides=overrides)
    print(format_rows(rows))
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    failed = [r["layout"] + f" ({r['dtype']})" for r in rows
              if r["status"].startswith(("DIFFERS", "ERROR"))]
    refused = sum(r["status"].startswith("REFUSED") for r in rows)
    print(f"selftest: {len(rows) - len(failed) - refused} of {len(rows)} passed"
          + (f", {refused} refused" if refused else "")
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0
