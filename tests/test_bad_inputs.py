"""Every bad input is one line: a table of mistakes across the config, the layout, the data, the
tokenizer, checkpoints, runtime faults and every subcommand.

Each case runs ``torchpar <command> ...`` (the ``torchpar`` entry point's ``main``, in this process:
the same code as the console script without a new interpreter per case) and asserts the exit
code, that the last line on stderr that is not a warning is one ``torchpar: error: ...`` naming the
field or file, that no file that was in the dump folder before changed, and that nothing reached
the user as a traceback. A closed pipe runs as real processes.
"""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
from harness import ROOT, TINY, cli
from test_checkpoint_files import folder_digest
from test_train import env

from torchpar.commands import main
from torchpar.preflight import RunLock

STEP = "checkpoint/step-00000006"  # the latest


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A dump folder with complete checkpoints of steps 3 and 6 of the tiny model."""
    tmp = tmp_path_factory.mktemp("bad_inputs")
    folder = tmp / "trained"
    r = cli(["train", "--config", str(TINY), "--training.steps", "6", "--checkpoint.enable", "true",
             "--checkpoint.interval", "3", "--job.dump_folder", str(folder)], env(tmp))
    assert r.returncode == 0, r.stderr
    return folder


def write(path: Path, data: str | bytes) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return str(path)


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    flipped = data[:500] + bytes([data[500] ^ 0xFF]) + data[501:]
    path.write_bytes(data[:1000] if how == "truncate" else flipped)


def edit_manifest(folder: Path, **changes) -> None:
    p = folder / STEP / "torchpar.json"
    manifest = json.loads(p.read_text())
    for key, value in changes.items():
        if value is None:
            manifest.pop(key)
        else:
            manifest[key] = value
    p.write_text(json.dumps(manifest))


class Case:
    """``command``: the arguments after ``torchpar``, split like a shell does, with {tiny} (the test
    config), {t} (the case's folder) and {run} (its dump folder, t/run) filled in. ``files`` are
    written under {t} first; ``run`` copies the trained run into {run} (``"lock"``: and holds its
    lock as another run would); ``edit`` then changes it; ``env``: variables a launcher would set."""

    def __init__(self, name, command, *fragments, code=2, world=None, files=None, run=False, edit=None,
                 env=None):
        self.name, self.command, self.fragments, self.code = name, command, fragments, code
        self.world, self.files, self.run, self.edit, self.env = world, files or {}, run, edit, env or {}

    def argv(self, t: Path) -> list[str]:
        return shlex.split(self.command.format(tiny=TINY, t=t, run=t / "run"))


CHECK = "train --config {tiny} --check"
SRUN = {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
        "SLURM_STEP_NODELIST": "localhost"}  # one task of two, as srun starts it without torchrun
TRAIN = "train --config {tiny} --training.steps 2 --validation.enable false --job.dump_folder {run}"
# (a resume of the trained run with steps left to train: 8 > its 6)
CKPT = TRAIN.replace("--training.steps 2", "--training.steps 8") + " --checkpoint.enable true"
CHECK_RUN = CHECK + " --job.dump_folder {run} --checkpoint.enable true --training.steps 8"
FILES = " --data.dataset files --data.path {t}/x.txt"
X = {"x.txt": "x = 1\n" * 50}
CHAT = (" --data.dataset files --data.format chat --data.path {t}/c.jsonl --validation.enable false "
        "--model.vocab_size 4104")
CONVERSATION = {"c.jsonl": '{"messages": [{"role": "user", "content": "hi"}, '
                           '{"role": "assistant", "content": "yo"}]}\n'}
DS = "config from-deepspeed {t}/ds.json"
EXPORT = "export --checkpoint {run} "
GENERATE = "generate --checkpoint {run} --prompt x "
PP2 = " --parallelism.pipeline_parallel_degree 2"
MIX, SOURCE = "train --config {t}/mix.toml --check", "[[data.sources]]\n"


def hf_of_another_shape(folder: Path) -> None:
    """A Hugging Face folder of the tiny model whose config.json matches, one tensor's shape not."""
    import torch
    from safetensors.torch import load_file, save_file

    from torchpar.hf import full_shapes, write_hf
    from torchpar.models import MODELS

    model = MODELS["llama3"]
    args = model.args("debug")
    shapes = full_shapes(model, args)
    write_hf(folder, model, args, lambda name: torch.zeros(shapes[name]), torch.bfloat16)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.norm.weight"] = torch.zeros(7, dtype=torch.bfloat16)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})


def prepared_and_damaged(folder: Path) -> None:
    """A corpus prepared from the case's x.txt, then one byte of its shard flipped (sizes unchanged)."""
    assert main(["prepare-data", "--config", str(TINY), "--data.dataset", "files", "--data.path",
                 str(folder.parent / "x.txt"), "--out", str(folder), "--processes", "1"]) == 0
    shard = folder / "shard-00000.bin"
    data = bytearray(shard.read_bytes())
    data[10] ^= 1
    shard.write_bytes(bytes(data))


def tokenizer_changed(run: Path) -> None:
    data = json.loads((run / STEP / "torchpar.json").read_text())["data"]
    edit_manifest(run, data={**data, "tokenizer": "1 tokens, crc 00000000"})


CASES = [
    # --- the config: files, overrides, types, values
    Case("unknown section", CHECK + " --trainig.steps 3", "unknown section [trainig]", "training"),
    Case("unknown key", CHECK + " --training.stpes 3", "unknown key 'stpes'", "steps"),
    Case("wrong type", CHECK + " --training.steps ten", "training.steps", "expected int"),
    Case("override without value", CHECK + " --training.steps", "--training.steps", "no value"),
    Case("stray argument", CHECK + " stray", "unexpected argument", "stray"),
    Case("missing config file", "train --config {t}/none.toml --check", "none.toml"),
    Case("config without path", "train --config", "--config needs a file path"),
    Case("TOML syntax", "train --config {t}/bad.toml --check", "bad.toml",
         files={"bad.toml": "[training\nsteps = 3\n"}),
    Case("extends cycle", "train --config {t}/a.toml --check", "cycle", "a.toml",
         files={"a.toml": 'extends = "b.toml"\n', "b.toml": 'extends = "a.toml"\n'}),
    Case("top-level key", "train --config {t}/c.toml --check", "'steps' must be a [section]",
         files={"c.toml": "steps = 3\n"}),
    Case("zero steps", CHECK + " --training.steps 0", "training.steps must be positive"),
    Case("zero batch", CHECK + " --training.local_batch_size 0", "training.local_batch_size"),
    Case("negative lr", CHECK + " --optimizer.lr -1", "optimizer.lr must be >= 0"),
    Case("beta2 of 1", CHECK + " --optimizer.beta2 1", "optimizer.beta2 must be in [0, 1)"),
    Case("eps of 0", CHECK + " --optimizer.eps 0", "optimizer.eps"),
    Case("a negative z-loss", CHECK + " --loss.z_loss -0.1", "loss.z_loss must be in [0, 1)"),
    Case("an unknown optimizer", CHECK + " --optimizer.name adamv", "optimizer.name = 'adamv' is not one of",
         "Did you mean 'adamw'"),
    Case("an optimizer path to a module without that class", CHECK + " --optimizer.name torchpar.optim.Lion",
         "optimizer.name = 'torchpar.optim.Lion'", "optim.py defines no class 'Lion' at its top level"),
    Case("an optimizer path to no module", CHECK + " --optimizer.name nopackage.Lion",
         "no module 'nopackage' on the import path"),
    Case("an optimizer argument it does not take", CHECK + " --optimizer.name muon --optimizer.kwargs "
         "betas=1",
         "optimizer.kwargs.betas: set it through [optimizer] itself"),
    Case("a misspelt optimizer argument", CHECK + " --optimizer.name torch.optim.SGD --optimizer.kwargs "
         "momentun=0.9", "unexpected keyword argument 'momentun'"),
    Case("a negative lr multiplier", CHECK + " --optimizer.head_lr_mult -1",
         "optimizer.head_lr_mult must be >= 0"),
    Case("kwargs that are not key=value", CHECK + " --optimizer.kwargs momentum", "is not key=value"),
    Case("a whole-matrix optimizer under ZeRO-3", CHECK + " --optimizer.name adafactor "
         "--parallelism.zero_stage 3", "'adafactor' updates whole matrices, which zero_stage = 3 keeps as "
         "DTensor shards"),
    Case("a misspelt state dtype", CHECK + " --optimizer.state_dtype bf16", "optimizer.state_dtype"),
    Case("bf16 moments of an optimizer that keeps fp32 state", CHECK + " --optimizer.name adafactor "
         "--optimizer.state_dtype bfloat16",
         "optimizer.state_dtype = 'bfloat16': optimizer.name = 'adafactor' keeps its state in float32"),
    Case("a z-loss of NaN", CHECK + " --loss.z_loss nan", "loss.z_loss: got 'nan', not a finite number"),
    # --- the model
    Case("a model path to no module", CHECK + " --model.name no_such_module:ADAPTER",
         "model.name = 'no_such_module:ADAPTER': ModuleNotFoundError"),
    Case("a model path to something else", CHECK + " --model.name json:dumps",
         "model.name = 'json:dumps' names a function, not a ModelAdapter instance"),
    Case("a yes/no model field on a family without it", CHECK + " --model.name gpt2 --model.qk_norm true",
         "model.qk_norm does not apply to the gpt2 family; leave it unset"),
    *(Case(f"{what} under ring attention", f"{CHECK} --model.{field} {value} --parallelism.context_parallel_"
           "degree 2 --parallelism.context_parallel_method ring",
           f"model.{field}: attention beyond what the ring's kernels compute", world=2)
      for what, field, value in (("attention sinks", "attn_sink", "true"),
                                 ("a sliding window", "sliding_window", 8))),
    Case("a YaRN factor below 1", CHECK + " --model.yarn_factor 0.5", "model.yarn_factor = 0.5",
         "at least 1"),
    Case("YaRN without the original context", CHECK + " --model.yarn_factor 4",
         "model.yarn_factor needs model.yarn_original_seq_len"),
    Case("a window on GPT-2", CHECK + " --model.name gpt2 --model.sliding_window 8",
         "model.sliding_window does not apply to the gpt2 family"),
    # latent attention
    Case("latent attention with grouped KV heads", CHECK + " --model.kv_lora_rank 32",
         "model.n_kv_heads = 4 with model.kv_lora_rank", "set n_kv_heads = n_heads = 8"),
    Case("latent attention with q/k norms", CHECK + " --model.name moe --model.kv_lora_rank 32 "
         "--model.n_kv_heads 8", "model.qk_norm with model.kv_lora_rank (latent attention)"),
    Case("an odd rotary part", CHECK + " --model.flavor debug-mla --model.qk_rope_dim 7",
         "model.qk_rope_dim = 7: RoPE rotates pairs"),
    Case("value heads wider than query heads", CHECK + " --model.flavor debug-mla --model.v_head_size 64",
         "model.v_head_size = 64 is wider than a query head (24"),
    Case("a latent of NaN", CHECK + " --model.flavor debug-mla --model.kv_lora_rank nan",
         "model.kv_lora_rank", "expected int"),
    Case("latent attention on GPT-2", CHECK + " --model.name gpt2 --model.kv_lora_rank 32",
         "model.kv_lora_rank does not apply to the gpt2 family"),
    # multi-token prediction
    Case("more prediction depths than blocks", CHECK + " --model.mtp_depth 9",
         "model.mtp_depth = 9: 0 (none) to model.n_layers = 8 prediction depths"),
    Case("negative prediction depths", CHECK + " --model.mtp_depth -1", "model.mtp_depth must be >= 0"),
    Case("prediction depths past the window", CHECK + " --model.mtp_depth 8 --training.seq_len 8",
         "model.mtp_depth = 8 needs training.seq_len > 8"),
    Case("a prediction weight of infinity", CHECK + " --model.mtp_depth 1 --model.mtp_weight inf",
         "model.mtp_weight: got 'inf', not a finite number"),
    Case("an absurd prediction weight", CHECK + " --model.mtp_depth 1 --model.mtp_weight 1e9",
         "model.mtp_weight must be in [0, 10]"),
    Case("prediction depths on GPT-2", CHECK + " --model.name gpt2 --model.mtp_depth 1",
         "model.mtp_depth does not apply to the gpt2 family"),
    Case("prediction depths under a split backward", CHECK + " --model.mtp_depth 1 --parallelism."
         "pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble",
         "model.mtp_depth with ZBVZeroBubble", world=2),
    # --- a mixture of experts
    Case("an absurd clamp of the experts' SwiGLU", CHECK + " --model.name gpt_oss --model.swiglu_limit 1e9",
         "model.swiglu_limit must be in [0, 1e4]"),
    Case("a clamp of NaN", CHECK + " --model.name gpt_oss --model.swiglu_limit nan",
         "model.swiglu_limit: got 'nan', not a finite number"),
    Case("experts' biases on a dense family", CHECK + " --model.expert_biases true",
         "model.expert_biases does not apply to the llama3 family"),
    Case("top-k above the experts", CHECK + " --model.name moe --model.top_k 9",
         "model.top_k = 9 must be between 1 and model.experts = 8"),
    Case("experts on a dense family", CHECK + " --model.experts 4", "model.experts does not apply to the "
         "llama3 family"),
    Case("a negative capacity factor", CHECK + " --model.name moe --model.capacity_factor -1",
         "model.capacity_factor must be >= 0"),
    Case("a balance loss under context parallelism", CHECK + " --model.name moe --model.balance_coeff 0.01"
         " --parallelism.context_parallel_degree 2", "model.balance_coeff: the moe family computes these "
         "terms per whole sequence",
         world=2),
    Case("an expert degree that does not divide the experts", CHECK + " --model.name moe --model.experts 6 "
         "--parallelism.zero_stage 3 --parallelism.expert_parallel_degree 4",
         "expert_parallel_degree = 4 does not divide the model's 6 experts", world=4),
    Case("an expert degree beyond the shard ranks", CHECK + " --model.name moe --parallelism.zero_stage 3 "
         "--parallelism.expert_parallel_degree 2 --parallelism.tensor_parallel_degree 2",
         "expert_parallel_degree = 2 must divide parallelism.data_parallel_shard_degree = 1", world=2),
    Case("expert parallelism without ZeRO-3", CHECK + " --model.name moe --parallelism.zero_stage 1 "
         "--parallelism.expert_parallel_degree 2",
         "expert_parallel_degree = 2 needs parallelism.zero_stage = 3", "(zero_stage is 1)", world=2),
    Case("expert parallelism of a dense model", CHECK + " --parallelism.zero_stage 3 "
         "--parallelism.expert_parallel_degree 2", "the llama3 family has no experts", world=2),
    Case("an expert degree of 0", CHECK + " --parallelism.expert_parallel_degree 0",
         "expert_parallel_degree = 0: a degree is a positive integer"),
    Case("min_lr_ratio", CHECK + " --lr_scheduler.min_lr_ratio 2", "lr_scheduler.min_lr_ratio"),
    Case("negative warmup", CHECK + " --lr_scheduler.warmup_steps -1", "lr_scheduler.warmup_steps"),
    Case("negative max_norm", CHECK + " --training.max_norm -1", "training.max_norm"),
    Case("bad choice", CHECK + " --training.activation_checkpoint some", "activation_checkpoint", "'some'"),
    Case("every-k without full", CHECK + " --training.activation_checkpoint_every 2",
         "training.activation_checkpoint_every = 2 applies", "'full'"),
    Case("selective with a split backward", CHECK + " --training.activation_checkpoint selective"
         " --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule ZBVZeroBubble"
         " --parallelism.zero_stage 0", "'selective' fails with ZBVZeroBubble", "use 'full'", world=2),
    Case("every-k beyond the layers", CHECK + " --training.activation_checkpoint full"
         " --training.activation_checkpoint_every 9",
         "training.activation_checkpoint_every = 9 exceeds the model's 8 layers", "use at most 8"),
    Case("every-k of 0", CHECK + " --training.activation_checkpoint full"
         " --training.activation_checkpoint_every 0",
         "training.activation_checkpoint_every must be positive"),
    Case("log_freq 0", CHECK + " --metrics.log_freq 0", "metrics.log_freq must be positive"),
    Case("checkpoint interval 0", CHECK + " --checkpoint.interval 0", "checkpoint.interval"),
    Case("keep_latest_k -1", CHECK + " --checkpoint.keep_latest_k -1", "keep_latest_k >= 0"),
    Case("validation freq 0", CHECK + " --validation.freq 0", "validation.freq"),
    Case("watchdog too short", CHECK + " --comm.watchdog_s 1", "comm.watchdog_s"),
    Case("watchdog beyond timeout", CHECK + " --comm.timeout_s 60 --comm.watchdog_s 90", "comm.timeout_s",
         "comm.watchdog_s"),
    Case("spike window 0", CHECK + " --training.loss_spike_window 0", "loss_spike_window"),
    Case("profile period too short", CHECK + " --profiling.profile_freq 1 --profiling.profile_active 2",
         "profiling.profile_freq must be >= profile_warmup + profile_active"),
    # --- the model
    Case("unknown family", CHECK + " --model.name llama9", "model.name", "llama9"),
    Case("unknown flavour", CHECK + " --model.flavor debgu", "model.flavor", "Did you mean 'debug'"),
    Case("heads do not divide dim", CHECK + " --model.n_heads 7", "n_heads"),
    Case("override the family lacks", CHECK + " --model.name gpt2 --model.rope_theta 5", "model.rope_theta"),
    Case("sequence beyond the model", CHECK + " --training.seq_len 99999",
         "training.seq_len = 99999 exceeds the model's max_seq_len"),
    # --- the layout, for the world size run_train.sh checks
    Case("tp does not divide the world", CHECK + " --parallelism.tensor_parallel_degree 3",
         "does not divide the world size 4", world=4),
    Case("degrees exceed the world", CHECK + " --parallelism.tensor_parallel_degree 2"
         " --parallelism.data_parallel_shard_degree 4", "but the world size is 4", world=4),
    Case("tp does not divide kv heads", CHECK + " --parallelism.tensor_parallel_degree 8", "n_kv_heads",
         world=8),
    Case("two -1 degrees", CHECK + " --parallelism.tensor_parallel_degree -1"
         " --parallelism.data_parallel_shard_degree -1", "only one degree may be -1", world=4),
    Case("SP splits seq_len", CHECK + " --parallelism.tensor_parallel_degree 2 --training.seq_len 33",
         "training.seq_len = 33", world=2),
    Case("global batch", CHECK + " --training.global_batch_size 12", "not a multiple of 16", world=2),
    # --- context parallelism
    Case("cp of 0", CHECK + " --parallelism.context_parallel_degree 0", "context_parallel_degree = 0",
         world=2),
    Case("cp beyond the world", CHECK + " --parallelism.context_parallel_degree 4",
         "(context_parallel_degree=4) multiply to 4, which does not divide the world size 2", world=2),
    Case("unknown cp method", CHECK + " --parallelism.context_parallel_method ulysses",
         "parallelism.context_parallel_method = 'ulysses'", "alltoall", world=2),
    Case("cp chunks of seq_len", CHECK + " --parallelism.context_parallel_degree 2 --training.seq_len 30",
         "training.seq_len = 30", "multiple of 4", world=2),
    Case("cp x tp splits KV heads", CHECK + " --parallelism.context_parallel_degree 2"
         " --parallelism.tensor_parallel_degree 4", "n_kv_heads (4)", "context_parallel_method = 'ring'",
         world=8),
    Case("over the memory cap", CHECK + " --training.memory_cap_gib 0.01",
         "training.memory_cap_gib = 0.01: this layout needs", "parallelism.context_parallel_degree", world=2),
    Case("ring with document masking", CHECK + " --parallelism.context_parallel_degree 2"
         " --parallelism.context_parallel_method ring --data.document_masking true",
         "context_parallel_method = 'ring' with data.document_masking", world=2),
    # --- layout = auto
    Case("unknown layout mode", CHECK + " --parallelism.layout best", "parallelism.layout = 'best'", "auto",
         world=2),
    Case("auto: nothing fits", CHECK + " --parallelism.layout auto --training.memory_cap_gib 0.001",
         "parallelism.layout = 'auto': no layout of llama3 debug fits 2 rank(s)", "needs", world=2),
    Case("trials without auto", CHECK + " --parallelism.auto_trials 2", "parallelism.auto_trials = 2 needs "
         "parallelism.layout = 'auto'", world=2),
    Case("negative trials", CHECK + " --parallelism.layout auto --parallelism.auto_trials -1",
         "parallelism.auto_trials must be >= 0", world=2),
    Case("one trial step", CHECK + " --parallelism.layout auto --parallelism.auto_trial_steps 1",
         "auto_trial_steps >= 2", world=2),
    Case("negative prediction margin", CHECK + " --metrics.prediction_margin -0.1",
         "metrics.prediction_margin must be >= 0", world=2),
    Case("too many gradient buckets", CHECK + " --parallelism.zero_stage 2 --parallelism.bucket_mb 0.000001",
         "parallelism.bucket_mb = 1e-06", "1,311,808 buckets, more than 10,000", "use at least 0.0011",
         world=2),
    Case("empty gradient buckets", CHECK + " --parallelism.bucket_mb -1", "parallelism.bucket_mb = -1.0",
         world=2),
    Case("offload on ZeRO-2", CHECK + " --parallelism.cpu_offload true --parallelism.zero_stage 2",
         "cpu_offload needs", world=2),
    Case("unknown schedule", CHECK + PP2 + " --parallelism.pipeline_parallel_schedule 2F2B",
         "pipeline_parallel_schedule", world=2),
    Case("split of the wrong sum", CHECK + PP2 + " --parallelism.pipeline_parallel_layers_per_stage 3,3",
         "pipeline_parallel_layers_per_stage", world=2),
    # --- the data and the tokenizer
    Case("files without a path", CHECK + " --data.dataset files", "data.path is required"),
    Case("path matches nothing", CHECK + " --data.dataset files --data.path {t}/no*.txt", "data.path",
         "matches no file"),
    Case("not UTF-8", CHECK + FILES, "x.txt: not valid UTF-8 at byte 3", files={"x.txt": b"ok \xff\xfe"}),
    Case("JSONL line not JSON", CHECK + " --data.dataset files --data.path {t}/a.jsonl",
         "a.jsonl:2: not a JSON",
         files={"a.jsonl": '{"text": "x"}\n{oops\n'}),
    Case("JSONL without the field", CHECK + " --data.dataset files --data.path {t}/a.jsonl",
         "a.jsonl:1: no field 'text'", "data.text_field", files={"a.jsonl": '{"body": "x"}\n'}),
    Case("only empty documents", CHECK + FILES, "no non-empty documents", files={"x.txt": "  \n"}),
    Case("held-out files missing", CHECK + FILES + " --validation.enable true", "validation.path is required",
         files=X),
    Case("lanes 0", CHECK + " --data.lanes 0", "data.lanes must be positive"),
    Case("a conversation with a role the template lacks", CHECK + CHAT,
         "c.jsonl:1: message 1's role 'bot' is not one the llama3 template renders",
         files={"c.jsonl": '{"messages": [{"role": "user", "content": "hi"}, '
                           '{"role": "bot", "content": "x"}]}\n'}),
    Case("a conversation that is no list", CHECK + CHAT, "c.jsonl:1: 'messages' must be a non-empty list",
         files={"c.jsonl": '{"messages": "hi"}\n'}),
    Case("a misspelt chat template", CHECK + CHAT + " --data.chat_template llama",
         "data.chat_template = 'llama'", files={"c.jsonl": "{}\n"}),
    Case("chat markers beyond the vocabulary", CHECK + CHAT.replace(" --model.vocab_size 4104", ""),
         "uses token ids up to 4103", "set model.vocab_size = 4104 or more", files=CONVERSATION),
    Case("chat from the stdlib corpus", CHECK + " --data.format chat",
         "data.format = 'chat' reads local .jsonl"),
    Case("mixture weight 0", MIX, "data.sources[1]: weight must be a number > 0",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + "weight = 1\n" + SOURCE + "weight = 0\n"}),
    Case("mixture unknown key", MIX, "data.sources[0]: unknown key 'paht'",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + 'weight = 1\npaht = "x"\n'}),
    Case("mixture source without path", MIX, "data.sources[0].path is required",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + 'weight = 1\ndataset = "files"\n'}),
    Case("mixture weight too small", MIX, "data.sources weights [1.0, 100000.0]", "at least 1/10000",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + "weight = 1\n" + SOURCE
                + 'weight = 100000\nname = "b"\n'}),
    Case("mixture names repeat", MIX, "data.sources: names", "give each source its own `name`",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + "weight = 1\n" + SOURCE + "weight = 2\n"}),
    Case("prepared corpus corrupted, --check", CHECK + " --data.dataset tokenized --data.path {t}/p",
         "shard-00000.bin fails its CRC32", "prepare the corpus again", files=X,
         edit=lambda run: prepared_and_damaged(run.parent / "p")),
    Case("tokenized folder not prepared", CHECK + " --data.dataset tokenized --data.path {t}",
         "is not a prepared corpus", "torchpar prepare-data"),
    Case("prepare-data: out is a file", "prepare-data --config {tiny} --out {t}/f", "--out", "is a file",
         files={"f": "x"}),
    Case("prepare-data: zero processes", "prepare-data --config {tiny} --out {t}/p --processes 0",
         "--processes must be >= 1"),
    Case("tokenizer missing", CHECK + " --model.tokenizer_path {t}/none.tiktoken", "model.tokenizer_path",
         "none.tiktoken"),
    Case("tokenizer damaged", CHECK + " --model.tokenizer_path {t}/bad.tiktoken", "model.tokenizer_path",
         "bad.tiktoken", files={"bad.tiktoken": "zz zz\n"}),
    Case("tokenizer beyond the vocabulary", CHECK + " --model.vocab_size 300", "vocab_size 300",
         "matching tokenizer"),
    # --- folders and checkpoints
    Case("dump folder is a file", TRAIN.replace("{run}", "{t}/f"), "job.dump_folder",
         "is a file, not a folder",
         files={"f": "x"}),
    Case("a number that is not finite", CHECK + " --model.bias_rate nan", "model.bias_rate",
         "not a finite number"),
    Case("a number that is not finite in the file", "train --config {t}/inf.toml --check",
         "inf.toml: training.memory_cap_gib", "not a finite number",
         files={"inf.toml": f'extends = "{TINY}"\n[training]\nmemory_cap_gib = inf\n'}),
    Case("negative capacity factor", CHECK + " --model.name moe --model.capacity_factor -1",
         "model.capacity_factor must be >= 0 (0 = dropless), got -1.0"),
    Case("negative memory cap", CHECK + " --training.memory_cap_gib -2",
         "training.memory_cap_gib must be >= 0"),
    Case("dump folder is the root", TRAIN.replace("{run}", "/"),
         "job.dump_folder = / is the file system's root", "a folder of its own"),
    Case("dump folder above the working folder", TRAIN.replace("{run}", ".."), "job.dump_folder = ..",
         "a folder above the working folder"),
    Case("dump folder is a Git repository", TRAIN.replace("{run}", "{t}/repo"), "job.dump_folder",
         "is a Git repository's root", files={"repo/.git/HEAD": "ref: refs/heads/main\n"}),
    Case("checkpoint folder is a file", CKPT + " --checkpoint.folder {t}/f", "checkpoint.folder",
         "is a file, not a folder", files={"f": "x"}),
    Case("folder in use", CKPT, "is in use by another run", "host", run="lock"),
    Case("load_step missing", CKPT + " --checkpoint.load_step 5", "checkpoint.load_step = 5",
         "complete steps there: 3, 6", run=True),
    Case("truncated checkpoint", CKPT, "is damaged", "truncated", run=True,
         edit=lambda run: damage(run / STEP / "__0_0.distcp", "truncate")),
    Case("corrupted checkpoint", CKPT, "is damaged", "CRC32", run=True,
         edit=lambda run: damage(run / STEP / "__0_0.distcp", "flip")),
    Case("corrupted checkpoint, --check", CHECK_RUN, "is damaged", "__0_0.distcp fails its CRC32", run=True,
         edit=lambda run: damage(run / STEP / "__0_0.distcp", "flip")),
    Case("damaged DCP metadata, checksums off", CKPT + " --checkpoint.verify_checksums false", "is damaged",
         ".metadata cannot be read", run=True, edit=lambda run: damage(run / STEP / ".metadata", "flip")),
    Case("damaged data file, checksums off", CKPT + " --training.steps 8 --checkpoint.verify_checksums false",
         "is damaged: reading it failed", "checkpoint.verify_checksums = true", run=True,
         edit=lambda run: (run / STEP / "__0_0.distcp").write_bytes(
             b"\0" * 64 + (run / STEP / "__0_0.distcp").read_bytes()[64:])),
    Case("nothing left to train", CKPT + " --training.steps 6", "training.steps = 6", "is at step 6",
         "raise training.steps above 6", run=True),
    Case("another optimizer than the checkpoint's", CHECK_RUN + " --optimizer.name muon",
         "optimizer.name = 'muon', but the checkpoint", "trained with 'adamw'", run=True),
    Case("fewer steps than the checkpoint, --check", CHECK_RUN + " --training.steps 4", "training.steps = 4",
         "is at step 6", run=True),
    Case("checkpoint of another shape", CKPT + " --model.n_layers 4", "another shape",
         "n_layers: saved 8 vs config 4", run=True),
    Case("checkpoint of another width", CKPT + " --model.dim 256 --model.n_heads 16", "another shape",
         "dim: saved 128 vs config 256", run=True),
    Case("checkpoint of another flavour", CKPT + " --model.flavor debug-tied", "model.flavor = 'debug-tied'",
         run=True),
    Case("checkpoint of another format", CKPT, "checkpoint format 1", "torchpar export", run=True,
         edit=lambda run: edit_manifest(run, format=1)),
    Case("another corpus", CKPT + FILES, "data.dataset / data.path", "another corpus",
         "data.resume_position = false", files=X, run=True),
    Case("another number of lanes", CKPT + " --data.lanes 8", "data.lanes", "64 there, 8 here", run=True),
    Case("another tokenizer", CKPT, "model.tokenizer_path", "another tokenizer", run=True,
         edit=tokenizer_changed),
    Case("position beyond the corpus", CKPT + FILES, "does not fit files (1 documents)", files=X,
         run=True, edit=lambda run: edit_manifest(run, data=None)),
    Case("initial weights missing", TRAIN + " --checkpoint.initial_load_path {t}/w.pt", "w.pt"),
    Case("HF weights of another shape", CHECK + " --checkpoint.initial_load_path {t}/hf",
         "model.norm.weight is (7,), torchpar expects (128,)",
         edit=lambda run: hf_of_another_shape(run.parent / "hf")),
    Case("initial weights not HF", TRAIN + " --checkpoint.initial_load_path {t}"
         " --checkpoint.initial_load_format hf", "not a Hugging Face"),
    # --- runtime
    Case("divergence", TRAIN + " --optimizer.lr 1e30", "step 2: non-finite loss nan",
         "the update was not applied",
         "last good checkpoint: none", code=3),
    Case("dead model", TRAIN + " --optimizer.lr 1e6 --training.max_norm 0", "step 2: gradient norm 0",
         "the model is dead", "last good checkpoint: none", code=3),
    # --- launch variables that do not add up (srun's tasks, torchrun's ranks), refused before any wait
    Case("srun: task index past the tasks", TRAIN, "SLURM_PROCID=2 but SLURM_STEP_NUM_TASKS=2",
         env={**SRUN, "SLURM_PROCID": "2"}),
    Case("srun: local index not a number", TRAIN, "SLURM_LOCALID='x'", "whole number",
         env={**SRUN, "SLURM_LOCALID": "x"}),
    Case("srun: tasks not a number", TRAIN, "SLURM_STEP_NUM_TASKS='abc'", "whole number",
         env={**SRUN, "SLURM_STEP_NUM_TASKS": "abc"}),
    Case("rank without MASTER_ADDR", TRAIN, "RANK and WORLD_SIZE are set but MASTER_ADDR is not", "torchrun",
         env={"RANK": "0", "WORLD_SIZE": "2", "MASTER_PORT": "29500"}),
    Case("rank past the world", TRAIN, "RANK=2 but WORLD_SIZE=2",
         env={"RANK": "2", "WORLD_SIZE": "2", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}),
    # --- the other commands
    Case("unknown command", "trian", "unknown command 'trian'", "train"),
    Case("plan: no model", "plan", "give --model FLAVOR"),
    Case("plan: unknown flavour", "plan --model 9B", "--model '9B' is not a llama3 flavour"),
    Case("plan: unknown option", "plan --modle 8B", "torchpar plan", "--modle"),
    Case("plan: unknown GPU", "plan --model 8B --gpu B300", "--gpu", "B300"),
    Case("plan: zero nodes", "plan --model 8B --nodes 0", "--nodes must be >= 1"),
    Case("plan: zero efficiency", "plan --model 8B --efficiency 0", "--efficiency"),
    Case("plan: zero batch", "plan --model 8B --global-batch-size 0", "--global-batch-size must be >= 1"),
    Case("plan: not a number", "plan --model 8B --nodes two", "--nodes", "'two'"),
    Case("plan: sequence beyond the model", "plan --family gpt2 --model 124M --seq-len 100000",
         "--seq-len 100000 is beyond", "max_seq_len 1024"),
    Case("plan: config missing", "plan --config {t}/none.toml", "none.toml"),
    Case("plan: layout of the config", "plan --nproc 4 --config {t}/tp3.toml",
         "does not divide the world size 4",
         files={"tp3.toml": f'extends = "{TINY}"\n[parallelism]\ntensor_parallel_degree = 3\n'}),
    Case("schedule: pp 0", "schedule --pp 0 --microbatches 4", "--pp must be >= 1"),
    Case("schedule: no microbatches", "schedule --pp 2 --microbatches 0", "--microbatches must be >= 1"),
    Case("schedule: missing option", "schedule --pp 2", "--microbatches"),
    Case("schedule: unknown", "schedule --pp 2 --microbatches 4 --schedule ZBV", "--schedule 'ZBV'"),
    Case("schedule: picture suffix", "schedule --pp 2 --microbatches 4 --out {t}/g.jpg", "--out",
         "not '.jpg'"),
    Case("schedule: picture folder missing", "schedule --pp 2 --microbatches 4 --out {t}/no/g.svg", "--out",
         "does not exist"),
    Case("schedule: one-stage schedule, two stages", "schedule --pp 2 --microbatches 4 --stages-per-rank 2",
         "1F1B runs one stage per rank", "--stages-per-rank = 1"),
    Case("schedule: V schedule, three stages",
         "schedule --pp 2 --microbatches 4 --schedule ZBVZeroBubble --stages-per-rank 3",
         "needs exactly 2 stages per rank"),
    Case("schedule: too few microbatches", "schedule --pp 4 --microbatches 2",
         "1F1B needs at least as many microbatches as stages: 2 < 4"),
    Case("export: no checkpoint", "export --checkpoint {t}/none --out {t}/m.pt", "none"),
    Case("export: into a checkpoint", EXPORT + "--out {run}/" + STEP + "/m.pt", "--out", "inside checkpoint",
         run=True),
    Case("export: folder missing", EXPORT + "--out {t}/no/m.pt", "--out", "does not exist", run=True),
    Case("export: a folder for a file", EXPORT + "--out {t}", "--out", "is a folder", run=True),
    Case("export: HF over a file", EXPORT + "--format hf --out {t}/f", "--out", "is a file", files={"f": "x"},
         run=True),
    Case("export: zero shard size", EXPORT + "--format hf --out {t}/hf --max-shard-mb 0",
         "--max-shard-mb must be > 0", run=True),
    Case("export: unknown dtype", EXPORT + "--out {t}/m.pt --dtype fp8", "--dtype", "fp8", run=True),
    Case("generate: no checkpoint", "generate --checkpoint {t}/none --prompt x", "none"),
    Case("generate: negative length", GENERATE + "--max-new-tokens -1", "--max-new-tokens must be >= 0",
         run=True),
    Case("generate: negative temperature", GENERATE + "--temperature -1", "--temperature must be >= 0",
         run=True),
    Case("generate: tokenizer missing", GENERATE + "--tokenizer {t}/none.tiktoken", "--tokenizer",
         "none.tiktoken", run=True),
    Case("config: file missing", DS, "ds.json: cannot read it as JSON"),
    Case("config: not JSON", DS, "ds.json: cannot read it as JSON", files={"ds.json": "{"}),
    Case("config: zero ranks", DS + " --nproc 0", "--nproc must be >= 1", files={"ds.json": "{}"}),
    Case("config: ZeRO stage 5", DS, "ds.json", "zero_stage = 5",
         files={"ds.json": '{"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 5}}'}),
    Case("config: no batch size", DS, "ds.json", "train_micro_batch_size_per_gpu", files={"ds.json": "{}"}),
    Case("config: no subcommand", "config", "torchpar config", "command"),
    Case("plot: no metrics there", "plot {t}", "no metrics.jsonl there", "job.dump_folder"),
    Case("plot: picture suffix", "plot {run} --out {t}/m.jpg", "--out", ".png or .svg", run=True),
    Case("plot: damaged record", "plot {t}", "metrics.jsonl:2: not a JSON record",
         files={"metrics.jsonl": '{"step": 1, "loss": 2.0}\n{"step": 2, "lo\n'}),
    Case("plan: picture suffix", "plan --model 8B --out {t}/m.gif", "--out", ".png or .svg"),
    Case("selftest: unknown layout", "selftest --nproc 2 --only zero3,dp2_zer1", "--only 'dp2_zer1'",
         "Did you mean 'dp2_zero1'"),
    Case("selftest: layout beyond the processes", "selftest --nproc 1 --only dp2_zero1", "--only 'dp2_zero1'",
         "at most 1 process(es)"),
    # --- outputs never replace what torchpar did not write (the user's files sit under {run}, so the
    # harness checks they are unchanged)
    Case("prepare-data: a folder of other files", "prepare-data --config {tiny} --out {run}/corpus", "--out",
         "holds files torchpar did not write there (manifest.json)", "--overwrite",
         files={"run/corpus/manifest.json": '{"mine": true}\n'}),
    Case("export: over a user's file", EXPORT + "--out {run}/m.pt", "--out", "m.pt already exists",
         "--overwrite", run=True, edit=lambda run: write(run / "m.pt", "mine")),
    Case("export: over a user's metadata file", EXPORT + "--out {run}/m.pt", "--out",
         "m.pt.json already exists", run=True, edit=lambda run: write(run / "m.pt.json", "{}")),
    Case("export: HF into a user's folder", EXPORT + "--format hf --out {run}/hf", "--out",
         "holds files torchpar did not write there (config.json)", "--overwrite", run=True,
         edit=lambda run: write(run / "hf" / "config.json", "{}")),
    Case("plan: over a user's picture", "plan --model 8B --out {run}/m.png", "--out", "m.png already exists",
         "--overwrite", files={"run/m.png": "mine"}),
    Case("plot: over a user's picture", "plot {run}", "--out", "metrics.png already exists", "--overwrite",
         run=True, edit=lambda run: write(run / "metrics.png", "mine")),
    Case("schedule: over a user's picture", "schedule --pp 2 --microbatches 4 --out {run}/g.svg", "--out",
         "g.svg already exists", files={"run/g.svg": "<svg/>"}),
    # --- absurd sizes, refused by arithmetic
    Case("plan: absurd batch", "plan --model 8B --global-batch-size 1000000000000000", "--global-batch-size",
         "tokens per step"),
    Case("plan: zero GPUs per node", "plan --model 8B --gpus-per-node 0", "--gpus-per-node must be >= 1"),
    Case("plan: zero device memory", "plan --model 8B --memory-gb 0", "--memory-gb must be > 0"),
    Case("plan: a config of too many microbatches", "plan --config {t}/pp.toml --nproc 2",
         "training.global_batch_size gives 4,096 pipeline microbatches",
         files={"pp.toml": f'extends = "{TINY}"\n[parallelism]\npipeline_parallel_degree = 2\n'
                           "[training]\nglobal_batch_size = 4096\n"}),
    Case("schedule: too many microbatches", "schedule --pp 2 --microbatches 100000", "--microbatches 100000",
         "beyond the 256"),
    # --- LoRA
    Case("LoRA rank negative", CHECK + " --lora.rank -1", "lora.rank must be in [0, 65536]"),
    Case("LoRA alpha not finite", CHECK + " --lora.rank 4 --lora.alpha nan", "lora.alpha",
         "not a finite number"),
    Case("LoRA dropout of 1", CHECK + " --lora.dropout 1", "lora.dropout must be in [0, 1)"),
    Case("LoRA rank above a layer's width", CHECK + " --lora.rank 100",
         "lora.rank = 100 exceeds the 64 features of layers.0.attention.wk", "lora.rank <= 64"),
    Case("LoRA patterns naming no linear layer", CHECK + " --lora.rank 4 --lora.modules output",
         "lora.modules = ['output']", "names no linear layer"),
    Case("LoRA dropout under TP on a CPU", CHECK + " --lora.rank 4 --lora.dropout 0.1"
         " --parallelism.tensor_parallel_degree 2", "lora.dropout = 0.1 with tensor_parallel_degree = 2",
         world=2),
    Case("LoRA past the first stage of a split-backward schedule", CHECK + " --lora.rank 4 --lora.modules"
         " layers.7.* --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule"
         " ZBVZeroBubble", "lora.modules adapts no layer of the first pipeline stage", "1F1B", world=2),
    Case("LoRA resuming a full checkpoint", CKPT + " --lora.rank 4", "it trained every parameter",
         "checkpoint.initial_load_path", run=True),
    Case("PEFT export of a full checkpoint", EXPORT + "--format peft --out {t}/adapter",
         "holds no LoRA adapters", run=True),
    Case("a straggler factor below 1", CHECK + " --metrics.straggler_factor 0.5",
         "metrics.straggler_factor must be 0 (off) or in (1, 1000]"),
    # --- replica groups (torchft)
    Case("fault tolerance without a lighthouse", CHECK + " --fault_tolerance.enable true",
         "needs the torchft lighthouse's address", "TORCHFT_LIGHTHOUSE"),
    Case("a replica id beyond the groups", CHECK + " --fault_tolerance.enable true"
         " --fault_tolerance.replica_groups 2 --fault_tolerance.replica_id 2", "replica_id = 2",
         "0 <= replica_id < replica_groups"),
    Case("DiLoCo's momentum of 1", CHECK + " --fault_tolerance.enable true --fault_tolerance.semi_sync diloco"
         " --fault_tolerance.outer_momentum 1", "outer_momentum = 1", "outer_momentum in [0, 1)"),
    Case("streaming DiLoCo's fragments not dividing sync_every", CHECK + " --fault_tolerance.enable true"
         " --fault_tolerance.semi_sync diloco --fault_tolerance.sync_every 5 --fault_tolerance.fragments 2",
         "fragments = 2, sync_every = 5", "sync_every a multiple of fragments"),
    Case("replica groups with layout = auto", CHECK + " --fault_tolerance.enable true"
         " --parallelism.layout auto", "with parallelism.layout = 'auto'", "parallelism.layout = 'manual'"),
    Case("fragments without semi_sync", CHECK + " --fault_tolerance.enable true"
         " --fault_tolerance.fragments 2",
         "fault_tolerance.fragments = 2", "set fault_tolerance.semi_sync = 'diloco'"),
    Case("a fragment_alpha above 1", CHECK + " --fault_tolerance.enable true"
         " --fault_tolerance.semi_sync diloco --fault_tolerance.fragment_alpha 1.5", "fragment_alpha = 1.5",
         "fragment_alpha in [0, 1]"),
    # --- data edge cases
    Case("JSONL text not a string", CHECK + " --data.dataset files --data.path {t}/a.jsonl",
         "a.jsonl:2: field 'text' is not a string (3)", files={"a.jsonl": '{"text": "x"}\n{"text": 3}\n'}),
    Case("JSONL texts all null", CHECK + " --data.dataset files --data.path {t}/a.jsonl",
         "no non-empty documents", "'null': 2", files={"a.jsonl": '{"text": null}\n{"text": null}\n'}),
    Case("NUL bytes in a text file", CHECK + FILES, "x.txt: a NUL byte at byte 1", "UTF-16",
         files={"x.txt": "x\0y\0"}),
    Case("prepare-data: a mixture", "prepare-data --config {t}/mix.toml --out {t}/p",
         "data.sources lists 2 sources (stdlib, x.txt)", "--source NAME",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + "weight = 1\n" + SOURCE
                + 'weight = 1\ndataset = "files"\npath = "x.txt"\n', **X}),
    Case("prepare-data: unknown source", "prepare-data --config {t}/mix.toml --out {t}/p --source web",
         "--source 'web' is not one of data.sources' names (stdlib, x.txt)",
         files={"mix.toml": f'extends = "{TINY}"\n' + SOURCE + "weight = 1\n" + SOURCE
                + 'weight = 1\ndataset = "files"\npath = "x.txt"\n', **X}),
    Case("prepare-data: source without a mixture", "prepare-data --config {tiny} --out {t}/p --source web",
         "--source NAME picks one of [[data.sources]]"),
    Case("config: a list at the top", DS, "ds.json: the top level", "must be a JSON object",
         files={"ds.json": "[1, 2]"}),
    Case("config: a section not an object", DS, "ds.json: optimizer must be a JSON object",
         files={"ds.json": '{"train_micro_batch_size_per_gpu": 2, "optimizer": "adam"}'}),
    Case("plot: not UTF-8", "plot {t}", "metrics.jsonl: not UTF-8 text (byte 0)",
         files={"metrics.jsonl": b"\xff\xfe{\x00"}),
    Case("plot: no losses", "plot {t}", "no loss in the metrics.jsonl", "nothing to draw",
         files={"metrics.jsonl": '{"step": 1, "lr": 0.001}\n'}),
]


def error_line(stderr: str) -> str:
    """The last line that is not a warning (torchpar's or Python's, whose second line is indented)."""
    lines = [line for line in stderr.splitlines()
             if line.strip() and not line.startswith(("torchpar: warning:", " ")) and "Warning" not in line]
    return lines[-1] if lines else ""


def test_the_table_has_sixty_cases_or_more():
    assert len(CASES) >= 60 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_one_line(case, trained, tmp_path, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHFT_LIGHTHOUSE"):
        monkeypatch.delenv(key, raising=False)
    if case.world:
        monkeypatch.setenv("WORLD_SIZE", str(case.world))
    for key, value in case.env.items():
        monkeypatch.setenv(key, value)
    for name, data in case.files.items():
        write(tmp_path / name, data)
    run = tmp_path / "run"
    if case.run:
        shutil.copytree(trained, run)
    if case.edit:
        case.edit(run)
    lock = RunLock(run) if case.run == "lock" else None  # as a run that is still alive holds it
    before = folder_digest(run) if run.is_dir() else {}
    capfd.readouterr()
    try:
        got = main(case.argv(tmp_path))
    finally:
        if lock is not None:
            lock.release()
    err = capfd.readouterr().err
    line = error_line(err)
    assert got == case.code, f"exit {got}, stderr:\n{err}"
    assert "Traceback" not in err, err
    assert line.startswith("torchpar: error: "), err
    for fragment in case.fragments:
        assert fragment in line, f"{fragment!r} not in {line!r}"
    after = folder_digest(run) if run.is_dir() else {}
    # (the run lock's file names whoever holds the lock now; it is not the user's work)
    changed = [k for k in before if after.get(k) != before[k] and k != "torchpar.lock"]
    assert not changed, f"files that were in the dump folder changed: {changed}"


def test_the_launchers_check_leaves_the_checkpoints_bytes_to_the_ranks(trained, tmp_path, monkeypatch):
    """Each node's launcher checks the job before torchrun starts a rank, a checkpoint's files by
    their sizes: the ranks read its CRC32s at the load, each a share (read whole by every node's
    launcher at every start, a 70B checkpoint on 64 nodes was ~54 TB before the first step).
    ``--check`` reads every byte."""
    from torchpar.checkpoint import files
    from torchpar.commands.train import check_before_launch

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    read, crc32 = [], files.file_crc32
    monkeypatch.setattr(files, "file_crc32", lambda path: read.append(path.name) or crc32(path))
    monkeypatch.setenv("WORLD_SIZE", "1")
    job = ["--config", str(TINY), "--job.dump_folder", str(run), "--checkpoint.enable", "true",
           "--training.steps", "8"]
    assert check_before_launch(job) == 0 and read == []
    assert main(["train", "--check", *job]) == 0 and "__0_0.distcp" in read


def test_a_restart_of_a_finished_job_has_nothing_to_do(trained, tmp_path, monkeypatch, capfd):
    """A job whose last step was saved and then a rank failed on its way out is started again by
    torchrun (or SLURM): that restart ends at once with exit code 0 and one line. Started by hand,
    the same command is the usual 'nothing left to train' (exit code 2)."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    job = ["train", "--config", str(TINY), "--job.dump_folder", str(run), "--checkpoint.enable", "true",
           "--training.steps", "6"]
    assert main(job) == 2 and "nothing left to train" in capfd.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert main(job) == 0
    assert "the job had finished before this restart" in capfd.readouterr().out


def test_a_disk_fault_no_check_foresaw_is_one_line(capfd):
    """An OSError out of a command (a full disk, a file gone under it) ends as one line naming the
    file and the fault, exit 1, no traceback."""
    import errno

    from torchpar.console import run_command

    def full_disk(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/data/run/metrics.jsonl")

    assert run_command(full_disk, []) == 1
    err = capfd.readouterr().err
    assert "Traceback" not in err, err
    assert error_line(err) == "torchpar: error: /data/run/metrics.jsonl: No space left on device", err


@pytest.mark.slow  # (real processes)
def test_a_closed_pipe_is_one_line(tmp_path):
    """`torchpar plan ... | head -1`: the reader goes away; one line, no BrokenPipeError traceback."""
    # 129 kB of output: more than a pipe holds, so the write fails while the command runs.
    # (the timeout guards against a hang only: a loaded machine takes longer, never ten minutes)
    r = subprocess.run("torchpar plan --model 8B --nodes 1 --top 1000 | head -1", shell=True, cwd=ROOT,
                       env=env(tmp_path), capture_output=True, text=True, timeout=600, executable="/bin/bash")
    assert r.stdout.startswith("layout")
    assert "Traceback" not in r.stderr and "BrokenPipeError" not in r.stderr, r.stderr
    assert error_line(r.stderr).startswith("torchpar: error: the output pipe was closed"), r.stderr


@pytest.mark.parametrize("code", ["ENOLCK", "EIO"])
def test_a_dump_folder_whose_file_system_has_no_locks(tmp_path, monkeypatch, capfd, code):
    """Some network mounts take no advisory locks: the run goes on with one warning (a second run
    on the folder is then not refused); any other failure to lock is one line naming the folder."""
    import errno
    import fcntl
    import os

    from torchpar.errors import ConfigError

    def no_locks(file, how):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)))

    monkeypatch.setattr(fcntl, "flock", no_locks)
    if code == "EIO":
        with pytest.raises(ConfigError, match=f"job.dump_folder {tmp_path}: cannot lock torchpar.lock"):
            RunLock(tmp_path)
        return
    lock = RunLock(tmp_path)
    assert "file system without locks" in capfd.readouterr().err
    lock.release()
