"""The trainer: check everything, build everything, then the loop. Its command (argv, exit codes)
is ``torchpar train`` in torchpar/commands/train.py."""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from torchpar import device as dev
from torchpar.breakdown import StepBreakdown, Stragglers
from torchpar.checkpoint import Checkpointer, checkpoint_root
from torchpar.config import JobConfig, to_toml
from torchpar.console import StartupClock, progress, tee_output, warn
from torchpar.data import build_dataloader, document_ids
from torchpar.errors import Preempted, TrainingStopped
from torchpar.evaluate import evaluate
from torchpar.fault_tolerance import CommitCount, OuterStep, ReplicaGroups, data_shard, for_replica
from torchpar.guard import SKIPS_IN_A_ROW, DivergenceGuard, skipped_where, weights_finite
from torchpar.loss import Z_LOSS, auxiliary_terms, record_term, target_count, tokens_ahead, training_loss
from torchpar.metrics import MetricsLogger, Throughput, describe_run, log_step
from torchpar.models.lora import flops_per_token as lora_flops
from torchpar.models.lora import spec as lora_spec
from torchpar.optim import OptimizerFactory, build_lr_scheduler, load_local_state, local_state
from torchpar.parallel import build_parallel_model, compute_context
from torchpar.parallel.context import inputs_and_targets, shard_sequence
from torchpar.parallel.zero import clip_grad_norm, frozen_names, full_value, local
from torchpar.preflight import claim_folders, preflight
from torchpar.profiling import Profiler
from torchpar.signals import StopSignals
from torchpar.state import ModelState, OptimizerState, RNGState, TrainState
from torchpar.watchdog import Watchdog


class Trainer:
    def __init__(self, cfg: JobConfig, on_first_step=None, check_layout=None, on_logged_step=None,
                 on_process_group=None):
        """``on_first_step(trainer, measured) -> dict``: extra figures for the first logged step
        (``torchpar train`` passes the planner's prediction, to be logged beside the measurement);
        ``on_logged_step(trainer, record) -> dict``: extra figures for every logged step (called on
        every rank; ``torchpar train`` passes the planner's step time beside the measured one);
        ``on_process_group(cfg, layout, model, args)``: called on every rank once the process group
        and the mesh exist, before the model is built (``torchpar train`` passes the machine probe,
        which runs while the device is still empty);
        ``check_layout(cfg, layout, model, args)``: raises ConfigError for a layout it refuses,
        before any collective (``torchpar train`` passes the planner's memory cap)."""
        cfg = for_replica(cfg)  # (a replica group of several: its own folders)
        self.cfg, self.on_first_step, self.on_logged_step = cfg, on_first_step, on_logged_step
        self.startup = clock = StartupClock()
        tr = cfg.training
        dev.adopt_slurm_environment()  # srun without torchrun: every task joins one job
        # 1. Everything a user can get wrong is checked here, before any collective.
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
        with progress("checking the config, tokenizer, data and checkpoint", rank == 0), \
                clock.phase("checks"):
            pre = preflight(cfg, world)
            if check_layout is not None:
                check_layout(cfg, pre.layout, pre.model, pre.args)
        self.run_lock = claim_folders(cfg, rank)
        if cfg.job.rank_logs and "TORCHELASTIC_RUN_ID" in os.environ:
            tee_output(Path(cfg.job.dump_folder) / "logs" / f"rank_{rank}.log")
        self.model_family, self.args, self.tokenizer, self.layout, self.val_source, self.data_identity = (
            pre.model, pre.args, pre.tokenizer, pre.layout, pre.val_source, pre.data)
        lay = self.layout

        # 2. Process group, mesh, model, optimizer, data.
        with (progress(f"joining the process group of {world} rank(s) and building the mesh", rank == 0),
              clock.phase("process group and mesh")):
            self.rank, world = dev.init_distributed(cfg.comm.timeout_s, lay.cpu_offload, tr.tf32)
            self.device = dev.local_device(tr.tf32)
            # where the gradients live: the host under CPU offload (its group has gloo for them)
            self.grad_device = torch.device("cpu") if lay.cpu_offload else self.device
            dev.cap_memory(tr.memory_cap_gib)
            lay.build_mesh(dev.device_type())
            ft = cfg.fault_tolerance
            self.replicas = None  # (one of several replica groups: joins them once ready to train)
        if on_process_group is not None:
            with clock.phase("machine probe"):
                on_process_group(cfg, lay, pre.model, pre.args)
        torch.manual_seed(tr.seed)
        with progress("building, parallelizing and initializing the model", rank == 0), \
                clock.phase("model"):
            self.model = build_parallel_model(
                pre.model, self.args, lay, self.device, tr.seed,
                OptimizerFactory(cfg.optimizer, pre.model), pre.weights)
        self.lr_scheduler = build_lr_scheduler(self.model.state.optimizer, cfg.lr_scheduler, tr.steps)
        with clock.phase("data"):
            shard, shards = data_shard(ft, lay.dp_rank, lay.dp)
            self.dataloader = build_dataloader(pre.sources, self.tokenizer, tr.seq_len, tr.local_batch_size,
                                               shard, shards, tr.seed, cfg.data.num_workers,
                                               cfg.data.lanes, self.device.type == "cuda", pre.shares)
        self.source_names = pre.source_names
        self.global_batch = tr.local_batch_size * lay.accum * lay.dp
        self.global_tokens = self.global_batch * tr.seq_len  # every position a real token: windows are full
        self.train_state = TrainState()
        self.guard = DivergenceGuard(tr, self.model.state.optimizer)
        self.breakdown = StepBreakdown(lay.mesh, dev.synchronize, self.model.pipeline,
                                       experts_view=lay.experts_view, views=lay.views)
        mx = cfg.metrics
        self.stragglers = (Stragglers(mx.straggler_factor, mx.straggler_steps, self.device, world)
                           if mx.straggler_factor > 0 and mx.log_step_breakdown and world > 1 else None)
        self.profiler = Profiler(cfg.profiling, cfg.job.dump_folder, self.rank, dev.device_type())
        self.signals, self.stop_requested = StopSignals(), False
        self.uncommitted = 0  # steps the replica groups' quorum did not commit
        self.recovered = 0  # times this replica group took a healthy group's state
        self.members: list[int] = []  # the replica groups whose work the last committed step holds
        self.losses: list[float] = []  # every step's global loss, as the host reads them
        self.settled = (float("nan"), float("nan"))  # (loss, grad norm) of the last step read
        self.settled_terms: dict[str, float] = {}  # its auxiliary loss terms, per token
        self.val_losses: list[tuple[int, float]] = []  # (step, held-out loss) of this run
        # The ranks whose loss counts: last stage, first TP rank (one per dp rank and, with context
        # parallelism, per part of the sequences).
        pipeline = self.model.pipeline
        self.holds_loss = (pipeline.has_last if pipeline else True) and lay.coordinate("tp") == 0
        self.logger = MetricsLogger(cfg.metrics, cfg.job.dump_folder, self.rank == 0,
                                    run_config=dataclasses.asdict(cfg),
                                    resumed=pre.resume_manifest)
        self.peak_flops, self.peak_source = dev.peak_flops(getattr(torch, lay.param_dtype), self.args.dim,
                                                           tr.tf32, cfg.metrics.peak_tflops)
        if self.peak_flops is None:
            warn(self.peak_source)
        self.flops_per_token = lora_flops(pre.model, self.args, tr.seq_len, lora_spec(cfg.lora))
        # The auxiliary loss terms every rank logs, in one order (the same on every rank).
        # (the layout's z_loss: what the planner counts among the step's figures)
        self.loss_terms = (Z_LOSS,) * lay.z_loss + pre.model.auxiliary_terms(self.args)
        # The routers' loads, balancing bias and figures (a mixture of experts), or None.
        self.routing = pre.model.routing(self.model.parts, self.args)
        if self.routing is not None and pre.weights is not None:
            self.routing.start_from(pre.weights)
        self.figure_names = tuple(f"loss/{name}" for name in self.loss_terms) + (
            self.routing.names if self.routing is not None else ())
        if self.model.pipeline is not None:
            self.model.pipeline.z_loss = cfg.loss.z_loss
        # Semi-synchronous groups (LocalSGD, DiLoCo): the weights of the last sync, saved with the rest.
        self.outer = (OuterStep(ft, [local(w) for w in self.model.state.weights()], self.rank)
                      if ft.enable and ft.semi_sync != "off" else None)
        self.commits = CommitCount() if ft.enable and ft.semi_sync == "off" else None
        with clock.phase("checkpoint"):
            self._restore(pre.resume, pre.resume_manifest)
        self.batches = None  # the data's iterator, made when training starts
        if ft.enable:
            # This rank's torchft manager, made last: from its first heartbeat the lighthouse holds
            # the other groups' quorums for this group (up to its join timeout), so it joins only
            # when ready to train. A group that joins late recovers this state live from a healthy
            # group's same rank.
            self.replicas = ReplicaGroups(ft, self.rank, world)
            # A resumed group counts its commits from where its checkpoint was (semi-synchronous:
            # meetings, in the same turn; else steps): torchft heals a group whose count is below
            # the quorum's highest, so groups resumed from different steps line up at the first
            # commit (all counting from 0, they averaged gradients of different weights).
            committed = (int(self.outer.meetings) if self.outer is not None
                         else self.commits.resume_at(self.train_state.step))
            self.replicas.resume_at(committed)
            self._snapshot_position()
            self.replicas.serve(self._recovery_state, self._recover)
        # 3. From here on a rank that stops answering or a step that never ends is a hang.
        self.watchdog = None
        if world > 1 and cfg.comm.watchdog_s > 0:
            self.watchdog = Watchdog(dist.distributed_c10d._get_default_store(), self.rank, world,
                                     cfg.comm.watchdog_s, cfg.job.dump_folder).start()

    def _restore(self, resume, resume_manifest) -> None:
        """The checkpointer, and the resume preflight found (or the new timeline it starts)."""
        cfg = self.cfg
        with progress("setting up the checkpoint folder (every rank meets there first)", self.rank == 0):
            manifest = self.manifest()
            # (a GPU generator's state belongs to its rank's place in the layout: another layout's
            # ranks would hand tensor-parallel peers different states)
            same = resume_manifest is None or resume_manifest.get("layout") == manifest["layout"]
            self.checkpointer = Checkpointer(cfg.checkpoint, checkpoint_root(cfg), self.stateful_parts(same),
                                             manifest, resume, resume_manifest)
        if self.checkpointer.branch is not None:  # metrics.jsonl says where this timeline starts
            self.logger.log({"step": self.checkpointer.branch["branch_from_step"], "event": "branch",
                             **self.checkpointer.branch})
        with progress(f"loading the checkpoint {resume}", self.rank == 0):
            resumed = self.checkpointer.load(skip=() if cfg.data.resume_position else ("dataloader",))
        if resumed is not None and self.rank == 0:
            print(f"torchpar: resumed from {resumed} at step {self.train_state.step} "
                  f"({self.train_state.tokens_seen:,} tokens seen; {self.checkpointer.loaded})", flush=True)

    def stateful_parts(self, same_layout: bool = True) -> dict:
        """Everything a checkpoint saves and restores: one entry per part (``same_layout``: the
        checkpoint to resume from was saved in this layout)."""
        lora = self.cfg.lora
        base = frozen_names(self.model.parts) if lora.rank and not lora.save_base else frozenset()
        parts = {"model": ModelState(self.model.state, base), "optimizer": OptimizerState(self.model.state),
                 "lr_scheduler": self.lr_scheduler, "train_state": self.train_state,
                 "dataloader": self.dataloader, "rng": RNGState(self.rank, device=same_layout)}
        if self.routing is not None:
            parts["routing"] = self.routing
        if self.outer is not None:
            parts["outer"] = self.outer
        if self.commits is not None:
            parts["commits"] = self.commits
        return parts

    def forward_kwargs(self, rows: torch.Tensor, training: bool = False) -> dict:
        """The model's inputs beside the tokens of windows ``rows`` [b, S + 1] — from the batch's
        host copy, so that the model reads where documents start without waiting for the device:
        each token's document, when attention is kept inside documents; in training with
        multi-token prediction, the tokens ahead of each position (this rank's positions)."""
        kwargs = {}
        if self.cfg.data.document_masking:
            kwargs["documents"] = document_ids(rows[:, :-1], self.tokenizer.bos_id)
        depths = self.model_family.prediction_depths(self.args)
        if training and depths:
            ahead = tokens_ahead(rows, depths, kwargs.get("documents"))
            kwargs["ahead"] = shard_sequence(ahead.to(self.device, non_blocking=True), self.layout)
        return kwargs

    def manifest(self) -> dict:
        """What a checkpoint records beside its tensors, to check a resume or an export against."""
        lay, cfg = self.layout, self.cfg
        return {
            "model_name": cfg.model.name, "model_flavor": cfg.model.flavor, "model_args": self.args.to_dict(),
            "tokenizer_path": cfg.model.tokenizer_path,
            "layout": {"world": lay.world, "pp": lay.pp, "dp_replicate": lay.dp_replicate,
                       "dp_shard": lay.dp_shard, "cp": lay.cp, "tp": lay.tp, "zero_stage": lay.zero_stage},
            "data": self.data_identity,
            "run_id": self.logger.run_id,  # a resumed run goes on logging under it
            "device": self.device.type,
            "generator": dev.generator_identity(),  # (whose draws the seeded init was: a LoRA base's again)
            "config": to_toml(cfg),
        }

    # ------------------------------------------------------------------ one step

    def global_targets(self, mine: int, masked: bool):
        """The loss targets of the whole job's windows whose share here holds ``mine``: with loss
        masks (``masked``) counted — one all-reduce of an integer, left on the device (each data-
        parallel rank's windows are held alike by world / dp ranks) — else every position of every
        data-parallel rank's windows (a number)."""
        if not masked:
            return mine * self.layout.dp
        count = torch.tensor(mine, dtype=torch.int64, device=self.device)
        dist.all_reduce(count)
        # (at least 1: a step whose windows hold only prompts has a loss of 0, not 0 / 0)
        return (count.double() * self.layout.dp / self.layout.world).clamp(min=1).float()

    def train_step(self, batches) -> None:
        """One optimizer step. Its figures are read by the host later (:meth:`_settle`)."""
        state, step = self.model.state, self.train_state.step
        phase = self.breakdown.phase  # times the phases of logged steps
        synchronous = self.replicas is not None and self.outer is None  # (gradients averaged every step)
        committed = True
        if self.replicas is not None:
            self.replicas.new_step()
        if synchronous:
            self.replicas.start_step()  # (the quorum is computed while the step runs)
        with phase("data"):
            hosts = [next(batches) for _ in range(self.layout.accum)]
        # (conversations carry loss masks: their targets are counted, not assumed)
        targets = self.global_targets(sum(target_count(h) for h in hosts), self.layout.loss_mask)
        # Gradients of the globally normalized loss: the average over dp x cp taken by the
        # reduction undoes the factor here. The cross-entropy is a mean over the step's targets,
        # the other terms over its tokens.
        scale = self.layout.grad_ranks / self.global_tokens
        scales = (self.layout.grad_ranks / targets, scale)
        with auxiliary_terms(self.loss_terms, scale) as terms:
            loss_sum = self._forward_backward(hosts, scales, phase)
        with phase("reduce_clip"):
            state.reduce_gradients()
            if synchronous:  # ...and over the replica groups of this step's quorum
                pieces = [g for g, _ in state.grad_pieces()]
                if self.replicas.fingerprint is None:
                    shapes = [tuple(g.shape) for g in pieces]
                    self.replicas.describe(f"{self.layout.to_dict()}, pieces {shapes}")
                self.replicas.average(pieces)
            grad_norm = clip_grad_norm(state, self.cfg.training.max_norm, self.grad_device)
            routed = self.routing.take() if self.routing is not None else None
            summed = self.global_figures(loss_sum, terms.values(loss_sum), routed)
            if synchronous:  # (the figures of the whole quorum: each group's, averaged)
                own = summed.clone()
                self.replicas.average([summed])
                committed = self.replicas.commit()
                if committed:
                    self.commits.count.fill_(self.replicas.committed())
                else:  # (a failed average leaves whatever it held: the guard reads this group's)
                    summed = own
            n = 2 + len(self.loss_terms)
            loss, stopping, term_sums = summed[0], summed[1], summed[2:n]
            # (the balancing bias moves here, before the next step's forwards)
            routing = self.routing.update(summed[n:]) if self.routing is not None else summed[n:]
            # (with CPU offload the norm of host gradients is on the host)
            head = torch.stack([loss / targets, grad_norm.to(loss.device), stopping])
            figures = torch.cat([head, term_sums / self.global_tokens, routing])
            # (an uncommitted step is not applied anyway: its averaged figures are not judged)
            skip = self.guard.record(step, figures, judged=committed)
        # The steps before this one are read now: waiting for them leaves this one's work queued.
        # A guard that decides on the host reads this step too, before its update.
        on_device = self.guard.on_device
        if synchronous:
            self._quorum_said(committed)
        if committed and step not in self._settle(step - 1 if on_device else step):
            with phase("optimizer"), skipped_where(state.optimizer, skip if on_device else None):
                state.step()
        self.lr_scheduler.step()  # a skipped step keeps its place in the schedule

    def _forward_backward(self, hosts: list[torch.Tensor], scales: tuple, phase) -> torch.Tensor:
        """Every micro-step's forward and backward (or the pipeline's schedule step) on the host
        batches ``hosts``, with the loss ``scales`` (:func:`training_loss`); returns this rank's
        summed token cross-entropy."""
        state, loss_sum = self.model.state, torch.zeros((), device=self.device)
        if self.model.pipeline is not None:
            # With a pipeline, accumulation is just more microbatches in one schedule step.
            with phase("data"):
                # each batch is copied from its pinned buffer: a host-side cat would not be pinned
                batch = torch.cat([host.to(self.device, non_blocking=True) for host in hosts])
                kwargs = self.forward_kwargs(torch.cat(hosts), training=True)
            state.set_sync(True)
            with phase("forward_backward"), compute_context(self.layout):
                inputs, targets = inputs_and_targets(batch, self.layout)
                loss_sum += self.model.pipeline.step(inputs, targets, scales, **kwargs)
        else:
            for micro, host in enumerate(hosts):
                with phase("data"):
                    batch = host.to(self.device, non_blocking=True)
                # (this rank's part of each sequence under context parallelism; documents stay whole)
                inputs, targets = inputs_and_targets(batch, self.layout)
                state.set_sync(micro == self.layout.accum - 1)
                with phase("forward_backward"), compute_context(self.layout):
                    kwargs = self.forward_kwargs(host, training=True)
                    logits = self.model.parts[0](inputs, **kwargs)
                    loss, ce, z = training_loss(logits, targets, self.cfg.loss.z_loss, scales)
                    del logits  # (the logits must not outlive the loss)
                    if z is not None:
                        record_term(Z_LOSS, z)
                    loss.backward()
                    loss_sum += full_value(ce.detach())
                if self.watchdog is not None:
                    self.watchdog.progress()
        return loss_sum

    def _settle(self, upto: int) -> set[int]:
        """Read the figures of the steps up to ``upto``: their losses, stop signals and
        divergence (stop here, or count the skip). Returns the steps not applied."""
        rejected = set()
        for step, loss, grad_norm, stopping, terms, problem in self.guard.settle(upto):
            self.losses.append(loss)
            self.settled = (loss, grad_norm)
            self.settled_terms = dict(zip(self.figure_names, terms))
            self.stop_requested |= stopping
            if problem is not None:
                self._diverged(step, problem)
                rejected.add(step)
            else:
                self.guard.in_a_row = 0
        return rejected

    def _snapshot_position(self) -> None:
        """Where this group is after a step, as a recovering group takes it: the step, the data
        position, the schedule, the routers' bias (copies: the next step changes them before a peer
        reads them); the weights and optimizer state are read live (torchft holds the next update
        back until a transfer is done)."""
        self.position = {"train_state": self.train_state.state_dict(), "data": self.dataloader.state_dict(),
                         "lr_scheduler": self.lr_scheduler.state_dict(),
                         "routing": {k: v.clone() for k, v in self.routing.state_dict().items()}
                         if self.routing is not None else None}

    def _recovery_state(self) -> dict:
        """This rank's training state for the same rank of a recovering replica group (torchft calls
        it in its quorum thread)."""
        state = self.model.state
        outer = self.outer.state_dict() if self.outer is not None else None
        return {"weights": [local(w) for w in state.weights()], "optimizer": local_state(state.optimizer),
                "outer": outer, **self.position}

    def _recover(self, sd: dict) -> None:
        """Take a healthy group's state (torchft calls it on every rank of this group as the step
        commits): weights, optimizer state, step, schedule and data position. This group trains from
        the next step on, at the data position after this one (its share of this step is skipped:
        its gradients, from stale weights, did not count)."""
        state = self.model.state
        state.wait_params()
        with torch.no_grad():
            for mine, theirs in zip(state.weights(), sd["weights"]):
                local(mine).copy_(theirs)
        load_local_state(state.optimizer, sd["optimizer"])
        if self.outer is not None:  # (the sync committing now starts from the peers' last one)
            self.outer.load_state_dict(sd["outer"])
        state.load_model_state_dict({})  # (the compute copy and its gathers made from the weights)
        self.train_state.load_state_dict(sd["train_state"])
        self.train_state.step += 1  # (the step committing now)
        self.lr_scheduler.load_state_dict(sd["lr_scheduler"])
        if self.outer is not None:  # (a semi-synchronous group meets after the step's schedule moved on)
            self.lr_scheduler.step()
        if self.routing is not None:
            self.routing.load_state_dict(sd["routing"])
        self.dataloader.load_state_dict(sd["data"])
        self.batches = iter(self.dataloader)
        for _ in range(self.layout.accum):  # (this step's windows of this group's share)
            next(self.batches)
        self.recovered += 1
        self.logger.log({"step": self.train_state.step, "event": "recovered", "recoveries": self.recovered})
        if self.rank == 0:
            print(f"torchpar: replica group {self.cfg.fault_tolerance.replica_id} recovered the weights and "
                  f"optimizer state of step {self.train_state.step - 1} from a healthy group; training on",
                  flush=True)

    def _stragglers(self, step: int) -> None:
        """Name a rank slower than the others at its own work (see breakdown.Stragglers)."""
        mx = self.cfg.metrics
        for rank, own, median in self.stragglers.check(self.breakdown.times):
            self.logger.log({"step": step, "straggler": rank, "own_work_s": own, "median_own_work_s": median})
            warn(f"rank {rank} is a straggler: its own work (data loading and the optimizer step) took over "
                 f"{mx.straggler_factor:g} x the median rank's on each of the last {mx.straggler_steps} "
                 f"logged steps (this one: {own:.3f} s against {median:.3f} s); the other ranks wait for it "
                 "in every collective (a slow device, host or input pipeline)")

    def _outer_sync(self) -> None:
        """LocalSGD's or DiLoCo's meeting of the groups (see fault_tolerance.OuterStep)."""
        state = self.model.state
        state.wait_params()
        weights = [local(w) for w in state.weights()]
        if self.replicas.fingerprint is None:
            self.replicas.describe(f"{self.layout.to_dict()}, weights {[tuple(w.shape) for w in weights]}")
        self._quorum_said(self.outer.sync(self.replicas, weights))
        state.load_model_state_dict({})  # (the compute copy and its gathers made from the weights)

    def _quorum_said(self, committed: bool) -> None:
        """Log what the replica groups' quorum decided for the step just met: its groups, or that it
        was not committed — at the step this group is at now (one that recovered in the commit is
        at the peers')."""
        (self._members if committed else self._uncommitted)(self.train_state.step)

    def _members(self, step: int) -> None:
        """Log the replica groups whose work a committed step holds, each time they change (a group
        lost, or back after recovering)."""
        if self.replicas.members != self.members:
            self.members = self.replicas.members
            self.logger.log({"step": step, "replica_members": self.members})

    def _uncommitted(self, step: int) -> None:
        """A step the replica groups' quorum did not commit (a group failed in it, or fewer than
        fault_tolerance.min_replicas took part): its update is not applied, here as everywhere."""
        self.uncommitted += 1
        present = self.replicas.participants()
        self.logger.log({"step": step, "uncommitted_steps": self.uncommitted, "replica_groups": present})
        warn(f"step {step} not committed by the replica groups (participants: {present}, "
             f"fault_tolerance.min_replicas = {self.cfg.fault_tolerance.min_replicas}); its update is "
             "dropped")

    def _diverged(self, step: int, problem: str) -> None:
        """A step that was not applied: stop with one line, or skip it (counted and logged) unless
        it is the SKIPS_IN_A_ROW-th in a row."""
        self.guard.in_a_row += 1
        skip = self.cfg.training.on_divergence == "skip"
        if not skip or self.guard.in_a_row >= SKIPS_IN_A_ROW:
            self.checkpointer.wait()
            last = self.checkpointer.latest()
            why = (f"; {SKIPS_IN_A_ROW} steps skipped in a row (training.on_divergence = 'skip' stops there)"
                   if skip else " (training.on_divergence = 'skip' drops such batches instead)")
            raise TrainingStopped(f"step {step}: {problem}; the update was not applied and nothing after it "
                                  f"was saved; last good checkpoint: {last or 'none'}{why}")
        self.guard.skipped += 1
        self.logger.log({"step": step, "skipped_steps": self.guard.skipped, "skip_reason": problem})
        warn(f"step {step} skipped: {problem}")

    def _preempted(self) -> None:
        """Some rank's stop signal has been read (the flag travels with a step's figures, read a step
        or two after the signal came): save after this complete step, then stop everywhere."""
        step, signum = self.train_state.step, self.signals.received or signal.SIGTERM
        saved = ""
        if self.cfg.checkpoint.save_on_signal and self.cfg.checkpoint.enable:
            self._save(final=True)
            self.checkpointer.wait()
            saved = f"; saved checkpoint {self.checkpointer.latest()}, run the same command to resume"
        raise Preempted(f"stopped by {signal.Signals(signum).name} after step {step}{saved}", signum)

    def _save(self, final: bool) -> None:
        """Save if one is due, never weights that are not finite."""
        if not self.checkpointer.due(self.train_state.step, final):
            return
        self._phase(f"the checkpoint save of step {self.train_state.step}", short=False)
        if not weights_finite(self.model.state.weights(), self.device):
            raise TrainingStopped(f"step {self.train_state.step}: the updated weights are not finite, so "
                                  "they were not saved; last good checkpoint: "
                                  f"{self.checkpointer.latest() or 'none'}")
        step = self.train_state.step
        with progress(f"saving the checkpoint of step {step}", self.rank == 0):
            self.checkpointer.maybe_save(step, force=final, tokens_seen=self.train_state.tokens_seen)

    def global_figures(self, loss_sum: torch.Tensor, term_sums: list[torch.Tensor] = (),
                       counts: torch.Tensor | None = None) -> torch.Tensor:
        """One all-reduce over the world, left on the device: each dp rank's loss counted once,
        whether any rank received a stop signal (so that all stop at the same step), each
        auxiliary term's sum (counted on the first TP rank of each stage: the others hold copies),
        then ``counts`` (the routers' loads, summed over the first TP rank of each tp group: the
        others route the same tokens alike)."""
        tp0 = self.layout.coordinate("tp") == 0
        figures = torch.stack([loss_sum if self.holds_loss else torch.zeros_like(loss_sum),
                               torch.full_like(loss_sum, float(self.signals.received > 0)),
                               *(t if tp0 else torch.zeros_like(t) for t in term_sums)])
        if counts is not None:
            counts = counts.to(figures)
            figures = torch.cat([figures, counts if tp0 else torch.zeros_like(counts)])
        dist.all_reduce(figures)
        return figures

    def global_sum(self, loss_sum: torch.Tensor) -> float:
        """:meth:`global_figures` read at once (evaluation): the global loss; notes a stop signal."""
        loss, stopping = self.global_figures(loss_sum).tolist()
        self.stop_requested |= stopping > 0
        return loss

    # ------------------------------------------------------------------ the loop

    def train(self) -> list[float]:
        cfg, tr, ts = self.cfg, self.cfg.training, self.train_state
        if self.rank == 0:
            print(self.startup.line() + "\n" + describe_run(self), flush=True)
        self.batches = iter(self.dataloader)
        dev.reset_peak_memory()
        first = ts.step + 1  # > 1 after a resume
        self.throughput = Throughput(self.global_tokens, first, tr.steps)
        while ts.step < tr.steps:
            ts.step += 1
            self._phase(f"step {ts.step}", short=ts.step != first, step=True)  # the first warms up, compiles
            lr = self.lr_scheduler.get_last_lr()[0]
            last = ts.step == tr.steps
            logged = ts.step == first or ts.step % cfg.metrics.log_freq == 0 or last
            evaluating = bool(self.val_source) and (ts.step % cfg.validation.freq == 0 or last)
            # (the first step's traffic includes one-time set-up: counted from the second on)
            with self.breakdown.step(logged and cfg.metrics.log_step_breakdown,
                                     logged and cfg.metrics.log_communication and ts.step > first):
                self.train_step(self.batches)
            self.profiler.step(ts.step)
            if self.outer is not None and self.outer.due(ts.step):
                self._outer_sync()
            if self.replicas is not None:
                self._snapshot_position()
            ts.tokens_seen += self.global_tokens
            self.throughput.steps += 1
            # The host waits for the device only where it must: to log, evaluate, save or stop.
            if logged or evaluating or self.stop_requested or self.checkpointer.due(ts.step, last):
                self._settle(ts.step)
            if logged:
                log_step(self, *self.settled, lr, first)
                if self.stragglers is not None:  # (made only where the phases are timed)
                    self._stragglers(ts.step)
            self.model.state.zero_grad()
            with self.throughput.aside():
                if evaluating:
                    self._phase(f"the evaluation after step {ts.step}", steps=cfg.validation.steps)
                    evaluate(self)
                if self.stop_requested and ts.step < tr.steps:
                    self._preempted()
                self._save(final=last)
        self.close()
        return self.losses

    def _phase(self, what: str, short: bool = True, steps: float = 1.0, step: bool = False) -> None:
        if self.watchdog is not None:
            self.watchdog.phase(what, short, steps, step)

    def close(self, graceful: bool = True) -> None:
        """End the run's threads and files. ``graceful`` (every rank closes at the same point):
        also wait for a checkpoint still being written, which takes collectives."""
        self._phase("shutdown", short=False)
        if graceful:
            self.model.state.wait_params()  # the last step's parameters, whole, for whoever reads them
            self.checkpointer.close()
        self.profiler.close()
        if self.watchdog is not None:  # before the process group goes: it reads the group's store
            self.watchdog.stop()
        self.logger.close()
        self.signals.restore()
        if self.replicas is not None:
            self.replicas.close()
        if self.run_lock is not None:
            self.run_lock.release()


if __name__ == "__main__":
    # Scripts written for torchpar's first releases ran this module; it holds no command now.
    print("torchpar: error: python -m torchpar.train trains nothing; run `torchpar train --config FILE "
          "[--section.key value ...]` (under torchrun: `torchrun ... -m torchpar train ...`), or "
          "./run_train.sh", file=sys.stderr)
    raise SystemExit(2)
