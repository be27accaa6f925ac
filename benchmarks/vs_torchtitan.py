"""torchpar's side of a comparison with torchtitan 0.3.0's llama3 debug model on this machine, and
the ratios to a peer's figures.

    python benchmarks/vs_torchtitan.py [--peer-lines peer_lines.txt] [--steps 6] [--repeats 2]

The model is torchtitan's debug shape (dim 256, 6 layers, 16 heads, full multi-head attention,
SwiGLU width rounded to 256 -> 768), 8 x 512 tokens per rank, fp32, one thread per rank, no
recomputation, attention kept inside documents (torchtitan's debug config masks block-causally
per document). Layouts: 1 process, dp 2 ZeRO-3 (FSDP2), tp 2 (sequence and loss parallel), pp 2
(Interleaved1F1B, 4 stages, 8 microbatches of 1), as torchtitan's debug config runs them. Each
variant runs in fresh processes, repeat by repeat; prints model GFLOP per second of the whole job
(wall clock: what a user waits for) and per CPU-second (the vocabularies differ: 4096 here, 2048
there, so tokens are not comparable). A rank that waits (a pipeline bubble, a blocking collective)
is charged no CPU-second, so the CPU figure flatters a layout that idles a rank; the wall figure
does not.

``--peer-lines``: the "PEER ..." lines a torchtitan run printed (config=fsdp1|fsdp2|tp2|pp2,
tokens_per_cpu_s=..., and tokens_per_s=... where the run recorded its wall clock); their tokens
become GFLOP with torchtitan's vocabulary and are set beside torchpar's.
"""

from __future__ import annotations

import re
from pathlib import Path

from vs_plain_pytorch import SHAPE, arguments, interleaved, medians, worker

from torchpar.models import MODELS

TITAN_SHAPE = {**SHAPE, "multiple_of": 256, "rope_theta": 500000.0}
COMMON = ["--data.document_masking", "true", *(f"--model.{k}={v}" for k, v in TITAN_SHAPE.items()
                                               if k not in SHAPE)]
# torchtitan's debug config: Interleaved1F1B, 4 stages on 2 ranks, 8 microbatches of 1.
PP = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
      "Interleaved1F1B", "--parallelism.pipeline_parallel_stages_per_rank", "2",
      "--parallelism.pipeline_parallel_microbatch_size", "1"]
LAYOUTS = {  # torchtitan config name: (ranks, data-parallel degree, torchpar overrides)
    "fsdp1": (1, 1, ["--parallelism.zero_stage", "0"]),
    "fsdp2": (2, 2, ["--parallelism.zero_stage", "3"]),
    "tp2": (2, 1, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.zero_stage", "0"]),
    "pp2": (2, 1, [*PP, "--parallelism.zero_stage", "0"]),
}


def flops_per_token(vocab: int, seq: int) -> int:
    adapter = MODELS["llama3"]
    args = adapter.args("debug", **TITAN_SHAPE, vocab_size=vocab)
    return adapter.flops_per_token(args, seq)


def peer_figures(path: str, seq: int) -> dict[str, dict[str, float]]:
    """config -> {"cpu": GFLOP per CPU-second, "wall": GFLOP/s of the job, where recorded} from the
    peer's lines (torchtitan's vocabulary, 2048)."""
    out = {}
    for line in Path(path).read_text().splitlines():
        config = re.search(r"config=(\S+)", line)
        if not (line.startswith("PEER") and config):
            continue
        figures = {}
        for key, name in (("cpu", "tokens_per_cpu_s"), ("wall", "tokens_per_s")):
            found = re.search(rf"\b{name}=([\d.]+)", line)
            if found:
                figures[key] = float(found.group(1)) * flops_per_token(2048, seq) / 1e9
        out[config.group(1)] = figures
    return out


def main() -> None:
    p = arguments(2)
    p.add_argument("--peer-lines", help="a torchtitan run's PEER lines, to set beside torchpar's")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"which of {', '.join(LAYOUTS)} to run")
    p.add_argument("--data", help="a .txt/.jsonl file to train on instead of the bundled corpus (e.g. the "
                   "peer's own documents, so both sides attend over the same document lengths)")
    a = p.parse_args()
    data = ["--data.dataset", "files", "--data.path", a.data] if a.data else []
    variants = {name: (LAYOUTS[name][0], None, [*COMMON, *data, *LAYOUTS[name][2]])
                for name in a.layouts.split(",")}
    runs = interleaved(variants, a.repeats, worker, a.steps, a.seq, a.batch)
    # (the worker counts batch x seq tokens per rank; under TP or PP the ranks share them)
    gflop = flops_per_token(4096, a.seq) / 1e9
    mine = {}
    for name, files in runs.items():
        m, share = medians(files["result.json"]), LAYOUTS[name][1] / LAYOUTS[name][0]
        mine[name] = {"wall": m["tokens_per_s"] * share * gflop, "cpu": m["gflop_per_cpu_s"] * share}
    peer = peer_figures(a.peer_lines, a.seq) if a.peer_lines else {}
    print(f"torchtitan's debug shape {TITAN_SHAPE}, {a.batch} x {a.seq} tokens per rank, fp32, document "
          f"masking, no recomputation; median of {a.repeats} runs of {a.steps - 1} timed steps")
    print(f"{'layout':>8} | {'torchpar GFLOP/s (wall)':>23} | {'torchtitan':>10} | {'ratio':>5} | "
          f"{'torchpar GFLOP/CPU-s':>20} | {'torchtitan':>10} | ratio")

    def cell(mine_figure, theirs):
        return (f"{f'{theirs:.1f}' if theirs else '-':>10} | "
                f"{f'{mine_figure / theirs:.3f}' if theirs else '-':>5}")
    for name, figures in mine.items():
        theirs = peer.get(name, {})
        print(f"{name:>8} | {figures['wall']:>23.1f} | {cell(figures['wall'], theirs.get('wall'))} | "
              f"{figures['cpu']:>20.1f} | {cell(figures['cpu'], theirs.get('cpu'))}")


if __name__ == "__main__":
    main()
