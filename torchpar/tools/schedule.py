"""``torchpar schedule``: a pipeline schedule drawn as text, SVG or PNG, with its bubble.

    torchpar schedule --pp 4 --microbatches 16 --schedule 1F1B [--stages-per-rank V] [--out FILE.svg|.png]

The schedule is torch's own (built for rank 0 on a fake process group); the timing is the cost
model of ``torchpar.parallel.bubble``.
"""

from __future__ import annotations

from pathlib import Path

from torchpar.outputs import PICTURE_MARK, write_text
from torchpar.tools.plot import pyplot, save_figure

COLOR = {"F": "#4C72B0", "B": "#DD8452", "I": "#C44E52", "W": "#55A868"}
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
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="monospace" '
        'font-size="10">',
        f"<desc>{PICTURE_MARK}</desc>",
        f'<rect width="{w}" height="{h}" fill="white"/>',
        f'<text x="10" y="20" font-size="13">{title}</text>',
    ]
    for i, r in enumerate(ranks):
        y = top + i * row
        parts.append(f'<text x="10" y="{y + 15}">rank {r}</text>')
        parts.append(
            f'<rect x="{left}" y="{y}" width="{makespan * cell}" height="{row - 4}" fill="#eeeeee"/>'
        )
        parts.append(
            f'<text x="{left + makespan * cell + 8}" y="{y + 15}">bubble '
            f'{100 * sim["bubble_per_rank"][r]:.1f}%</text>'
        )
    for r, start, end, kind, label, colour in _cells(sim):
        x, y = left + start * cell, top + ranks.index(r) * row
        parts.append(
            f'<rect x="{x}" y="{y}" width="{(end - start) * cell - 1}" height="{row - 4}" fill="{colour}"/>'
        )
        parts.append(f'<text x="{x + 2}" y="{y + 15}" fill="white">{label}</text>')
    parts.append(f'<text x="{left}" y="{h - 12}">{LEGEND}; lighter = a later stage of the same rank</text>')
    parts.append("</svg>")
    write_text(Path(path), "\n".join(parts))


def write_png(sim: dict, path: str, title: str) -> None:

    plt = pyplot()
    ranks = sorted(sim["timeline"])
    per_unit = 0.4 if _has_virtual_stages(sim) else 0.25
    fig, ax = plt.subplots(figsize=(max(6, sim["makespan"] * per_unit + 1.5), 0.6 * len(ranks) + 1.4))
    ax.barh(range(len(ranks)), sim["makespan"], color="#eeeeee")  # idle shows through
    for r, start, end, kind, label, colour in _cells(sim):
        ax.barh(ranks.index(r), end - start, left=start, color=colour, edgecolor="white")
        ax.text(start + 0.1, ranks.index(r), label, va="center", fontsize=7, color="white")
    for i, r in enumerate(ranks):
        ax.text(sim["makespan"] + 0.5, i, f"bubble {100 * sim['bubble_per_rank'][r]:.1f}%", va="center",
                fontsize=8)
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.set_xlim(0, sim["makespan"] * 1.12 + 2)
    ax.invert_yaxis()
    ax.set_xlabel(f"time (forward = 1)    {LEGEND}; lighter = a later stage of the same rank")
    ax.set_title(title)
    fig.tight_layout()
    save_figure(fig, Path(path), dpi=120)


PICTURES = {".svg": write_svg, ".png": write_png}
