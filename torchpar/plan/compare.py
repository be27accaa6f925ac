"""The planner beside a running job: its prediction for exactly this job, logged at step 1 next
to what the trainer measured (``Trainer(cfg, on_first_step=predict_for_trainer)``)."""

from __future__ import annotations

from torchpar.errors import ConfigError
from torchpar.plan.estimate import communication, plan
from torchpar.plan.layout import PRESETS, state_bytes


def check_memory_cap(cfg, lay, model, args) -> None:
    """``training.memory_cap_gib``: refuse a layout whose predicted device peak on its heaviest rank
    exceeds the cap (before any collective)."""
    cap = cfg.training.memory_cap_gib
    if cap <= 0:
        return
    m = plan(model, args, lay, PRESETS["H100-80GB"], cfg.training.seq_len).memory  # (bytes: any device)
    peak = max(m["total_bytes"], m["startup_peak"], m["checkpoint_peak"])
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
