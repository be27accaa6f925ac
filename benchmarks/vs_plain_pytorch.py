"""torchpar against plain PyTorch written here, on the same model, batch and ranks: a single-process
loop, DDP and FSDP2 per block (same options as torchpar's ZeRO-3: reshard after forward, fp32),
each with fused AdamW and gradient clipping, against torchpar's trainer step in the matching layout.

    python benchmarks/vs_plain_pytorch.py [--steps 6] [--repeats 2] [--seq 512] [--batch 8]

Each variant runs in fresh processes (one thread per rank; 2 ranks for DDP/FSDP2 and torchpar's
dp 2), the variants interleaved repeat by repeat; the first step of each run is not timed. Prints
tokens/s, tokens per CPU-second (user + system time of all ranks over the timed steps) and model
FLOPs per CPU-second, and each torchpar layout's ratio to its plain reference. The plain loops read
pre-made random tokens; torchpar's step includes its own data loader.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torchpar.selftest import BASE as TINY
from torchpar.selftest import spawn_ranks

# The shape of the comparison (a model torchtitan's debug config also builds).
SHAPE = {"dim": 256, "n_layers": 6, "n_heads": 16, "n_kv_heads": 16}
# name: (ranks, plain reference or None, torchpar overrides or None)
VARIANTS = {
    "plain 1 process": (1, "single", None),
    "torchpar 1 process": (1, None, ["--parallelism.zero_stage", "0"]),
    "plain DDP, dp 2": (2, "ddp", None),
    "torchpar ZeRO-0, dp 2": (2, None, ["--parallelism.zero_stage", "0"]),
    "plain FSDP2, dp 2": (2, "fsdp", None),
    "torchpar ZeRO-3, dp 2": (2, None, ["--parallelism.zero_stage", "3"]),
}
RATIOS = {"torchpar 1 process": "plain 1 process", "torchpar ZeRO-0, dp 2": "plain DDP, dp 2",
          "torchpar ZeRO-3, dp 2": ("plain DDP, dp 2", "plain FSDP2, dp 2")}


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _plain_model(kind: str, args, bucket_mb: float = 25.0):
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from torchpar.models import MODELS

    model = MODELS["llama3"].build(args)
    model.init_weights(0)
    if kind == "ddp":
        return DistributedDataParallel(model, bucket_cap_mb=bucket_mb), model.parameters()
    if kind == "fsdp":
        for block in model.layers.values():
            fully_shard(block, reshard_after_forward=True)
        fully_shard(model, reshard_after_forward=True)
    return model, model.parameters()


def config_overrides(out: str, seq: int, batch: int, bucket_mb: float = 25.0) -> list[str]:
    """The job every variant runs: :data:`SHAPE`, ``batch`` x ``seq`` tokens per rank, no validation."""
    return [*(f"--model.{k}={v}" for k, v in SHAPE.items()), "--training.seq_len", str(seq),
            "--training.local_batch_size", str(batch), "--validation.enable", "false",
            "--job.dump_folder", f"{out}/run", "--parallelism.bucket_mb", str(bucket_mb)]


def torchpar_step(out: str, overrides: list[str], seq: int, batch: int, bucket_mb: float = 25.0):
    """torchpar's trainer for that job with ``overrides``, and ``step(i)``: one training step."""
    from torchpar.config import load_config
    from torchpar.train import Trainer

    trainer = Trainer(load_config(TINY, [*config_overrides(out, seq, batch, bucket_mb), *overrides]))
    batches = iter(trainer.dataloader)

    def step(i):
        trainer.train_state.step = i
        trainer.train_step(batches)
        trainer.model.state.zero_grad()
    return trainer, step


def worker(rank, world, out, variant, steps, seq, batch, bucket_mb=25.0):
    """One variant (ranks, plain reference kind or None, torchpar overrides or None) in this group:
    ``steps`` steps, the first untimed (and its collectives counted), figures to result.json."""
    from torchpar.parallel.ledger import CommLedger

    ranks, kind, overrides = variant
    if kind is None:
        trainer, step = torchpar_step(out, overrides, seq, batch, bucket_mb)
        flops = trainer.flops_per_token
        close = trainer.close
    else:
        from torchpar.config import load_config
        from torchpar.loss import cross_entropy_sum
        from torchpar.models import MODELS, model_args

        cfg = load_config(TINY, config_overrides(out, seq, batch, bucket_mb))
        args = model_args(cfg.model)
        model, params = _plain_model(kind, args, bucket_mb)
        params = list(params)
        opt = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay,
                                fused=True)
        gen = torch.Generator().manual_seed(rank)
        data = [torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen) for _ in range(steps)]

        def step(i):
            tokens = data[i - 1]
            loss = cross_entropy_sum(model(tokens[:, :-1]), tokens[:, 1:]) / (batch * seq)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.training.max_norm)
            opt.step()
            opt.zero_grad(set_to_none=True)
        flops = MODELS["llama3"].flops_per_token(args, seq)
        close = None
    with CommLedger() as ledger:  # not timed: lazy state, first allocations; its traffic counted
        step(1)
    dist.barrier()
    t0, c0 = time.perf_counter(), cpu_seconds()
    for i in range(2, steps + 1):
        step(i)
    dist.barrier()
    wall = time.perf_counter() - t0
    figures = torch.tensor([cpu_seconds() - c0, wall], dtype=torch.float64)
    dist.all_reduce(figures)  # CPU seconds of all ranks; wall summed, divided below
    most = torch.tensor([peak_rss_mib(), sum(ledger.sent_bytes().values())], dtype=torch.float64)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    if close is not None:
        close()
    if rank == 0:
        tokens = (steps - 1) * batch * seq * ranks
        cpu, wall = figures[0].item(), figures[1].item() / ranks
        with open(f"{out}/result.json", "w") as f:
            json.dump({"tokens_per_s": tokens / wall, "tokens_per_cpu_s": tokens / cpu,
                       "gflop_per_cpu_s": tokens * flops / cpu / 1e9, "peak_rss_mib": most[0].item(),
                       "sent_mib_per_step": most[1].item() / 2**20}, f)


def arguments(repeats: int) -> argparse.ArgumentParser:
    """The options of the benchmarks that run :func:`worker` (the model is :data:`SHAPE`)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    return ap


def interleaved(variants: dict, repeats: int, target, *args) -> dict[str, dict[str, list[dict]]]:
    """Each variant ``target(rank, world, out, variant, *args)`` in fresh processes, the variants
    interleaved repeat by repeat (the machine's drift hits all alike): {name: {json file: [its
    contents, one per run]}}."""
    runs: dict[str, dict[str, list[dict]]] = {name: {} for name in variants}
    for _ in range(repeats):
        for name, variant in variants.items():
            out = spawn_ranks(target, variant[0], variant, *args)
            for path in sorted(Path(out).glob("*.json")):
                runs[name].setdefault(path.name, []).append(json.loads(path.read_text()))
            shutil.rmtree(out, ignore_errors=True)
    return runs


def medians(runs: list[dict]) -> dict[str, float]:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def main() -> None:
    a = arguments(repeats=2).parse_args()
    runs = interleaved(VARIANTS, a.repeats, worker, a.steps, a.seq, a.batch)
    med = {name: medians(files["result.json"]) for name, files in runs.items()}
    print(f"llama {SHAPE}, batch {a.batch} x seq {a.seq} per rank, fp32, 1 thread per rank; "
          f"median of {a.repeats} runs of {a.steps - 1} timed steps")
    print(f"{'variant':<24} {'tokens/s':>9} {'tokens/CPU-s':>13} {'GFLOP/CPU-s':>12}  ratio (tokens/CPU-s)")
    for name, m in med.items():
        refs = RATIOS.get(name, ())
        refs = (refs,) if isinstance(refs, str) else refs
        ratio = ", ".join(f"{m['tokens_per_cpu_s'] / med[r]['tokens_per_cpu_s']:.3f}x {r}" for r in refs)
        print(f"{name:<24} {m['tokens_per_s']:>9,.0f} {m['tokens_per_cpu_s']:>13,.0f} "
              f"{m['gflop_per_cpu_s']:>12.1f}  {ratio}")


if __name__ == "__main__":
    main()
