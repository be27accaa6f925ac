"""The GPU and cluster paths, in their CPU-testable shapes: the peak table and MFU, the dtype
'auto' resolves to, the device index, the backends of the default group, srun's variables, the
device-side init, SDPA's grouped-query attention, and ``torchpar selftest`` itself."""

import json
import os
import re
import socket
import subprocess
import sys
import zlib
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from harness import ROOT, TINY, cli, free_port

from torchpar import device as dev
from torchpar.errors import ConfigError

B = torch.bfloat16


@pytest.mark.parametrize(
    "name, dtype, tf32, peak",
    [
        ("NVIDIA H100 80GB HBM3", B, True, 989e12),
        ("NVIDIA H100 PCIe", B, True, 756e12),
        ("NVIDIA H100 NVL", B, True, 835e12),
        ("NVIDIA H200", B, True, 989e12),
        ("NVIDIA H20", B, True, 148e12),  # not the H200's row
        ("NVIDIA H800", B, True, 989e12),
        ("NVIDIA A100-SXM4-80GB", B, True, 312e12),
        ("NVIDIA A10G", B, True, 70e12),  # not the A10's
        ("NVIDIA A10", B, True, 125e12),
        ("NVIDIA L4", B, True, 121e12),
        ("NVIDIA L40S", B, True, 362e12),
        ("NVIDIA B200", B, True, 2.25e15),
        ("NVIDIA GB200", B, True, 2.5e15),
        ("NVIDIA GH200 480GB", B, True, 989e12),  # not the H200's row, though it holds "H200"
        ("NVIDIA GH200 480GB", torch.float32, True, 494.7e12),
        ("NVIDIA GH200 480GB", torch.float32, False, 67e12),
        ("AMD Instinct MI300X", B, True, 1307.4e12),  # ROCm reports as a cuda device
        ("NVIDIA H100 80GB HBM3", torch.float32, True, 494.7e12),  # fp32 matmuls run as TF32
        ("NVIDIA H100 80GB HBM3", torch.float32, False, 67e12),
        ("NVIDIA GeForce RTX 4090", B, True, None),  # unknown: no MFU rather than a guess
    ],
)
def test_peak_table_by_device_name_and_dtype(name, dtype, tf32, peak):
    assert dev.gpu_peak(name, dtype, tf32) == peak


def test_peak_override_and_auto_dtype(monkeypatch):
    assert dev.peak_flops(torch.float32, 64, override_tflops=123.0) == (123e12, "metrics.peak_tflops")
    assert dev.compute_dtype("auto") == "float32"  # this machine: a CPU
    assert (dev.compute_dtype("auto", "cuda"), dev.compute_dtype("float32", "cuda")) == (
        "bfloat16",
        "float32",
    )
    monkeypatch.setattr(dev, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA GH200 480GB")
    assert dev.peak_flops(B, 64) == (989e12, "datasheet bfloat16 peak of NVIDIA GH200 480GB")


@pytest.mark.parametrize("name", ["NVIDIA Foo 9000", "NVIDIA GeForce RTX 4090", "NVIDIA XH200"])
def test_a_gpu_the_peak_table_lacks_says_which_figure_to_give(monkeypatch, name):
    """No MFU rather than a guess, and the warning the trainer prints names the device and the
    setting, with the figure it wants (the compute dtype's dense peak)."""
    monkeypatch.setattr(dev, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    peak, why = dev.peak_flops(B, 64)
    assert peak is None and why == (
        f"{name} is not in torchpar's table of datasheet peaks, so no MFU is reported: set "
        "metrics.peak_tflops to its dense bfloat16 peak in TFLOP/s")
    assert "dense float32 (TF32) peak" in dev.peak_flops(torch.float32, 64, tf32=True)[1]
    assert dev.peak_flops(torch.float32, 64, override_tflops=50.0) == (50e12, "metrics.peak_tflops")


def test_tf32_is_set_through_fp32_precision(monkeypatch):
    """local_device sets TF32 with torch's fp32_precision settings (the allow_tf32 flags are
    deprecated, and mixing the two raises); on a CPU build they can be set, so the GPU path runs."""
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    before = matmul.fp32_precision, conv.fp32_precision
    monkeypatch.setattr(dev, "device_type", lambda: "cuda")
    monkeypatch.setattr(dev, "device_index", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    try:
        for tf32, precision in ((True, "tf32"), (False, "ieee"), (True, "tf32")):
            assert dev.local_device(tf32) == torch.device("cuda", 0)
            assert (matmul.fp32_precision, conv.fp32_precision) == (precision, precision)
    finally:
        matmul.fp32_precision, conv.fp32_precision = before
    assert (matmul.fp32_precision, conv.fp32_precision) == before


def test_default_group_backends(monkeypatch):
    assert dev.backend() == dev.backend(cpu_tensors=True) == "gloo"
    monkeypatch.setattr(dev, "device_type", lambda: "cuda")
    # CPU offload keeps gradients (and their norm's all-reduce) on the host: gloo beside nccl.
    assert (dev.backend(), dev.backend(cpu_tensors=True)) == ("nccl", "cpu:gloo,cuda:nccl")


def test_the_device_is_local_rank_and_must_exist(monkeypatch):
    monkeypatch.setattr(dev, "device_type", lambda: "cuda")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv("RANK", "13")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(ConfigError, match="LOCAL_RANK 5 but this node has 4 visible GPU"):
        dev.local_device()


def test_cpu_offload_group_runs_host_collectives():
    """The default group a GPU job gets with CPU offload, in the form gloo takes on a CPU."""
    import torch.distributed as dist

    dist.init_process_group("cpu:gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
    finally:
        dist.destroy_process_group()


SRUN = {
    "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_NUM_NODES": "2",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_STEP_NODELIST": "gpu[003-004]",
    "SLURM_JOB_ID": "4242",
}


@pytest.mark.slow
def test_srun_variables_map_to_torchrun_ones():
    env = dev.slurm_environment(SRUN)
    assert env == {
        "RANK": "5",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "gpu003",
        "MASTER_PORT": str(20000 + 4242),
    }
    assert (
        dev.slurm_environment({**SRUN, "MASTER_ADDR": "head", "MASTER_PORT": "1234"})["MASTER_ADDR"] == "head"
    )
    assert dev.slurm_environment({**SRUN, "RANK": "5"}) == {}  # torchrun under srun already set them
    assert dev.slurm_environment({**SRUN, "SLURM_STEP_NUM_TASKS": "1"}) == {}  # one task: nothing to join
    assert dev.slurm_environment({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"}) == {}  # a batch script, no srun
    assert [dev.first_host(s) for s in ("n1", "n[7,9]", "gpu[003-010,012],cpu1", "a-b[1-2]")] == [
        "n1",
        "n7",
        "gpu003",
        "a-b1",
    ]
    with pytest.raises(ConfigError, match="SLURM_PROCID is not set"):
        dev.slurm_environment({k: v for k, v in SRUN.items() if k != "SLURM_PROCID"})


@pytest.mark.slow
def test_srun_without_torchrun_is_one_job(tmp_path):
    """Two processes started as srun starts them (no torchrun variables) form one world-2 job, not
    two world-1 jobs writing the same files; a task that cannot tell its rank is one line."""
    base = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    base.update(
        OMP_NUM_THREADS="1",
        SLURM_STEP_NUM_TASKS="2",
        SLURM_STEP_NUM_NODES="1",
        SLURM_STEP_NODELIST="localhost",
        MASTER_PORT=str(free_port()),
    )
    cmd = [
        sys.executable,
        "-m",
        "torchpar",
        "train",
        "--config",
        str(TINY),
        "--training.steps",
        "2",
        "--training.local_batch_size",
        "4",
        "--job.dump_folder",
        str(tmp_path),
    ]
    procs = [
        subprocess.Popen(
            cmd,
            cwd=ROOT,
            env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "world 2 = pp 1 x dp_replicate 1 x dp_shard 2" in outs[0]
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # one writer
    r = cli(cmd[3:], {**base, "SLURM_LOCALID": "0"}, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "torchpar: error: started by srun with 2 tasks, but SLURM_PROCID is not set, so this process cannot "
        "tell its rank: launch through torchrun (scripts/slurm/train.sbatch) instead"
    ]


def test_init_on_the_device_keeps_the_seeded_numbers():
    """Weights come from a per-name generator on the parameter's device; on a CPU the numbers are
    those of the seeded CPU generator, so checkpoints and tests from before still agree."""
    from torchpar.models import MODELS

    model = MODELS["llama3"].build(MODELS["llama3"].args("debug"))
    model.init_weights(7)
    name = "layers.3.attention.wq.weight"
    gen = torch.Generator().manual_seed(7 * 1_000_003 + zlib.crc32(name.encode()))
    expected = torch.randn(tuple(model.get_parameter(name).shape), generator=gen) * model.init_std(name)
    assert torch.equal(model.get_parameter(name), expected)


def test_grouped_query_attention_in_the_kernel_equals_repeated_heads():
    from torchpar.models.llama import Attention, ModelArgs, rope_tables

    args = ModelArgs(dim=64, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=16, max_seq_len=16)
    attn = Attention(args)
    x = torch.randn(2, 16, 64, requires_grad=True)
    cos, sin = rope_tables(args)
    out = attn(x, cos, sin)
    out.sum().backward()
    grads = [p.grad.clone() for p in attn.parameters()] + [x.grad.clone()]
    for p in [*attn.parameters(), x]:
        p.grad = None

    # The same attention with K and V repeated to every query head, as before enable_gqa.
    from torchpar.models import common

    def repeated_sdpa(q, k, v, attn_mask, is_causal, enable_gqa):
        n = q.shape[1] // k.shape[1]
        return sdpa(q, k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1), attn_mask=attn_mask,
                    is_causal=is_causal)

    sdpa = torch.nn.functional.scaled_dot_product_attention
    common.F.scaled_dot_product_attention = repeated_sdpa
    try:
        ref = attn(x, cos, sin)
        ref.sum().backward()
    finally:
        common.F.scaled_dot_product_attention = sdpa
    assert torch.allclose(out, ref, atol=1e-6)
    for g, p in zip(grads, [*attn.parameters(), x]):
        assert torch.allclose(g, p.grad, atol=1e-5)


@pytest.mark.slow
def test_selftest_passes_and_fails_a_broken_layout(tmp_path):
    """`torchpar selftest --nproc 2` on CPU, on a job with an opt-in model feature (attention sinks,
    given as a plain override) and two built-in layouts: each equals one process (losses,
    parameters); a layout whose learning rate differs (a broken layout, on purpose) differs."""
    out = tmp_path / "rows.json"
    r = cli(["selftest", "--nproc", "2", "--only", "zero3,dp2_zero1", "--json", str(out), "--layout",
             "broken=--optimizer.lr 4e-3", "--model.attn_sink", "true"],
            {**os.environ, "OMP_NUM_THREADS": "1"}, timeout=600)
    rows = {row["layout"]: row for row in json.loads(out.read_text())}
    assert r.returncode == 1, r.stdout + r.stderr
    assert "with --model.attn_sink true" in r.stdout
    broken = rows.pop("broken")
    assert broken["status"].startswith("DIFFERS: the loss differs from step 2 on")  # (after the first update)
    assert "failed: broken (float32)" in r.stdout
    assert any("final parameters differ" in line for line in broken["differences"])
    assert set(rows) == {"one_device", "zero3", "dp2_zero1"}
    for row in rows.values():
        assert row["status"] == "PASS" and row["max_dloss"] <= 1e-5 and row["tokens_per_sec"] > 0, row


@pytest.mark.slow
def test_selftest_catches_a_forks_broken_change_and_names_its_refusals(tmp_path):
    """A fork's change that is right on one device and wrong under tensor parallelism (attention
    sinks read in reverse order: each rank's split hands its heads other heads' sinks; a model kept
    outside the package, named by module:NAME, set by --set): DIFFERS under tp 2 and PASS where no
    split reorders heads; ring attention is REFUSED with the composition table's line, before any
    process starts, and does not fail the run."""
    out = tmp_path / "rows.json"
    path = f"{ROOT / 'tests'}:{os.environ.get('PYTHONPATH', '')}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    r = cli(["selftest", "--nproc", "2", "--only", "dp2_zero3,tp2_sp_lp,cp2_ring", "--json", str(out),
             "--set", "model.name=flipped_sinks:ADAPTER", "--set", "model.attn_sink=true"], env, timeout=600)
    rows = {row["layout"]: row["status"] for row in json.loads(out.read_text())}
    assert r.returncode == 1, r.stdout + r.stderr
    assert rows["one_device"] == rows["dp2_zero3"] == "PASS", rows
    assert rows["tp2_sp_lp"].startswith("DIFFERS: the loss differs from step 1 on"), rows
    assert rows["cp2_ring"].startswith("REFUSED: model.attn_sink: attention beyond what the ring's"), rows
    assert "2 of 4 passed, 1 refused; failed: tp2_sp_lp (float32)" in r.stdout


def fake_result(loss: float = 1.0) -> dict:
    """What a layout's run returns, as much of it as a table row reads."""
    return {"losses": [loss], "params": {}, "val_losses": [],
            "logged": [{"loss": loss, "tokens_per_sec": 100.0, "mfu": None, "mem_peak_rss_gib": 0.5}]}


def test_selftest_reports_a_layout_that_raises_and_runs_the_others(monkeypatch, capsys):
    """A rank that raises in one layout ends its group of processes (here a fake group): that
    layout's row is ERROR with the rank's one-line error, the layouts after it train in a new
    group, and the command exits 1. A group that fails after its last layout marks that one."""
    from torchpar import selftest
    from torchpar.commands.selftest import main

    calls = []

    def fake_group(world, layouts, base):
        calls.append((world, list(layouts)))
        done = {}
        for name in layouts:
            if name == "dp2_zero1":
                return done, RuntimeError(
                    "process 1 terminated with exit code 1\n--- rank 1 ---\n"
                    "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
                    "ValueError: dp2_zero1 broke on purpose\n--- rank 0 ---\n")
            done[name] = fake_result()
        return done, None

    monkeypatch.setattr(selftest, "run_group", fake_group)
    assert main(["--nproc", "2", "--only", "dp2_zero0,dp2_zero1,dp2_zero2"]) == 1
    assert calls == [(1, ["one_device"]), (2, ["dp2_zero0", "dp2_zero1", "dp2_zero2"]), (2, ["dp2_zero2"])]
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split(None, 3)[3] for line in out.splitlines()
            if line.split() and line.split()[0] in ("one_device", "dp2_zero0", "dp2_zero1", "dp2_zero2")}
    assert rows["dp2_zero1"] == "ERROR: ValueError: dp2_zero1 broke on purpose", out
    assert all(rows[n].endswith("PASS") for n in ("one_device", "dp2_zero0", "dp2_zero2")), out
    assert "selftest: 3 of 4 passed; failed: dp2_zero1 (float32)" in out

    def fails_at_the_end(world, layouts, base):
        return {name: fake_result() for name in layouts}, RuntimeError("a rank died")

    monkeypatch.setattr(selftest, "run_group", fails_at_the_end)
    assert selftest.run_each(2, {"a": [], "b": []}, selftest.BASE) == {
        "a": fake_result(), "b": "after training, at the group's end: a rank died (no Python error: a signal "
                                 "or a native abort)"}


FAKE_PYTHON = """#!/usr/bin/env bash
# Records each call and the variables gpu_check.sh sets.
echo "$* | NCCL_DEBUG=${NCCL_DEBUG:-} PYTHONFAULTHANDLER=${PYTHONFAULTHANDLER:-}" >> "$FAKE_LOG"
case "$*" in
  *"torchpar selftest"*) exit 3 ;;
  *"quantize.float8"*) ;;
  *"zero_stage 3"*) sleep 30 ;;
esac
"""
FAKE_NVIDIA_SMI = """#!/usr/bin/env bash
if [ "$1" = -L ]; then printf 'GPU 0: NVIDIA H200 (UUID: GPU-0)\nGPU 1: NVIDIA H200 (UUID: GPU-1)\n'
else echo "NVIDIA H200, 143771 MiB, 570.86.15"; fi
"""


def test_gpu_check_runs_the_cheap_stages_first_each_under_its_limit(tmp_path):
    """benchmarks/gpu_check.sh with a fake python and nvidia-smi on PATH (2 GPUs): the stages in
    order (env, one-GPU smoke step, two-GPU torchrun smoke step, the 1B runs, FP8's, the CUDA tests, the
    attention benchmark, MoE with ep 2 and under FP8, the ring on 2 GPUs, Muon under ZeRO-3 on 2
    GPUs, auto with 2 trials, selftest), NCCL_DEBUG only in the first distributed stage, Python's
    fault handler on everywhere, a stage past its limit stopped by SIGABRT (exit 124), and one
    summary line at the end; exit 1."""
    script = ROOT / "benchmarks" / "gpu_check.sh"
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", FAKE_PYTHON), ("nvidia-smi", FAKE_NVIDIA_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log, out = tmp_path / "calls.log", tmp_path / "out"
    r = subprocess.run(["bash", str(script), str(out)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(log),
                            "STAGE_S": "2", "SMOKE_S": "20"})
    assert r.returncode == 1, r.stdout + r.stderr
    calls = [line.split(" | ") for line in log.read_text().splitlines()]
    launch = ("-m torchpar.commands.launch --standalone --nproc-per-node 2 --max-restarts 0 "
              "--local-ranks-filter 0 -m torchpar train --config train_configs/debug_model.toml")
    stages = [
        ("-c import faulthandler, time; faulthandler.dump_traceback_later(10, exit=True)", ""),
        ("-m torchpar train --config torchpar/assets/selftest.toml --training.steps 3", ""),
        ("-m torchpar.commands.launch --standalone --nproc-per-node 2", "INFO"),
        ("-m torchpar train --config train_configs/debug_model.toml --model.flavor 1B", ""),
        ("-m torchpar train --config train_configs/debug_model.toml --model.flavor 1B", ""),
        *[("-m torchpar train --config train_configs/debug_model.toml --model.flavor 1B", "")] * 2,
        ("-m pytest -q -p no:cacheprovider tests/test_attention.py", ""),
        ("benchmarks/attention.py --repeats 3", ""),
        (f"{launch} --model.name moe", ""),
        (f"{launch} --model.name moe", ""),
        (f"{launch} --training.steps 20 --training.seq_len 4096", ""),
        (f"{launch} --model.flavor 1B", ""),
        ("-m torchpar train --config train_configs/debug_model.toml --model.flavor 1B", ""),
        ("-m torchpar selftest --json", ""),
        ("- " + str(out), ""),
    ]
    assert len(calls) == len(stages), calls
    for (args, env), (start, nccl) in zip(calls, stages):
        assert args.startswith(start) and env == f"NCCL_DEBUG={nccl} PYTHONFAULTHANDLER=1", (args, env)
    summary = r.stdout.splitlines()[-1]
    assert re.fullmatch(r"gpu_check: env ok \d+s \| smoke_1gpu ok \d+s \| smoke_2gpu ok \d+s \| "
                        r"1B_zero0 ok \d+s \| 1B_zero3 exit 124 \(limit\) \d+s \| "
                        r"1B_fp8_tensorwise ok \d+s \| 1B_fp8_rowwise ok \d+s \| cuda_tests ok \d+s \| "
                        r"attention ok \d+s \| "
                        r"moe ok \d+s \| moe_fp8 ok \d+s \| ring_cp2 ok \d+s \| "
                        r"muon_zero3 exit 124 \(limit\) \d+s \| "
                        r"auto ok \d+s \| selftest exit 3 \d+s", summary), summary
    assert "NVIDIA H200, 143771 MiB" in (out / "env.log").read_text()
    assert (out / "tmp" / "selftest").is_dir()  # a failed self-test keeps its ranks' logs


def _tails(codes, outputs: dict[str, str], logs, lines: int = 40) -> str:
    """What failed runs printed: each output's and each log's last lines, one short line each (a
    folded or cut message would hide the one line that says why)."""
    parts = [f"exit codes {codes}"]
    texts = {**outputs, **{p.name: p.read_text(errors="replace") for p in sorted(logs.glob("*.log"))}}
    for name, text in texts.items():
        parts.append(f"--- {name}")
        parts += [line[:300] for line in text.splitlines()[-lines:]]
    return "\n".join(parts)


@pytest.mark.slow
def test_two_nodes_on_one_machine_equal_one_process(tmp_path):
    """Two torchrun agents as two nodes of 2 ranks (run_train.sh with NNODES=2, a c10d rendezvous on
    127.0.0.1) train dp_shard 2 x tp 2 for 5 steps; the losses equal one process's within 1e-5."""
    layout = ["--parallelism.tensor_parallel_degree", "2", "--training.local_batch_size", "4"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "CONFIG_FILE": str(TINY),
        "NGPU": "2",
        "NNODES": "2",
        "RDZV_ENDPOINT": f"127.0.0.1:{free_port()}",
        "RDZV_ID": "two-nodes-test",
        "PYTHONFAULTHANDLER": "1",  # a rank that crashes leaves its Python stack in its log
    }
    nodes = [
        subprocess.Popen(
            ["./run_train.sh", *layout, "--job.dump_folder", str(tmp_path / "job")],
            cwd=ROOT,
            env={**env, "NODE_RANK": str(n)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for n in range(2)
    ]
    ref = cli(["train", "--config", str(TINY), "--parallelism.zero_stage", "0", "--job.dump_folder",
               str(tmp_path / "ref")], {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"})
    outs = [p.communicate(timeout=300)[0] for p in nodes]
    codes = [p.returncode for p in nodes] + [ref.returncode]
    printed = {"node 0": outs[0], "node 1": outs[1], "one process": ref.stderr}
    assert codes == [0, 0, 0], _tails(codes, printed, tmp_path / "job" / "logs")
    assert "world 4 = pp 1 x dp_replicate 1 x dp_shard 2 x tp 2" in outs[0] and "[default" not in outs[0]
    # Every rank of both nodes also wrote its output to its own file in the shared dump folder.
    logs = tmp_path / "job" / "logs"
    # (and each node's torchrun its report)
    assert sorted(p.name for p in logs.iterdir()) == [f"rank_{r}.log" for r in range(4)] + [
        "torchrun_node0.log", "torchrun_node1.log"]
    assert "world 4 = pp 1" in (logs / "rank_0.log").read_text()

    def losses(folder):
        return [
            r["loss"]
            for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
            if "loss" in r
        ]

    got, want = losses(tmp_path / "job"), losses(tmp_path / "ref")
    assert len(got) == len(want) == 5 and max(abs(a - b) for a, b in zip(got, want)) <= 1e-5, (got, want)


@pytest.mark.slow
def test_run_train_refuses_a_multi_node_launch_it_cannot_join(tmp_path):
    env = {**os.environ, "CONFIG_FILE": str(TINY), "NGPU": "2"}
    for extra, message in [
        ({"NNODES": "2"}, "NNODES=2 needs RDZV_ENDPOINT=host:port"),
        ({"NNODES": "2", "NODE_RANK": "2", "RDZV_ENDPOINT": "h:1"}, "NODE_RANK=2: give 0..1"),
        ({"SLURM_STEP_NUM_TASKS": "8"}, "started by srun as 8 tasks for NNODES=1"),
    ]:
        r = subprocess.run(
            ["./run_train.sh", "--job.dump_folder", str(tmp_path)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**env, **extra},
            timeout=60,
        )
        assert r.returncode == 2 and r.stderr.startswith(f"run_train.sh: error: {message}"), r.stderr


@pytest.mark.slow
def test_cpu_training_keeps_freed_memory_in_the_heap():
    """Once the training device is chosen on a CPU, a large tensor is carved from the process heap
    and its pages stay resident when it is freed, as CUDA's caching allocator keeps a GPU's; before,
    glibc maps it on its own and unmaps it at the free, so the next one faults in again.
    Asserted on what the setting fixes (where the block lies, what a free gives back), not on
    page faults per allocation: torch asks glibc for 64-byte-aligned blocks, for which glibc's
    memalign requests the size plus the alignment and a minimum chunk, so a freed hole of exactly
    one block cannot take the next equal block while a small live chunk borders it; that block
    goes on top of the heap, which grows to two or three blocks of a size and then reuses them
    (measured in fresh processes: faults stop after at most the third equal allocation)."""
    code = (
        "import json, torch\n"
        "from torchpar.device import local_device\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096\n"
        "def heap():\n"
        "    for line in open('/proc/self/maps'):\n"
        "        if line.endswith('[heap]\\n'):\n"
        "            return tuple(int(x, 16) for x in line.split()[0].split('-'))\n"
        "    return (0, 0)\n"
        "def freed():\n"
        "    t = torch.ones(2**24)  # 64 MiB, every page written\n"
        "    lo, hi = heap()\n"
        "    inside = lo <= t.data_ptr() < hi\n"
        "    held = rss()\n"
        "    del t\n"
        "    return [inside, (held - rss()) >> 20, heap()[1] >= hi]\n"
        "plain = [freed(), freed()]\n"
        "local_device()\n"
        "print(json.dumps([plain, [freed(), freed()]]))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 0, r.stderr
    plain, kept = json.loads(r.stdout)
    for inside, given_back_mib, _ in plain:
        assert not inside and given_back_mib >= 63, r.stdout  # its own mapping, unmapped at the free
    for inside, given_back_mib, heap_kept in kept:
        assert inside and given_back_mib <= 1 and heap_kept, r.stdout


@pytest.mark.parametrize("change, message", [
    ({"SLURM_PROCID": "8"}, "SLURM_PROCID=8 but SLURM_STEP_NUM_TASKS=8"),
    ({"SLURM_PROCID": "-1"}, "SLURM_PROCID='-1': expected a whole number 0 or more"),
    ({"SLURM_LOCALID": "first"}, "SLURM_LOCALID='first': expected a whole number 0 or more"),
    ({"SLURM_STEP_NUM_TASKS": "abc"}, "SLURM_STEP_NUM_TASKS='abc': expected a whole number 1 or more"),
    ({"SLURM_STEP_NUM_NODES": "0"}, "SLURM_STEP_NUM_NODES='0': expected a whole number 1 or more"),
    ({"SLURM_JOB_ID": "x"}, "SLURM_JOB_ID='x'"),
])
def test_srun_variables_that_do_not_add_up_are_refused(change, message):
    with pytest.raises(ConfigError, match=message):
        dev.slurm_environment({**SRUN, **change})


WHERE = {"MASTER_ADDR": "h", "MASTER_PORT": "1"}


@pytest.mark.parametrize("env, message", [
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "1"}, "WORLD_SIZE are set but MASTER_ADDR is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h"}, "MASTER_PORT is not"),
    ({"RANK": "2", "WORLD_SIZE": "2", **WHERE}, "RANK=2 but WORLD_SIZE=2"),
    ({"RANK": "0"}, "WORLD_SIZE=''"),
    ({"RANK": "0", "WORLD_SIZE": "two"}, "WORLD_SIZE='two'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "a", **WHERE}, "LOCAL_RANK='a'"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "port"}, "MASTER_PORT='port'"),
])
def test_torchrun_variables_that_do_not_add_up_are_refused(env, message):
    with pytest.raises(ConfigError, match=message):
        dev.check_rank_environment(env)


def test_torchrun_variables_that_add_up_pass():
    dev.check_rank_environment({})  # one process
    dev.check_rank_environment({"WORLD_SIZE": "4"})  # the launch check's world, no rank
    dev.check_rank_environment({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h",
                                "MASTER_PORT": "29500"})


def test_an_srun_task_with_its_one_gpu_uses_it(monkeypatch):
    """srun --gpus-per-task=1: each task sees exactly its own GPU (device 0), whatever its
    SLURM_LOCALID; under torchrun, or with more GPUs visible, LOCAL_RANK must exist."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for key in ("TORCHELASTIC_RUN_ID", "RANK", "SLURM_PROCID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(ConfigError, match="LOCAL_RANK 3 but this node has 1 visible GPU"):
        dev.device_index()  # no srun: a launch of more processes than GPUs
    monkeypatch.setenv("SLURM_PROCID", "7")
    monkeypatch.setenv("RANK", "7")  # as adopt_slurm_environment sets it
    assert dev.device_index() == 0
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job")  # torchrun under srun: its LOCAL_RANK counts
    with pytest.raises(ConfigError, match="LOCAL_RANK 3"):
        dev.device_index()
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # not one GPU per task
    with pytest.raises(ConfigError, match="LOCAL_RANK 3 but this node has 2 visible GPU"):
        dev.device_index()


def test_gloo_binds_the_interface_that_reaches_rank0():
    """gloo (every CPU group, the checkpointer's group on GPUs) binds the interface by which this
    host reaches MASTER_ADDR, not the address its host name resolves to (127.0.1.1 on many
    clusters: unreachable from other nodes)."""
    names = {name for _, name in socket.if_nameindex()}
    assert dev.gloo_interface("127.0.0.1") == "lo"
    assert dev.gloo_interface("localhost") == "lo"
    assert dev.gloo_interface("no-such-host.invalid") is None
    outward = dev.gloo_interface("10.255.255.1")  # by the default route, where there is one
    assert outward is None or (outward in names and outward != "lo")
    # Rank 0's node of a multi-node job, whose host name maps to 127.0.1.1: the default route's
    # interface (the other nodes cannot reach the loopback); on one node the loopback is right.
    assert dev.gloo_interface("127.0.1.1", across_nodes=True) == (outward or "lo")
    assert dev.gloo_interface("127.0.1.1") == "lo"


def test_one_process_group_has_the_timeout_and_the_interface(monkeypatch):
    """Without torchrun the one-rank group is made with comm.timeout_s (and on a GPU its device,
    so nccl connects at once, inside the start-up phase that says so), and gloo is told its
    interface before any group exists."""
    made = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.update(kw, backend=backend))
    monkeypatch.setattr(dev.atexit, "register", lambda fn: None)
    for name in ("RANK", "MASTER_ADDR", "GLOO_SOCKET_IFNAME"):
        monkeypatch.delenv(name, raising=False)
    assert dev.init_distributed(timeout_s=77) == (0, 1)
    assert made["timeout"] == timedelta(seconds=77) and made["device_id"] is None and made["world_size"] == 1
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice is kept
    dev.init_distributed(timeout_s=77)
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_the_checkpoint_writers_group_gets_the_configured_timeout(tmp_path):
    """comm.timeout_s reaches the async checkpoint writer's group (c10d would give a later group
    its own default: 30 min on gloo)."""
    import dataclasses

    from torchpar.checkpoint.checkpointer import Checkpointer
    from torchpar.config import load_config

    dev.init_distributed(timeout_s=77)
    try:
        cfg = load_config(TINY, [])
        saver = Checkpointer(dataclasses.replace(cfg.checkpoint, enable=True, async_mode="async"), tmp_path,
                             {}, {}, None, None)
        timeout = saver.async_group._get_backend(torch.device("cpu")).options._timeout
        assert timeout == timedelta(seconds=77)
        saver.close()
    finally:
        dev.shutdown_distributed()


def test_every_gloo_group_has_one_worker_and_its_timeout(monkeypatch):
    """torch 2.13's gloo groups run two worker threads that race on the group's status string when
    two collectives finish together (a double free: the rank aborts in malloc, seen with DTensor's
    all-gathers beside another collective): every gloo group torchpar makes has one worker, with
    a device for each interface named (as torch's own constructor gives) and comm.timeout_s; a
    functional all-gather and an all-reduce in flight together still complete."""
    from torch.distributed import _functional_collectives as funcol

    from torchpar.parallel.layout import Layout

    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo,lo")
    dev.init_distributed(timeout_s=77)
    try:
        mesh = Layout().build_mesh("cpu")
        later = dist.new_group(backend="gloo", timeout=dev.group_timeout())
        groups = list(dist.distributed_c10d._world.pg_map)
        assert len(groups) == 2  # (the default one and the later one: a mesh of one rank is the default)
        for group in groups:
            options = group._get_backend(torch.device("cpu")).options
            assert (options._threads, len(options._devices)) == (1, 2)
            assert options._timeout == timedelta(seconds=77)
        # How the mesh's groups get comm.timeout_s: c10d must still know the group for gloo.
        dist.distributed_c10d._set_pg_timeout(timedelta(seconds=55), later)
        assert later._get_backend(torch.device("cpu")).options._timeout == timedelta(seconds=55)
        x = torch.arange(4.0)
        gathered = funcol.all_gather_tensor(x, 0, mesh["tp"])
        summed = funcol.all_reduce(x, "sum", mesh["dp_shard"])
        assert torch.equal(funcol.wait_tensor(gathered), x) and torch.equal(funcol.wait_tensor(summed), x)
    finally:
        dev.shutdown_distributed()


def test_a_pickled_mesh_is_the_same_bytes_in_every_process():
    """inductor keys a compiled graph by the pickled bytes of the meshes its DTensors live on;
    torch 2.13 pickles a mesh with its cached hash, a value of the process's string-hash seed, so
    every compiled tensor-parallel block missed the FX graph cache in a new process. Another
    seed's hash changes nothing pickled now, and an unpickled mesh hashes as its equal here."""
    import pickle

    from torchpar.parallel.layout import Layout

    dev.init_distributed()
    try:
        tp = Layout().build_mesh("cpu")["tp"]
        here = hash(tp)
        pickled = pickle.dumps(tp)
        tp._hash = here + 1  # (what another process's seed gives the same mesh)
        assert pickle.dumps(tp) == pickled
        tp._hash = here
        back = pickle.loads(pickled)
        assert back == tp and hash(back) == here
    finally:
        dev.shutdown_distributed()


class _Sent(Exception):
    """What the recording all_reduce raises once it has seen the tensor (a meta tensor has no value)."""


def test_a_rank_with_nothing_of_its_own_reduces_on_the_device(monkeypatch):
    """The figures a rank all-reduces without holding any of the values behind them (a rank that
    owns no gradient piece; the trials' step times of layout = 'auto') are on the device the job
    runs on, never the host: a host tensor has no backend in an NCCL-only group, and the collective
    raises on the first GPU job. A meta device stands for the GPU here."""
    from torchpar.config import load_config
    from torchpar.guard import weights_finite
    from torchpar.parallel.zero import clip_grad_norm
    from torchpar.tools import auto_layout

    seen = []

    def all_reduce(tensor, *args, **kwargs):
        seen.append(tensor.device)
        raise _Sent

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    class NoPieces:
        def grad_pieces(self):
            return []

    with pytest.raises(_Sent):
        clip_grad_norm(NoPieces(), 1.0, torch.device("meta"))
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    with pytest.raises(_Sent):  # (the finite check before a save, on a stage without adapters)
        weights_finite([], torch.device("meta"))

    class Trial:  # a trainer whose steps take 0.1 s
        device = torch.device("meta")

        def __init__(self, cfg, on_logged_step):
            self.on_logged_step = on_logged_step

        def train(self):
            for step in (1, 2, 3):
                self.on_logged_step(self, {"step": step, "step_s": 0.1})

    monkeypatch.setattr(auto_layout, "Trainer", Trial)
    with pytest.raises(_Sent):
        auto_layout.trial(load_config(TINY, []), 3, Path("/nonexistent/trial"))
    assert seen == [torch.device("meta")] * 3


class SignSGD(torch.optim.SGD):
    """A stand-in for a fork's sign optimizer: what the self-test reads is its declaration."""

    continuous = False


def test_selftest_bounds_a_sign_optimizer_by_norm_and_a_continuous_one_by_element():
    """A layout whose reduction differs in the last bits flips a sign optimizer's step on an
    element (2 x lr): the self-test then compares each matrix in norm (Kind.continuous False:
    Rprop, or a class saying ``continuous = False``), while a continuous optimizer's parameters
    stay compared element by element; a wrong shard differs under both."""
    from torchpar.config import load_config
    from torchpar.optim import kind_of
    from torchpar.selftest import _row

    assert not kind_of(load_config(None, ["--optimizer.name", "torch.optim.Rprop"]).optimizer).continuous
    assert not kind_of(load_config(None, ["--optimizer.name", f"{__name__}.SignSGD"]).optimizer).continuous
    assert kind_of(load_config(None, ["--optimizer.name", "torch.optim.SGD"]).optimizer).continuous
    assert kind_of(load_config(None, []).optimizer).continuous
    weight = torch.randn(64, 64, generator=torch.Generator().manual_seed(0)) * 0.02
    ref = {**fake_result(), "params": {"w": weight}}
    flipped = weight.clone()
    flipped[3, 5] += 2 * 2e-3  # one element stepped the other way
    wrong = weight.roll(1, 0)  # another rank's rows
    sgd, rprop = (load_config(None, ["--optimizer.name", name])
                  for name in ("torch.optim.SGD", "torch.optim.Rprop"))
    for params, optimizer, status in ((flipped, sgd, "DIFFERS"), (flipped, rprop, "PASS"),
                                      (wrong, rprop, "DIFFERS")):
        row = _row("dp2_zero1", 2, "float32", {**fake_result(), "params": {"w": params}}, ref, optimizer)
        assert row["status"].split(":")[0] == status, (optimizer.optimizer.name, row["status"])


def test_the_start_up_line_adds_its_parts_up_to_the_whole(monkeypatch):
    """Rank 0's first line: the launcher's share (from what run_train.sh's launcher exported), this
    process's imports, each phase of at least 0.05 s, and the rest, summing to the total; without
    the launcher's figures, from this process's start."""
    import re

    from torchpar import console

    ages = iter([10.0, 14.0, 15.0])  # (at the clock's start, at the line; the second clock's line)
    monkeypatch.setattr(console, "process_age_s", lambda: next(ages))
    monkeypatch.setattr(console.time, "time", lambda: 1000.0)
    monkeypatch.setattr(console.StartupClock, "_first", True)  # (a process's first trainer)
    clock = console.StartupClock()
    clock.seconds = {"checks": 0.5, "process group and mesh": 1.0, "model": 2.0, "data": 0.01}
    monkeypatch.setenv(console.LAUNCHED_AT, str(1000.0 - 14.0 - 5.0))  # 5 s before this process
    monkeypatch.setenv(console.LAUNCH_CHECK_S, "3.0")
    line = clock.line()
    assert line == ("torchpar: ready 19.0 s after the launch: the launcher's imports and check 3.0 s, "
                    "torchrun 2.0 s, imports 10.0 s, checks 0.5 s, process group and mesh 1.0 s, "
                    "model 2.0 s, the rest 0.5 s"), line
    assert sum(float(x) for x in re.findall(r" (\d+\.\d) s", line.split(": ", 2)[2])) == 19.0
    later = console.StartupClock()  # a second trainer in the process: its own phases only
    later.seconds = {"model": 2.0}
    assert later.line() == "torchpar: start-up: model 2.0 s"
    monkeypatch.delenv(console.LAUNCHED_AT)
    monkeypatch.setattr(console.StartupClock, "_first", True)
    ages = iter([10.0, 14.0])
    alone = console.StartupClock().line()
    assert alone.startswith("torchpar: ready 14.0 s after this process started: imports 10.0 s"), alone


def test_a_checkpoint_keeps_the_gpus_generator_beside_the_cpus(monkeypatch):
    """LoRA's dropout and DTensor's random ops draw from the GPU's generator: each rank saves its
    state beside the CPU's, and a resume restores both (a GPU stands in by its two calls); a
    checkpoint without it (a CPU run's), or of another layout (whose tensor-parallel peers would
    get different states), leaves the seeded one."""
    from torchpar.state import RNGState

    restored = []
    monkeypatch.setattr(dev, "device_rng_state", lambda: torch.tensor([7, 8], dtype=torch.uint8))
    monkeypatch.setattr(dev, "set_device_rng_state", restored.append)
    sd = RNGState(3).state_dict()
    assert sorted(sd) == ["rank3", "rank3_device"] and torch.equal(sd["rank3"], torch.get_rng_state())
    RNGState(3).load_state_dict(sd)
    assert len(restored) == 1 and torch.equal(restored[0], torch.tensor([7, 8], dtype=torch.uint8))
    RNGState(3).load_state_dict({"rank3": sd["rank3"]})
    RNGState(3, device=False).load_state_dict(sd)  # (a checkpoint of another layout)
    assert len(restored) == 1
