"""``parallelism.layout = "auto"``: the planner picks the layout for the machine at hand.

    candidates = plan_candidates(cfg, world, figures)    # every layout that fits, ranked
    cfg = auto_layout(cfg, world)                         # before the Trainer, on every rank

The planner ranks every layout of the job (degrees, ZeRO stage, recomputation, micro-batch and
pipeline schedule) by predicted step time on this machine, measured by ``torchpar.plan.probe``
(cached per cluster), and keeps those that fit the device memory (or ``training.memory_cap_gib``)
and that the trainer accepts. With ``parallelism.auto_trials = k`` the k best are trained for a
few steps each in this job, and the fastest measured is kept: the planner prunes, the trials
decide. Whether a layout fits is arithmetic, so "nothing fits" is one line before any collective.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import shutil
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from torchpar import device as dev
from torchpar.checkpoint.files import job_key, restarted
from torchpar.config import JobConfig, to_toml
from torchpar.device import compute_dtype
from torchpar.errors import ConfigError
from torchpar.models import adapter, model_args
from torchpar.outputs import write_text
from torchpar.parallel.layout import release_meshes
from torchpar.plan.compare import step_terms
from torchpar.plan.estimate import Plan, device_peak, memory_of, plan
from torchpar.plan.layout import Cluster, layout_from_config
from torchpar.plan.probe import cluster_of, probe
from torchpar.plan.search import describe_layout, layouts, search
from torchpar.preflight import preflight
from torchpar.train import Trainer

SHOWN = 5  # candidates printed
HEADROOM = 0.9  # of the device's memory a layout may plan to use (a cap is used whole)


def global_batch(cfg: JobConfig, world: int) -> int:
    """The global batch a chosen layout keeps: training.global_batch_size, or (0) local_batch_size x
    the world, the batch of plain data parallelism over every rank."""
    tr = cfg.training
    return tr.global_batch_size or tr.local_batch_size * world


def config_of(cfg: JobConfig, lay: dict, world: int) -> JobConfig:
    """``cfg`` with a planned layout's fields ([parallelism] and the batch and recomputation of
    [training]) and layout = 'manual'."""
    pp = lay["pp"]
    par = replace(cfg.parallelism, layout="manual", auto_trials=0,
                  data_parallel_replicate_degree=lay["dp_replicate"],
                  data_parallel_shard_degree=lay["dp_shard"], tensor_parallel_degree=lay["tp"],
                  pipeline_parallel_degree=pp, context_parallel_degree=lay["cp"],
                  context_parallel_method=lay["cp_method"], zero_stage=lay["zero_stage"],
                  cpu_offload=lay["cpu_offload"], sequence_parallel=True, loss_parallel=True,
                  pipeline_parallel_schedule=lay["schedule"] if pp > 1 else "1F1B",
                  pipeline_parallel_microbatch_size=lay["microbatch_size"] if pp > 1 else 1,
                  pipeline_parallel_stages_per_rank=lay["stages_per_rank"] if pp > 1 else 0,
                  pipeline_parallel_layers_per_stage=[])
    tr = replace(cfg.training, local_batch_size=lay["local_batch_size"],
                 global_batch_size=global_batch(cfg, world),
                 activation_checkpoint=lay["activation_checkpoint"],
                 activation_checkpoint_every=lay["activation_checkpoint_every"])
    return replace(cfg, parallelism=par, training=tr)


def overrides_of(cfg: JobConfig) -> list[str]:
    """The command-line overrides that give ``cfg``'s layout by hand (to pin what auto chose)."""
    p, t = cfg.parallelism, cfg.training
    out = [f"--parallelism.data_parallel_replicate_degree {p.data_parallel_replicate_degree}",
           f"--parallelism.data_parallel_shard_degree {p.data_parallel_shard_degree}",
           f"--parallelism.tensor_parallel_degree {p.tensor_parallel_degree}",
           f"--parallelism.pipeline_parallel_degree {p.pipeline_parallel_degree}",
           f"--parallelism.context_parallel_degree {p.context_parallel_degree}",
           f"--parallelism.zero_stage {p.zero_stage}", f"--training.local_batch_size {t.local_batch_size}",
           f"--training.global_batch_size {t.global_batch_size}",
           f"--training.activation_checkpoint {t.activation_checkpoint}"]
    if p.context_parallel_degree > 1:
        out.append(f"--parallelism.context_parallel_method {p.context_parallel_method}")
    if t.activation_checkpoint_every > 1:
        out.append(f"--training.activation_checkpoint_every {t.activation_checkpoint_every}")
    if p.cpu_offload:
        out.append("--parallelism.cpu_offload true")
    if p.tensor_parallel_degree > 1:
        out += ["--parallelism.sequence_parallel true", "--parallelism.loss_parallel true"]
    if p.pipeline_parallel_degree > 1:
        out += [f"--parallelism.pipeline_parallel_schedule {p.pipeline_parallel_schedule}",
                f"--parallelism.pipeline_parallel_microbatch_size {p.pipeline_parallel_microbatch_size}",
                f"--parallelism.pipeline_parallel_stages_per_rank {p.pipeline_parallel_stages_per_rank}"]
    return out


def replaced_fields(cfg: JobConfig, chosen: JobConfig) -> list[str]:
    """The [parallelism] and [training] fields the chosen job sets otherwise than ``cfg``."""
    out = []
    for section in ("parallelism", "training"):
        mine, theirs = getattr(cfg, section), getattr(chosen, section)
        out += [f"{section}.{f.name} = {getattr(mine, f.name)!r} -> {getattr(theirs, f.name)!r}"
                for f in dataclasses.fields(mine) if f.name not in ("layout", "auto_trials")
                and getattr(mine, f.name) != getattr(theirs, f.name)]
    return out


def device_memory(cfg: JobConfig, per_node: int) -> float:
    """Bytes a rank's layout may plan to fill: training.memory_cap_gib (whole), else the device's
    (GPU) or this host's memory shared by its ranks (CPU), less headroom."""
    if cfg.training.memory_cap_gib > 0:
        return cfg.training.memory_cap_gib * 2**30 / HEADROOM  # plan() keeps HEADROOM of it
    return dev.rank_memory(per_node)


@dataclasses.dataclass
class Candidate:
    plan: Plan
    cfg: JobConfig  # the job with this layout
    measured_s: float | None = None  # a trial's median step time

    @property
    def name(self) -> str:
        return describe_layout(self.plan.layout)


def plan_candidates(cfg: JobConfig, world: int, cluster: Cluster, keep: int = SHOWN,
                    offload: bool = True) -> tuple[list, list]:
    """(the ``keep`` fastest predicted layouts that fit and that the trainer accepts, as
    Candidates planned as the trainer resolves them, fastest first; the plans of those that do
    not fit). CPU offload only with ``offload`` (and on GPUs). ConfigError naming the memory
    needed when none fits."""
    model, args, device, dtype, batch, seq = _job(cfg, world)
    plans = search(model, args, cluster, batch, seq, dtype, 1.0, device, cfg.optimizer, offload, cfg.quantize,
                   cfg.lora)
    if not plans:
        raise _none_divides(world, batch)
    out, refused = [], []
    for p in (p for p in plans if p.fits):
        job = config_of(cfg, p.layout, world)
        try:
            lay = layout_from_config(job, world, device)[0]
        except ConfigError as e:
            refused.append(str(e))
            continue
        resolved = plan(model, args, lay, cluster, seq, 1.0)  # (the config's own bucket size, dtypes...)
        if resolved.fits:
            out.append(Candidate(resolved, job))
        if len(out) == keep:
            break
    out.sort(key=lambda c: c.plan.step_s)
    if not out:
        smallest = min(plans, key=lambda p: device_peak(p.memory))
        raise _none_fits(cfg, world, cluster, batch, seq, smallest.layout, smallest.memory, refused)
    return out, [p for p in plans if not p.fits]


def first_fit(cfg: JobConfig, world: int, cluster: Cluster, offload: bool = True) -> JobConfig:
    """The config of the first layout, in the search's order, that fits ``cluster``'s memory and
    that the trainer accepts — memory alone priced, and the scan ended there: what a check before
    launch and the choice of offload need, in a fraction of the full search (which then runs
    once, on the probed machine). ConfigError naming the smallest layout's memory when none fits."""
    model, args, device, dtype, batch, seq = _job(cfg, world)
    smallest, refused = None, []
    every = list(layouts(model, args, cluster, batch, seq, dtype, device, cfg.optimizer, offload))  # (cheap)
    if not every:
        raise _none_divides(world, batch)
    for lay in sorted(every, key=_frugal_first):
        memory, fits = memory_of(model, args, lay, cluster, seq)
        if not fits:
            if smallest is None or device_peak(memory) < device_peak(smallest[1]):
                smallest = (lay.to_dict(), memory)
            continue
        job = config_of(cfg, lay.to_dict(), world)
        try:
            resolved = layout_from_config(job, world, device)[0]
        except ConfigError as e:
            refused.append(str(e))
            continue
        memory, fits = memory_of(model, args, resolved, cluster, seq)  # (as the trainer resolves it)
        if fits:
            return job
        if smallest is None or device_peak(memory) < device_peak(smallest[1]):
            smallest = (resolved.to_dict(), memory)
    if smallest is None:  # every layout fitted, and the trainer refused each
        raise ConfigError("parallelism.layout = 'auto': the trainer refused every layout that fits: "
                          f"{refused[0]}")
    raise _none_fits(cfg, world, cluster, batch, seq, *smallest, refused)


RECOMPUTE_FRUGALITY = {"full": 0, "selective": 2, "none": 3}


def _frugal_first(lay) -> tuple:
    """Layouts that likely need the least memory first: state split over the most ranks, then the
    most recomputation, the smallest micro-batch (a first fit is then found within a few)."""
    state_split = lay.tp * lay.pp * lay.cp * (lay.dp_shard if lay.zero_stage == 3 else 1)
    recompute = RECOMPUTE_FRUGALITY[lay.activation_checkpoint] + (lay.activation_checkpoint_every > 1)
    return -state_split, recompute, lay.microbatch_size


def _job(cfg: JobConfig, world: int) -> tuple:
    """(adapter, args, device type, compute dtype, global batch, sequence length) of the job."""
    device = dev.device_type()
    return (adapter(cfg.model.name), model_args(cfg.model), device,
            compute_dtype(cfg.training.mixed_precision_param, device), global_batch(cfg, world),
            cfg.training.seq_len)


def _none_divides(world: int, batch: int) -> ConfigError:
    return ConfigError(f"parallelism.layout = 'auto': no layout divides {world} rank(s), the model and the "
                       f"global batch of {batch}; change the rank count or training.global_batch_size")


def _none_fits(cfg: JobConfig, world: int, cluster: Cluster, batch: int, seq: int, layout: dict, memory: dict,
               refused: list[str]) -> ConfigError:
    why = f"; the trainer refused the rest ({refused[0]})" if refused else ""
    return ConfigError(
        f"parallelism.layout = 'auto': no layout of {cfg.model.name} {cfg.model.flavor} fits {world} "
        f"rank(s) of {HEADROOM * cluster.memory / 2**30:.2f} GiB at seq_len {seq} and global batch "
        f"{batch}: the smallest ({describe_layout(layout)}) needs "
        f"{device_peak(memory) / 2**30:.2f} GiB{why}. Add ranks, raise "
        "training.memory_cap_gib, or shorten training.seq_len")


def why_slower(p: Plan, best: Plan) -> str:
    """How much slower ``p`` is predicted than ``best``, and the term that makes most of it."""
    a, b = step_terms(p), step_terms(best)
    term = max(a, key=lambda k: a[k] - b[k])
    return f"+{100 * (p.step_s / best.step_s - 1):.0f}% step ({term} +{1e3 * (a[term] - b[term]):.1f} ms)"


def machine(figures: dict, cluster: Cluster) -> str:
    """One line of what the probe measured."""
    largest = max(figures["collectives"], key=lambda k: int(k.split(":")[1]), default=None)
    coll = ""
    if largest is not None:
        lat, bw = figures["collectives"][largest]["all_reduce"]
        coll = f", all-reduce over {largest.split(':')[1]} ranks {1e6 * lat:.0f} us + {bw / 1e9:.2f} GB/s"
    source = (f"cached in {figures['cached']}" if figures.get("cached")
              else f"probed in {figures['probe_s']:.1f} s")
    model = "the model's forward and backward " + (
        figures["model_probe"] if "model_probe" in figures else f"{cluster.peak_flops / 1e9:.1f}")
    return (f"this machine ({source}): matmul {figures['matmul_flops'] / 1e9:.1f} GFLOP/s per rank, {model}, "
            f"memory {cluster.memory_bw / 1e9:.1f} GB/s{coll}")


def report(cands: list[Candidate], unfit: list[Plan], chosen: Candidate) -> str:
    """The candidates with predicted (and measured) step time and memory, and why each lost."""
    best = cands[0].plan
    lines = [f"  {'#':>2}  {'layout':<84} {'predicted':>10} {'measured':>9} {'memory':>10}"]
    for i, c in enumerate(cands, 1):
        measured = f"{c.measured_s:.3f} s" if c.measured_s is not None else "-"
        if c is chosen:
            verdict = "chosen"
        elif c.measured_s is not None and chosen.measured_s is not None:
            verdict = f"measured +{100 * (c.measured_s / chosen.measured_s - 1):.0f}%"
        else:
            verdict = why_slower(c.plan, best)
        lines.append(f"  {i:>2}  {c.name:<84} {c.plan.step_s:>8.3f} s {measured:>9} "
                     f"{device_peak(c.plan.memory) / 2**30:>6.3f} GiB  {verdict}")
    if unfit:
        faster = [p for p in unfit if p.step_s < best.step_s]
        if faster:
            f = min(faster, key=lambda p: p.step_s)
            lines.append(f"  faster but does not fit: {describe_layout(f.layout)}: {f.step_s:.3f} s, needs "
                         f"{device_peak(f.memory) / 2**30:.3f} GiB")
    return "\n".join(lines)


def trial_config(cfg: JobConfig, steps: int, folder: Path) -> JobConfig:
    """``cfg`` cut down to a trial: ``steps`` steps, each logged, in ``folder``; no checkpoint,
    evaluation, profiling or external sinks."""
    return replace(
        cfg, training=replace(cfg.training, steps=steps),
        checkpoint=replace(cfg.checkpoint, enable=False),
        validation=replace(cfg.validation, enable=False),
        metrics=replace(cfg.metrics, log_freq=1, enable_tensorboard=False, enable_wandb=False,
                        log_communication=False, prediction_margin=0.0),
        profiling=replace(cfg.profiling, enable_profiling=False, enable_memory_snapshot=False),
        job=replace(cfg.job, dump_folder=str(folder)))


class _StepTimes:
    """A trial's on_logged_step: each logged step's time (every rank sees every record)."""

    def __init__(self):
        self.seconds: list[float] = []

    def __call__(self, trainer, record: dict) -> dict:
        if record["step"] > 1 and "step_s" in record:
            self.seconds.append(record["step_s"])
        return {}


def trial(cfg: JobConfig, steps: int, folder: Path) -> float:
    """Train ``cfg`` for ``steps`` steps in this process group (in a fresh ``folder``); the
    median time of the steps after the first, the slowest rank's (the same on every rank)."""
    shutil.rmtree(folder, ignore_errors=True)
    times = _StepTimes()
    trainer = Trainer(trial_config(cfg, steps, folder), on_logged_step=times)
    try:
        trainer.train()  # (closes the trainer)
    except BaseException:
        trainer.close(graceful=False)
        raise
    # (on the trainer's device: a host tensor has no backend in an NCCL-only group)
    median = torch.tensor([statistics.median(times.seconds)], dtype=torch.float64, device=trainer.device)
    del trainer
    gc.collect()  # the engine's hooks hold it in reference cycles
    dev.empty_cache()  # the next trial's layout starts from an empty device
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def room_of(cfg: JobConfig, world: int) -> Cluster:
    """This machine's memory (device_memory) and shape, without a measurement: enough to tell
    which layouts fit."""
    per_node = dev.local_world_size(world)
    return Cluster(per_node, device_memory(cfg, per_node), 1e12, 1e11, 1e10, dev.host_memory(),
                   max(1, world // per_node))


def auto_layout(cfg: JobConfig, world: int, say=print) -> tuple[JobConfig, dict]:
    """The job with the layout 'auto' chose, and the probe's figures of this machine (for the
    run's own prediction). Every rank calls it (it probes and may run trials); rank 0 ranks the
    candidates and prints them (through ``say``), and every rank takes rank 0's list. Raises
    ConfigError before any collective when no layout fits or the config is wrong."""
    dev.adopt_slurm_environment()
    room = room_of(cfg, world)
    # Memory alone, nothing measured yet: CPU offload only when nothing fits without it.
    try:
        first = first_fit(cfg, world, room, offload=False)
        offload = False
    except ConfigError:
        first = first_fit(cfg, world, room)
        offload = True
    preflight(first, world)  # every other check, before the probe's collectives
    dev.init_distributed(cfg.comm.timeout_s, offload and dev.device_type() == "cuda", cfg.training.tf32)
    rank = dist.get_rank()
    dtype = getattr(torch, compute_dtype(cfg.training.mixed_precision_param))
    figures = probe(dtype, adapter(cfg.model.name), model_args(cfg.model), cfg.training.seq_len,
                    memory_cap_gib=cfg.training.memory_cap_gib)
    trials = cfg.parallelism.auto_trials
    ranked = [None]
    if rank == 0:  # one ranking for all (memory figures can differ between hosts by a few bytes)
        before = chosen_before(cfg, world)
        if before is not None:
            ranked = [before]
        else:
            cluster = cluster_of(figures, room.memory)
            started = time.perf_counter()
            found = plan_candidates(cfg, world, cluster, max(SHOWN, trials), offload)
            ranked = [(found, cluster, time.perf_counter() - started)]
    dist.broadcast_object_list(ranked, src=0)  # (the other ranks wait here, within comm.timeout_s)
    if isinstance(ranked[0], dict):  # (a restart: what the job's first start chose)
        chosen_cfg = config_of(cfg, ranked[0], world)
        if rank == 0:
            say(f"torchpar: layout = 'auto': this restart of the job trains the layout its first start "
                f"chose: {describe_layout(ranked[0])}")
        return chosen_cfg, figures
    (cands, unfit), cluster, searched_s = ranked[0]
    if rank == 0:
        say(f"torchpar: layout = 'auto': {machine(figures, cluster)}; every layout ranked in "
            f"{searched_s:.1f} s")
    chosen = cands[0]
    if trials:
        base = Path(cfg.job.dump_folder) / "auto_trials"
        for i, c in enumerate(cands[:trials]):
            if rank == 0:
                say(f"torchpar: trial {i + 1}/{min(trials, len(cands))}: {c.name}")
            c.measured_s = trial(c.cfg, cfg.parallelism.auto_trial_steps, base / f"trial_{i + 1}")
        chosen = min((c for c in cands if c.measured_s is not None), key=lambda c: c.measured_s)
        # (the trials' other meshes: their communicators would hold their buffers for the whole run)
        release_meshes(keep=layout_from_config(chosen.cfg, world)[0])
    if rank == 0:
        say(report(cands, unfit, chosen))
        if trials:
            agreed = chosen is cands[0]
            say("torchpar: the trials agreed with the planner" if agreed else
                f"torchpar: the trials disagreed with the planner: its first choice measured "
                f"{cands[0].measured_s:.3f} s a step, {chosen.name} {chosen.measured_s:.3f} s")
        if replaced_fields(cfg, chosen.cfg):
            say("torchpar: layout = 'auto' set " + ", ".join(replaced_fields(cfg, chosen.cfg)))
        say("torchpar: auto chose " + chosen.name + "; to pin it: " + " ".join(overrides_of(chosen.cfg)))
        remember_choice(cfg, world, chosen.plan.layout)
    return chosen.cfg, figures


AUTO_CHOICE = "auto_layout.json"  # in the dump folder: what layout = 'auto' chose, for the job's restarts


def remember_choice(cfg: JobConfig, world: int, layout: dict) -> None:
    """Note the chosen layout for :func:`chosen_before` (with the job, the world and the config)."""
    folder = Path(cfg.job.dump_folder)
    folder.mkdir(parents=True, exist_ok=True)
    write_text(folder / AUTO_CHOICE, json.dumps({"job": job_key(), "world": world, "config": to_toml(cfg),
                                                 "layout": layout}, indent=1) + "\n")


def chosen_before(cfg: JobConfig, world: int) -> dict | None:
    """The layout auto chose at this job's first start, where this start is a restart of the job
    (torchrun's, a SLURM requeue: the same command again) on as many ranks: the restart trains the
    layout its checkpoints were saved in, without the search (a minute at 512 GPUs) and the trials
    again, which might choose another."""
    if not restarted() or job_key() is None:
        return None
    try:
        saved = json.loads((Path(cfg.job.dump_folder) / AUTO_CHOICE).read_text())
    except (OSError, ValueError):
        return None
    same = (saved.get("job"), saved.get("world"), saved.get("config")) == (job_key(), world, to_toml(cfg))
    return saved.get("layout") if same else None
