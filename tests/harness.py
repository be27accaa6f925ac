"""What the tests share: the repository root, the tiny job every layout trains (the self-test's
own), and the comparison of a layout's run with one process.

``run_layouts(world, {name: overrides})`` and ``spawn_ranks`` are ``torchpar.selftest``'s: the
tests and ``torchpar selftest`` start and compare their processes with the same code.
"""

from __future__ import annotations

from pathlib import Path

from torchpar.selftest import BASE as TINY  # noqa: F401 (re-exported, like the names below)
from torchpar.selftest import NATIVE_ERROR, free_port, run_each, run_group, run_layouts, spawn_ranks  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
# Final fp32 parameters of a layout against one process, after a few Adam steps: another summation
# order changes gradients in their last bits, and Adam's normalization turns that into up to about
# 1e-5 on entries whose gradient is near zero (lr 2e-3; 7.7e-6 here for tp 2). The CI machine, whose
# GEMM kernels differ from this one's, reached 1.1e-5 on one attention output matrix under TP and
# ring CP (losses within 1e-5): 2e-5 bounds it with room, two orders below a real error (a lost
# gradient, a wrong shard), which the tables see at 1e-3 and above.
PARAM_TOL = 2e-5
# The layout and checkpoint tables' model depth: four layers hold every kind of parameter a layer
# has and split into 2 x 2 pipeline stages, and the self-test job's eight cost each run about a
# third more. A layout that needs more stages says so.
LAYERS = ["--model.n_layers", "4"]


def assert_matches(run: dict, ref: dict, tol: float = 1e-5, param_tol: float | None = None,
                   per_param: dict[str, float] | None = None, matrices_in_norm: bool = False) -> None:
    """Losses and held-out losses within ``tol``; final parameters within ``param_tol`` (default
    ``tol``), or the tolerance ``per_param`` gives a parameter by name; with ``matrices_in_norm``,
    each matrix's difference in norm relative to its norm, and vectors not compared (see the bf16
    tolerance in test_composition.py)."""
    param_tol = tol if param_tol is None else param_tol
    assert len(run["losses"]) == len(ref["losses"])
    dl = max(abs(a - b) for a, b in zip(run["losses"], ref["losses"]))
    assert dl <= tol, f"losses differ by {dl:.2e}: {run['losses']} vs {ref['losses']}"
    assert run["params"].keys() == ref["params"].keys(), set(run["params"]) ^ set(ref["params"])
    for k, want in ref["params"].items():
        diff = run["params"][k] - want
        if not matrices_in_norm:
            dp = diff.abs().max().item()
        elif want.dim() >= 2:
            dp = (diff.norm() / want.norm()).item()
        else:
            continue
        assert dp <= (per_param or {}).get(k, param_tol), f"final parameter {k} differs by {dp:.2e}"
    assert [s for s, _ in run["val_losses"]] == [s for s, _ in ref["val_losses"]], "evaluated at other steps"
    for (step, a), (_, b) in zip(run["val_losses"], ref["val_losses"]):
        assert abs(a - b) <= tol, f"held-out loss at step {step} differs: {a} vs {b}"


def bytes_of(run: dict, key: str) -> list[int]:
    """Each rank's ``key`` (param / grad / optim) bytes at step 1 of a layout's run."""
    return run["step1"][f"{key}_bytes_per_rank"]
