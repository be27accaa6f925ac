"""Where numbers go: one logger, several sinks — the console (one line per logged step or
evaluation), ``metrics.jsonl``, TensorBoard and wandb — each receiving the same records.

Only the logging rank writes; every figure it writes is already global (all-reduced) or says
which rank it belongs to. A run has an id, kept in its checkpoints' manifests: a resumed run
continues the same wandb run and the same TensorBoard curves (events of steps after the
checkpoint, from an attempt that crashed, are dropped) instead of starting new ones.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from pathlib import Path

from torchpar import device as dev
from torchpar.data import ChatSource, TokenizedCorpus
from torchpar.models.lora import adapted_layers
from torchpar.models.lora import spec as lora_spec
from torchpar.parallel import float8


class Throughput:
    """Tokens per second over training time alone (evaluation and checkpoint saves are set aside),
    between logged steps, and the time left."""

    def __init__(self, tokens_per_step: int, first_step: int, last_step: int):
        self.tokens_per_step, self.first_step, self.last_step = tokens_per_step, first_step, last_step
        self.start = self.last = time.perf_counter()
        self.steps = 0  # since the last figures

    @contextlib.contextmanager
    def aside(self):
        """Time inside this block is not training time."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.last += time.perf_counter() - t0

    def figures(self, step: int) -> dict:
        """tokens_per_sec and step_s (seconds a step) since the previous call (the caller
        synchronized the device), elapsed_s, eta_s."""
        now = time.perf_counter()
        step_s = (now - self.last) / self.steps
        eta = (now - self.start) / (step - self.first_step + 1) * (self.last_step - step)
        self.last, self.steps = now, 0
        return {"tokens_per_sec": self.tokens_per_step / step_s, "step_s": step_s,
                "elapsed_s": now - self.start, "eta_s": eta}


def numbers(record: dict) -> dict:
    return {k: v for k, v in record.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
            and k != "step"}


class Console:
    def write(self, record: dict) -> None:
        if "loss" in record:
            mem = record.get("mem_max_allocated_gib", record.get("mem_rss_gib", 0.0))
            eta = f"  eta {_duration(record['eta_s'])}" if "eta_s" in record else ""
            mfu = "n/a" if record.get("mfu") is None else f"{100 * record['mfu']:.2f}%"
            print(
                f"step {record['step']:>5}  loss {record['loss']:.4f}  grad_norm {record['grad_norm']:.3f}  "
                f"lr {record['lr']:.2e}  tok/s {record['tokens_per_sec']:,.0f}  mfu "
                f"{mfu}  mem {mem:.2f}GiB  elapsed {record['elapsed_s']:.1f}s{eta}",
                flush=True,
            )
        if "val_loss" in record:
            print(f"step {record['step']:>5}  val_loss {record['val_loss']:.4f}  val_ppl "
                  f"{record['val_ppl']:.2f}  in {record.get('eval_s', 0.0):.1f}s", flush=True)

    def close(self) -> None:
        pass


class Jsonl:
    def __init__(self, path: Path):
        self.file = open(path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class TensorBoard:
    """Event files under ``<dump_folder>/tb``; one scalar series per numeric key."""

    def __init__(self, folder: Path, resume_step: int):
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: TensorBoard hides what earlier files hold from this step on, so a resumed
        # run's curve has no step twice.
        self.writer = SummaryWriter(str(folder), purge_step=resume_step + 1 if resume_step else None)

    def write(self, record: dict) -> None:
        for key, value in numbers(record).items():
            self.writer.add_scalar(key, value, record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class Wandb:
    def __init__(self, cfg, folder: Path, run_id: str, run_config: dict):
        import wandb

        env = os.environ.get
        self.run = wandb.init(
            project=env("WANDB_PROJECT") or cfg.wandb_project, entity=env("WANDB_ENTITY"),
            name=env("WANDB_RUN_NAME") or cfg.wandb_run_name or None, tags=list(cfg.wandb_tags) or None,
            dir=str(folder), config=run_config, id=run_id, resume="allow", mode=env("WANDB_MODE"),
        )

    def write(self, record: dict) -> None:
        self.run.log(numbers(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


class MetricsLogger:
    def __init__(self, cfg, dump_folder: str, enabled: bool, run_config: dict, resumed: dict | None = None):
        """``cfg`` is the [metrics] section; ``enabled`` is False on non-logging ranks; ``resumed``
        the manifest of the checkpoint this run resumes from (its run id and step), if any."""
        self.enabled = enabled
        self.run_id = (resumed or {}).get("run_id") or uuid.uuid4().hex[:12]
        self.sinks: list = []
        if not enabled:
            return
        folder = Path(dump_folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.sinks = [Console(), Jsonl(folder / "metrics.jsonl")]
        if cfg.enable_tensorboard:
            self.sinks.append(TensorBoard(folder / "tb", int((resumed or {}).get("step", 0))))
        if cfg.enable_wandb:
            self.sinks.append(Wandb(cfg, folder, self.run_id, run_config))

    def log(self, record: dict) -> None:
        for sink in self.sinks:
            sink.write(record)

    def close(self) -> None:
        for sink in self.sinks:
            sink.close()
        self.sinks = []


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds // 60 % 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s"


def describe_run(trainer) -> str:
    """The start-up line(s): model, layout, batch, device, compute precision and the MFU peak."""
    cfg, lay = trainer.cfg, trainer.layout
    n = trainer.model_family.num_params(trainer.args)
    tf32 = cfg.training.tf32 and trainer.device.type == "cuda"
    engine = "FSDP2 mixed precision" if lay.zero_stage == 3 else "flat ZeRO engine"
    bf16 = f"bfloat16 parameters and activations over a float32 master ({engine})"
    fp32 = "float32" + (" (TF32 matmuls)" if tf32 else "")
    precision = {"float32": fp32, "bfloat16": bf16}[lay.param_dtype]
    peak = "unknown" if trainer.peak_flops is None else f"{trainer.peak_flops / 1e9:.1f} GFLOP/s per rank"
    line = (f"torchpar: {cfg.model.name} {cfg.model.flavor} ({n / 1e6:.2f}M params), world {lay.world} = "
            f"pp {lay.pp} x dp_replicate {lay.dp_replicate} x dp_shard {lay.dp_shard} "
            + (f"(experts over ep {lay.ep} of them) " if lay.ep > 1 else "") + "x "
            + (f"cp {lay.cp} ({lay.cp_method}) x " if lay.cp > 1 else "") + f"tp {lay.tp}, zero "
            f"{lay.zero_stage}, global batch {trainer.global_batch} ({lay.accum} accumulation step(s)), "
            f"device {trainer.device}, compute {precision}; peak {peak} ({trainer.peak_source})")
    windows = trainer.dataloader.dataset

    how = {True: "prepared: own windows only", False: "tokenized on the fly"}
    def what(src) -> str:
        return src.describe() if isinstance(src, ChatSource) else how[isinstance(src, TokenizedCorpus)]

    read = ", ".join(f"{name} ({what(src)})" for name, src in zip(trainer.source_names, windows.sources))
    mix = f", mixture exact over every {windows.mixture.period} windows" if len(windows.sources) > 1 else ""
    masking = ", attention inside documents" if cfg.data.document_masking else ""
    line += f"\ntorchpar: data {read}{mix}{masking}"
    for note in trainer.model_family.run_notes(trainer.args, lay, trainer.device):
        line += f"\ntorchpar: {note}"
    if lay.float8 != "off":
        experts = trainer.model_family.experts(trainer.args) > 0
        line += f"\ntorchpar: {float8.describe(trainer.model.parts, lay, experts, trainer.device)}"
    if trainer.replicas is not None:
        ft = cfg.fault_tolerance
        meet = {"off": "gradients averaged with the other groups every step",
                "localsgd": f"weights averaged with the other groups every {ft.sync_every} steps (LocalSGD)",
                "diloco": f"DiLoCo with the other groups every {ft.sync_every} steps (outer Nesterov SGD, lr "
                          f"{ft.outer_lr:g}, momentum {ft.outer_momentum:g})"}[ft.semi_sync]
        if ft.semi_sync != "off" and ft.fragments > 1:
            meet += (f", streamed: one of {ft.fragments} fragments every {ft.sync_every // ft.fragments} "
                     f"steps, kept with {ft.fragment_alpha:g} of the group's own")
        line += (f"\ntorchpar: replica group {ft.replica_id} of {ft.replica_groups} (torchft; a step commits "
                 f"with {ft.min_replicas} or more): {meet}, the data split over their "
                 f"{ft.replica_groups * lay.dp} data-parallel ranks")
    if lay.lora_rank:
        lora = cfg.lora
        adapted = adapted_layers(trainer.model_family, trainer.args, lora_spec(lora))
        trained = sum(lora.rank * (a + b) for a, b in adapted.values())
        line += (f"\ntorchpar: LoRA rank {lora.rank} (alpha {lora.alpha:g}) on {len(adapted)} linear layers: "
                 f"{trained / 1e6:.3f}M trained parameters ({trained / n:.2%}), the rest frozen; checkpoints "
                 + ("hold the base weights too" if lora.save_base else "hold the adapters alone"))
    pipeline = trainer.model.pipeline
    return line if pipeline is None else f"{line}\n{pipeline.describe()}"


def log_step(trainer, loss: float, grad_norm: float, lr: float, first: int) -> None:
    """The record of a logged step: throughput since the last logged step, MFU, memory (the max
    over ranks: under a pipeline the stages differ), the step breakdown; at the run's first step
    also each rank's state bytes (and, through ``on_first_step``, the planner's prediction)."""
    import torch
    import torch.distributed as dist

    lay, step = trainer.layout, trainer.train_state.step
    dev.synchronize()
    speed = trainer.throughput.figures(step)
    memory = dev.memory_stats()
    peak = torch.tensor(list(memory.values()), device=trainer.device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    tps = speed["tokens_per_sec"]
    record = {"step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr, **speed,
              "tokens_per_sec_per_rank": tps / lay.world,
              "mfu": None if trainer.peak_flops is None
              else trainer.flops_per_token * tps / (trainer.peak_flops * lay.world),
              "tokens_seen": trainer.train_state.tokens_seen,
              **trainer.settled_terms, **dict(zip(memory, peak.tolist())), **trainer.breakdown.record()}
    if trainer.replicas is not None:  # replica groups: this rank's payload averaged with theirs last step
        record.update(replica_groups=trainer.replicas.participants(), replica_bytes=trainer.replicas.payload)
    if len(trainer.source_names) > 1:  # a mixture: tokens read from each source so far (global)
        seen = trainer.dataloader.position()["source_tokens"]
        record.update({f"tokens_seen/{name}": n for name, n in zip(trainer.source_names, seen)})
    if step == first:
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, trainer.model.state.state_bytes())
        record.update(per_rank[0])
        record.update({f"{key}_per_rank": [r[key] for r in per_rank] for key in per_rank[0]})
        if trainer.on_first_step is not None:
            record.update(trainer.on_first_step(trainer, per_rank[0]))
    if trainer.on_logged_step is not None:
        record.update(trainer.on_logged_step(trainer, record))
    trainer.logger.log(record)
