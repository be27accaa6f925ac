"""Pipeline parallelism with ``torch.distributed.pipelining``.

The meta model is cut into ``pp x stages_per_rank`` stages of consecutive layers; the first
stage keeps the embedding, the last the final norm and head. Each rank keeps only its own
stages (loop placement: stage s on rank s mod pp; V placement for ZBVZeroBubble / DualPipeV:
rank r holds stages r and 2pp-1-r). Each stage is then parallelized like a whole model.
"""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist

from torchpar.errors import ConfigError, did_you_mean
from torchpar.loss import Z_LOSS, cross_entropy_sum, record_term, training_loss, uncounted
from torchpar.parallel.bubble import bubble_report, schedule_actions, simulate
from torchpar.parallel.zero import full_value

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")
SINGLE_STAGE = ("GPipe", "1F1B")
# Zero-bubble schedules run backward in two passes over one graph: input gradients, then weights.
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")


def stage_ids(pp: int, pp_rank: int, schedule: str, stages_per_rank: int) -> list[int]:
    """The global pipeline stages rank ``pp_rank`` holds, in order: stage s on rank s mod pp,
    or the V placement (rank r holds r and 2pp-1-r) of the V-shaped schedules."""
    if pp == 1:
        return [0]
    if schedule in V_SCHEDULES:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + k * pp for k in range(stages_per_rank)]


# The most microbatches a schedule is built for here: torch builds the multi-stage schedules in
# time quadratic in their count (about a second at 1024), and the planner builds one per layout.
MAX_MICROBATCHES = 256


def schedule_order(
    name: str, pp: int, n_microbatches: int, stages_per_rank: int
) -> tuple[dict[int, list], int]:
    """Build the real torch schedule for rank 0 on a fake process group and return its order.
    Inside a running job (a default group exists) the fake group stands apart from it: no group is
    made on the job's ranks (which would be a collective every rank must join)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch import nn
    from torch._C._distributed_c10d import FakeProcessGroup
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
    from torch.testing._internal.distributed.fake_pg import FakeStore

    num_stages = pp * stages_per_rank
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=pp)
        group = None
    else:  # this process as rank 0 of a fake group of pp ranks, known to c10d for the stages' queries
        make = getattr(FakeProcessGroup, "_create_internal", FakeProcessGroup)  # (older torch: the class)
        group = make(rank=0, world_size=pp)
        c10d._world.pg_group_ranks[group] = {dist.get_rank(): 0}
    try:
        stages = [PipelineStage(nn.Linear(1, 1), s, num_stages, "cpu", group=group)
                  for s in stage_ids(pp, 0, name, stages_per_rank)]
        cls = get_schedule_class(name)
        schedule = cls(stages[0] if issubclass(cls, PipelineScheduleSingle) else stages, n_microbatches,
                       loss_fn=lambda out, target: out.sum(), scale_grads=False)
        return schedule.pipeline_order, num_stages
    finally:
        if created:
            dist.destroy_process_group()
        else:
            del c10d._world.pg_group_ranks[group]


def stages_per_rank(par) -> int:
    if par.pipeline_parallel_stages_per_rank:
        return par.pipeline_parallel_stages_per_rank
    return 1 if par.pipeline_parallel_schedule in SINGLE_STAGE else 2


def balanced_split(model, args, num_stages: int) -> list[int]:
    """Layers per stage minimizing the costliest stage, in units of one block's matmul FLOPs.

    Lookups (embeddings) cost nothing; the head costs its matmul weights over a block's. Exact
    search over contiguous splits (dynamic programming).
    """
    return list(_balanced_split(model, args, num_stages))


@functools.lru_cache(maxsize=256)  # (the planner's search asks for the same few splits thousands of times)
def _balanced_split(model, args, num_stages: int) -> tuple[int, ...]:
    block, head_weights = model.matmul_params(args)
    # (the last stage also runs each prediction depth: a block and the head again)
    head = (head_weights / block + 1) * (1 + model.prediction_depths(args)) - 1
    L = args.n_layers
    INF = float("inf")
    # best[s][n]: minimal max cost of putting the first n layers into the first s stages.
    best = [[INF] * (L + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, num_stages + 1):
        for n in range(s, L + 1):
            for k in range(s - 1, n):  # the first k layers go to earlier stages
                cost = (n - k) + (head if s == num_stages else 0.0)
                value = max(best[s - 1][k], cost)
                if value < best[s][n] - 1e-12:
                    best[s][n], cut[s][n] = value, k
    sizes, n = [], L
    for s in range(num_stages, 0, -1):
        k = cut[s][n]
        sizes.append(n - k)
        n = k
    return tuple(sizes[::-1])


def _layers_per_stage(par, num_stages: int, v: int, pp: int, model, args) -> list[int]:
    explicit = list(par.pipeline_parallel_layers_per_stage)
    if explicit:
        if len(explicit) != num_stages or any(not isinstance(n, int) or n < 1 for n in explicit) \
                or sum(explicit) != args.n_layers:
            raise ConfigError(
                f"parallelism.pipeline_parallel_layers_per_stage = {explicit} must list {num_stages} "
                f"positive layer counts (pp {pp} x {v} stages per rank) that cover all {args.n_layers} "
                f"layers exactly once (sum {sum(n for n in explicit if isinstance(n, int))})"
            )
        return explicit
    return balanced_split(model, args, num_stages)


def schedule_problem(name: str, pp: int, v: int, n_layers: int, n_micro: int | None = None,
                     stages_field: str = "parallelism.pipeline_parallel_stages_per_rank") -> str | None:
    """What stops schedule ``name`` with ``v`` stages per rank from running over ``pp`` ranks of
    an ``n_layers`` model, and (if given) ``n_micro`` microbatches; None if nothing. The
    trainer's validation, the planner's search and ``torchpar schedule`` share these rules;
    ``stages_field`` is what the caller calls the stages per rank."""
    if name in SINGLE_STAGE and v != 1:
        return f"schedule {name} runs one stage per rank; set {stages_field} = 1"
    if name in V_SCHEDULES and v != 2:
        return f"schedule {name} needs exactly 2 stages per rank (V shape); set {stages_field} = 2"
    if pp * v > n_layers:
        return (
            f"{pp * v} pipeline stages (pp {pp} x {v} per rank) but the model has only {n_layers} layers; "
            "lower the degree or stages per rank"
        )
    if n_micro is None:
        return None
    if name == "1F1B" and n_micro < pp:
        return (f"1F1B needs at least as many microbatches as stages: {n_micro} < {pp}; raise "
                "training.local_batch_size or lower pipeline_parallel_microbatch_size")
    if name == "DualPipeV" and n_micro < pp * v:
        return f"DualPipeV needs at least as many microbatches as stages: {n_micro} < {pp * v}"
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n_micro // pp)
        if n_micro % rounds:
            return (f"{name} needs the microbatch count ({n_micro}) to be a multiple of its rounds (max(1, "
                    f"{n_micro} // pp {pp}) = {rounds}); choose e.g. {rounds * pp} microbatches")
    return None


def pipeline_split(par, layout, model, args) -> tuple[str, int, tuple[int, ...]]:
    """Check the pipeline part of [parallelism] against the model's layers and the batch (what a
    schedule cannot run beside is in torchpar.composition); returns the schedule, stages per rank
    and layers per stage."""
    name = par.pipeline_parallel_schedule
    if name not in SCHEDULES:
        raise ConfigError(
            f"parallelism.pipeline_parallel_schedule = {name!r} is unknown.{did_you_mean(name, SCHEDULES)}"
        )
    v, pp = stages_per_rank(par), layout.pp
    problem = schedule_problem(name, pp, v, args.n_layers)
    if problem:
        raise ConfigError(problem)
    split = _layers_per_stage(par, pp * v, v, pp, model, args)
    mb, rows = layout.microbatch_size, layout.local_batch_size * layout.accum
    if mb < 1 or rows % mb:
        raise ConfigError(
            f"parallelism.pipeline_parallel_microbatch_size = {mb} must divide the sequences per step and dp "
            f"rank (local_batch_size x accumulation = {rows})"
        )
    problem = schedule_problem(name, pp, v, args.n_layers, rows // mb)
    if problem:
        raise ConfigError(problem)
    return name, v, tuple(split)


def split_model(module, model, layout) -> list:
    """This rank's stages, pruned from the meta module (cheap: nothing is allocated); ``model``
    is its adapter, which names the modules of the first and the last stage."""
    sizes = layout.layers_per_stage
    parts = []
    for s in layout.stage_ids(layout.pp_rank):
        stage = copy.deepcopy(module)
        first = sum(sizes[:s])
        keep = {str(i) for i in range(first, first + sizes[s])}
        if s == layout.num_stages - 1:  # (blocks past the model's own, prediction depths': with the head)
            keep |= {key for key in stage.layers.keys() if int(key) >= sum(sizes)}
        for key in list(stage.layers.keys()):
            if key not in keep:
                del stage.layers[key]
        for name in (model.first_stage if s != 0 else ()) + (
            model.last_stage if s != layout.num_stages - 1 else ()
        ):
            setattr(stage, name, None)
        parts.append(stage)
    return parts


class Pipeline:
    """The schedule over this rank's stages; ``step`` returns the summed token cross-entropy it
    saw (its backward also takes the z-loss and every stage's auxiliary terms)."""

    def __init__(self, parts, layout, device):
        from torch.distributed.pipelining import PipelineStage
        from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class

        group = layout.submesh("pp").get_group()
        self.layout, self.group, self.pp_rank = layout, group, layout.pp_rank
        stage_ids = layout.stage_ids(self.pp_rank)
        self.parts = dict(zip(stage_ids, parts))  # global stage id -> this rank's module
        self.holder = {s: r for r in range(layout.pp) for s in layout.stage_ids(r)}
        num_stages = layout.num_stages
        self.stages = [
            PipelineStage(part, s, num_stages, device, group=group) for part, s in zip(parts, stage_ids)
        ]
        for stage in self.stages:
            # torch 2.13 infers the stages' shapes with one real forward inside the first step: its
            # auxiliary terms must not count (the one place a private method of torch's is wrapped;
            # tests/test_loss.py fails if it is renamed).
            if hasattr(stage, "_forward_metadata_inference"):
                stage._forward_metadata_inference = uncounted(stage._forward_metadata_inference)
        self.has_first = 0 in stage_ids
        self.has_last = num_stages - 1 in stage_ids
        self.n_microbatches = layout.n_microbatches
        cls = get_schedule_class(layout.schedule)
        stages = self.stages[0] if issubclass(cls, PipelineScheduleSingle) else self.stages
        # scale_grads=False: the loss is already normalized by the global token count.
        self.schedule = cls(stages, self.n_microbatches, loss_fn=self._loss, scale_grads=False)
        self._scales, self._sums = (1.0, 1.0), []
        self.z_loss = 0.0  # [loss] z_loss, set by the trainer
        self._timer = None  # see time_actions

    def _loss(self, output, target):

        with self._timer("L") if self._timer else contextlib.nullcontext():  # the last stage's work too
            loss, ce, z = training_loss(output, target, self.z_loss, self._scales)
        self._sums.append((full_value(ce.detach()), None if z is None else z.detach()))
        return loss

    def step(self, inputs: torch.Tensor, targets: torch.Tensor, scales: tuple, **kwargs) -> torch.Tensor:
        """``scales``: the cross-entropy's and the z term's (:func:`torchpar.loss.training_loss`).
        ``kwargs``: the model's other inputs (``documents``), split into microbatches like the
        tokens and given to every stage."""
        self._scales, self._sums = scales, []
        target = targets if self.has_last else None
        # return_outputs=False: the last stage would otherwise keep every microbatch's logits until
        # the step ends and concatenate them into a batch-sized copy nobody reads.
        self.schedule.step(*((inputs,) if self.has_first else ()), target=target, return_outputs=False,
                           **kwargs)
        # The first step may also call the loss once while torch infers stage shapes: keep the
        # microbatches' own calls, the last n.
        sums = self._sums[-self.n_microbatches:]
        for _, z in sums:
            if z is not None:
                record_term(Z_LOSS, z)
        return torch.stack([ce for ce, _ in sums]).sum() if sums else torch.zeros((), device=inputs.device)

    def forward_only(self, inputs: torch.Tensor, targets: torch.Tensor, **kwargs) -> torch.Tensor:
        """Evaluation (call under no_grad): a batch through the stages in stage order, with
        plain sends between ranks and no schedule — torch 2.13's ``schedule.eval`` fails for the
        V-shaped schedules. Returns the summed token loss on the last stage's ranks, else 0."""

        loss = torch.zeros((), device=inputs.device)
        x, dtype = inputs, getattr(torch, self.layout.param_dtype)  # activations in the compute dtype
        for s in range(self.layout.num_stages):
            if self.holder[s] != self.pp_rank:
                continue
            if s > 0 and self.holder[s - 1] != self.pp_rank:
                # Shape first: it depends on the layout (sequence parallel sends the local shard).
                shape = torch.empty(3, dtype=torch.long, device=inputs.device)
                dist.recv(shape, group=self.group, group_src=self.holder[s - 1])
                x = torch.empty(shape.tolist(), dtype=dtype, device=inputs.device)
                dist.recv(x, group=self.group, group_src=self.holder[s - 1])
            x = self.parts[s](x, **kwargs)
            if s == self.layout.num_stages - 1:
                loss = cross_entropy_sum(x, targets)
            elif self.holder[s + 1] != self.pp_rank:
                dist.send(torch.tensor(x.shape, dtype=torch.long, device=inputs.device), group=self.group,
                          group_dst=self.holder[s + 1])
                dist.send(x.to(dtype).contiguous(), group=self.group, group_dst=self.holder[s + 1])
        return loss

    def time_actions(self, timer) -> None:
        """Run each compute action of this rank's stages (the schedule calls these three) inside
        ``timer(kind)``, a context manager, and the loss too (kind L): the measured bubble."""
        self._timer = timer
        for stage in self.stages:
            for name, kind in (("forward_one_chunk", "F"), ("backward_one_chunk", "B"),
                               ("backward_weight_one_chunk", "W")):
                def timed(*args, _method=getattr(stage, name), _kind=kind, **kwargs):
                    # A zero-bubble schedule's input-gradient half is a backward without the weights.
                    kind = "I" if _kind == "B" and kwargs.get("full_backward") is False else _kind
                    with timer(kind):
                        return _method(*args, **kwargs)

                setattr(stage, name, timed)

    def predicted_bubble(self, cost: dict | None = None) -> float:
        """The cost model's bubble of this schedule (mean over the pipeline ranks); ``cost``:
        times per action kind instead of the model's F=1, B=2, I=W=1."""

        return simulate(self.actions(), self.layout.num_stages, cost)["bubble"]

    def actions(self) -> dict[int, list]:

        return schedule_actions(self.layout.schedule, self.schedule.pipeline_order, self.layout.pp,
                                self.n_microbatches)

    def describe(self) -> str:

        lay = self.layout
        return (
            f"pipeline: {lay.schedule}, {lay.num_stages} stages with layers {list(lay.layers_per_stage)}, "
            f"{self.n_microbatches} microbatches; " + bubble_report(self.actions(), lay.num_stages)
        )
