"""`torchpar config from-deepspeed`: DeepSpeed configs as torchpar TOML files that load and run."""

import json
import sys

import pytest
from test_train import records, run

from torchpar.config import load_config
from torchpar.models import MODELS
from torchpar.parallel.layout import resolve_layout

pytestmark = pytest.mark.slow  # trains in spawned processes

# The tutorials' ZeRO-2 example: micro-batch 4 x accumulation 2 x 4 GPUs = 32.
TUTORIAL = {
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}, "allgather_partitions": True},
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
}
ZERO3_OFFLOAD_BF16 = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": "auto",
    "train_batch_size": 16,
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu"}, "overlap_comm": True},
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 2e-4, "betas": [0.9, 0.98], "eps": 1e-6, "weight_decay": 0.05}},
    "scheduler": {
        "type": "WarmupCosineLR",
        "params": {"total_num_steps": 1000, "warmup_num_steps": 50, "cos_min_ratio": 0.05,
                   "warmup_type": "linear"},
    },
    "gradient_clipping": 0.5,
    "steps_per_print": 25,
    "wall_clock_breakdown": False,
}
ZERO2_FP16 = {
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_max_lr": 1e-3, "warmup_num_steps": 10,
                                                      "total_num_steps": 200}}}


def convert(tmp_path, ds, *args):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ds))
    return run([sys.executable, "-m", "torchpar", "config", "from-deepspeed", str(path), *args], tmp_path)


def written(tmp_path, r):
    assert r.returncode == 0, r.stderr
    (tmp_path / "out.toml").write_text(r.stdout)
    return load_config(tmp_path / "out.toml")


def test_tutorial_example_keeps_its_batch_arithmetic(tmp_path):
    r = convert(tmp_path, TUTORIAL, "--nproc", "4")
    cfg = written(tmp_path, r)
    assert (cfg.parallelism.zero_stage, cfg.training.local_batch_size, cfg.training.global_batch_size) == (2,
                                                                                                           4,
                                                                                                           32)
    llama = MODELS["llama3"]
    layout = resolve_layout(cfg.parallelism, cfg.training, llama, llama.args("debug"), 4, "float32")
    assert layout.accum == 2 and layout.dp_shard == 4 and layout.zero_stage == 2
    # What it could not map is said, with the reason, in the file and on stderr.
    assert "# not mapped: zero_optimization.allgather_partitions" in r.stdout
    assert "not mapped: zero_optimization.allgather_partitions" in r.stderr


def test_zero3_offload_bf16_adamw_cosine(tmp_path):
    cfg = written(tmp_path, convert(tmp_path, ZERO3_OFFLOAD_BF16, "--nproc", "4", "--model", "1B"))
    p, t, o, s = cfg.parallelism, cfg.training, cfg.optimizer, cfg.lr_scheduler
    assert (p.zero_stage, p.cpu_offload, t.mixed_precision_param, cfg.model.flavor) == (3, True, "bfloat16",
                                                                                        "1B")
    assert (t.local_batch_size, t.global_batch_size, t.steps, t.max_norm) == (2, 16, 1000, 0.5)  # "auto" = 2
    assert (o.lr, o.beta1, o.beta2, o.eps, o.weight_decay) == (2e-4, 0.9, 0.98, 1e-6, 0.05)
    assert o.decay_all  # (DeepSpeed decays every parameter its optimizer is given)
    assert (s.decay_type, s.warmup_steps, s.min_lr_ratio, cfg.metrics.log_freq) == ("cosine", 50, 0.05, 25)


def test_zero2_fp16_reports_what_torchpar_does_not_do(tmp_path):
    r = convert(tmp_path, ZERO2_FP16, "--nproc", "2")
    cfg = written(tmp_path, r)
    assert (cfg.training.global_batch_size, cfg.training.mixed_precision_param) == (
        16,
        "float32",
    )  # auto = 8x1x2
    assert (cfg.lr_scheduler.decay_type, cfg.lr_scheduler.min_lr_ratio, cfg.training.steps) == ("linear", 0.0,
                                                                                                200)
    for key in ("fp16.enabled", "scheduler.params.warmup_type"):
        assert f"not mapped: {key}" in r.stderr, key
    assert cfg.parallelism.bucket_mb == 5e8 * 4 / 2**20  # DeepSpeed's elements, as MB of fp32 gradients


@pytest.mark.parametrize("ds, message", [
    ({**TUTORIAL, "train_batch_size": 30}, "train_batch_size 30 != train_micro_batch_size_per_gpu 4"),
    ({"train_batch_size": 16}, "give train_micro_batch_size_per_gpu"),
    ({"train_micro_batch_size_per_gpu": -1}, "positive integers"),
])
def test_bad_configs_are_one_line(tmp_path, ds, message):
    r = convert(tmp_path, ds, "--nproc", "4")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("torchpar: error: ") and message in r.stderr, r.stderr


def test_generated_toml_trains(tmp_path):
    """The tutorial's shape on 2 ranks (ZeRO-2, micro-batch 4 x accumulation 2 x 2 = 16) runs."""
    ds = {**TUTORIAL, "train_batch_size": 16, "steps_per_print": 1}
    (tmp_path / "my.toml").write_text(convert(tmp_path, ds, "--nproc", "2").stdout)
    out = tmp_path / "run"
    r = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
             "torchpar", "train", "--config", str(tmp_path / "my.toml"), "--training.steps", "3",
             "--training.seq_len", "32", "--job.dump_folder", str(out)], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert [x["step"] for x in records(out)] == [1, 2, 3]
    assert "zero 2, global batch 16 (2 accumulation step(s))" in r.stdout
