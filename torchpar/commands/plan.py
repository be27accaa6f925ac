"""``torchpar plan``: memory, communication, bubble and step time of layouts, for a cluster or one config."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from torchpar.config import load_config
from torchpar.console import ArgumentParser, at_least
from torchpar.errors import ConfigError, did_you_mean
from torchpar.models import DEFAULT_FAMILY, MODELS
from torchpar.outputs import add_overwrite, claim, is_own_picture
from torchpar.plan.estimate import plan
from torchpar.plan.layout import PRESETS, Cluster, layout_from_config
from torchpar.plan.search import (
    MAX_TOKENS_PER_STEP,
    OVERRIDES,
    _gb,
    check_microbatches,
    describe_layout,
    explain,
    search,
)
from torchpar.plan.seeds import seed_examples
from torchpar.tools.plot import PICTURE_SUFFIXES, plot_plan_memory


def _parser():

    ap = ArgumentParser(
        prog="torchpar plan",
        description="Per-rank memory, communication, bubble and step time of layouts, by arithmetic; the "
        "best layouts of a model on a cluster.",
    )
    ap.add_argument("--model", help="model flavour (search over layouts)")
    ap.add_argument(
        "--family", default=DEFAULT_FAMILY, choices=sorted(MODELS), help="model family of --model"
    )
    ap.add_argument("--config", help="a training config: the prediction for exactly that layout")
    ap.add_argument("--nproc", type=int, help="ranks for --config (default: the cluster's devices)")
    ap.add_argument(
        "--gpu", default="H100-80GB", choices=sorted(PRESETS), help="cluster preset (datasheet figures)"
    )
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, help="override the preset's 8")
    ap.add_argument("--memory-gb", type=float, help="override device memory")
    ap.add_argument("--host-memory-gb", type=float, help="override CPU memory per node (what offload fills)")
    ap.add_argument("--peak-tflops", type=float, help="override dense bf16 peak")
    ap.add_argument("--intra-gbps", type=float, help="GB/s per direction inside a node")
    ap.add_argument("--inter-gbps", type=float, help="GB/s per direction across nodes")
    ap.add_argument("--global-batch-size", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--param-dtype", default="bf16", choices=("bf16", "fp32"),
                    help="compute copy of the weights and activations (state stays fp32, AdamW)")
    ap.add_argument("--float8", default="off", choices=("off", "tensorwise", "rowwise"),
                    help="FP8 matmuls of the blocks' linear layers (as [quantize] float8, its other "
                         "fields at their defaults): FP8 all-gathers under ZeRO-3, the FP8 peak where the "
                         "GPU has one")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--efficiency", type=float, default=0.5, help="share of peak FLOP/s the matmuls reach")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="draw the per-rank memory of the listed layouts: FILE.png or FILE.svg (a "
                    "picture torchpar drew is redrawn; any other existing file only with --overwrite)")
    add_overwrite(ap)
    ap.add_argument("--seeds", action="store_true", help="recompute the tutorials' worked examples")
    ap.add_argument("--launch", action="store_true",
                    help="with --config and --nproc: train that job on this machine with the layout the "
                    "planner picks for it here (run_train.sh with --parallelism.layout auto: this machine "
                    "measured, the candidates printed, the best launched)")
    return ap


def _cluster(a) -> Cluster:
    """The preset with the command line's overrides; impossible figures are one line."""

    for flag, low in (("--nodes", 1), ("--nproc", 1), ("--gpus-per-node", 1), ("--global-batch-size", 1),
                      ("--seq-len", 1), ("--top", 1)):
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None:
            at_least(flag, value, low)
    for flag in OVERRIDES:  # an override is a figure of the hardware: 0 is no hardware, not the preset
        value = getattr(a, flag[2:].replace("-", "_"))
        if value is not None:
            at_least(flag, value, 0, exclusive=True)
    if not 0 < a.efficiency <= 1:
        raise ConfigError(f"--efficiency is the share of peak FLOP/s the matmuls reach, in (0, 1]; got "
                          f"{a.efficiency:g}")
    tokens = a.global_batch_size * a.seq_len
    if tokens > MAX_TOKENS_PER_STEP:
        raise ConfigError(f"--global-batch-size {a.global_batch_size} x --seq-len {a.seq_len} = {tokens:.3g} "
                          f"tokens per step, beyond the {MAX_TOKENS_PER_STEP:.0e} the planner takes; is it a "
                          "typo?")
    c = PRESETS[a.gpu]

    def given(value, scale: float, preset: float):
        return preset if value is None else value * scale

    return Cluster(given(a.gpus_per_node, 1, c.gpus_per_node), given(a.memory_gb, 1e9, c.memory),
                   given(a.peak_tflops, 1e12, c.peak_flops), given(a.intra_gbps, 1e9, c.intra_bw),
                   given(a.inter_gbps, 1e9, c.inter_bw), given(a.host_memory_gb, 1e9, c.host_memory), a.nodes,
                   c.memory_bw, peak_fp8_flops=c.peak_fp8_flops)


def _launch(a) -> int:
    """``--launch``: run_train.sh with this config, --nproc ranks and layout = auto (it replaces
    this process)."""
    script = Path(__file__).resolve().parents[2] / "run_train.sh"
    if not a.config or not a.nproc:
        raise ConfigError("--launch trains a job: give --config FILE and --nproc N (ranks on this machine)")
    if not script.exists():
        raise ConfigError(f"--launch starts {script}, which this installation lacks: run from a checkout of "
                          "torchpar, or run_train.sh with --parallelism.layout auto yourself")
    load_config(a.config, ["--parallelism.layout", "auto"])  # a bad config: one line here, not on every rank
    env = {**os.environ, "NGPU": str(a.nproc), "CONFIG_FILE": str(Path(a.config).resolve())}
    os.execve(str(script), [str(script), "--parallelism.layout", "auto"], env)
    return 0  # (not reached)


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    cluster = _cluster(a)
    out = None
    if a.out:  # claimed before the search, which may take a while

        out = claim("--out", a.out, suffixes=PICTURE_SUFFIXES, overwrite=a.overwrite, own=is_own_picture)
    if a.seeds:

        examples = seed_examples()
        if a.json:
            print(json.dumps(examples, indent=1))
            return 0
        for e in examples:
            print(f"## {e['example']}\n  seed:  {e['seed']}")
            for k, v in e["exact"].items():
                print(f"  {k:<34} {v:,.4g}" if isinstance(v, float) else f"  {k:<34} {v:,}")
            print(f"  note:  {e['note']}\n")
        return 0
    if a.launch:
        return _launch(a)
    if a.config:
        cfg = load_config(a.config, [])
        lay, model, args = layout_from_config(cfg, a.nproc or cluster.world, "cuda")
        check_microbatches(lay)
        plans = [plan(model, args, lay, cluster, cfg.training.seq_len, a.efficiency)]
    elif a.model:
        model = MODELS[a.family]
        if a.model not in model.flavors:
            raise ConfigError(
                f"--model {a.model!r} is not a {a.family} flavour.{did_you_mean(a.model, model.flavors)}"
            )
        args = model.args(a.model)
        if a.seq_len > args.max_seq_len and hasattr(args, "rope_theta"):
            args = model.args(a.model, max_seq_len=a.seq_len)  # rotary positions: computed, any length
        if a.seq_len > args.max_seq_len:
            raise ConfigError(f"--seq-len {a.seq_len} is beyond {a.family} {a.model}'s max_seq_len "
                              f"{args.max_seq_len}; the model has no positions past it")
        dtype = "bfloat16" if a.param_dtype == "bf16" else "float32"
        quantize = load_config(None, ["--quantize.float8", a.float8]).quantize
        plans = search(model, args, cluster, a.global_batch_size, a.seq_len, dtype, a.efficiency,
                       quantize=quantize)
    else:
        raise ConfigError("give --model FLAVOR (search) or --config FILE --nproc N (one layout)")
    if not plans:
        raise ConfigError(f"no layout divides {cluster.world} devices, the model and --global-batch-size "
                          f"{a.global_batch_size}; change the device count or the batch")
    if out is not None:

        plot_plan_memory(plans[: a.top], describe_layout, cluster.memory, out)
    if a.json:
        print(json.dumps([p.to_json() for p in plans[: a.top]], indent=1))
        return 0
    print(f"{'layout':<84} {'mem/rank':>10} {'fits':>5} {'bubble':>7} {'tok/s':>12} {'MFU':>6}")
    for p in plans[: a.top]:
        print(f"{describe_layout(p.layout):<84} {_gb(p.memory['total_bytes']):>10} {str(p.fits):>5} "
              f"{100 * p.bubble:>6.1f}% {p.tokens_per_sec:>12,.0f} {100 * p.mfu:>5.1f}%")
    print()
    print(explain(model, args, plans, cluster))
    return 0
