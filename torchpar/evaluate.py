"""Evaluation: the loss on held-out text, in the same chunks and layout as training."""

from __future__ import annotations

import itertools
import math
import time

import torch

from torchpar.console import progress
from torchpar.data import build_dataloader, loss_masked
from torchpar.loss import cross_entropy_sum, target_count
from torchpar.parallel import compute_context
from torchpar.parallel.context import inputs_and_targets
from torchpar.parallel.zero import full_value


def held_out_loss(trainer) -> float:
    """Mean loss per target token over the first ``validation.steps`` global batches of the
    held-out stream: the same windows at every evaluation and under every layout (with loss
    masks, the assistant's tokens of held-out conversations)."""
    tr, steps = trainer.cfg.training, trainer.cfg.validation.steps
    # Per dp rank and step, local_batch_size x accumulation rows, as in training; run in
    # the chunks training runs (micro-steps, or pipeline microbatches), so that evaluation
    # needs no more memory than a training forward.
    pipeline = trainer.model.pipeline
    lay = trainer.layout
    chunk = lay.microbatch_size if pipeline else tr.local_batch_size
    loader = build_dataloader(trainer.val_source, trainer.tokenizer, tr.seq_len,
                              tr.local_batch_size * lay.accum, lay.dp_rank, lay.dp, tr.seed, 0,
                              trainer.cfg.data.lanes)
    loss_sum, mine = torch.zeros((), device=trainer.device), 0
    with torch.no_grad(), compute_context(trainer.layout):
        for rows in (r for batch in itertools.islice(loader, steps) for r in batch.split(chunk)):
            kwargs = trainer.forward_kwargs(rows)  # from the host copy: no device sync
            mine += target_count(rows)
            rows = rows.to(trainer.device, non_blocking=True)
            inputs, targets = inputs_and_targets(rows, lay)
            if pipeline is not None:
                loss_sum += full_value(pipeline.forward_only(inputs, targets, **kwargs))
            else:
                loss_sum += full_value(cross_entropy_sum(trainer.model.parts[0](inputs, **kwargs), targets))
    targets = trainer.global_targets(mine, loss_masked(trainer.val_source))
    return trainer.global_sum(loss_sum) / float(targets)


def evaluate(trainer) -> None:
    """The held-out loss after this step: kept by the trainer and logged."""
    t0, step = time.perf_counter(), trainer.train_state.step
    with progress(f"the evaluation after step {step}", trainer.rank == 0):
        val_loss = held_out_loss(trainer)
    trainer.val_losses.append((step, val_loss))
    trainer.logger.log({"step": step, "val_loss": val_loss, "val_ppl": math.exp(val_loss),
                        "eval_s": time.perf_counter() - t0})
