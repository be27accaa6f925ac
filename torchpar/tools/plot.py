"""Pictures: ``torchpar plot`` draws runs' curves from metrics.jsonl (several runs overlaid, the
A/B comparison of two layouts on the same data), and ``torchpar plan --out`` the per-rank memory
of candidate layouts as stacked bars. matplotlib is an optional dependency (``torchpar[plot]``).

    torchpar plot outputs/zero3 outputs/tp2 --out compare.png
"""

from __future__ import annotations

import json
from pathlib import Path

from torchpar.console import warn
from torchpar.errors import ConfigError
from torchpar.outputs import PICTURE_MARK, replacing

# (title, keys drawn in that panel: the first solid, the rest dashed)
PANELS = (("loss", ("loss", "val_loss")), ("learning rate", ("lr",)), ("gradient norm", ("grad_norm",)),
          ("tokens/s", ("tokens_per_sec",)), ("memory (GiB)", ("mem_max_allocated_gib", "mem_rss_gib")))
PICTURE_SUFFIXES = (".png", ".svg")  # what matplotlib writes here
MEMORY_PARTS = ("param_bytes", "grad_bytes", "optim_bytes", "activation_bytes", "logits_bytes",
                "gathered_bytes", "unsharded_grad_bytes")


def pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("pictures need matplotlib: pip install 'torchpar[plot]'") from None
    return plt


def save_figure(fig, out: Path, dpi: int) -> None:
    """``fig`` to ``out`` whole or not at all, marked as torchpar's (``torchpar.outputs``), closed."""
    with replacing(out) as tmp:
        fig.savefig(tmp, dpi=dpi, format=out.suffix[1:].lower(), metadata={"Creator": PICTURE_MARK})
    pyplot().close(fig)


def read_metrics(folder: str | Path) -> list[dict]:
    path = Path(folder) / "metrics.jsonl"
    if not path.is_file():
        raise ConfigError(f"{folder}: no metrics.jsonl there; give a run's job.dump_folder")
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); torchpar writes metrics.jsonl as "
                          "UTF-8 JSON lines: give a run's job.dump_folder") from None
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ConfigError(f"{path}:{lineno}: not a JSON record with a step")
        records.append(record)
    return records


def check_losses(runs: list[tuple[str, list[dict]]]) -> None:
    """A run without a logged loss draws empty charts: refused when no run has one, a warning for
    each run that lacks them beside runs that have them."""

    lacking = [name for name, records in runs if not any("loss" in r for r in records)]
    if len(lacking) == len(runs):
        raise ConfigError(f"no loss in the metrics.jsonl of {', '.join(lacking)} (no training step logged "
                          "yet?); nothing to draw")
    for name in lacking:
        warn(f"{name}: no loss in its metrics.jsonl; drawn without its curves")


def plot_runs(runs: list[tuple[str, list[dict]]], out: Path) -> None:
    """``runs``: (name, records) each; one panel per PANELS entry, one colour per run."""
    plt = pyplot()
    fig, axes = plt.subplots(len(PANELS), 1, figsize=(8, 2.2 * len(PANELS)), sharex=True)
    for ax, (title, keys) in zip(axes, PANELS):
        for colour, (name, records) in enumerate(runs):
            for style, key in zip(("-", "--", ":"), keys):
                points = [(r["step"], r[key]) for r in records if key in r]
                if points:
                    xs, ys = zip(*points)
                    ax.plot(xs, ys, style, color=f"C{colour}", label=f"{name} {key}")
        ax.set_ylabel(title)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    save_figure(fig, out, dpi=100)


def plot_plan_memory(plans, describe, device_bytes: float, out: Path) -> None:
    """Per-rank memory of each plan as stacked bars by part, and the device's usable memory."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(plans) + 1.5))
    labels = [describe(p.layout) for p in plans]
    left = [0.0] * len(plans)
    for i, part in enumerate(MEMORY_PARTS):
        widths = [p.memory.get(part, 0) / 1e9 for p in plans]
        ax.barh(labels, widths, left=left, color=f"C{i}", label=part.removesuffix("_bytes"))
        left = [a + b for a, b in zip(left, widths)]
    ax.axvline(0.9 * device_bytes / 1e9, color="black", linestyle="--", label="usable device memory")
    ax.set_xlabel("GB per rank (the heaviest pipeline rank)")
    ax.invert_yaxis()
    ax.tick_params(axis="y", labelsize=7)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out, dpi=100)
