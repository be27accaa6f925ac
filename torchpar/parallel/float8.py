"""FP8 training through torchao: which linear layers run their matmuls in FP8 ([quantize]), and
the scales FSDP2's FP8 all-gather needs after each optimizer step.

The layers are converted on the meta model before any parallelism, by torchao's
``convert_to_float8_training``: its ``Float8Linear`` is an ``nn.Linear`` whose forward and backward
cast each matmul's operands to FP8 with dynamic scales (one per tensor, or one per row). Its
weight stays the parameter it was, under the same name, so the TP plans, the ZeRO engines, the
checkpoints and the Hugging Face mapping see the model they know; the model's code holds no
quantization.

A mixture of experts' stacked weights ([experts, in, out], the adapter's ``expert_plan``) are no
``nn.Linear``: their module's ``run(x, counts, *weights)`` multiplies each expert's rows by its
matrix, by grouped GEMM or a loop. Under FP8 the stacks it is handed are wrapped (for that call
only; the parameters stay as they are) in :class:`Float8Stack`, which sends those products to
torchao: its grouped FP8 GEMM (rowwise scales, padding each expert's rows to 16) on a CUDA GPU of
compute capability 9.0 or later, elsewhere one FP8 matmul per expert with the job's recipe — the
matmul ``Float8Linear`` runs, so an expert's product equals that of a converted linear layer
holding its matrix.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import types
from fnmatch import fnmatch

import torch
from torch import nn

from torchpar.device import cuda_capability
from torchpar.errors import ConfigError
from torchpar.parallel.tensor import submodule

FLOAT8_ROWS = 16  # FP8 matmuls take widths, and torchao's grouped GEMM each expert's rows, in multiples of 16


def too_small(recipe: str, out_features: int, in_features: int) -> bool:
    """Whether FP8 is slower than the compute dtype for a layer of this size, by torchao's rule
    (measured on H100: the casts cost more than the faster matmul gains)."""
    n, k = out_features, in_features
    if recipe == "tensorwise":
        return k <= 4096 and n <= 1024
    return n <= 2048 or k <= 1024 or (n <= 4096 and k <= 2048)


def float8_layers(module: nn.Module, model, q) -> list[tuple[str, nn.Linear]]:
    """The linear layers of ``module`` (of adapter ``model``) that [quantize] ``q`` names (by
    ``modules``, not by ``exclude``), never one under the embedding or the head (the adapter's
    first_stage and last_stage modules), nor, with ``skip_small``, one too small to gain."""
    keep_out = (*model.first_stage, *model.last_stage)
    out = []
    for name, m in module.named_modules():
        if type(m) is not nn.Linear or name.split(".")[0] in keep_out:
            continue
        if not _named(name, q):
            continue
        if q.skip_small and too_small(q.float8, m.out_features, m.in_features):
            continue
        out.append((name, m))
    return out


def _named(name: str, q) -> bool:
    """Whether [quantize] ``q`` names module ``name``: by a pattern of ``modules``, none of ``exclude``."""
    return any(fnmatch(name, p) for p in q.modules) and not any(fnmatch(name, p) for p in q.exclude)


def float8_experts(module: nn.Module, model, q) -> list[tuple[str, nn.Module, tuple]]:
    """The stacked-expert modules of ``module``'s blocks (the adapter ``model``'s ``expert_plan``)
    that [quantize] ``q`` names, as (name, module, ((weight, in, out), ...) for its 3-D stacks);
    with ``skip_small``, not a module with a stack too small to gain (the rule of a linear layer
    of the same widths)."""
    out = []
    for key, block in getattr(module, "layers", {}).items():
        for name in model.expert_plan:
            sub, full = submodule(block, name), f"layers.{key}.{name}"
            if sub is None or not _named(full, q):
                continue
            stacks = tuple((w, p.shape[1], p.shape[2]) for w in model.expert_plan[name]
                           if (p := getattr(sub, w, None)) is not None and p.dim() == 3)
            if stacks and not (q.skip_small and any(too_small(q.float8, m, k) for _, k, m in stacks)):
                out.append((full, sub, stacks))
    return out


def converted_layers(model, args, q) -> tuple[tuple[str, int, int], ...]:
    """(name, out features, in features) of each linear layer [quantize] ``q`` converts in a model
    of adapter ``model`` with ``args`` (:func:`float8_layers`; none when FP8 is off), read from one
    meta model per job, which the start-up check and the planner share."""
    return _converted(model, args, q)[0]


def converted_experts(model, args, q) -> tuple[tuple[str, tuple], ...]:
    """(name, ((weight, in, out), ...)) of each stacked-expert module whose matmuls [quantize]
    ``q`` puts in FP8 (:func:`float8_experts`), from the same meta model."""
    return _converted(model, args, q)[1]


def _converted(model, args, q):
    if q is None or q.float8 == "off":
        return (), ()
    return _layers(model, args, q.float8, tuple(q.modules), tuple(q.exclude), q.skip_small)


@functools.lru_cache(maxsize=32)
def _layers(model, args, recipe: str, modules: tuple, exclude: tuple, skip_small: bool):
    q = types.SimpleNamespace(float8=recipe, modules=modules, exclude=exclude, skip_small=skip_small)
    with torch.device("meta"):
        module = model.build(args)
    return (tuple((name, m.out_features, m.in_features) for name, m in float8_layers(module, model, q)),
            tuple((name, stacks) for name, _, stacks in float8_experts(module, model, q)))


def float8_weights(model, args, lay) -> dict[str, int]:
    """Weight elements each token's matmuls multiply in FP8 under layout ``lay``, by canonical name
    (the planner's FLOPs at the FP8 peak): a converted linear layer's all, an expert stack's
    (per expert) times the experts a token is sent to; empty without FP8."""
    out = {f"{name}.weight": n * k for name, n, k in converted_layers(model, args, lay.quantize)}
    slots = model.expert_slots(args)
    for name, stacks in converted_experts(model, args, lay.quantize):
        out.update({f"{name}.{w}": k * m * slots for w, k, m in stacks})
    return out


def gathered_in_float8(model, args, lay) -> frozenset[str]:
    """Canonical names of the weights ZeRO-3 all-gathers in FP8 under layout ``lay`` (the
    planner's bytes in flight: 1 per element): the converted linear layers' (torchao's FP8
    all-gather is ``Float8Linear``'s; expert stacks are gathered in the compute dtype), none
    without FP8 all-gather."""
    if not lay.float8_all_gather:
        return frozenset()
    return frozenset(f"{name}.weight" for name, _, _ in converted_layers(model, args, lay.quantize))


def check_float8(model, args, q, tp: int = 1) -> list[str]:
    """The names of the layers and expert modules [quantize] ``q`` converts in a model of adapter
    ``model`` with ``args``; one line for one FP8 matmuls cannot take (a width, or an expert
    stack's width on each of ``tp`` ranks, no multiple of 16), or torchao missing."""
    layers = converted_layers(model, args, q)
    for name, n, k in layers:
        if n % FLOAT8_ROWS or k % FLOAT8_ROWS:
            raise ConfigError(
                f"quantize.float8 = {q.float8!r}: layer {name} is {n} x {k} (out x in), and FP8 matmuls "
                "need both multiples of 16; leave it out (add it to quantize.exclude) or choose a flavour "
                "whose widths are")
    experts = converted_experts(model, args, q)
    for name, stacks in experts:
        plan = model.expert_plan[name.split(".", 2)[2]]
        for w, k, m in stacks:
            # (TP splits each stack's hidden width: its dimension 1 or 2, counting the experts' as 0)
            k, m = (k // tp if plan[w] == 1 else k), (m // tp if plan[w] == 2 else m)
            if k % FLOAT8_ROWS or m % FLOAT8_ROWS:
                raise ConfigError(
                    f"quantize.float8 = {q.float8!r}: the expert stack {name}.{w} is {k} x {m} (in x out) "
                    f"per expert{f' on each of {tp} tensor-parallel ranks' if tp > 1 else ''}, and FP8 "
                    f"matmuls need both multiples of 16; leave the experts out (add "
                    f"'*.{name.rsplit('.', 1)[1]}' to quantize.exclude) or choose a flavour or degree "
                    "whose widths are")
    if q is not None and q.float8 != "off":
        _torchao()
    return [name for name, _, _ in layers] + [name for name, _ in experts]


@functools.cache
def _torchao():
    """torchao's float8 package, imported when a job asks for FP8 only: its import takes seconds,
    and on a machine without CUDA each of its CUDA kernels' libraries fails to load with a warning.
    Once per process: the FP8 matmuls ask for it at every call, and setting a logger's level
    clears every logger's cache (~0.4 ms each time)."""
    logging.getLogger("torchao").setLevel(logging.ERROR)
    try:
        import torchao.float8 as float8
    except ImportError as e:
        raise ConfigError(f"quantize.float8 needs torchao ({e}); pip install torchao, or set "
                          "quantize.float8 = 'off'") from None
    return float8


def convert(module: nn.Module, model, q, all_gather: bool) -> None:
    """Convert the layers :func:`float8_layers` names, in place (on the meta model of adapter
    ``model``), and hand the stacked-expert modules :func:`float8_experts` names their stacks as
    :class:`Float8Stack`; ``all_gather``: the layers' weights are to be all-gathered in FP8 by
    FSDP2 (tensorwise)."""
    float8 = _torchao()
    names = {name for name, _ in float8_layers(module, model, q)}
    config = float8.Float8LinearConfig.from_recipe_name(q.float8)
    if all_gather:
        config = dataclasses.replace(config, enable_fsdp_float8_all_gather=True)
    float8.convert_to_float8_training(module, config=config, module_filter_fn=lambda m, fqn: fqn in names)
    stack = _stack_class(q.float8)
    for _, sub, _ in float8_experts(module, model, q):
        # (an attribute of the instance: expert parallelism's forward calls module.run too)
        sub.run = _float8_run(sub.run, stack)


def frozen_matmuls(module: nn.Module) -> None:
    """Converted layers whose weight trains nothing (LoRA's frozen base) run
    :class:`_FrozenWeightMatmul`: torchao's FP8 matmul makes the weight's gradient whether or not
    anything asks for it (a third of the layer's FLOPs, and the input kept for it)."""
    linear = _torchao().float8_linear.Float8Linear
    for m in module.modules():
        if isinstance(m, linear) and not m.weight.requires_grad:
            m.forward = types.MethodType(_frozen_forward, m)


def _frozen_forward(self, x: torch.Tensor) -> torch.Tensor:
    """``Float8Linear.forward`` with :class:`_FrozenWeightMatmul` (and, like it, autocast's dtype)."""
    if torch.is_autocast_enabled():
        x = x.to(torch.get_autocast_gpu_dtype())
    out = _FrozenWeightMatmul.apply(x, self.weight.t(), self.linear_mm_config, self.config)
    return out if self.bias is None else out + self.bias.to(out.dtype)


def _cast(t: torch.Tensor, cast, mm_config, config, role: str, dim: int) -> torch.Tensor:
    """``t`` in FP8 as torchao's matmul casts it for one of its products (unless it is already FP8,
    or the recipe leaves that operand in high precision)."""
    f8 = _torchao()
    scaling = f8.float8_scaling_utils
    disabled = cast.scaling_type is f8.config.ScalingType.DISABLED
    if disabled or f8.distributed_utils.tensor_already_casted_to_fp8(t):
        return t
    return scaling.hp_tensor_to_float8_dynamic(
        t, cast.target_dtype, mm_config, gemm_input_role=f8.float8_training_tensor.GemmInputRole[role],
        scaling_granularity=cast.scaling_granularity, axiswise_dim=scaling.get_maybe_axiswise_dim(
            dim, cast.scaling_granularity), round_scales_to_power_of_2=config.round_scales_to_power_of_2)


@torch._dynamo.allow_in_graph
class _FrozenWeightMatmul(torch.autograd.Function):
    """x [..., in] @ w_t [in, out] in FP8 for a weight that trains nothing: the same casts and
    products as torchao's matmul for the output and the input's gradient, no weight gradient, and
    only the weight kept for backward."""

    @staticmethod
    def forward(ctx, x, w_t, mm_config, config):
        ctx.save_for_backward(w_t)
        ctx.mm_config, ctx.config = mm_config, config
        x8 = _cast(x, config.cast_config_input, mm_config, config, "INPUT", -1)
        w8 = _cast(w_t, config.cast_config_weight, mm_config, config, "WEIGHT", 0)
        out = torch.mm(x8.reshape(-1, x8.shape[-1]), w8)
        return out.reshape(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):
        (w_t,), c, mm_config = ctx.saved_tensors, ctx.config, ctx.mm_config
        rows = grad.reshape(-1, grad.shape[-1])
        g8 = _cast(rows, c.cast_config_grad_output, mm_config, c, "GRAD_OUTPUT", -1)
        w8 = _cast(w_t, c.cast_config_weight_for_grad_input, mm_config, c, "WEIGHT", -1)
        grad_x = torch.mm(g8, w8.t())
        return grad_x.reshape(*grad.shape[:-1], grad_x.shape[-1]), None, None, None


def _float8_run(run, stack: type):
    @functools.wraps(run)
    def float8_run(x, counts, *weights, **kwargs):
        return run(x, counts, *(w.as_subclass(stack) if w is not None and w.dim() == 3 else w
                                for w in weights), **kwargs)

    float8_run.float8 = stack.recipe
    return float8_run


def grouped_float8(device: torch.device) -> bool:
    """Whether torchao's grouped FP8 GEMM runs the experts here: CUDA, compute capability 9.0 or
    later (``torch._scaled_grouped_mm``'s); elsewhere a loop of FP8 matmuls, one per expert."""
    capability = cuda_capability(device)
    return capability is not None and capability >= (9, 0)


class Float8Stack(torch.Tensor):
    """A stack of expert matrices [experts, in, out] (a view of the weight, in autograd's graph)
    whose products with activations run in FP8: ``torch._grouped_mm(x, stack, offs=ends)`` by
    torchao's grouped FP8 GEMM where :func:`grouped_float8`, else one FP8 matmul per expert; an
    expert's matrix ``stack[i]`` stays a Float8Stack, and ``rows @ stack[i]`` is torchao's FP8
    matmul (``Float8Linear``'s, with the recipe of :attr:`recipe`). Every other operation sees a
    plain tensor. Subclasses per recipe: :func:`_stack_class`."""

    recipe = "rowwise"
    config = None  # torchao's Float8TrainingOpConfig of the recipe

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        a, b = (args + (None, None))[:2]
        if func in _SELECT and isinstance(a, cls):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
            return out.as_subclass(cls) if out.dim() == 2 else out
        if (func in _MATMUL and isinstance(b, cls) and not isinstance(a, cls) and a.dim() == b.dim() == 2
                and a.device.type != "meta"):
            return cls.matmul(a, plain(b))
        if func is torch._grouped_mm and isinstance(b, cls) and a.dim() == 2 and "offs" in kwargs:
            return cls.grouped(a, plain(b), kwargs["offs"])
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)

    @classmethod
    def matmul(cls, rows: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """rows [n, in] @ w [in, out] in FP8 (torchao's autograd function of ``Float8Linear``,
        which takes the transposed weight: w itself)."""
        if not rows.shape[0]:  # (an expert without rows: no scale to take)
            return rows @ w
        c = cls.config
        matmul = (_torchao().float8_linear.matmul_with_hp_or_float8_args if w.requires_grad
                  else _FrozenWeightMatmul)  # (a frozen expert: LoRA's base)
        return matmul.apply(rows, w, c._linear_mm_config, c._float8_linear_config)

    @classmethod
    def grouped(cls, x: torch.Tensor, stack: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        """x [n, in] (expert i's rows up to ``ends[i]``) times each expert's matrix -> [n, out]."""
        if grouped_float8(x.device):
            def gemm(a, b, offs):
                return _torchao_moe()._to_fp8_rowwise_then_scaled_grouped_mm(
                    a, b, offs, out_dtype=a.dtype, pad_token_groups_for_grouped_mm=False)

            return padded_groups(x, stack, ends, gemm)
        out, start = [], 0
        for i, end in enumerate(ends.tolist()):  # (one host sync for the sizes)
            out.append(cls.matmul(x[start:end], stack[i]))
            start = end
        return torch.cat(out)


_SELECT = {torch.Tensor.__getitem__, torch.Tensor.select}
_MATMUL = {torch.Tensor.__matmul__, torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm}


def plain(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a torch.Tensor (still in autograd's graph)."""
    return t.as_subclass(torch.Tensor)


@functools.lru_cache(maxsize=None)
def _stack_class(recipe: str) -> type:
    config = _torchao_moe().config.Float8TrainingOpConfig(float8_linear_recipe=recipe)
    return type(f"Float8Stack_{recipe}", (Float8Stack,), {"recipe": recipe, "config": config})


@functools.cache
def _torchao_moe():
    """torchao's mixture-of-experts training package (its grouped FP8 GEMM and the configuration
    of its FP8 matmuls), imported when a job puts experts in FP8 (:func:`_torchao`'s reasons)."""
    _torchao()
    import torchao.prototype.moe_training as moe_training

    return moe_training


def padded_groups(x: torch.Tensor, stack: torch.Tensor, ends: torch.Tensor, gemm) -> torch.Tensor:
    """``gemm(a, b, offs)`` — a grouped GEMM whose groups must start at multiples of 16 rows and
    whose matrices are column-major, as torchao's grouped FP8 GEMM — on x [n, in] (expert i's rows
    up to ``ends[i]``) and stack [e, in, out]: each expert's rows moved to a start that is a
    multiple of 16 (zeros between), the product's rows moved back. No host sync: the padded rows
    are bounded by n + 15 per expert."""
    n, e = x.shape[0], stack.shape[0]
    ends = ends.to(torch.int64)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + FLOAT8_ROWS - 1) // FLOAT8_ROWS * FLOAT8_ROWS
    padded_starts = torch.cumsum(padded, 0) - padded
    expert = torch.repeat_interleave(torch.arange(e, device=x.device), counts, output_size=n)
    to = padded_starts[expert] + torch.arange(n, device=x.device) - (ends - counts)[expert]  # [n]
    a = x.new_zeros(n + (FLOAT8_ROWS - 1) * e, x.shape[1]).index_copy(0, to, x)
    b = stack.transpose(1, 2).contiguous().transpose(1, 2)  # [e, in, out], column-major
    return gemm(a, b, torch.cumsum(padded, 0).to(torch.int32))[to]


def describe(parts: list[nn.Module], lay, routed_experts: bool, device: torch.device) -> str:
    """The start-up note of an FP8 run: its recipe, how many linear layers and expert modules this
    rank converted, how ZeRO-3 gathers them, how the experts' FP8 runs, and what stays in the
    compute dtype."""
    linear = _torchao().float8_linear.Float8Linear
    modules = [m for part in parts for m in part.modules()]
    converted = sum(isinstance(m, linear) for m in modules)
    experts = sum(getattr(m.__dict__.get("run"), "float8", None) is not None for m in modules)
    line = f"FP8 ({lay.float8}) matmuls in this rank's {converted} linear layers"
    if experts:
        line += f" and routed experts of {experts} block{'s' if experts > 1 else ''}"
    if lay.zero_stage == 3:
        line += ", all-gathered in FP8" if lay.float8_all_gather else f", all-gathered in {lay.param_dtype}"
        if experts and lay.float8_all_gather:
            line += f" (the experts' stacks in {lay.param_dtype})"
    if experts:
        line += ("; the experts through torchao's grouped FP8 GEMM (rowwise)" if grouped_float8(device) else
                 "; the experts by one FP8 matmul per expert (torchao's grouped FP8 GEMM needs CUDA compute "
                 "capability 9.0)")
    elif routed_experts:
        line += f"; the routed experts stay in {lay.param_dtype} (quantize.modules or quantize.exclude)"
    return line


def precompute_scales(parts: list[nn.Module]) -> None:
    """After an optimizer step under FP8 all-gather: every converted weight's scale from its
    global absolute maximum, in one all-reduce for all of them (otherwise each weight's gather
    would reduce its own)."""
    float8 = _torchao()
    for part in parts:
        float8.precompute_float8_dynamic_scale_for_fsdp(part)
