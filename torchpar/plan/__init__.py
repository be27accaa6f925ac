"""The planner: per-rank memory, communication, bubble and step time of a layout, by arithmetic.

    torchpar plan --model 70B --nodes 4 --gpus-per-node 8 --gpu H100-80GB \\
        --global-batch-size 512 --seq-len 4096
    torchpar plan --config train_configs/debug_model.toml --nproc 2      # one exact config
    torchpar plan --seeds                                                 # the tutorials' worked examples

Byte convention (torchpar's, which the trainer's measurements are checked against): parameters,
gradients and both Adam moments are fp32 — 4 + 4 + 8 = 16 bytes per parameter — with bf16 only
as compute copies (FSDP2's MixedPrecisionPolicy). DeepSpeed and Megatron count the same 16
bytes differently under mixed precision: 2 (bf16 params) + 2 (bf16 grads) + 12 (fp32 master +
two moments), and their ZeRO-1 shards the 12, ZeRO-2 also the 2 of gradients, ZeRO-3 also the 2
of parameters. :func:`deepspeed_bytes` gives that convention for comparison.

The model is known through its adapter (``torchpar.models``), the layout is
:class:`torchpar.parallel.layout.Layout`. Modules: ``layout`` (the cluster, what each rank holds),
``estimate`` (memory, bubble, step time of one layout), ``communication`` (its bytes and seconds
per mesh dimension, what the step waits for), ``probe`` (this machine measured), ``search`` (every
layout and the explanation), ``seeds`` (published worked examples), ``compare`` (the prediction a
running job logs beside its measurement). ``torchpar.verify`` holds the planner against measured
runs; nothing at run time imports the planner.
"""

from torchpar.parallel.layout import Layout
from torchpar.plan.communication import communication
from torchpar.plan.compare import check_memory_cap, predict_for_trainer
from torchpar.plan.estimate import (
                                    Plan,
                                    in_flight,
                                    pipeline_bubble,
                                    plan,
                                    recompute_flops_per_token,
)
from torchpar.plan.layout import (
                                    PRESETS,
                                    Cluster,
                                    deepspeed_bytes,
                                    layout_from_config,
                                    rank_params,
                                    state_bytes,
)
from torchpar.plan.search import explain, search

__all__ = ["PRESETS", "Cluster", "Layout", "Plan", "check_memory_cap", "communication", "deepspeed_bytes",
           "explain", "in_flight",
           "layout_from_config", "pipeline_bubble", "plan", "predict_for_trainer",
           "rank_params", "recompute_flops_per_token", "search", "state_bytes"]
