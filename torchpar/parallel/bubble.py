"""Bubble accounting of a pipeline schedule, from torch's own action order.

Cost model: every stage has the same cost per microbatch; forward F = 1 time unit, a full
backward B = 2 (backward costs twice the forward), which zero-bubble schedules split into an
input-gradient half I = 1 and a weight-gradient half W = 1. Sends are free and instant. Each
rank runs its actions in torch's order, each as soon as its inputs exist:
F(s, m) after F(s-1, m); B or I(s, m) after F(s, m) and B/I(s+1, m); W(s, m) after I(s, m).
A rank's bubble is its idle time over the makespan. For GPipe and 1F1B this gives
(p-1)/(m+p-1); interleaving v stages per rank gives (p-1)/(v·m+p-1). The pictures and the
``torchpar schedule`` command are in ``torchpar.tools.schedule``.
"""

from __future__ import annotations

COST = {"F": 1, "B": 2, "I": 1, "W": 1}


def compute_actions(order: dict[int, list]) -> dict[int, list[tuple[str, int, int]]]:
    """rank -> [(kind, stage, microbatch)] of compute actions, comms and idle slots dropped."""
    out = {}
    for rank, actions in order.items():
        seq = []
        for a in actions:
            if a is None:
                continue
            for sub in (a.sub_actions or (a,)):
                kind = sub.computation_type.value
                if kind in COST:
                    seq.append((kind, sub.stage_index, sub.microbatch_index))
        out[rank] = seq
    return out


def single_stage_actions(name: str, pp: int, n: int) -> dict[int, list[tuple[str, int, int]]]:
    """The order torch's GPipe / 1F1B runtime loops execute (``_step_microbatches``).

    Their ``pipeline_order`` is only a drawing aid and in torch 2.13 mislabels 1F1B's
    microbatches (the last rank starts at F1), so the order is rebuilt from the runtime's rule:
    1F1B warms up with min(n, p - r) forwards, then alternates backward/forward, then drains.
    """
    out = {}
    for r in range(pp):
        if name == "GPipe":
            out[r] = [("F", r, m) for m in range(n)] + [("B", r, m) for m in range(n)]
            continue
        warmup = min(n, pp - r)
        seq = [("F", r, m) for m in range(warmup)]
        fwd, bwd = warmup, 0
        while bwd < n:
            seq.append(("B", r, bwd))
            bwd += 1
            if fwd < n:
                seq.append(("F", r, fwd))
                fwd += 1
        out[r] = seq
    return out


def schedule_actions(
    name: str, order: dict[int, list], pp: int, n: int
) -> dict[int, list[tuple[str, int, int]]]:
    """Compute actions per rank for a schedule: torch's order, or the runtime rule (GPipe/1F1B)."""
    return single_stage_actions(name, pp, n) if name in ("GPipe", "1F1B") else compute_actions(order)


def simulate(actions: dict[int, list[tuple[str, int, int]]], num_stages: int,
             cost: dict | None = None) -> dict:
    """Start/end of every action under the cost model (``cost``: another time per kind); per-rank
    and overall bubble."""
    cost = cost or COST
    done: dict[tuple[str, int, int], float] = {}
    free = {r: 0.0 for r in actions}
    nxt = {r: 0 for r in actions}
    timeline: dict[int, list[tuple[float, float, str, int, int]]] = {r: [] for r in actions}

    def deps(kind: str, s: int, m: int) -> list[tuple[str, int, int]]:
        if kind == "F":
            return [("F", s - 1, m)] if s > 0 else []
        if kind in ("B", "I"):
            return [("F", s, m)] + ([] if s == num_stages - 1 else [("grad", s + 1, m)])
        return [("I", s, m)]

    remaining = sum(len(v) for v in actions.values())
    while remaining:
        progressed = False
        for r, seq in actions.items():
            while nxt[r] < len(seq):
                kind, s, m = seq[nxt[r]]
                need = deps(kind, s, m)
                if any(d not in done for d in need):
                    break
                start = max([free[r]] + [done[d] for d in need])
                end = start + cost[kind]
                done[(kind, s, m)] = end
                if kind in ("B", "I"):
                    done[("grad", s, m)] = end  # the input gradient the previous stage waits for
                free[r] = end
                timeline[r].append((start, end, kind, s, m))
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: seq[nxt[r]] for r, seq in actions.items() if nxt[r] < len(seq)}
            raise ValueError(f"the action order deadlocks under the cost model; next actions: {stuck}")
    makespan = max(free.values())
    busy = {r: sum(e - s for s, e, *_ in timeline[r]) for r in actions}
    per_rank = {r: 1.0 - busy[r] / makespan for r in actions}
    return {"timeline": timeline, "makespan": makespan, "bubble_per_rank": per_rank,
            "bubble": sum(per_rank.values()) / len(per_rank)}


def bubble_report(actions: dict[int, list], num_stages: int) -> str:
    sim = simulate(actions, num_stages)
    ranks = ", ".join(f"rank {r} {100 * b:.1f}%" for r, b in sorted(sim["bubble_per_rank"].items()))
    return f"bubble {100 * sim['bubble']:.2f}% of the step (F=1, B=2, I=W=1 cost model; {ranks})"
