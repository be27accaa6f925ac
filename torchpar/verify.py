"""The planner held against measurement: the activation bytes the real model keeps for backward,
block by block, and the peak of a real training step of the trainer, each beside the planner's
prediction for the same job on this rank. It sits above the trainer and the planner, which never
import it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path

import torch

from torchpar.checkpoint.checkpointer import Checkpointer, HostStaging
from torchpar.checkpoint.files import complete_checkpoints, read_manifest
from torchpar.loss import cross_entropy_sum
from torchpar.optim import OptimizerFactory, ensure_state, optimized
from torchpar.parallel import _local_part, compute_context, materialize, parallelize
from torchpar.parallel.context import inputs_and_targets
from torchpar.parallel.flat import bucket_elements
from torchpar.parallel.recompute import recomputed
from torchpar.parallel.zero import local, nbytes
from torchpar.plan.activations import LiveStorages, held_bytes, tagged
from torchpar.plan.estimate import rank_memory
from torchpar.plan.layout import transient_bytes
from torchpar.state import ModelState, OptimizerState
from torchpar.train import Trainer


def measured_activations(model, args, lay, batch: int, seq: int, seed: int = 0) -> dict:
    """The real model on the CPU, laid out by ``lay`` (its mesh built, for TP), one microbatch of
    forward + loss: the bytes each block, and the rest (embedding, final norm, head, loss), hold
    at the end of the forward on this rank — followed storage by storage, as the planner's trace
    does on the meta device."""
    (module,) = parallelize(model, args, lay)
    module.to_empty(device="cpu")
    module.tie_weights()
    module.init_weights(seed, local_part=_local_part)
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=gen)
    tags = {module: ("rest", None), **{block: ("block", int(i)) for i, block in module.layers.items()}}
    tracker = LiveStorages()
    inputs, targets = inputs_and_targets(tokens, lay)  # (under cp: this rank's part)
    with tagged(tracker, tags), compute_context(lay), tracker:
        loss = cross_entropy_sum(module(inputs), targets)
    held = tracker.live()
    del loss
    return {"blocks": [held.get(("block", i), 0) for i in range(args.n_layers)],
            "rest": held.get(("rest", None), 0)}


def activation_check(model, args, lay, batch: int, seq: int) -> dict:
    """Measured against predicted bytes per block (each block's policy) and for the whole
    forward + loss, on this rank of layout ``lay``."""
    measured = measured_activations(model, args, lay, batch, seq)
    policy = lay.activation_checkpoint
    blocks = [held_bytes(model, args, lay, batch, seq,
                         policy if recomputed(i, policy, lay.activation_checkpoint_every) else "none",
                         layer=i)
              for i in range(args.n_layers)]
    rest = held_bytes(model, args, lay, batch, seq, "none", part="rest")
    whole = sum(measured["blocks"]) + measured["rest"]
    return {"block_ratios": [m / p if p else (1.0 if m == 0 else float("inf"))  # (LoRA: frozen blocks hold 0)
                             for m, p in zip(measured["blocks"], blocks)],
            "measured_blocks": measured["blocks"], "predicted_blocks": blocks,
            "measured_bytes": whole, "predicted_bytes": sum(blocks) + rest,
            "ratio": whole / (sum(blocks) + rest)}


def step_peak_check(cfg) -> dict:
    """One real training step of the trainer (its second: the first creates lazy state) with every
    storage followed: parameters + Adam state + the most bytes alive at once during the step,
    against the planner's device peak for the same job, on this rank."""
    trainer = Trainer(cfg)
    try:
        batches = iter(trainer.dataloader)
        trainer.train_state.step = 1
        trainer.train_step(batches)
        trainer.model.state.zero_grad()
        tracker = LiveStorages(peak=True)
        with tracker:
            trainer.train_state.step = 2
            trainer.train_step(batches)
        state = trainer.model.state.state_bytes()
        measured = state["param_bytes"] + state["optim_bytes"] + tracker.peak
        lay, model, args = trainer.layout, trainer.model_family, trainer.args
        predicted = rank_memory(model, args, lay, cfg.training.seq_len, lay.pp_rank)["total_bytes"]
    finally:
        trainer.close()
    return {"measured_bytes": measured, "predicted_bytes": predicted, "ratio": measured / predicted}


def zero_transients_check(cfg, folder: Path) -> dict:
    """ZeRO 0-2 outside the step, on this rank, every storage followed: the most bytes alive while
    the engine is built; the most bytes a synchronous checkpoint save adds to the state; the host
    copies an async save makes; and the most bytes a resume into a freshly built engine adds (its
    optimizer state included) — beside the planner's start-up and checkpoint peaks. The resumed
    engine's weights and optimizer state must equal the saved ones bitwise."""
    trainer = Trainer(cfg)  # the process group, the mesh and the layout
    try:
        lay = trainer.layout

        def build(tracker=None):
            parts = parallelize(trainer.model_family, trainer.args, lay)  # on the meta device
            optimizer = OptimizerFactory(cfg.optimizer, trainer.model_family)
            with tracker or contextlib.nullcontext():
                return parts, materialize(parts, lay, trainer.device, cfg.training.seed, optimizer)

        tracker = LiveStorages(peak=True)
        parts, saved = build(tracker)
        startup = tracker.peak - sum(nbytes(b) for part in parts for b in part.buffers())
        ensure_state(saved.optimizer)
        state = saved.state_bytes()
        gen = torch.Generator().manual_seed(1)  # the same on every rank: replicas stay identical
        with torch.no_grad():  # values a fresh engine does not start from
            for m in saved.weights():
                m.add_(torch.randn(m.shape, generator=gen))
            for t in optimized(saved.optimizer):
                for v in saved.optimizer.state[t].values():
                    if v.dim():  # (not the step, which every piece of a parameter shares)
                        local(v).add_(torch.rand(local(v).shape, generator=gen))
            if cfg.lora.save_base:  # (a frozen base the checkpoint holds: one a fresh engine lacks)
                saved.frozen.add_(torch.randn(saved.frozen.shape, generator=gen))
        saved.publish_params(one_at_a_time=True)
        stateful = {"model": ModelState(saved), "optimizer": OptimizerState(saved)}
        ckpt_cfg = dataclasses.replace(cfg.checkpoint, enable=True, async_mode="off")
        saver = Checkpointer(ckpt_cfg, folder, stateful, {}, None, None)
        with LiveStorages(peak=True) as tracker:
            saver.maybe_save(1, force=True)
        save = tracker.peak
        saver.close()
        staging = HostStaging(pin=False)
        staging.stage({name: part.state_dict() for name, part in stateful.items()})
        fresh = build()[1]
        path = complete_checkpoints(folder)[1]
        loader = Checkpointer(ckpt_cfg, folder, {"model": ModelState(fresh),
                                                 "optimizer": OptimizerState(fresh)},
                              {}, path, read_manifest(path))
        with LiveStorages(peak=True) as tracker:
            loader.load()
        resume = tracker.peak
        loader.close()
        same = torch.equal(saved.flat, fresh.flat) and torch.equal(saved.frozen, fresh.frozen)
        same &= all(torch.equal(a, b) for a, b in zip(saved.weights(), fresh.weights()))
        pairs = zip(optimized(saved.optimizer), optimized(fresh.optimizer))
        same &= all(torch.equal(a, b) for m, n in pairs
                    for a, b in zip(saved.optimizer.state[m].values(), fresh.optimizer.state[n].values()))
        predicted = transient_bytes(trainer.model_family, trainer.args, lay, lay.pp_rank)
    finally:
        trainer.close()
    return {"startup_bytes": startup, "save_added_bytes": save, "staged_bytes": staging.nbytes(),
            "resume_added_bytes": resume, "state_bytes": state, "equal_after_resume": same,
            "predicted": predicted, "elements": saved.total, "frozen_bytes": nbytes(saved.frozen),
            "dp": lay.grad_ranks,
            "shard_elements": saved.shard_starts[-1],
            "bucket_bytes": 4 * max(bucket_elements(lay), *(b - a for a, b in saved.buckets))}
