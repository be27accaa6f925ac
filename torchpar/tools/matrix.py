"""The composition matrix: cells of feature values in which every pair of values of any two
dimensions meets at least once, each trained against one process or refused by the table.

    cells = generate()                       # deterministic
    world, overrides = cell_job(cell, docs)  # the config overrides of a cell on the tiny job
    key, overrides = reference(cell, docs)   # the one-process run it is compared with

The dimensions are the composition table's (:data:`torchpar.composition.DIMENSIONS`), each with
the values below. Cells are built greedily, in the manner of AETG: each new cell starts from the
first pair of values no cell has yet (dimensions with more values first), then adds, one at a
time, the value of an open dimension that brings the most pairs not yet covered less what it costs
(:func:`_cost`, at :data:`PAIRS_PER_SECOND`), among the values the table lets run beside those
already chosen (a cell grows beyond 4 ranks only for a pair that needs more) — so every cell
runs, and every pair that some runnable cell can hold is held by one. A pair no runnable cell can
hold is refused by the table: :func:`pair_refusal` names its rule. For each rule,
:func:`refused_cells` gives one cell that breaks it and no other, which the trainer must refuse
before launch with the rule's line.

A cell is the self-test's tiny job (``assets/selftest.toml``) on 2 ranks its ZeRO stage shards
over (dp_shard 2, or the context-parallel pair; HSDP: 2 replicas of those), times 2 for each of
tp, pp and cp, at most :data:`MAX_WORLD` ranks; 4 layers, a global batch of 8 sequences, 3 steps.
"""

from __future__ import annotations

import functools
import itertools
from pathlib import Path

from torchpar.composition import DIMENSIONS, RULES, Features, Rule
from torchpar.config import load_config
from torchpar.preflight import features_of
from torchpar.selftest import BASE

# Every dimension's values; the first is the plain job's (what a cell leaves a dimension at when
# nothing else is asked of it).
VALUES: dict[str, tuple] = {
    "family": ("llama3", "gpt2", "moe", "moe-deepseek", "llama3-tied", "moe-gptoss"),
    "optimizer": ("adamw", "muon", "adafactor", "torch.optim.SGD", "torch.optim.Rprop"),
    "optimizer_state": ("float32", "bfloat16"),
    "zero": (0, 1, 2, 3, "hsdp"),
    "tp": (1, 2),
    "pp": ("off", "1F1B", "Interleaved1F1B", "ZBVZeroBubble"),
    "cp": ("off", "alltoall", "ring"),
    "ep": (1, 2),
    "recompute": ("none", "selective", "full", "every2"),
    "compile": (False, True),
    "document_masking": (False, True),
    "data_format": ("text", "chat"),
    "precision": ("float32", "bfloat16"),
    "float8": ("off", "tensorwise", "rowwise"),
    "offload": (False, True),
    "loss_terms": (False, True),
    "accumulation": (False, True),
    "evaluation": (False, True),
    "lora": (False, True),
}
assert tuple(VALUES) == tuple(DIMENSIONS), "the matrix's dimensions are the composition table's"
MAX_WORLD = 8  # the most ranks a cell starts (tiny models: 8 processes share this machine's cores)
STEPS = 3
# The greedy's exchange rate: a value costing a second more must bring this many more new pairs.
PAIRS_PER_SECOND = 0.3
GLOBAL_BATCH = 8
# What the one-process run a cell is compared with shares with it: the dimensions that change the
# numbers (the others are how the same numbers are computed).
REFERENCE_DIMS = ("family", "optimizer", "optimizer_state", "document_masking", "data_format", "precision",
                  "float8", "loss_terms", "evaluation", "lora")

Cell = dict  # dimension -> value


def _data_parallel(cell: Cell) -> tuple[int, int]:
    """(dp_replicate, dp_shard) of a cell: the ZeRO stage shards over 2 ranks — dp_shard 2, or the
    2 ranks of a context-parallel group (ZeRO shards over dp_shard x cp) unless experts need shard
    ranks of their own — and HSDP replicates that twice."""
    shard = 1 if cell.get("cp", "off") != "off" and cell.get("ep", 1) == 1 else 2
    return (2 if cell.get("zero") == "hsdp" else 1), shard


def _world(cell: Cell) -> int:
    replicas, shard = _data_parallel(cell)
    return replicas * shard * (2 if cell.get("tp", 1) == 2 else 1) * (
        2 if cell.get("pp", "off") != "off" else 1) * (2 if cell.get("cp", "off") != "off" else 1)


def _model(family: str, loss_terms: bool) -> list[str]:
    out = {"llama3": [], "llama3-tied": ["--model.flavor", "debug-tied"], "gpt2": ["--model.name", "gpt2"],
           "moe": ["--model.name", "moe"],
           # gpt-oss: biased routers and experts with the clamped SwiGLU; attention sinks and biases,
           # YaRN, and a window of 16 keys in every other layer
           "moe-gptoss": ["--model.name", "gpt_oss"],
           # DeepSeek-V3's parts: latent attention, group-limited routing with its bias, and one
           # multi-token prediction depth
           "moe-deepseek": ["--model.name", "deepseek_v3", "--model.bias_rate", "0.01",
                            "--model.mtp_depth", "1"]}[family]
    out += ["--model.n_layers", "4"]  # (enough for 2 x 2 pipeline stages; the flavours' shapes otherwise)
    if loss_terms:  # the z-loss, and a mixture of experts' auxiliary balance term
        out += ["--loss.z_loss", "1e-3"] + (["--model.balance_coeff", "0.01"] if family.startswith("moe")
                                            else [])
    return out


def _numbers(cell: Cell, docs: str) -> list[str]:
    """The overrides of the dimensions a one-process reference shares (see REFERENCE_DIMS)."""
    out = _model(cell["family"], cell["loss_terms"])
    out += {"adamw": [], "muon": ["--optimizer.name", "muon"], "adafactor": ["--optimizer.name", "adafactor"],
            "torch.optim.SGD": ["--optimizer.name", "torch.optim.SGD", "--optimizer.kwargs", "momentum=0.9",
                                "--optimizer.lr", "0.05"],
            "torch.optim.Rprop": ["--optimizer.name", "torch.optim.Rprop"]}[cell["optimizer"]]
    out += ["--optimizer.state_dtype", cell["optimizer_state"]]
    if cell["data_format"] == "chat":  # conversations of one exchange (short_chat.jsonl beside docs)
        chats = str(Path(docs).with_name("short_chat.jsonl"))
        out += ["--data.dataset", "files", "--data.format", "chat", "--data.path", chats, "--validation.path",
                chats, "--model.vocab_size", "4104"]  # (the llama3 template's markers follow BOS and EOS)
    elif cell["document_masking"]:  # short documents: most windows hold several
        out += ["--data.dataset", "files", "--data.path", docs, "--validation.path", docs]
    if cell["document_masking"]:
        out += ["--data.document_masking", "true"]
    out += ["--training.mixed_precision_param", cell["precision"]]
    if cell["float8"] != "off":  # every block's linear layer and routed experts but the routers and
        # the debug flavours' 8-wide rotary key projections (FP8 takes multiples of 16)
        out += ["--quantize.float8", cell["float8"], "--quantize.skip_small", "false", "--quantize.exclude",
                "*.gate,*.wk_rope"]
    if cell["evaluation"]:
        out += ["--validation.enable", "true", "--validation.freq", "2", "--validation.steps", "2"]
    if cell["lora"]:  # adapters on every block's linear layer but the routers, the rest frozen
        out += ["--lora.rank", "4", "--lora.alpha", "8"]
    return out + ["--training.steps", str(STEPS), "--training.global_batch_size", str(GLOBAL_BATCH)]


def cell_job(cell: Cell, docs: str = "short_docs.jsonl") -> tuple[int, list[str]]:
    """(ranks, config overrides on the self-test's job) of a cell; ``docs``: a .jsonl of short
    documents for document masking, with short_chat.jsonl beside it for conversations (what it
    reads; the default names one for the checks alone)."""
    world = _world(cell)
    zero = cell["zero"]
    replicas, shard = _data_parallel(cell)
    local = GLOBAL_BATCH // (replicas * shard) // (2 if cell["accumulation"] else 1)
    out = _numbers(cell, docs)
    out += ["--parallelism.zero_stage", "3" if zero == "hsdp" else str(zero),
            "--parallelism.data_parallel_replicate_degree", str(replicas),
            "--parallelism.data_parallel_shard_degree", str(shard), "--training.local_batch_size", str(local)]
    if cell["tp"] == 2:
        out += ["--parallelism.tensor_parallel_degree", "2"]  # (sequence and loss parallel: the default)
    if cell["pp"] != "off":
        out += ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
                cell["pp"]]
    if cell["cp"] != "off":
        out += ["--parallelism.context_parallel_degree", "2", "--parallelism.context_parallel_method",
                cell["cp"]]
    if cell["ep"] == 2:
        out += ["--parallelism.expert_parallel_degree", "2"]
    recompute = {"none": [], "selective": ["--training.activation_checkpoint", "selective"],
                 "full": ["--training.activation_checkpoint", "full"],
                 "every2": ["--training.activation_checkpoint", "full",
                            "--training.activation_checkpoint_every", "2"]}[cell["recompute"]]
    out += recompute + ["--training.compile", str(cell["compile"]).lower(),
                        "--parallelism.cpu_offload", str(cell["offload"]).lower()]
    return world, out


def reference(cell: Cell, docs: str = "short_docs.jsonl") -> tuple[str, list[str]]:
    """(name, overrides) of the one-process run a cell is compared with: the same numbers, the
    whole batch in one micro-step."""
    key = "ref/" + "/".join(f"{cell[d]}" for d in REFERENCE_DIMS)
    return key, _numbers(cell, docs) + ["--parallelism.zero_stage", "0", "--training.local_batch_size",
                                        str(GLOBAL_BATCH)]


def name(cell: Cell) -> str:
    """The cell's values that differ from the plain job's, e.g. 'gpt2 muon zero=3 tp=2 compile'."""
    parts = []
    for d, v in cell.items():
        if v == VALUES[d][0]:
            continue
        parts.append(d if v is True else f"{d}={v}" if d in ("zero", "tp", "pp", "cp", "ep", "recompute")
                     else str(v))
    return " ".join(parts) or "plain"


# ------------------------------------------------------------------ what runs


def _full(cell: Cell) -> Cell:
    return {d: cell.get(d, vs[0]) for d, vs in VALUES.items()}


@functools.lru_cache(maxsize=None)
def _features(items: tuple) -> Features:
    cell = _full(dict(items))
    world, overrides = cell_job(cell)
    return features_of(load_config(BASE, overrides), world, device="cpu")


def features(cell: Cell) -> Features:
    """The features the trainer's check reads of ``cell`` (unset dimensions at their first value)."""
    return _features(tuple(_full(cell).items()))


def _breaks(rule: Rule, cell: Cell) -> bool:
    """Whether ``rule`` refuses ``cell``, read from the rule's own dimensions only (every rule reads
    no other: a test holds it to that), the rest at their first values."""
    return _rule_breaks(_INDEX[id(rule)], tuple(cell[d] for d in rule.dims))


_INDEX = {id(rule): i for i, rule in enumerate(RULES)}


@functools.lru_cache(maxsize=None)
def _rule_breaks(rule: int, values: tuple) -> bool:
    return RULES[rule].applies(features(dict(zip(RULES[rule].dims, values))))


def _runs(cell: Cell, but: Rule | None = None) -> bool:
    """The (partial) cell fits MAX_WORLD and breaks no rule (but ``but``) whose dimensions it sets."""
    return _world(cell) <= MAX_WORLD and not any(
        _breaks(rule, cell) for rule in RULES if rule is not but and all(d in cell for d in rule.dims))


def _complete(cell: Cell, order: list[str], but: Rule | None = None) -> Cell | None:
    """A completion of ``cell`` that runs (or that breaks no rule but ``but``), depth first, values
    in order; None if there is none."""
    todo = [d for d in order if d not in cell]
    if not todo:
        return dict(cell)
    d = todo[0]
    for v in VALUES[d]:
        trial = {**cell, d: v}
        if _runs(trial, but):
            done = _complete(trial, order, but)
            if done is not None:
                return done
    return None


def _pairs() -> list[tuple[tuple[str, object], tuple[str, object]]]:
    dims = sorted(VALUES, key=lambda d: -len(VALUES[d]))  # (stable: the table's order on a tie)
    return [((a, va), (b, vb)) for a, b in itertools.combinations(dims, 2)
            for va in VALUES[a] for vb in VALUES[b]]


@functools.lru_cache(maxsize=None)
def runnable_pairs() -> tuple:
    """Every pair of values some runnable cell holds."""
    order = sorted(VALUES, key=lambda d: -len(VALUES[d]))
    return tuple(p for p in _pairs() if _complete(dict(p), order) is not None)


def _cost(cell: Cell) -> float:
    """Roughly the seconds a cell costs here (measured on 2 cores): its ranks' steps, more in bf16
    (slow matmuls on CPUs) and with offload, and most with compile (a first compile of each block
    kind takes 10-40 s in a group of 2 processes, on their shared cores; 4 take twice as long)."""
    world = _world(cell)
    steps = {2: 1.5, 4: 3.0, 8: 8.0}.get(world, world)
    steps *= (1.5 if cell.get("precision") == "bfloat16" else 1) * (1.5 if cell.get("offload") else 1)
    if cell.get("compile"):  # (every rank compiles, on the machine's shared cores)
        steps += (25 if str(cell.get("family", "")).startswith("moe") else 15) * world / 2
    return steps


@functools.lru_cache(maxsize=None)
def _generate() -> tuple:
    order = sorted(VALUES, key=lambda d: -len(VALUES[d]))
    todo = list(runnable_pairs())
    left = set(todo)
    cells = []
    while left:
        first = next(p for p in todo if p in left)
        cell = dict(first)
        # (beyond 4 ranks only for a pair that needs more, e.g. HSDP and tp: the larger worlds cost most)
        ranks = max(4, _world(_complete(cell, order)))
        while len(cell) < len(VALUES):
            best = None  # (score, dimension, value): the most new pairs, then the cheapest
            for d in (d for d in order if d not in cell):
                for i, v in enumerate(VALUES[d]):
                    trial = {**cell, d: v}
                    if _world(trial) > ranks or not _runs(trial):
                        continue
                    gain = sum(((a, cell[a]), (d, v)) in left or ((d, v), (a, cell[a])) in left
                               for a in cell)
                    score = (gain - PAIRS_PER_SECOND * _cost(trial), -i)
                    if (best is None or score > best[0]) and _complete(trial, order) is not None:
                        best = (score, d, v)
            cell[best[1]] = best[2]
        cell = {d: cell[d] for d in VALUES}
        left -= {p for p in itertools.combinations(((d, cell[d]) for d in order), 2)}
        cells.append(cell)
    return tuple(tuple(c.items()) for c in cells)


def generate() -> list[Cell]:
    """The cells, in the order they were built (deterministic)."""
    return [dict(c) for c in _generate()]


def coverage(cells: list[Cell]) -> tuple[int, int]:
    """(runnable pairs the cells hold, runnable pairs)."""
    held = {p for c in cells for p in itertools.combinations(((d, c[d]) for d in VALUES), 2)}
    held |= {(b, a) for a, b in held}
    pairs = runnable_pairs()
    return sum(p in held for p in pairs), len(pairs)


def pair_refusal(a: tuple[str, object], b: tuple[str, object]) -> list[Rule]:
    """The rules that keep values ``a`` and ``b`` apart in every cell (empty: some cell runs them):
    the first rule of these two dimensions that refuses them; else the rules that refuse them beside
    each value of a third dimension (adafactor and ep 2: ep needs ZeRO-3, which adafactor refuses)."""
    if (a, b) in runnable_pairs() or (b, a) in runnable_pairs():
        return []
    cell = dict([a, b])

    def first(trial: Cell) -> Rule | None:
        return next((r for r in RULES if set(r.dims) <= set(trial) and _breaks(r, trial)), None)

    if first(cell) is not None:
        return [first(cell)]
    for d in VALUES:
        if d not in cell:
            hits = [first({**cell, d: v}) for v in VALUES[d]]
            if all(hits):
                return list(dict.fromkeys(hits))
    raise AssertionError(f"{a} and {b} never run together, and no rule says why")


def refused_cells() -> list[tuple[Rule, Cell]]:
    """For each rule, one cell that breaks it and no other rule (within MAX_WORLD): the first values
    of its dimensions that it refuses, the rest the first that run beside them."""
    order = sorted(VALUES, key=lambda d: -len(VALUES[d]))
    out = []
    for rule in RULES:
        for values in itertools.product(*(VALUES[d] for d in rule.dims)):
            start = dict(zip(rule.dims, values))
            if _breaks(rule, start) and _runs(start, but=rule):
                cell = _complete(start, order, but=rule)
                if cell is not None:
                    out.append((rule, {d: cell[d] for d in VALUES}))
                    break
        else:
            raise AssertionError(f"no cell breaks the rule {rule.reason[:60]!r} alone")
    return out


def _label(d: str, v) -> str:
    return f"{d}={str(v).lower() if isinstance(v, bool) else v}"


def page() -> str:
    """docs/compatibility.md: the table of refusals, the cells, and every pair of values: the cell
    that trains it (✔) or the rule that refuses it (✘). ``scripts/compatibility.py`` writes it."""
    cells = generate()
    held, runnable = coverage(cells)
    values = [(d, v) for d, vs in VALUES.items() for v in vs]
    first = {}
    for i, c in enumerate(cells, 1):
        for p in itertools.combinations(((d, c[d]) for d in VALUES), 2):
            first.setdefault(p, i)
            first.setdefault(p[::-1], i)
    index = {id(rule): i for i, rule in enumerate(RULES, 1)}
    lines = [
        "# Compatibility: every feature with every other",
        "",
        "<!-- Written by `python scripts/compatibility.py` from the composition table",
        "     (torchpar/composition.py) and the matrix (torchpar/tools/matrix.py); a test fails when it is",
        "     stale. -->",
        "",
        "Every feature is a value on a dimension. Any values run together and train what one process",
        "trains, except where a rule of the composition table says otherwise; the trainer's check before",
        "launch, the planner's search and `parallelism.layout = \"auto\"` read the same table.",
        "",
        f"The matrix: {len(cells)} cells, built greedily so that every pair of values of any two dimensions",
        f"that can run together meets in at least one cell ({held} of {runnable} pairs: "
        f"{100 * held / runnable:.0f}%). `tests/test_composition.py` trains each",
        "cell on the tiny job (3 steps, a global batch of 8 sequences of 32 tokens) against a one-process",
        "run of the same numbers: losses, held-out losses and final parameters within the layout tables'",
        "tolerances, the routers' figures, and the planner's bytes on every rank equal to the measured ones.",
        "Each rule also refuses a cell that breaks it alone, before launch, with its line.",
        "",
        "## What does not run together",
        "",
        "| rule | dimensions | why (the line the trainer prints) |",
        "|---|---|---|",
    ]
    for i, rule in enumerate(RULES, 1):
        reason = rule.reason.replace("{", "<").replace("}", ">").replace("|", "/")
        lines.append(f"| R{i} | {', '.join(rule.dims)} | {reason} |")
    lines += ["", "## The dimensions", "", "| dimension | values (the first: the plain job's) |", "|---|---|"]
    lines += [f"| {d} | {', '.join(f'`{_label(d, v)}`' for v in vs)} |" for d, vs in VALUES.items()]
    lines += ["", "## The cells", "", "| cell | ranks | values other than the plain job's |", "|---|---|---|"]
    lines += [f"| {i} | {cell_job(c)[0]} | {name(c)} |" for i, c in enumerate(cells, 1)]
    lines += ["", "## Every pair", "",
              "A number is the cell that trains the pair (✔); R*n* the rule that refuses it (✘).", ""]
    short = [f"{d[:4]}={str(v)[:6]}" for d, v in values]
    lines.append("| | " + " | ".join(short) + " |")
    lines.append("|---" * (len(values) + 1) + "|")
    for a, label in zip(values, short):
        row = []
        for b in values:
            if a[0] == b[0]:
                row.append("")
            elif (a, b) in first:
                row.append(str(first[(a, b)]))
            else:
                row.append("✘" + "+".join(f"R{index[id(r)]}" for r in pair_refusal(a, b)))
        lines.append(f"| **{label}** | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def docs_path() -> Path:
    """The page :func:`page` writes (``scripts/compatibility.py``)."""
    return Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
