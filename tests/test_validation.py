"""Bad layouts fail with one clear message before any process group exists."""

import pytest
import torch.distributed as dist
from harness import TINY, cli
from test_train import env

from torchpar.config import load_config
from torchpar.errors import ConfigError
from torchpar.models import MODELS
from torchpar.models.llama import ModelArgs
from torchpar.parallel.layout import resolve_layout
from torchpar.plan.layout import layout_from_config
from torchpar.train import Trainer


def build(world, monkeypatch, *overrides):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    cfg = load_config(TINY, list(overrides) + ["--job.dump_folder", "/tmp/torchpar_validation"])
    Trainer(cfg)


@pytest.mark.parametrize(
    "world, overrides, message",
    [
        (4, ["--parallelism.tensor_parallel_degree", "3"],
         r"the other degrees \(tensor_parallel_degree=3\) multiply to 3, which does not divide the world "
         "size 4"),
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
            "fails inside torch.compile",
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


def test_zero_stage_without_shards_warns_and_runs_as_ddp(capfd):
    par = load_config(
        None,
        ["--parallelism.zero_stage", "2", "--parallelism.data_parallel_replicate_degree", "2",
         "--parallelism.data_parallel_shard_degree", "1"],
    ).parallelism
    tr, llama = load_config(None).training, MODELS["llama3"]
    assert resolve_layout(par, tr, llama, llama.args("debug"), 2, "float32").zero_stage == 0
    assert capfd.readouterr().err == ("torchpar: warning: parallelism.zero_stage = 2 with "
                                      "data_parallel_shard_degree 1 shards nothing; it runs as zero_stage 0 "
                                      "(gradients all-reduced over the replicas)\n")
    cfg = load_config(None, ["--parallelism.zero_stage", "3"])
    layout = resolve_layout(cfg.parallelism, cfg.training, llama, llama.args("debug"), 1, "float32")
    assert layout.zero_stage == 3 and capfd.readouterr().err == ""


def layout_of(world, *overrides):
    cfg = load_config(None, list(overrides))
    return resolve_layout(cfg.parallelism, cfg.training, MODELS["llama3"], MODELS["llama3"].args("debug"),
                          world, "float32", overridden=cfg.overridden)


def warnings_in(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("torchpar: warning: ")]


def test_bucket_size_under_zero3_warns(capfd):
    """FSDP2 has no buckets: a bucket size given on the command line under ZeRO-3 is named as having
    no effect; under ZeRO 0-2, left at its default, or set by a config file (a base its ZeRO 0-2
    layouts share: the self-test's), nothing is said."""
    layout_of(2, "--parallelism.zero_stage", "3", "--parallelism.bucket_mb", "4")
    assert warnings_in(capfd.readouterr().err) == [
        "torchpar: warning: parallelism.bucket_mb = 4 has no effect under zero_stage 3 (FSDP2 reduces each "
        "block's gradients in one collective); drop it, or choose zero_stage 0-2 for buckets"]
    layout_of(2, "--parallelism.zero_stage", "3", "--parallelism.bucket_mb", "25")
    layout_of(2, "--parallelism.zero_stage", "2", "--parallelism.bucket_mb", "4")
    cfg = load_config(TINY)
    assert cfg.parallelism.zero_stage == 3 and cfg.parallelism.bucket_mb != 25 and not cfg.overridden
    layout_from_config(cfg, 2)
    assert warnings_in(capfd.readouterr().err) == []


def test_too_many_buckets_are_refused_by_arithmetic():
    """The bucket count is worked out from the rank's parameters before anything is built; the
    size the message suggests is accepted, and gives at most MAX_BUCKETS."""
    from torchpar.parallel.flat import MAX_BUCKETS, bucket_elements

    with pytest.raises(ConfigError, match=r"bucket_mb = 1e-06 cuts a rank's 2,623,616 gradient elements into "
                       r"1,311,808 buckets, more than 10,000 .* use at least 0.0011 \(25"):
        layout_of(2, "--parallelism.zero_stage", "2", "--parallelism.bucket_mb", "0.000001")
    layout = layout_of(2, "--parallelism.zero_stage", "2", "--parallelism.bucket_mb", "0.0011")
    assert 2_623_616 / bucket_elements(layout) <= MAX_BUCKETS


def test_recompute_every_k_beyond_the_layers(capfd):
    """Beyond the layer count no block is recomputed: refused. Under a pipeline, a stage none of
    whose blocks is picked (by global index) is named in a warning."""
    full = ["--training.activation_checkpoint", "full", "--training.activation_checkpoint_every"]
    with pytest.raises(ConfigError, match="activation_checkpoint_every = 9 exceeds the model's 8 layers"):
        layout_of(1, *full, "9")
    layout_of(1, *full, "8")
    pp2 = ["--parallelism.pipeline_parallel_degree", "2", "--parallelism.zero_stage", "0",
           "--parallelism.pipeline_parallel_layers_per_stage", "4,4"]
    layout_of(2, *pp2, *full, "4")  # blocks 3 and 7: one in each stage of 4
    assert warnings_in(capfd.readouterr().err) == []
    layout_of(2, *pp2, *full, "5")  # block 4 only: stage 1's
    (line,) = warnings_in(capfd.readouterr().err)
    assert "activation_checkpoint_every = 5 recomputes no block of pipeline stage(s) 0 (layers per stage " \
           "[4, 4]" in line


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A dump folder with a checkpoint of step 2 of the tiny model."""
    tmp = tmp_path_factory.mktemp("resume")
    r = cli(["train", "--config", str(TINY), "--training.steps", "2", "--checkpoint.enable", "true",
             "--job.dump_folder", str(tmp / "run")], env(tmp))
    assert r.returncode == 0, r.stderr
    return tmp / "run"


@pytest.mark.slow
def test_what_a_resume_overrides_or_changes_warns(trained, capfd, monkeypatch):
    """A resume ignores checkpoint.initial_load_path and may toggle data.document_masking: one
    warning each, naming the checkpoint and its step; the same settings as the run say nothing."""
    from torchpar.preflight import preflight

    monkeypatch.delenv("RANK", raising=False)
    resume = ["--job.dump_folder", str(trained), "--checkpoint.enable", "true", "--training.steps", "4"]
    capfd.readouterr()
    preflight(load_config(TINY, resume), 1)
    assert [line for line in warnings_in(capfd.readouterr().err) if "bucket_mb" not in line] == []
    step = trained / "checkpoint" / "step-00000002"
    preflight(load_config(TINY, [*resume, "--checkpoint.initial_load_path", "/weights.pt",
                                 "--data.document_masking", "true"]), 1)
    lines = [line for line in warnings_in(capfd.readouterr().err) if "bucket_mb" not in line]
    assert lines == [
        f"torchpar: warning: checkpoint.initial_load_path = '/weights.pt' is not read: the run resumes from "
        f"the checkpoint {step} (step 2), whose weights win; initial weights apply only to a checkpoint "
        "folder without checkpoints",
        f"torchpar: warning: data.document_masking = true, but the checkpoint {step} (step 2) was trained "
        "with false: from step 3 on, attention stays inside each document and positions restart at each "
        "one; set it back to false to train on as before"]


@pytest.mark.parametrize("factor, dropped", [("0.001", "99.9%"), ("0.5", "50.0%"), ("1", None), ("0", None)])
def test_a_capacity_below_an_even_share_warns(factor, dropped, capfd):
    """A capacity factor under 1 drops slots even when the routing is perfectly even: one warning
    naming the share; 1 and above, and 0 (dropless), say nothing."""
    from torchpar.preflight import preflight

    preflight(load_config(TINY, ["--model.name", "moe", "--model.capacity_factor", factor]), 1)
    said = [w for w in warnings_in(capfd.readouterr().err) if "bucket_mb" not in w]
    assert len(said) == (dropped is not None), said
    assert dropped is None or (f"model.capacity_factor = {factor}" in said[0]
                               and f"drops about {dropped}" in said[0])
