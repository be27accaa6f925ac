"""``torchpar schedule``: a pipeline schedule drawn as text, SVG or PNG, with its bubble."""

from __future__ import annotations

import argparse

from torchpar.console import ArgumentParser, at_least
from torchpar.errors import ConfigError, did_you_mean
from torchpar.outputs import add_overwrite, claim, is_own_picture
from torchpar.parallel.bubble import schedule_actions, simulate
from torchpar.parallel.pipeline import (
    MAX_MICROBATCHES,
    SCHEDULES,
    SINGLE_STAGE,
    schedule_order,
    schedule_problem,
)
from torchpar.tools.schedule import PICTURES, text_gantt


def main(argv: list[str] | None = None) -> int:

    ap = ArgumentParser(prog="torchpar schedule", description=__doc__,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--schedule", default="1F1B", help=f"one of {', '.join(SCHEDULES)}")
    ap.add_argument("--stages-per-rank", type=int, default=0, help="virtual stages; 0 = 1 or 2 by schedule")
    ap.add_argument("--out", help="write a picture: FILE.svg or FILE.png (a picture torchpar drew is "
                    "redrawn; any other existing file only with --overwrite)")
    add_overwrite(ap)
    args = ap.parse_args(argv)
    at_least("--pp", args.pp, 1)
    at_least("--microbatches", args.microbatches, 1)
    if args.microbatches > MAX_MICROBATCHES:
        raise ConfigError(f"--microbatches {args.microbatches} is beyond the {MAX_MICROBATCHES} a schedule "
                          "is drawn for; draw it for fewer (beyond, the bubble only shrinks further)")
    at_least("--stages-per-rank", args.stages_per_rank, 0)
    out = claim("--out", args.out, suffixes=tuple(PICTURES), overwrite=args.overwrite,
                own=is_own_picture) if args.out else None
    if args.schedule not in SCHEDULES:
        raise ConfigError(f"--schedule {args.schedule!r} is unknown.{did_you_mean(args.schedule, SCHEDULES)}")
    v = args.stages_per_rank or (1 if args.schedule in SINGLE_STAGE else 2)
    problem = schedule_problem(args.schedule, args.pp, v, args.pp * v, args.microbatches, "--stages-per-rank")
    if problem:
        raise ConfigError(problem)
    try:
        order, num_stages = schedule_order(args.schedule, args.pp, args.microbatches, v)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    sim = simulate(schedule_actions(args.schedule, order, args.pp, args.microbatches), num_stages)
    title = (f"{args.schedule}: pp={args.pp}, {args.microbatches} microbatches, {v} stage(s)/rank -> bubble "
             f"{100 * sim['bubble']:.2f}%")
    print(title)
    print(text_gantt(sim))
    if out is not None:
        PICTURES[out.suffix.lower()](sim, str(out), title)
        print(f"wrote {args.out}")
    return 0
