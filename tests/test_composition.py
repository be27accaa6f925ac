"""Every feature with every other: the composition matrix (torchpar.tools.matrix) trains cells in
which every pair of values of any two dimensions meets, each against a one-process run of the same
numbers (family, optimizer and its state's dtype, document masking, precision, FP8, loss terms,
evaluation); and each rule of
the composition table (torchpar.composition) refuses a cell that breaks it, before launch, with its
one line.

A cell equals its reference when its losses, held-out losses and final parameters agree within
the layout tables' tolerances (torchpar.selftest.bounds; in fp32 some families' looser: see
tolerances),
its routers' figures agree, and the planner's parameter, gradient and optimizer bytes equal what
each rank held at step 1.
"""

import itertools

import pytest
from harness import ROOT, TINY, assert_matches, bytes_of, run_each, run_layouts

from torchpar.commands import main
from torchpar.composition import DIMENSIONS, RULES, Features, refusals
from torchpar.config import load_config
from torchpar.models.lora import merge_weights
from torchpar.plan import layout_from_config, state_bytes
from torchpar.selftest import bounds
from torchpar.tools import matrix

DOCS = str(ROOT / "tests" / "data" / "short_docs.jsonl")
CELLS = {f"c{i:02d} {matrix.name(cell)}": cell for i, cell in enumerate(matrix.generate(), 1)}
WORLDS = sorted({matrix.cell_job(c)[0] for c in CELLS.values()})
# bf16 rounds every matmul's inputs and a layout rounds at other points (another summation order,
# reductions in fp32 over bf16 pieces): 3 steps of the tiny job stay within the self-test's bf16
# bounds (selftest.bounds). There the sign of a near-zero gradient is noise, which Adam turns into a
# whole step either way (GPT-2's key bias, whose exact gradient is zero, ends 1.3 apart in norm), so
# the matrices are compared in norm, each within 5% of its own (one never updated, or updated from
# another rank's gradient, is 30-100% off after 3 steps); vectors and the routers' choices (a
# near-tie of two experts' scores) are compared in the fp32 cells. A sign optimizer (Rprop) is
# bounded as the self-test bounds it: a last-bit difference flips an element's step. FP8 cells have
# the self-test's bound for scales over other tokens (selftest.FLOAT8_OTHER_SCALES): each rank
# scales its share of the tokens, one process all of them (the FP8 layout table, test_float8.py,
# holds layouts to one process of the same scales).


def tolerances(cell: dict, ref: dict) -> dict:
    """The layout tables' tolerances: the self-test's bounds for the cell's precision and optimizer
    (selftest.bounds, which widen by the drift of moments stored in bf16), and in fp32 with an
    optimizer that moves continuously: GPT-2's token table has rows of rare tokens whose near-zero
    gradients Adam's normalization amplifies (up to 1e-3 with another summation order), as a tied
    table's, which gets its gradient from two paths; Muon orthogonalizes each update, which spreads
    one entry's last-bit difference over its matrix."""
    cfg = load_config(TINY, matrix.reference(cell, DOCS)[1])
    bound = bounds("cpu", cell["precision"], cfg.optimizer, ref, cell["float8"])
    if bound["matrices_in_norm"]:
        return bound
    wider = max(bound["param_tol"], {"gpt2": 1e-4, "llama3-tied": 2e-4}.get(
        cell["family"], 1e-4 if cell["optimizer"] == "muon" else 0))
    if cell["family"] == "gpt2":
        return {**bound, "param_tol": wider, "per_param": {"wte.weight": max(wider, 2e-3)}}
    return {**bound, "param_tol": wider}


def merged(run: dict, overrides: list[str]) -> dict:
    """A LoRA run with its adapters merged into the weights they adapt. Where matrices are compared
    in norm (bf16, FP8), the adapted weight W + (alpha / r) B A is what is held to the bound a
    trained weight is: B starts at zero, so B alone is nothing but its updates, each element of which
    Adam moves by a whole step whatever the sign noise of a near-zero gradient (the same noise a
    trained W carries within its norm)."""
    lora = load_config(TINY, overrides).lora
    return {**run, "params": merge_weights(run["params"], lora.alpha / lora.rank)}


@pytest.fixture(scope="module")
def refs():
    wanted = dict(matrix.reference(cell, DOCS) for cell in CELLS.values())
    return run_layouts(1, wanted)


_RUNS: dict[int, dict] = {}


def runs_of(world: int) -> dict:
    """The cells of ``world`` ranks, trained in one group of processes (once per test session): each
    cell's result, or the one line of the rank that failed in it (the cells after it go on in a new
    group)."""
    if world not in _RUNS:
        table = {n: matrix.cell_job(c, DOCS)[1] for n, c in CELLS.items() if matrix.cell_job(c)[0] == world}
        _RUNS[world] = run_each(world, table)
    return _RUNS[world]


def figures(run: dict, key: str) -> list[float]:
    return [r[key] for r in run["logged"] if key in r]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CELLS))
def test_cell_trains_as_one_process(refs, name):
    cell = CELLS[name]
    world, overrides = matrix.cell_job(cell, DOCS)
    run, ref = runs_of(world)[name], refs[matrix.reference(cell)[0]]
    assert not isinstance(run, str), run
    tol = tolerances(cell, ref)
    if cell["lora"] and tol["matrices_in_norm"]:
        run, ref = merged(run, overrides), merged(ref, overrides)
        if cell["optimizer"] == "muon":
            # Muon gives every singular direction of an update a whole step: A's gradient is B's size
            # in B's first steps, and its weakest directions, below the rounding, get one either way
            # (in fp32 the same cell matches to 1e-4).
            tol = {**tol, "param_tol": 2 * tol["param_tol"]}
    assert_matches(run, ref, **tol)
    for key in ("moe/max_load", "moe/bias_range", "moe/dropped", "loss/balance", "loss/z_loss"):
        assert (key in run["step1"]) == (key in ref["step1"]), key
        if cell["precision"] == "float32" and cell["float8"] == "off":
            assert figures(run, key) == pytest.approx(figures(ref, key), abs=1e-5), key
    lay, model, args = layout_from_config(load_config(TINY, overrides), world)
    for rank in range(world):
        predicted = state_bytes(model, args, lay, lay.rank_coords(rank))
        for key in ("param", "grad", "optim"):
            assert predicted[f"{key}_bytes"] == bytes_of(run, key)[rank], (rank, key)


@pytest.mark.parametrize("rule", range(len(RULES)))
def test_each_rule_refuses_a_cell_before_launch(rule, tmp_path, capfd, monkeypatch):
    """``torchpar train --check`` (run_train.sh's check before torchrun) on the cell that breaks
    only this rule: exit 2, and the rule's line."""
    broken, cell = matrix.refused_cells()[rule]
    assert broken is RULES[rule]
    world, overrides = matrix.cell_job(cell, DOCS)
    monkeypatch.setenv("WORLD_SIZE", str(world))
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--config", str(TINY), "--check", *overrides,
                 "--job.dump_folder", str(tmp_path / "run")]) == 2
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert line == f"torchpar: error: {broken.says(matrix.features(cell))}"


def test_the_cells_hold_every_pair_that_can_run():
    """Every pair of values that some cell can run together is in a cell; each cell runs (no rule
    refuses it, at most MAX_WORLD ranks); every other pair is refused by a rule of its own two
    dimensions."""
    cells = list(CELLS.values())
    held, runnable = matrix.coverage(cells)
    assert held == runnable and runnable > 700
    for cell in cells:
        assert not refusals(matrix.features(cell)) and matrix.cell_job(cell)[0] <= matrix.MAX_WORLD
    everything = [(d, v) for d, values in matrix.VALUES.items() for v in values]
    for a, b in itertools.combinations(everything, 2):
        if a[0] != b[0] and (a, b) not in matrix.runnable_pairs() and (b, a) not in matrix.runnable_pairs():
            assert matrix.pair_refusal(a, b), (a, b)


def test_every_rule_reads_only_its_own_dimensions():
    """The generator reads a rule from its dimensions alone: changing any other dimension of any
    cell never changes whether the rule applies."""
    cells = [*CELLS.values(), *(c for _, c in matrix.refused_cells())]
    for rule, cell in itertools.product(RULES, cells):
        base = rule.applies(matrix.features(cell))
        for dim in set(matrix.VALUES) - set(rule.dims):
            for value in matrix.VALUES[dim]:
                assert rule.applies(matrix.features({**cell, dim: value})) == base, (rule.reason[:40], dim)


def test_the_features_are_the_trainers():
    """A cell's features come from its config as the trainer's check reads them, and every
    dimension of the table has values in the matrix."""
    assert set(matrix.VALUES) == set(DIMENSIONS)
    assert {f for fs in DIMENSIONS.values() for f in fs} | {"device"} == set(Features.__dataclass_fields__)
    cell = next(c for c in CELLS.values() if c["pp"] != "off" and c["tp"] == 2)
    f = matrix.features(cell)
    assert f.pp == 2 and f.tp == 2 and f.schedule == cell["pp"] and f.family in ("llama3", "gpt2", "moe")


def test_the_compatibility_page_is_current():
    written = matrix.docs_path().read_text()
    assert written == matrix.page(), "docs/compatibility.md is stale: run python scripts/compatibility.py"
