"""``torchpar plot``: runs' curves from their metrics.jsonl."""

from __future__ import annotations

from pathlib import Path

from torchpar.console import ArgumentParser
from torchpar.outputs import add_overwrite, claim, is_own_picture
from torchpar.tools.plot import PICTURE_SUFFIXES, check_losses, plot_runs, read_metrics


def main(argv: list[str]) -> int:

    ap = ArgumentParser(prog="torchpar plot", description="Draw runs' curves from their metrics.jsonl; "
                        "several dump folders are overlaid.")
    ap.add_argument("folders", nargs="+", help="dump folders (each with a metrics.jsonl)")
    ap.add_argument("--out", help="FILE.png or FILE.svg; default <first folder>/metrics.png. A picture "
                    "torchpar drew is redrawn; any other existing file only with --overwrite")
    add_overwrite(ap)
    a = ap.parse_args(argv)
    out = claim("--out", a.out or Path(a.folders[0]) / "metrics.png", suffixes=PICTURE_SUFFIXES,
                overwrite=a.overwrite, own=is_own_picture)
    runs = [(Path(f).resolve().name, read_metrics(f)) for f in a.folders]  # all checked before drawing
    check_losses(runs)
    plot_runs(runs, out)
    print(f"wrote {out}")
    return 0
