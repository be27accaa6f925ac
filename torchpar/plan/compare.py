"""The planner beside a running job: its prediction for exactly this job, logged at step 1 next
to what the trainer measured (``Trainer(cfg, on_first_step=predict_for_trainer)``)."""

from __future__ import annotations

import torch

from torchpar.console import warn
from torchpar.errors import ConfigError
from torchpar.plan.communication import communication
from torchpar.plan.estimate import device_peak, plan
from torchpar.plan.layout import PRESETS, state_bytes
from torchpar.plan.probe import cluster_of, probe


def check_memory_cap(cfg, lay, model, args) -> None:
    """``training.memory_cap_gib``: refuse a layout whose predicted device peak on its heaviest rank
    exceeds the cap (before any collective)."""
    cap = cfg.training.memory_cap_gib
    if cap <= 0:
        return
    m = plan(model, args, lay, PRESETS["H100-80GB"], cfg.training.seq_len).memory  # (bytes: any device)
    peak = device_peak(m)
    if peak > cap * 2**30:
        state = m["param_bytes"] + m["grad_bytes"] + m["optim_bytes"]
        raise ConfigError(
            f"training.memory_cap_gib = {cap:g}: this layout needs {peak / 2**30:.2f} GiB on its heaviest "
            f"rank (activations {m['activation_bytes'] / 2**30:.2f}, logits {m['logits_bytes'] / 2**30:.2f}, "
            f"state {state / 2**30:.2f}); split each sequence over "
            "more ranks (parallelism.context_parallel_degree), recompute (training.activation_checkpoint), "
            "shard more, or raise the cap")


def predict_for_trainer(trainer, measured: dict) -> dict:
    """Each rank's predicted state bytes and the predicted device peak (state + activations +
    transients) of the heaviest rank, as metrics; rank 0 prints its own against ``measured``.
    A pipeline's schedule is read from the running job (no process group is made inside it)."""
    lay, model, args = trainer.layout, trainer.model_family, trainer.args
    pipeline = trainer.model.pipeline
    actions = pipeline.actions() if pipeline else None
    per_rank = [state_bytes(model, args, lay, lay.rank_coords(r)) for r in range(lay.world)]
    peak = plan(model, args, lay, PRESETS["H100-80GB"], trainer.cfg.training.seq_len,
                actions=actions).memory["total_bytes"]
    out = {f"predicted_{k}_per_rank": [r[k] for r in per_rank] for k in per_rank[0]}
    out["predicted_peak_bytes"] = peak
    # What rank 0 (the logging rank) sends per step, for metrics.log_communication's measurement.
    comm = communication(model, args, lay, PRESETS["H100-80GB"], trainer.cfg.training.seq_len,
                         lay.rank_coords(0).get("pp", 0))
    out.update({f"predicted_comm_{dim}_bytes": c["bytes"] for dim, c in comm.items()})
    out["predicted_comm_bytes"] = sum(c["bytes"] for c in comm.values())
    if trainer.rank == 0:
        def mib(d):
            return "/".join(f"{d[k] / 2**20:.2f}" for k in ("param_bytes", "grad_bytes", "optim_bytes"))

        print(f"planner: rank 0 params/grads/optimizer predicted {mib(per_rank[0])} MiB, measured "
              f"{mib(measured)} MiB; predicted device peak {peak / 2**30:.3f} GiB", flush=True)
    return out


TERMS = ("compute", "bubble", "communication")


def step_terms(p) -> dict[str, float]:
    """A plan's step time in three terms: compute (recomputation and the optimizer's matmuls
    included), the pipeline bubble, and the communication the step waits for."""
    return {"compute": p.compute_s, "bubble": p.bubble_s,
            "communication": p.step_s - p.compute_s - p.bubble_s}


def measured_terms(record: dict, step_s: float) -> dict[str, float]:
    """The same terms from a logged step's breakdown: the bubble is the pipeline's measured share
    of the step; communication the time inside collectives where the ledger timed them
    (metrics.log_communication), else the gradient reduction and clipping phase (what the step
    waits for after backward; ZeRO-3's, TP's and CP's collectives then count as compute); compute
    the rest."""
    bubble = record.get("pp_bubble", 0.0) * step_s
    timed = [v for k, v in record.items() if k.startswith("comm_") and k.endswith("_s")]
    comm = sum(timed) if timed else record.get("time_reduce_clip_s", 0.0)
    return {"compute": step_s - bubble - comm, "bubble": bubble, "communication": comm}


class StepCheck:
    """The planner's step time for this job on this machine beside the measured one, on every
    logged step after the run's first (``Trainer(on_logged_step=check, on_process_group=check.probe)``);
    one warning when they differ by more than ``metrics.prediction_margin``, naming the term that
    is off most. The machine is the probe's: ``figures``, or :meth:`probe`'s before the model is
    built; without either nothing is predicted."""

    def __init__(self, figures: dict | None = None):
        self.figures, self.plan, self.warned, self.first = figures, None, False, None

    def probe(self, cfg, lay, model, args) -> None:
        """This machine's figures for the job (cached per cluster; a collective: every rank calls it)."""
        if self.figures is None:
            self.figures = probe(getattr(torch, lay.param_dtype), model, args, cfg.training.seq_len,
                                 memory_cap_gib=cfg.training.memory_cap_gib)

    def __call__(self, trainer, record: dict) -> dict:
        if self.figures is None:
            return {}
        if self.plan is None:
            pipeline = trainer.model.pipeline
            actions = pipeline.actions() if pipeline else None
            self.plan = plan(trainer.model_family, trainer.args, trainer.layout, cluster_of(self.figures),
                             trainer.cfg.training.seq_len, 1.0, actions=actions)
            self.first = record["step"]
        predicted = step_terms(self.plan)
        out = {"predicted_step_s": self.plan.step_s,
               **{f"predicted_{k}_s": v for k, v in predicted.items()}}
        if record["step"] == self.first or "step_s" not in record:
            return out  # the run's first step warms up (and compiles)
        step_s = record["step_s"]
        measured = measured_terms(record, step_s)
        out.update(measured_step_s=step_s, **{f"measured_{k}_s": v for k, v in measured.items()})
        margin = trainer.cfg.metrics.prediction_margin
        ratio = step_s / self.plan.step_s
        if margin and not self.warned and max(ratio, 1 / ratio) - 1 > margin:
            self.warned = True
            term = max(TERMS, key=lambda k: abs(measured[k] - predicted[k]))
            split = "" if any(k.startswith("comm_") for k in record) else (
                " (collectives inside forward and backward count as compute here: "
                "metrics.log_communication = true times them apart)")
            if trainer.rank == 0:
                warn(f"step {record['step']}: measured {step_s:.3f} s a step, the planner predicted "
                     f"{self.plan.step_s:.3f} s for this machine (a factor of {max(ratio, 1 / ratio):.2f}, "
                     f"beyond metrics.prediction_margin = {margin:g}); most of it is {term}: measured "
                     f"{measured[term]:.3f} s, predicted {predicted[term]:.3f} s{split}")
        return out
