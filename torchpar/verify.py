"""The planner held against measurement: the activation bytes the real model keeps for backward,
block by block, and the peak of a real training step of the trainer, each beside the planner's
prediction for the same job on this rank. It sits above the trainer and the planner, which never
import it.
"""

from __future__ import annotations

import torch

from torchpar.loss import cross_entropy_sum
from torchpar.parallel import _local_part, compute_context, parallelize
from torchpar.parallel.recompute import recomputed
from torchpar.plan.activations import LiveStorages, held_bytes, tagged
from torchpar.plan.estimate import rank_memory
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
    with tagged(tracker, tags), compute_context(lay), tracker:
        loss = cross_entropy_sum(module(tokens[:, :-1]), tokens[:, 1:])
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
                         policy if recomputed(i, policy, lay.activation_checkpoint_every) else "none")
              for i in range(args.n_layers)]
    rest = held_bytes(model, args, lay, batch, seq, "none", part="rest")
    whole = sum(measured["blocks"]) + measured["rest"]
    return {"block_ratios": [m / p for m, p in zip(measured["blocks"], blocks)],
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
