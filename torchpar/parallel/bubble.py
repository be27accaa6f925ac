"""Bubble accounting and a picture of a pipeline schedule, from torch's own action order.

Cost model: every stage has the same cost per microbatch; forward F = 1 time unit, a full
backward B = 2 (backward costs twice the forward), which zero-bubble schedules split into an
input-gradient half I = 1 and a weight-gradient half W = 1. Sends are free and instant. Each
rank runs its actions in torch's order, each as soon as its inputs exist:
F(s, m) after F(s-1, m); B or I(s, m) after F(s, m) and B/I(s+1, m); W(s, m) after I(s, m).
A rank's bubble is its idle time over the makespan. For GPipe and 1F1B this gives
(p-1)/(m+p-1); interleaving v stages per rank gives (p-1)/(v·m+p-1).

    torchpar schedule --pp 4 --microbatches 16 --schedule 1F1B [--stages-per-rank V] [--out FILE.svg|.png]
"""

from __future__ import annotations

import argparse
import os
import sys

COST = {"F": 1, "B": 2, "I": 1, "W": 1}
COLOR = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}


def compute_actions(order: dict[int, list]) -> dict[int, list[tuple[str, int, int]]]:
    """rank -> [(kind, stage, microbatch)] of compute actions, comms and idle slots dropped."""
    out = {}
    for rank, actions in order.items():
        seq = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in COST:
                    seq.append((kind, sub.stage_index, sub.microbatch_index))
        out[rank] = seq
    return out


def single_stage_actions(name: str, pp: int, n: int) -> dict[int, list[tuple[str, int, int]]]:
    """The order torch's GPipe / 1F1B runtime loops execute (``_step_microbatches``).

    Their ``pipeline_order`` is only a drawing aid and in torch 2.13 mislabels 1F1B's
    microbatches (the last rank starts at F1), so the order is rebuilt from the runtime's rule:
    1F1B warms up with min(n, p - r) forwards, then alternates backward/forward, then drains.
    """
    out = {}
    for r in range(pp):
        if name == "GPipe":
            out[r] = [("F", r, m) for m in range(n)] + [("B", r, m) for m in range(n)]
            continue
        warmup = min(n, pp - r)
        seq = [("F", r, m) for m in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < n:
            seq.append(("B", r, bwd))
            bwd += 1
            if fwd < n:
                seq.append(("F", r, fwd))
                fwd += 1
        out[r] = seq
    return out


def schedule_actions(name: str, order: dict[int, list], pp: int, n: int) -> dict[int, list[tuple[str, int, int]]]:
    """Compute actions per rank for a schedule: torch's order, or the runtime rule (GPipe/1F1B)."""
    return single_stage_actions(name, pp, n) if name in ("GPipe", "1F1B") else compute_actions(order)


def simulate(actions: dict[int, list[tuple[str, int, int]]], num_stages: int) -> dict:
    """Start/end of every action under the cost model; per-rank and overall bubble."""
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in actions}
    nxt = {r: 0 for r in actions}
    timeline: dict[int, list[tuple[float, float, str, int, int]]] = {r: [] for r in actions}

    def deps(kind: str, s: int, m: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", s - 1, m)] if s > 0 else []
        if kind in ("B", "I"):
            return [("F", s, m)] + ([] if s == num_stages - 1 else [("grad", s + 1, m)])
        return [("I", s, m)]

    remaining = sum(len(v) for v in actions.values())
    while remaining:
        progressed = False
        for r, seq in actions.items():
            while nxt[r] < len(seq):
                kind, s, m = seq[nxt[r]]
                need = deps(kind, s, m)
                if any(d not in done for d in need):
                    break
                start = max([free[r]] + [done[d] for d in need])
                end = start + COST[kind]
                done[(kind, s, m)] = end
                if kind in ("B", "I"):
                    done[("grad", s, m)] = end  # the input gradient the previous stage waits for
                free[r] = end
                timeline[r].append((start, end, kind, s, m))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: seq[nxt[r]] for r, seq in actions.items() if nxt[r] < len(seq)}
            raise ValueError(f"the action order deadlocks under the cost model; next actions: {stuck}")
    makespan = max(free.values())
    busy = {r: sum(e - s for s, e, *_ in timeline[r]) for r in actions}
    per_rank = {r: 1.0 - busy[r] / makespan for r in actions}
    return {"timeline": timeline, "makespan": makespan, "bubble_per_rank": per_rank,
            "bubble": sum(per_rank.values()) / len(per_rank)}


def bubble_report(actions: dict[int, list], num_stages: int) -> str:
    sim = simulate(actions, num_stages)
    ranks = ", ".join(f"rank {r} {100 * b:.1f}%" for r, b in sorted(sim["bubble_per_rank"].items()))
    return f"bubble {100 * sim['bubble']:.2f}% of the step (F=1, B=2, I=W=1 cost model; {ranks})"


def schedule_order(name: str, pp: int, n_microbatches: int, stages_per_rank: int) -> tuple[dict[int, list], int]:
    """Build the real torch schedule for rank 0 on a fake process group and return its order."""
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchpar.parallel.pipeline import stage_ids_of_rank

    num_stages = pp * stages_per_rank
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
    try:
        group = dist.new_group(list(range(pp))) if not created else None
        stages = [PipelineStage(nn.Linear(1, 1), s, num_stages, "cpu", group=group)
                  for s in stage_ids_of_rank(0, pp, stages_per_rank, name)]
        cls = get_schedule_class(name)
        schedule = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n_microbatches,
                       loss_fn=lambda out, target: out.sum(), scale_grads=False)
        return schedule.pipeline_order, num_stages
    finally:
        if created:
            dist.destroy_process_group()


def _has_virtual_stages(sim: dict) -> bool:
    return len({s for tl in sim["timeline"].values() for *_, s, _ in tl}) > len(sim["timeline"])


def _cells(sim: dict):
    """(rank, start, end, kind, label, colour) per action; one description for text, SVG and PNG.

    With virtual stages a rank runs a microbatch once per stage it holds, so the label names the
    stage (F3s5 = forward of microbatch 3 on stage 5) and later chunks get a lighter shade."""
    multi = _has_virtual_stages(sim)
    pp = len(sim["timeline"])
    for r in sorted(sim["timeline"]):
        for start, end, kind, s, m in sim["timeline"][r]:
            chunk = s // pp if multi else 0
            yield r, start, end, kind, f"{kind}{m}" + (f"s{s}" if multi else ""), _shade(COLOR[kind], chunk)


def _shade(hex_colour: str, chunk: int) -> str:
    """Mix the colour with white: 0 for a rank's first stage, 40% for the second, ..."""
    mix = min(0.4 * chunk, 0.7)
    rgb = [int(hex_colour[i:i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(c + (255 - c) * mix):02X}" for c in rgb)


LEGEND = "F forward  B backward  I input-grad  W weight-grad  grey = idle"


def text_gantt(sim: dict) -> str:
    """One row per rank, one cell per time unit: kind + microbatch (+ stage when there are many)."""
    makespan = int(sim["makespan"])
    width = 6 if _has_virtual_stages(sim) else 4
    rows = {r: ["." .center(width)] * makespan for r in sim["timeline"]}
    for r, start, end, _, label, _ in _cells(sim):
        for t in range(int(start), int(end)):
            rows[r][t] = label[:width].ljust(width)
    return "\n".join(f"rank {r} |" + "".join(rows[r]) + f"| bubble {100 * sim['bubble_per_rank'][r]:5.1f}%"
                     for r in sorted(rows))


def write_svg(sim: dict, path: str, title: str) -> None:
    cell = 30 if _has_virtual_stages(sim) else 20
    row, left, top, right = 26, 70, 40, 110
    makespan = int(sim["makespan"])
    ranks = sorted(sim["timeline"])
    w, h = left + makespan * cell + right, top + len(ranks) * row + 40
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="monospace" font-size="10">',
             f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="10" y="20" font-size="13">{title}</text>']
    for i, r in enumerate(ranks):
        y = top + i * row
        parts.append(f'<text x="10" y="{y + 15}">rank {r}</text>')
        parts.append(f'<rect x="{left}" y="{y}" width="{makespan * cell}" height="{row - 4}" fill="#eeeeee"/>')
        parts.append(f'<text x="{left + makespan * cell + 8}" y="{y + 15}">bubble {100 * sim["bubble_per_rank"][r]:.1f}%</text>')
    for r, start, end, kind, label, colour in _cells(sim):
        x, y = left + start * cell, top + ranks.index(r) * row
        parts.append(f'<rect x="{x}" y="{y}" width="{(end - start) * cell - 1}" height="{row - 4}" fill="{colour}"/>')
        parts.append(f'<text x="{x + 2}" y="{y + 15}" fill="white">{label}</text>')
    parts.append(f'<text x="{left}" y="{h - 12}">{LEGEND}; lighter = a later stage of the same rank</text>')
    parts.append("</svg>")
    with open(path, "w") as f:
        f.write("\n".join(parts))


def write_png(sim: dict, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("torchpar schedule: a .png needs matplotlib (pip install 'torchpar[plot]'); .svg needs nothing")
    ranks = sorted(sim["timeline"])
    per_unit = 0.4 if _has_virtual_stages(sim) else 0.25
    fig, ax = plt.subplots(figsize=(max(6, sim["makespan"] * per_unit + 1.5), 0.6 * len(ranks) + 1.4))
    ax.barh(range(len(ranks)), sim["makespan"], color="#eeeeee")  # idle shows through
    for r, start, end, kind, label, colour in _cells(sim):
        ax.barh(ranks.index(r), end - start, left=start, color=colour, edgecolor="white")
        ax.text(start + 0.1, ranks.index(r), label, va="center", fontsize=7, color="white")
    for i, r in enumerate(ranks):
        ax.text(sim["makespan"] + 0.5, i, f"bubble {100 * sim['bubble_per_rank'][r]:.1f}%", va="center", fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlim(0, sim["makespan"] * 1.12 + 2)
    ax.invert_yaxis()
    ax.set_xlabel(f"time (forward = 1)    {LEGEND}; lighter = a later stage of the same rank")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


PICTURES = {".svg": write_svg, ".png": write_png}


def main(argv: list[str] | None = None) -> int:
    from torchpar.parallel.pipeline import SCHEDULES, SINGLE_STAGE

    ap = argparse.ArgumentParser(prog="torchpar schedule", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    ap.add_argument("--microbatches", type=int, required=True)
    ap.add_argument("--schedule", default="1F1B", help=f"one of {', '.join(SCHEDULES)}")
    ap.add_argument("--stages-per-rank", type=int, default=0, help="virtual stages; 0 = 1 or 2 by schedule")
    ap.add_argument("--out", help="write a picture: FILE.svg or FILE.png")
    args = ap.parse_args(argv)
    suffix = os.path.splitext(args.out or "")[1].lower()
    if args.out and suffix not in PICTURES:
        print(f"torchpar schedule: --out {args.out!r}: the picture is written as .svg or .png, not {suffix or 'no suffix'!r}",
              file=sys.stderr)
        return 2
    if args.schedule not in SCHEDULES:
        from torchpar.config import did_you_mean

        print(f"torchpar schedule: unknown schedule {args.schedule!r}.{did_you_mean(args.schedule, SCHEDULES)}", file=sys.stderr)
        return 2
    v = args.stages_per_rank or (1 if args.schedule in SINGLE_STAGE else 2)
    try:
        order, num_stages = schedule_order(args.schedule, args.pp, args.microbatches, v)
    except ValueError as e:
        print(f"torchpar schedule: {e}", file=sys.stderr)
        return 2
    sim = simulate(schedule_actions(args.schedule, order, args.pp, args.microbatches), num_stages)
    title = (f"{args.schedule}: pp={args.pp}, {args.microbatches} microbatches, {v} stage(s)/rank -> "
             f"bubble {100 * sim['bubble']:.2f}%")
    print(title)
    print(text_gantt(sim))
    if args.out:
        PICTURES[suffix](sim, args.out, title)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
