"""Bad layouts fail with one clear message before any process group exists."""

import warnings

import pytest
import torch.distributed as dist
from harness import TINY

from torchpar.config import ConfigError, load_config
from torchpar.models import MODELS
from torchpar.models.llama import ModelArgs
from torchpar.parallel.layout import resolve_layout
from torchpar.train import Trainer


def build(world, monkeypatch, *overrides):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_config(TINY, list(overrides) + ["--job.dump_folder", "/tmp/torchpar_validation"])
    Trainer(cfg)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ["--parallelism.tensor_parallel_degree", "3"],
         "the other degrees multiply to 3, which does not divide the world size 4"),
        (4, ["--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree", "4"],
         "tensor_parallel_degree=2 x pipeline_parallel_degree=1 = 8 ranks, but the world size is 4"),
        (3, ["--parallelism.tensor_parallel_degree", "3"], "does not divide the model's n_heads"),
        (8, ["--parallelism.tensor_parallel_degree", "8"], "does not divide the model's n_kv_heads"),
        (4, ["--parallelism.tensor_parallel_degree", "-1", "--parallelism.data_parallel_shard_degree", "-1"],
         "only one degree may be -1"),
        (2, ["--parallelism.tensor_parallel_degree", "2", "--training.seq_len", "33"],
         "sequence parallelism splits training.seq_len = 33"),
        (2, ["--training.global_batch_size", "12"], "not a multiple of 16"),
        (2, ["--parallelism.bucket_mb", "0"], "bucket size must be positive"),
        (2, ["--parallelism.cpu_offload", "true", "--parallelism.zero_stage", "2"], "cpu_offload needs"),
        (
            2,
            ["--parallelism.tensor_parallel_degree", "2", "--parallelism.zero_stage", "1",
             "--training.compile", "true"],
            "compile = true with tensor parallelism needs parallelism.zero_stage = 3",
        ),
        (
            2,
            ["--parallelism.tensor_parallel_degree", "2", "--training.compile", "true",
             "--training.activation_checkpoint", "full"],
            "fails inside torch.compile; drop one of the three",
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
             "ZBVZeroBubble", "--training.compile", "true"],
            "gives wrong gradients with ZBVZeroBubble",
        ),
        (
            2,
            [
                "--parallelism.pipeline_parallel_degree",
                "2",
                "--parallelism.pipeline_parallel_schedule",
                "1f1b",
            ],
            "Did you mean '1F1B'",
        ),
        (4, ["--parallelism.pipeline_parallel_degree", "4", "--training.local_batch_size", "2"],
         "1F1B needs at least as many microbatches as stages: 2 < 4"),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
             "Interleaved1F1B", "--training.local_batch_size", "5"],
            "multiple of its rounds",
        ),
        (
            4,
            ["--parallelism.pipeline_parallel_degree", "4", "--parallelism.pipeline_parallel_schedule",
             "Interleaved1F1B", "--model.n_layers", "5"],
            "8 pipeline stages .* only 5 layers",
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2",
             "--parallelism.pipeline_parallel_layers_per_stage", "4,3"],
            "cover all 8 layers exactly once",
        ),
        (
            2,
            ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.pipeline_parallel_schedule",
             "GPipe", "--parallelism.pipeline_parallel_stages_per_rank", "2"],
            "runs one stage per rank",
        ),
        (2, ["--parallelism.pipeline_parallel_degree", "2", "--model.flavor", "debug-tied"],
         "needs an untied flavour"),
        (1, ["--model.tokenizer_path", "/nonexistent/tok.model"],
         "model.tokenizer_path: tokenizer file not found"),
    ],
)
def test_bad_layout_is_refused_before_any_collective(monkeypatch, world, overrides, message):
    with pytest.raises(ConfigError, match=message):
        build(world, monkeypatch, *overrides)
    assert not dist.is_initialized()


def test_ffn_width_must_divide():
    cfg = load_config(
        TINY, ["--parallelism.tensor_parallel_degree", "4", "--parallelism.sequence_parallel=false"]
    )
    args = ModelArgs(dim=100, n_layers=2, n_heads=4, n_kv_heads=4, vocab_size=64, multiple_of=2)
    with pytest.raises(ConfigError, match=r"ffn hidden size \(266\)"):
        resolve_layout(cfg.parallelism, cfg.training, MODELS["llama3"], args, 4, "float32")


def test_zero_stage_without_shards_warns_and_runs_as_ddp(monkeypatch):
    par = load_config(
        None,
        ["--parallelism.zero_stage", "2", "--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"],
    ).parallelism
    tr, llama = load_config(None).training, MODELS["llama3"]
    with pytest.warns(UserWarning, match="shards nothing"):
        assert resolve_layout(par, tr, llama, llama.args("debug"), 2, "float32").zero_stage == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(None, ["--parallelism.zero_stage", "3"])
        layout = resolve_layout(cfg.parallelism, cfg.training, llama, llama.args("debug"), 1, "float32")
        assert layout.zero_stage == 3
