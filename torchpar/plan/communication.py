"""One layout's communication: what each rank sends per step through each mesh dimension, how
long that takes on a cluster (datasheet bandwidths, or a probed machine's latency and bandwidth per
collective), and how much of it the step waits for."""

from __future__ import annotations

import functools
import itertools
import math

from torchpar.fault_tolerance import tag_bytes
from torchpar.models.common import WHOLE_STYLES, planned_under
from torchpar.models.lora import first_adapted_block, is_adapter
from torchpar.models.lora import spec as lora_spec
from torchpar.optim import PARAM_GROUPS, kind_of, param_role, update_flops
from torchpar.parallel.flat import flat_shards
from torchpar.parallel.float8 import gathered_in_float8
from torchpar.parallel.layout import (
    Layout,
    block_entries,
    expert_names,
    rank_param_names,
    rank_params,
    split_of,
    stage_entries,
    trained,
)
from torchpar.parallel.ledger import RING_FACTOR
from torchpar.parallel.pipeline import SPLIT_BACKWARD
from torchpar.parallel.recompute import recomputed
from torchpar.plan.layout import Cluster, flat_rank_layout, flat_rank_params, state_bytes

PCIE_BW = 25e9  # host <-> device, PCIe 4.0 x16, per direction
CPU_MEMORY_BW = 100e9  # a server socket's DRAM bandwidth, for the offloaded optimizer step


# ------------------------------------------------------------------ what each rank sends


def _link(cluster: Cluster, stride: int, size: int) -> tuple[str, float]:
    """A mesh dimension spans ``stride * size`` consecutive ranks: inside a node if they fit."""
    return (
        ("intra-node", cluster.intra_bw)
        if stride * size <= cluster.gpus_per_node
        else ("inter-node", cluster.inter_bw)
    )


class _Sent(dict):
    """Bytes sent per rank per step, by mesh dimension; and by (dimension, kind, ranks) the bytes and
    the number of collectives (what a measured machine's latency is charged on)."""

    def __init__(self):
        super().__init__()
        self.by_kind: dict[tuple[str, str, int], list[float]] = {}  # -> [bytes, calls]

    def add(self, dim: str, kind: str, payload: float, n: int, times: float = 1, calls: int = 1) -> None:
        """``times`` collectives of ``payload`` (a ring's payload: RING_FACTOR says what one rank
        sends), each issued as ``calls`` pieces of the same total (buckets; or micro-steps, where
        ``payload`` is the step's)."""
        if n > 1:
            sent = times * RING_FACTOR[kind](n) * payload
            self[dim] = self.get(dim, 0.0) + sent
            entry = self.by_kind.setdefault((dim, kind, n), [0.0, 0.0])
            entry[0] += sent
            entry[1] += times * calls

    def seconds(self, dim: str, link: str, bw: float, cluster: Cluster) -> float:
        """Time of ``dim``'s traffic: measured latency and bandwidth of each collective where the
        machine was probed (the probed group of the same size and link, else the nearest size),
        else the bytes over the link's datasheet bandwidth."""
        if not cluster.collectives:
            return self[dim] / bw
        total = 0.0
        for (d, kind, n), (sent, calls) in self.by_kind.items():
            if d != dim:
                continue
            latency, rate = _measured(cluster.collectives, "intra" if link == "intra-node" else "inter", n,
                                      kind, bw)
            total += calls * latency + sent / rate
        return total


def _measured(table: dict, link: str, n: int, kind: str, bw: float) -> tuple[float, float]:
    """(latency, bandwidth) of ``kind`` on ``n`` ranks over ``link`` from a probe's table: that
    group size, else the nearest probed on that link (else on any link), else (0, ``bw``)."""
    sizes = [(int(key.split(":")[1]), key) for key in table if kind in table[key]]
    if not sizes:
        return 0.0, bw
    same = [s for s in sizes if s[1].startswith(link)] or sizes
    key = min(same, key=lambda s: (abs(s[0] - n), -s[0]))[1]
    latency, rate = table[key][kind]
    return latency, rate


@functools.lru_cache(maxsize=4096)
def _block_terms(model, args, layer: int, lora: tuple | None = None) -> dict:
    """What block ``layer`` of the adapter's plan sends under TP, by kind (cached: the search prices
    thousands of layouts): ``pairs`` (residual-stream conversions both ways), ``gathered`` (inputs
    whose every user runs whole: forward only), ``routed`` modules, ``inner`` (a routed module's
    row-wise outputs and column-wise inputs), ``summed`` (the widths of whole modules' outputs that
    each rank's heads use, whose gradients are summed), and the replicated trained parameters whose
    partial gradients are all-reduced once per step: ``sp_params`` (under sequence parallelism),
    ``head_params`` (a rank's own heads': always) and ``adapter_params`` (LoRA's pieces a split
    layer leaves whole — A beside a column-wise weight, B beside a row-wise one — which meet the
    other ranks' parts: always), as element counts. ``modules``: the same per module that converts
    the residual stream, in forward order, for :func:`_frozen_backward`; ``adapted``: an adapter
    outside them (which runs before them). Modules the block leaves
    out (a MoE block without shared experts: no parameter) count nothing. ``lora``: LoRA's spec
    (``models.lora.spec``; None: every parameter trained)."""
    entries = block_entries(model, args, layer, lora)
    held = set()
    for name, _, _ in entries:
        parts = name.split(".")
        held.update(".".join(parts[:i]) for i in range(1, len(parts)))
    plan = {m: w for m, w in model.layer_plan(args, layer).items() if m in held}
    routed = planned_under(plan, "routed")
    out = {"pairs": sum(w in ("rowwise", "input") for w in plan.values()),
           "gathered": sum(w == "whole_input" for w in plan.values()),
           "routed": len(routed),
           "inner": sum(w == "rowwise_replicated" or (w == "colwise" and m.startswith(routed))
                        for m, w in plan.items()) if routed else 0,
           "summed": [], "sp_params": [], "head_params": [], "adapter_params": [], "adapted": False}
    modules = {m: {"word": w, "rowwise": 0, "inner_colwise": 0, "summed": [], "adapted": False}
               for m, w in plan.items() if w in ("input", "whole_input", "routed")}

    def owner(name):  # (the converting module ``name`` lies in, if any)
        return next((modules[m] for m in modules if name.startswith(m + ".")), None)

    for m, w in plan.items():
        if owner(m) is not None:
            owner(m)["rowwise"] += w == "rowwise"
            owner(m)["inner_colwise"] += w == "colwise" and m.startswith(routed)
    weights = {name.rpartition(".")[0]: tp_dim for name, _, tp_dim in entries if name.endswith(".weight")}
    for name, (r, c), tp_dim in entries:
        module = name.rpartition(".")[0]
        word = plan.get(module)
        if word in ("latent", "shared") and not is_adapter(name):  # (its adapters add to its output)
            out["summed"].append(r)
            if owner(name) is not None:
                owner(name)["summed"].append(r)
        if is_adapter(name):  # (outside the converting modules: a prediction depth's join, run first)
            (owner(name) or out)["adapted"] = True
        if not trained(name, lora) or tp_dim is not None:
            continue  # (a frozen parameter has no gradient; a split one's is its own)
        if is_adapter(name) and weights[module] is not None:  # (beside a replicated weight: as it)
            out["adapter_params"].append(r * c)
        elif word not in WHOLE_STYLES:
            if word == "head_norm":
                out["head_params"].append(r * c)
            elif not name.startswith(routed):  # (a routed module's input is gathered)
                out["sp_params"].append(r * c)
    out["modules"] = tuple(modules.values())
    return out


def _frozen_backward(model, args, lora: tuple | None, blocks: list[int]) -> dict:
    """The backward exchanges autograd leaves out under LoRA (spec ``lora``; None: none) in this
    rank's ``blocks``: nothing before the first module holding an adapter is trained (the embedding
    is frozen), so no gradient flows there — through every stage: a pipeline stage's input asks for
    a gradient only where its sender's output has one. Counted: each converted input's gradient
    (``inputs``), a routed module's column-wise inputs' (``inner``) and its experts' rows
    (``rows``); in modules without adapters, their outputs' gradients (row-wise and routed:
    ``outputs``), their whole modules' summed ones (``summed``, widths) and, where it is a block's
    attention (its first module, in every family), the attention's own (``attention``). (The blocks
    passed whole are those before ``first_adapted_block``: no backward, nor recomputation.)"""
    return _frozen_walk(model, args, lora, tuple(blocks))


@functools.lru_cache(maxsize=4096)  # (the search asks for it several times per layout it prices)
def _frozen_walk(model, args, lora: tuple | None, blocks: tuple[int, ...]) -> dict:
    # (cached: read-only)
    out = {"inputs": 0, "inner": 0, "rows": 0, "outputs": 0, "summed": (), "attention": 0}
    if lora is None:
        return out
    for i in range(args.n_layers + model.prediction_depths(args)):  # (the depths' blocks follow the trunk)
        mine, term = i in blocks, _block_terms(model, args, i, lora)
        if term["adapted"]:
            return out
        for k, m in enumerate(term["modules"]):
            out["inputs"] += mine and m["word"] == "input"
            out["inner"] += mine * m["inner_colwise"]
            out["rows"] += mine and m["word"] == "routed"
            if m["adapted"]:  # (its output, and everything downstream, needs its gradient)
                return out
            out["outputs"] += mine * (m["rowwise"] + (m["word"] == "routed"))
            out["summed"] += tuple(m["summed"]) if mine else ()
            out["attention"] += mine and k == 0
    return out


def _tensor_parallel(sent: _Sent, model, args, lay: Layout, seq: int, blocks: list[int],
                     first: bool, last: bool, passes: int = 1) -> None:
    """Per block and micro-step, forward and backward, one collective pair for each module the
    plan converts the residual stream for (row-wise outputs, sub-module inputs): with sequence
    parallel an all-gather and a reduce-scatter of the activation, without it an all-reduce (same
    bytes); each embedding and the head add one pair; a sub-module input whose users all run whole
    only its forward all-gather, with sequence parallelism. A routed module (a mixture of experts, run
    whole on every tp rank) gathers its input forward and its output's gradient backward under
    sequence parallelism; inside it each row-wise linear's partial sums are all-reduced forward and
    each column-wise linear's input gradient backward, and its routed experts' ``k`` rows per token
    (the dropless count) both ways. Modules every rank runs whole (latent attention's latents): where
    each rank's heads use the output, its gradient is summed in backward; their parameters'
    gradients come out whole. Trained parameters TP replicates that see sequence-sharded
    activations, or a rank's own heads (per-head norms), and LoRA's whole pieces of split layers:
    their partial gradients all-reduced once per step. Under LoRA nothing before the first adapter
    gets a gradient (:func:`_frozen_backward`): neither the embedding's output (not gathered back)
    nor the frozen modules' before it. The embedding and the head run ``passes`` times a forward (multi-token
    prediction's depths embed their tokens and use the head again)."""
    micro_batch, n_micro = lay.micro_steps
    t, act, lora = lay.tp, lay.param_dtype_bytes, lora_spec(lay.lora)
    hidden = micro_batch * seq * args.dim * act  # (seq: this rank's tokens)
    terms = [_block_terms(model, args, i, lora) for i in blocks]

    def total(key):
        return sum(term[key] for term in terms)

    embeddings = sum(word == "embedding" for word in model.top_plan.values())
    pairs = total("pairs") + (embeddings * first + last) * passes
    routed = total("routed")
    frozen = _frozen_backward(model, args, lora, blocks)
    sent.add("tp", "all_reduce", hidden, t, (total("inner") - frozen["inner"]) * n_micro)
    rows = hidden * model.expert_slots(args)
    sent.add("tp", "all_reduce", rows, t, (2 * routed - frozen["rows"]) * n_micro)
    summed = [r for term in terms for r in term["summed"]]
    for r in frozen["summed"]:
        summed.remove(r)
    if summed:
        width = sum(summed) / len(summed)  # (the mean: bytes and calls as issued)
        sent.add("tp", "all_reduce", micro_batch * seq * act * width, t, len(summed) * n_micro)
    if lay.sequence_parallel:
        skipped = frozen["outputs"] + (embeddings * passes if lora and first else 0)
        sent.add("tp", "all_gather", hidden, t, (pairs + total("gathered") + 2 * routed - skipped) * n_micro)
        sent.add("tp", "reduce_scatter", hidden, t, (pairs - frozen["inputs"]) * n_micro)
    else:
        sent.add("tp", "all_reduce", hidden, t, (pairs - frozen["inputs"]) * n_micro)
    params = [n for term in terms for n in
              term["head_params"] + term["adapter_params"] + term["sp_params"] * lay.sequence_parallel]
    if lay.sequence_parallel:  # the stages' own modules (the final norm)
        params += [r * c for name, (r, c), tp_dim in _own_params(model, args, first, last)
                   if tp_dim is None and trained(name, lora)]
    if params:
        sent.add("tp", "all_reduce", 4 * sum(params) / len(params), t, len(params))
    if last:
        if lay.loss_parallel:  # cross-entropy on vocab shards: max, sum of exp, target logit
            sent.add("tp", "all_reduce", micro_batch * seq * 4, t, 3 * n_micro * passes)
        else:
            sent.add("tp", "all_gather", micro_batch * seq * args.vocab_size * 4, t, n_micro * passes)


def _own_params(model, args, first: bool, last: bool) -> list:
    """A stage's entries outside its blocks (the embedding, the final norm, the head): those of a
    stage of no blocks but the prediction depths' on the last, which come after the first-stage
    modules."""
    entries = model.stage_params(args, first, last, range(0))
    start = len(model.stage_params(args, first, False, range(0)))
    depths = model.depth_blocks(args) if last else ()
    return entries[:start] + entries[start + sum(len(model.block_params(args, i)) for i in depths):]


def _owned_elements(model, args, lay: Layout, pp_rank: int, shard_rank: int = 0) -> int:
    """Parameter elements (padding left out) in the flat engine's pieces that shard rank
    ``shard_rank`` owns: the r-th N-th of every bucket (all of it under stage 0)."""
    n = flat_shards(lay)
    local = [r * c for r, c in flat_rank_params(model, args, lay, pp_rank)[0]]
    _, _, starts, bounds = flat_rank_layout(model, args, lay, pp_rank)
    owned = [(lo + shard_rank * (hi - lo) // n, lo + (shard_rank + 1) * (hi - lo) // n)
             for lo, hi in zip(bounds, bounds[1:])]
    return sum(max(0, min(s + size, b) - max(s, a)) for s, size in zip(starts, local) for a, b in owned)


def _flat_zero(sent: _Sent, lay: Layout, bounds: list[int]) -> None:
    """ZeRO 0-2: the padded buffer's gradients (``bounds[-1]`` elements) reduced once per step,
    bucket by bucket, in the reduction dtype, and the updated pieces all-gathered in the compute
    dtype (in the same buckets)."""
    n, r, buckets = lay.shard_ranks, lay.dp_replicate, len(bounds) - 1
    grads = lay.reduce_dtype_bytes * bounds[-1]
    if lay.zero_stage == 2:
        sent.add(lay.shard_dim, "reduce_scatter", grads, n, calls=buckets)
        sent.add("dp_replicate", "all_reduce", grads / n, r, calls=buckets)
    else:
        sent.add(lay.reduce_dim, "all_reduce", grads, lay.grad_ranks, calls=buckets)
    if lay.zero_stage in (1, 2):
        sent.add(lay.shard_dim, "all_gather", lay.param_dtype_bytes * bounds[-1], n, calls=buckets)


def _fsdp(sent: _Sent, model, args, lay: Layout, local: list[tuple[int, int]], names: list[str],
          layers: list[int], first: bool) -> None:
    """FSDP2 units: each block, and the root (first- and last-stage modules); under expert
    parallelism a block's experts are a unit of their own over the ranks holding the same experts
    (efsdp). A unit's collectives carry every parameter padded to a multiple of its shard ranks; its
    reduce-scatters, the trained ones (with LoRA, the adapters)."""
    r, act, lora = lay.dp_replicate, lay.param_dtype_bytes, lora_spec(lay.lora)
    n_first = len(model.stage_params(args, True, False, range(0))) if first else 0
    ends = list(itertools.accumulate((len(block_entries(model, args, i, lora)) for i in layers),
                                     initial=n_first))
    experts = expert_names(model) if lay.ep > 1 else set()
    fp8 = gathered_in_float8(model, args, lay)
    blocks, expert_units = [], []
    for layer, a, b in zip(layers, ends, ends[1:]):
        entries = [(*rc, 1 if f"layers.{layer}.{name}" in fp8 else act, trained(name, lora), name)
                   for rc, name in zip(local[a:b], names[a:b])]
        blocks.append([e[:4] for e in entries if e[4] not in experts])
        expert_units.append([e[:4] for e in entries if e[4] in experts])
    root = [(*rc, act, trained(name, lora)) for rc, name in zip(local[:n_first] + local[ends[-1]:],
                                                                 names[:n_first] + names[ends[-1]:])]
    trained_from = first_adapted_block(model, args, lora)
    backward = [layer >= trained_from for layer in layers]
    _fsdp_units(sent, lay, blocks, root, lay.shard_ranks, lay.shard_dim, r, backward)
    # FP8 gathers' scales, after each step: one all-reduce of the weights' absolute maxima (fp32),
    # over each dimension that splits them
    mine = sum(any(w.startswith(f"layers.{i}.") for i in layers) for w in fp8)
    if mine:
        sent.add(lay.shard_dim, "all_reduce", 4 * mine, lay.shard_ranks)
        sent.add("tp", "all_reduce", 4 * mine, lay.tp)
    if any(expert_units):
        _fsdp_units(sent, lay, expert_units, [], lay.expert_shard_ranks,
                    "efsdp_cp" if lay.cp > 1 else "efsdp", r, backward)


def _fsdp_units(sent: _Sent, lay: Layout, blocks: list, root: list, n: int, dim: str, r: int,
                backward: list[bool]) -> None:
    """The collectives of FSDP2 units sharded over ``n`` ranks of ``dim``: one per block, the
    root's, and HSDP's all-reduce over ``r`` replicas. A unit: (rows, cols, bytes per gathered
    element: the compute dtype's, or 1 for a weight gathered in FP8; whether it is trained) of each
    parameter; gradients (fp32) are reduced for the trained ones alone. ``backward``: whether each
    block runs one (under LoRA, not those before the first adapter)."""
    def unit_bytes(shapes, dtype_bytes=None):
        return sum((dtype_bytes or gathered) * math.ceil(a / n) * n * b for a, b, gathered, learned in shapes
                   if learned or dtype_bytes is None)

    # Without a pipeline each micro-step gathers every unit, and the blocks but the last (where
    # backward starts) again for backward; under a pipeline nothing reshards until the step ends.
    gathers = lay.accum if lay.pp == 1 else 1
    # ... and reduces every micro-step's gradients, unless they accumulate unsharded until the last.
    reduces = gathers if lay.reduce_every_microstep else 1
    for i, unit in enumerate(blocks):
        # (FSDP2 gathers a block again when the next one's backward starts, which prefetches it:
        # under LoRA the last block before the first adapter too, though it runs no backward)
        again = lay.pp == 1 and i < len(blocks) - 1 and backward[i + 1]
        sent.add(dim, "all_gather", unit_bytes(unit), n, 2 * gathers if again else gathers)
    if root:
        sent.add(dim, "all_gather", unit_bytes(root), n, gathers)
    for unit in blocks + ([root] if root else []):
        if unit_bytes(unit, 4):  # (a unit of frozen parameters reduces nothing)
            sent.add(dim, "reduce_scatter", unit_bytes(unit, 4), n, reduces)
            sent.add("dp_replicate", "all_reduce", unit_bytes(unit, 4) / n, r, reduces)


def _whole_matrices(model, args, lay: Layout, pp_rank: int) -> list[tuple[tuple[int, ...], str, int | None]]:
    """(shape, role, TP-sharded dim) of the parameters whose update the rank at ``pp_rank`` computes
    whole when the optimizer gathers shards (Muon): under ZeRO-3 every one it holds a shard of;
    under ZeRO 0-2 those it owns (1/N of them, by size); with TP each is gathered over tp. A stack
    of experts' matrices is [the experts this rank holds, rows, cols]: each matrix is whole on the
    rank that holds its expert (over ep, and under ZeRO-3 over the ranks sharding the experts), so
    only TP's split of its width is gathered."""
    if not kind_of(lay.optimizer).gathers_shards:
        return []
    split, stacks, lora = split_of(model, args, lay), expert_names(model), lora_spec(lay.lora)
    out = []
    for s in lay.stage_ids(pp_rank):
        for name, (r, c), tp_dim in stage_entries(model, args, split, s, lora):
            if not trained(name, lora):
                continue  # (a frozen weight is never updated)
            shape = (r, c)
            if name in stacks and model.stack_shape(args, name) is not None:  # (not a stack of biases)
                experts, m, n = model.stack_shape(args, name)
                held = experts // lay.ep
                if lay.zero_stage == 3:  # (FSDP2 pads the expert dimension to a multiple of the ranks)
                    held = math.ceil(held / lay.expert_shard_ranks)
                shape = (held, m, n)
            out.append((shape, param_role(name, 1 if c == 1 else 2, model), tp_dim))
    return out


def _owned_share(lay: Layout) -> float:
    """The share of the matrices one rank updates: all it holds under ZeRO-3, 1/N under ZeRO 1-2."""
    return 1.0 if lay.zero_stage == 3 else 1 / flat_shards(lay)


def optimizer_seconds(model, args, lay: Layout, cluster: Cluster, efficiency: float) -> float:
    """The optimizer's own matmuls (Muon's Newton-Schulz, in bf16) on the busiest pipeline rank:
    under ZeRO-3 a matrix split by rows alone is orthogonalized by one rank of its shard group."""
    def share(shape, tp_dim) -> float:
        return 1 / lay.shard_ranks if _by_owner(lay, shape, tp_dim) else 1.0

    flops = max(sum(update_flops(lay.optimizer, shape, role) * share(shape, tp)
                    for shape, role, tp in _whole_matrices(model, args, lay, r)) for r in range(lay.pp))
    return flops * _owned_share(lay) / (cluster.peak_flops * efficiency)


def _by_owner(lay: Layout, shape: tuple[int, ...], tp_dim: int | None) -> bool:
    """Whether Muon orthogonalizes this matrix on one owner of its shard group (ZeRO-3 splits it by
    rows, and nothing else does) rather than on every rank that holds a piece."""
    return lay.zero_stage == 3 and lay.shard_ranks > 1 and len(shape) == 2 and (lay.tp == 1 or tp_dim is None)


def _gathered_updates(sent: _Sent, model, args, lay: Layout, pp_rank: int) -> None:
    """Muon's updates whole, in bf16. Under ZeRO-3 a matrix split by rows alone goes to its owner
    and back (two all-to-alls, each rank's rows: 1/N of it); one TP splits too is gathered
    (DTensor's full_tensor) over dp_shard at its TP-local width, then over tp."""
    n, owned, matrices = lay.shard_ranks, 0.0, 0
    for shape, role, tp_dim in _whole_matrices(model, args, lay, pp_rank):
        if not PARAM_GROUPS[role]["muon"]:
            continue
        size, tp_sharded = math.prod(shape), lay.tp > 1 and tp_dim is not None
        if _by_owner(lay, shape, tp_dim):
            # (each rank sends its 1/n of the rows to the owner, but its own: (n - 1) / n of it, on average)
            owned, matrices = owned + 2 * size / n * (n - 1) / n, matrices + 1
        elif lay.zero_stage == 3 and len(shape) == 2:  # (a stack keeps its experts where they are)
            sent.add(lay.shard_dim, "all_gather", 2 * size / (lay.tp if tp_sharded else 1), n)
        if tp_sharded:
            sent.add("tp", "all_gather", 2 * size * _owned_share(lay), lay.tp)
    if matrices:  # one all-to-all there and one back per round of n matrices
        rounds = -(-matrices // n)
        sent.add(lay.shard_dim, "all_to_all", owned / rounds, n, times=2 * rounds)


def _experts(sent: _Sent, model, args, lay: Layout, tokens: int, blocks: list[int], n_micro: int) -> None:
    """Expert parallelism's all-to-alls per step, for ``tokens`` of this rank (over its forwards)
    through the blocks of global indices ``blocks`` that hold experts. Each forward of such a
    block exchanges the per-expert counts (int64) and sends its rows to the experts' ranks and
    takes them back; backward sends the rows' gradients both ways again; a block recomputation
    wraps runs its forward's again. Under LoRA, no backward (nor recomputation) for the experts
    before the first adapter (:func:`_frozen_backward`). The rows: ``k`` per token (dropless) of
    which (ep - 1) / ep leave the rank — an assumption: routing balanced over the ep ranks (skewed
    routing sends more from some ranks, less from others)."""
    e, act = lay.ep, lay.param_dtype_bytes
    names = expert_names(model)
    routed = [i for i in blocks if any(name in names for name, _, _ in model.block_params(args, i))]
    lora = lora_spec(lay.lora)
    frozen = _frozen_backward(model, args, lora, blocks)
    policy, every = lay.activation_checkpoint, lay.activation_checkpoint_every
    trained_from = first_adapted_block(model, args, lora)
    again = sum(recomputed(i, policy, every) for i in routed if i >= trained_from)
    if lay.pp > 1 and lay.schedule in SPLIT_BACKWARD:
        again *= 2
    forwards = len(routed) + again
    rows = tokens * model.expert_slots(args) * args.dim * act * (e - 1) / e
    sent.add("ep", "all_to_all", rows, e, 2 * (forwards + len(routed) - frozen["rows"]), calls=n_micro)
    sent.add("ep", "all_to_all", 8 * model.experts(args) * (e - 1) / e, e, forwards * n_micro)


def _context(sent: _Sent, model, args, lay: Layout, tokens: int, blocks: list[int], n_micro: int) -> None:
    """Context parallelism's exchanges per step, for ``tokens`` of this rank (over its forwards)
    through the blocks of global indices ``blocks``: all-to-all sends (cp-1)/cp of q, k, v and
    the output (the heads of its TP rank) in forward and their gradients in backward; ring passes
    the key/value block (its KV heads) cp-1 times in forward and in backward, and the key/value
    gradients (fp32) cp times. A block that recomputation wraps runs
    its forward's exchanges again — except the ring's under selective recomputation, which keeps
    the ring's output as it keeps a fused attention's (the all-to-alls' results it does not keep).
    Under LoRA, no backward (nor recomputation) for the attentions before the first adapter
    (:func:`_frozen_backward`)."""
    c, act = lay.cp, lay.param_dtype_bytes
    policy, every = lay.activation_checkpoint, lay.activation_checkpoint_every
    if policy == "selective" and lay.cp_method == "ring":
        policy = "none"
    lora = lora_spec(lay.lora)
    frozen = _frozen_backward(model, args, lora, blocks)
    trained_from = first_adapted_block(model, args, lora)
    again = sum(recomputed(i, policy, every) for i in blocks if i >= trained_from)
    if lay.pp > 1 and lay.schedule in SPLIT_BACKWARD:
        again *= 2  # input- and weight-gradient passes each recompute the block
    backward = len(blocks) - frozen["attention"]
    passes = len(blocks) + backward + again  # forward and backward of every block, and the forwards run again
    heads, kv_heads, qk, v = model.attention_heads(args)
    per_rank = tokens / lay.tp  # (each tp rank its share of the heads)
    if lay.cp_method == "alltoall":
        qkvo = per_rank * (heads * (qk + v) + kv_heads * (qk + v)) * act
        sent.add("cp", "all_to_all", qkvo * (c - 1) / c, c, passes, calls=2 * n_micro)  # (q, k, v; then out)
    else:
        kv = per_rank * kv_heads * (qk + max(qk, v))  # (values narrower than keys travel widened)
        sent.add("cp", "all_to_all", kv * act, c, passes * (c - 1), calls=n_micro)
        sent.add("cp", "all_to_all", kv * 4, c, backward * c, calls=n_micro)


def _figures_bytes(model, args, lay: Layout) -> int:
    """The step's figures every rank sums (fp32): the loss, the stop-signal flag, the z-loss term
    (loss.z_loss > 0), the model's auxiliary terms and its routed loads."""
    return 4 * (2 + lay.z_loss + len(model.auxiliary_terms(args)) + model.routed_counts(args))


def communication(model, args, lay: Layout, cluster: Cluster, seq: int, pp_rank: int = 0) -> dict:
    """Bytes the rank at pipeline position ``pp_rank`` sends per step through each mesh
    dimension (ring algorithms), the seconds that takes and the links it crosses. Counted
    collective by collective as torchpar issues them (checked in the tests against a ledger of a
    real run)."""
    micro_batch, n_micro = lay.micro_steps
    split = split_of(model, args, lay)
    stages = lay.stage_ids(pp_rank)
    first, last = 0 in stages, len(split) - 1 in stages
    seq //= lay.cp  # the tokens of each sequence this rank holds
    sent = _Sent()
    # The trainer's own, over all ranks: the loss with the stop-signal flag, the z-loss term and the
    # model's auxiliary terms and routed loads (fp32 values), and the global gradient norm (one).
    sent.add("world", "all_reduce", _figures_bytes(model, args, lay), lay.world)
    sent.add("world", "all_reduce", 4, lay.world)
    if lay.loss_mask:  # the step's loss targets, counted (an int64), with loss masks
        sent.add("world", "all_reduce", 8, lay.world)
    starts = [0, *itertools.accumulate(split)]
    blocks = [i for s in stages for i in range(starts[s], starts[s + 1])]  # this rank's, global indices
    depths = model.prediction_depths(args)  # (their blocks on the last stage; the head runs 1 + depths times)
    blocks += list(model.depth_blocks(args)) if last else []
    if lay.tp > 1:
        _tensor_parallel(sent, model, args, lay, seq, blocks, first, last, 1 + depths)
    if lay.ep > 1:
        _experts(sent, model, args, lay, micro_batch * seq * n_micro, blocks, n_micro)
    if lay.cp > 1:
        _context(sent, model, args, lay, micro_batch * seq * n_micro, blocks, n_micro)
    if lay.grad_ranks > 1:
        local = rank_params(model, args, lay, pp_rank)
        if lay.zero_stage == 3:
            _fsdp(sent, model, args, lay, local, rank_param_names(model, args, lay, pp_rank), blocks, first)
        else:
            _flat_zero(sent, lay, flat_rank_layout(model, args, lay, pp_rank)[3])
    _gathered_updates(sent, model, args, lay, pp_rank)
    tags = tag_bytes(lay.replica_groups)  # (beside each fp32 average across replica groups)
    if lay.replica_groups > 1 and lay.replica_sync_every:
        # Semi-synchronous groups (LocalSGD, DiLoCo): every replica_sync_every / replica_fragments
        # steps, a fragment of the weights (or of their moves) this rank holds — the flat engine's
        # master pieces, padding included, or FSDP2's shards — with the layout's fingerprint; per
        # step, that share of it.
        if lay.zero_stage == 3:  # (the trained shards, fp32: as many bytes as their gradients)
            held = state_bytes(model, args, lay, {"pp": pp_rank, "dp_shard": 0, "tp": 0})["grad_bytes"]
        else:
            held = 4 * (flat_rank_layout(model, args, lay, pp_rank)[3][-1] // flat_shards(lay))
        k, every = lay.replica_fragments, lay.replica_sync_every
        sent.add("replicas", "all_reduce", held / k + tags, lay.replica_groups, times=k / every)
    elif lay.replica_groups > 1:
        # Replica groups: each rank's gradient pieces (what it holds of them: FSDP2's shards, the flat
        # engine's owned pieces), then the step's figures, averaged with the same rank of the other
        # groups, each with the fingerprint of the layout and the one-hot of the groups.
        if lay.zero_stage == 3:
            held = state_bytes(model, args, lay, {"pp": pp_rank, "dp_shard": 0, "tp": 0})["grad_bytes"]
        else:
            held = 4 * _owned_elements(model, args, lay, pp_rank)
        sent.add("replicas", "all_reduce", held + tags, lay.replica_groups)
        figures = _figures_bytes(model, args, lay)
        sent.add("replicas", "all_reduce", figures + tags, lay.replica_groups)
    if lay.pp > 1:
        # Each microbatch crosses every stage boundary forward (activations) and back (their
        # gradients); a rank sends from each of its stages that has a neighbour — back only where
        # something before the stage is trained (under LoRA a stage before the first adapter asks
        # for no gradient). The prediction depths' token embeddings travel in one tensor with the
        # hidden states; under sequence parallelism each tp rank sends its share of the tokens.
        share = lay.tp if lay.sequence_parallel else 1
        hidden = micro_batch * seq * args.dim * (1 + depths) * lay.param_dtype_bytes // share
        trained_from = first_adapted_block(model, args, lora_spec(lay.lora))
        crossings = sum((s < len(split) - 1) + (s > 0 and starts[s] > trained_from) for s in stages)
        sent.add("pp", "send", hidden, lay.pp, crossings * n_micro)
    # Links: mesh dims (pp, dp_replicate, dp_shard, cp, tp), tp innermost; a dim is intra-node when
    # all the ranks it spans fit in one node.
    t, c, n, e = lay.tp, lay.cp, lay.dp_shard, lay.ep
    stride = {"tp": (1, t), "cp": (t, c), "dp_shard": (t * c, n), "dp_shard_cp": (t, c * n),
              "ep": (t * c, e), "efsdp": (t * c * e, n // e), "efsdp_cp": (t, c * n),
              "dp_replicate": (t * c * n, lay.dp_replicate), "dp": (t * c, lay.dp), "dp_cp": (t, c * lay.dp),
              "pp": (t * c * lay.dp, lay.pp), "world": (1, lay.world),
              "replicas": (lay.world, lay.replica_groups)}
    out = {}
    for dim, b in sent.items():
        link, bw = _link(cluster, *stride[dim])
        out[dim] = {"bytes": b, "seconds": sent.seconds(dim, link, bw, cluster), "link": link}
    return out


# ------------------------------------------------------------------ what the step waits for


def _flat_exposed(model, args, lay: Layout, comm: dict, compute: float) -> float:
    """ZeRO 0-2's communication that the step waits for. Buckets are reduced during the last
    micro-step's backward (about 2/3 of its compute), except the last bucket, which starts as
    backward ends; under HSDP each owned piece's all-reduce over the replicas follows its
    reduce-scatter, over the rest of backward likewise; the parameter gathers overlap the next
    step's first forward (1/3 of a micro-step)."""
    def sec(dim):
        return comm.get(dim, {}).get("seconds", 0.0)

    n_micro = lay.micro_steps[1]
    shard = sec(lay.shard_dim)
    if lay.zero_stage == 2:  # dp_shard (x cp): reduce-scatter and all-gather of the same elements
        gather = shard * lay.param_dtype_bytes / (lay.param_dtype_bytes + lay.reduce_dtype_bytes)
        reduce, after = shard - gather, sec("dp_replicate")
    else:
        gather, reduce, after = shard, sec(lay.reduce_dim), 0.0
    buckets = max(1, len(flat_rank_layout(model, args, lay, 0)[3]) - 1)  # (none: a stage LoRA leaves empty)

    def exposed(seconds):  # (a chain of per-bucket collectives over the last backward)
        return max(seconds / buckets, seconds - compute * 2 / 3 / n_micro)

    return exposed(reduce) + exposed(after) + max(0.0, gather - compute / 3 / n_micro)


def exposed_seconds(model, args, lay: Layout, comm: dict, compute: float, overlap: bool = True) -> float:
    """Communication time the step waits for. ZeRO 0-2 overlap their reductions with backward
    and their gathers with forward (:func:`_flat_exposed`); FSDP2 overlaps with compute; TP
    collectives and context parallelism's exchanges sit on the critical path; pipeline sends
    are mostly hidden (counted fully). Without ``overlap`` (a CPU) all of it is waited for."""
    dp_s = sum(comm.get(d, {}).get("seconds", 0.0) for d in ("dp", "dp_shard", "dp_replicate", "dp_cp",
                                                               "dp_shard_cp"))
    # (replica groups average after the step's own reduction: nothing overlaps it)
    exposed = sum(comm.get(d, {}).get("seconds", 0.0) for d in ("tp", "cp", "pp", "world", "replicas"))
    if not overlap:
        exposed += dp_s
    elif lay.zero_stage == 3:
        exposed += max(0.0, dp_s - compute)
    elif lay.grad_ranks > 1:
        exposed += _flat_exposed(model, args, lay, comm, compute)
    if lay.cpu_offload:
        # Sharded parameters cross PCIe to the device for every all-gather, gradients back once,
        # and Adam runs on the CPU (counted as memory-bound: 16 bytes read + written per parameter).
        host = state_bytes(model, args, lay, {"pp": 0, "dp_shard": 0, "tp": 0})
        moved = host["param_bytes"] * (2 * lay.accum if lay.pp == 1 else 1) + host["grad_bytes"]
        comm["offload"] = {"bytes": moved, "seconds": moved / PCIE_BW, "link": "PCIe"}
        exposed += moved / PCIE_BW + 2 * (host["param_bytes"] + host["optim_bytes"]) / CPU_MEMORY_BW
    return exposed
