"""Hugging Face interoperability, checked against the real transformers library: importing a
LlamaForCausalLM into torchpar, exporting torchpar checkpoints to HF folders, and starting
training from an HF model under tensor and pipeline parallelism."""

import copy
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from harness import ROOT, TINY, assert_matches, cli, run_layouts

transformers = pytest.importorskip("transformers")
safetensors = pytest.importorskip("safetensors")
PeftModel = pytest.importorskip("peft").PeftModel

from torchpar.adapters import open_merged  # noqa: E402
from torchpar.errors import ConfigError  # noqa: E402
from torchpar.hf import HFWeights, write_hf  # noqa: E402
from torchpar.models import MODELS  # noqa: E402
from torchpar.outputs import MARKER  # noqa: E402
from torchpar.weights import build_from, model_from  # noqa: E402

LLAMA = MODELS["llama3"]
MOE = MODELS["moe"]


# config.json fields each family's transformers config class is not given (it spells them its own
# way, or takes none)
NOT_GIVEN = {"llama3": ("rope_parameters",), "moe": ("rope_parameters", "model_type", "num_local_experts"),
             "deepseek_v3": ("model_type", "rope_scaling"),
             "qwen3": ("model_type", "rope_scaling", "mlp_bias"), "gpt_oss": ("model_type", "rope_scaling")}


def make_hf(folder: Path, family, args, seed: int = 0):
    """A random model of ``family``'s Hugging Face class with ``args``'s shape, saved as transformers
    saves it, its norms and (zero-initialized) biases non-trivial, its routers decisive (no near
    ties) and its routing bias set."""
    fields = {k: v for k, v in family.hf_config(args).items()
              if k != "architectures" and k not in NOT_GIVEN[family.name]}
    config = getattr(transformers, family.hf_architecture.replace("ForCausalLM", "Config"))(**fields)
    torch.manual_seed(seed)
    model = getattr(transformers, family.hf_architecture)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.uniform_(-0.5, 0.5)
            elif "mlp.gate." in name:
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(folder)
    return model


def exports_as_read(tmp_path: Path, family, args, read, original: dict | None = None, **write) -> tuple:
    """Write ``family``'s HF folder at tmp_path/out from ``read`` (torchpar name -> tensor) in fp32 and
    assert it holds every tensor of ``original`` (default: tmp_path/in's) bit for bit, and no other.
    Returns (the original tensors, the write's figures)."""
    from safetensors.torch import load_file

    stats = write_hf(tmp_path / "out", family, args, read, torch.float32, **write)
    if original is None:
        original = load_file(tmp_path / "in" / "model.safetensors")
    exported = {k: v for f in stats["files"] for k, v in load_file(tmp_path / "out" / f).items()}
    assert original.keys() == exported.keys(), sorted(original.keys() ^ exported.keys())[:4]
    assert all(torch.equal(original[k], exported[k]) for k in original)
    return original, stats


def make_hf_llama(folder: Path, flavor: str, seed: int = 0, **shape) -> "transformers.LlamaForCausalLM":
    """A random LlamaForCausalLM of a torchpar flavour's shape (with ``shape``'s fields)."""
    return make_hf(folder, LLAMA, LLAMA.args(flavor, **shape), seed)


def torchpar_model(values, flavor: str, **shape):
    return build_from(LLAMA, LLAMA.args(flavor, **shape), values)


def run(args):
    """``torchpar *args`` in the repository root, forked (harness.cli)."""
    return cli(args, dict(os.environ), timeout=600)


# gpt-oss's attention biases and YaRN (the context RoPE was trained at stretched 4 times)
BIAS_YARN = {"attn_bias": True, "yarn_factor": 4.0, "yarn_original_seq_len": 512}


@pytest.mark.parametrize("flavor,shape", [("debug", {}), ("debug-tied", {}), ("debug", BIAS_YARN)],
                         ids=["debug", "debug-tied", "biases+yarn"])
def test_import_gives_transformers_logits(tmp_path, flavor, shape):
    """GQA (4 KV heads for 8 query heads), tied and untied, with attention biases and YaRN: the
    same logits within 1e-4."""
    hf = make_hf_llama(tmp_path, flavor, **shape)
    model = torchpar_model(HFWeights(tmp_path, LLAMA, LLAMA.args(flavor, **shape), flavor), flavor, **shape)
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("flavor", ["debug", "debug-tied"])
def test_round_trip_is_bitwise_and_streams(tmp_path, flavor):
    """HF -> torchpar -> HF in fp32 gives the same tensors bit for bit; the export holds at most
    two copies of the largest tensor at a time, however many files it writes."""

    make_hf_llama(tmp_path / "in", flavor)
    args = LLAMA.args(flavor)
    model = torchpar_model(HFWeights(tmp_path / "in", LLAMA, args, flavor), flavor)
    params = dict(model.named_parameters())
    _, stats = exports_as_read(tmp_path, LLAMA, args, lambda name: params[name].detach(),
                               max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(stats["files"]) > 4 and set(index["weight_map"].values()) == set(stats["files"])
    largest = max(p.numel() * 4 for p in params.values())
    total = sum(p.numel() * 4 for p in params.values())
    assert stats["peak_bytes"] <= 2 * largest < total / 2, (stats["peak_bytes"], largest, total)
    # Written again as one file: the earlier shards go; a file a hand-edited marker names stays.
    marker = tmp_path / "out" / MARKER
    listed = json.loads(marker.read_text())
    marker.write_text(json.dumps({**listed, "files": listed["files"] + ["notes.txt", "../elsewhere.txt"]}))
    (tmp_path / "out" / "notes.txt").write_text("the user's")
    (tmp_path / "elsewhere.txt").write_text("the user's")
    write_hf(tmp_path / "out", LLAMA, args, lambda name: params[name].detach(), torch.float32)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [MARKER, "notes.txt", "model.safetensors", "config.json", "generation_config.json"])
    assert (tmp_path / "elsewhere.txt").exists()


def test_biases_and_yarn_round_trip_and_another_rope_is_one_line(tmp_path):
    """Attention biases and YaRN: HF -> torchpar -> HF bit for bit, YaRN's fields in config.json;
    a checkpoint whose RoPE is not the model's is one line naming the field."""

    make_hf_llama(tmp_path / "in", "debug", **BIAS_YARN)
    args = LLAMA.args("debug", **BIAS_YARN)
    params = dict(torchpar_model(HFWeights(tmp_path / "in", LLAMA, args, "debug"), "debug",
                                 **BIAS_YARN).named_parameters())
    assert "layers.0.attention.wq.bias" in params
    exports_as_read(tmp_path, LLAMA, args, lambda name: params[name].detach())
    rope = json.loads((tmp_path / "out" / "config.json").read_text())["rope_parameters"]
    assert (rope["rope_type"], rope["factor"], rope["original_max_position_embeddings"]) == ("yarn", 4.0, 512)
    with pytest.raises(ConfigError, match="RoPE type 'yarn', but model.flavor = 'debug' has 'default'"):
        HFWeights(tmp_path / "in", LLAMA, LLAMA.args("debug", attn_bias=True), "debug")
    with pytest.raises(ConfigError, match="RoPE factor = 4.0, but the model has 8.0"):
        HFWeights(tmp_path / "in", LLAMA, LLAMA.args("debug", **{**BIAS_YARN, "yarn_factor": 8.0}), "debug")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A torchpar checkpoint trained for 4 steps (untied, GQA)."""
    folder = tmp_path_factory.mktemp("trained")
    r = run(["train", "--config", str(TINY), "--training.steps", "4", "--job.dump_folder", str(folder),
             "--checkpoint.enable", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_is_read_by_transformers(trained, tmp_path, dtype):
    from torchpar.weights import load_model

    out = tmp_path / "hf"
    r = run(["export", "--checkpoint", str(trained), "--out", str(out), "--format", "hf",
             "--dtype", dtype, "--max-shard-mb", "2"])
    assert r.returncode == 0, r.stderr
    assert "safetensors file(s)" in r.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 4
    assert config["torch_dtype"] == ("bfloat16" if dtype == "bf16" else "float32")
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 4095
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32).eval()
    ours, _ = load_model(trained)
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    # bf16 rounds every weight (relative 2^-9); fp32 is the same math.
    assert diff <= (1e-4 if dtype == "fp32" else 0.5), diff


@pytest.mark.slow
def test_export_never_replaces_what_it_did_not_write(trained, tmp_path, capfd):
    """A folder holding the user's config.json, and an existing weights file, are refused and left
    byte for byte; --overwrite writes there. A folder an earlier export wrote is written again
    without --overwrite: the shards of the earlier export go, a file the user put there stays."""
    from torchpar.commands import main
    from torchpar.weights import load_weights

    def export(out, *more):
        capfd.readouterr()
        code = main(["export", "--checkpoint", str(trained), "--out", str(out), *more])
        return code, capfd.readouterr().err

    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    code, err = export(hf, "--format", "hf")
    assert code == 2 and "holds files torchpar did not write there (config.json)" in err, err
    assert [p.name for p in hf.iterdir()] == ["config.json"] and (hf / "config.json").read_text() == "{}"
    assert export(hf, "--format", "hf", "--overwrite", "--max-shard-mb", "2")[0] == 0
    shards = sorted(p.name for p in hf.glob("model-*.safetensors"))
    assert len(shards) > 1 and json.loads((hf / "config.json").read_text())["architectures"]
    (hf / "README.md").write_text("the user's notes")
    code, err = export(hf, "--format", "hf")  # its own folder: no --overwrite needed
    assert code == 0, err
    assert not list(hf.glob("model-*.safetensors")) and (hf / "model.safetensors").exists()
    assert not (hf / "model.safetensors.index.json").exists()
    assert (hf / "README.md").read_text() == "the user's notes"
    transformers.AutoModelForCausalLM.from_pretrained(hf)

    pt = tmp_path / "m.pt"
    pt.write_bytes(b"the user's file")
    code, err = export(pt)
    assert code == 2 and "m.pt already exists" in err and "--overwrite" in err, err
    assert pt.read_bytes() == b"the user's file" and not (tmp_path / "m.pt.json").exists()
    assert export(pt, "--overwrite")[0] == 0
    assert "tok_embeddings.weight" in load_weights(pt)[0]
    code, err = export(pt)  # an export is not replaced by another without --overwrite either
    assert code == 2 and "m.pt already exists" in err, err


@pytest.mark.slow
def test_config_mismatch_and_damage_are_one_line(tmp_path):
    make_hf_llama(tmp_path / "hf", "debug")
    check = ["train", "--config", str(TINY), "--checkpoint.initial_load_path",
             str(tmp_path / "hf")]
    r = run([*check, "--check"])
    assert r.returncode == 0, r.stderr
    for extra, message in (
        (["--model.n_layers", "4"], "num_hidden_layers = 8, but model.flavor = 'debug' has 4"),
        (["--model.flavor", "debug-tied"], "tie_word_embeddings = False"),
        (["--model.name", "gpt2"], "the gpt2 family has no Hugging Face mapping"),
    ):
        r = run([*check, *extra, "--check"])
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("torchpar: error: ") and message in r.stderr, (
            r.stderr
        )
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"\x00" * 64)
    r = run([*check, "--check"])
    assert r.returncode == 2 and "Traceback" not in r.stderr and "safetensors" in r.stderr, r.stderr
    # A folder whose tokenizers JSON file is damaged: one line naming it.
    (tmp_path / "hf" / "tokenizer.json").write_text("{}")
    r = run([*check, "--model.tokenizer_path", str(tmp_path / "hf"), "--check"])
    assert r.returncode == 2 and "tokenizer.json: not a tokenizers JSON file" in r.stderr, r.stderr


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_llama")
    make_hf_llama(folder, "debug", seed=3)
    # (a model whose vocabulary holds the llama3 chat template's turn markers, as Llama 3's does)
    make_hf_llama(folder / "chat", "debug", seed=4, vocab_size=4104)
    return folder


CHATS = str(ROOT / "tests" / "data" / "short_chat.jsonl")


@pytest.mark.slow
def test_training_from_hf_is_the_same_under_tp_and_pp(hf_folder):
    """Started from the HF model, tp2 (each rank reads only its shards of every tensor) and pp2
    train exactly like one process — from the HF weights, not a fresh init; and so does supervised
    fine-tuning of an HF model on conversations (the loss on the answers) under ZeRO-3."""
    start = ["--checkpoint.initial_load_path", str(hf_folder)]
    sft = ["--checkpoint.initial_load_path", str(hf_folder / "chat"), "--data.dataset", "files",
           "--data.format", "chat", "--data.path", CHATS, "--validation.path", CHATS,
           "--data.document_masking", "true", "--model.vocab_size", "4104"]
    ref = run_layouts(1, {"one": start, "sft": sft})
    ref, sft_ref = ref["one"], ref["sft"]
    runs = run_layouts(
        2,
        {"tp2": [*start, "--parallelism.tensor_parallel_degree", "2"],
         "pp2": [*start, "--parallelism.pipeline_parallel_degree", "2"],
         "dp2_zero3": [*start, "--parallelism.zero_stage", "3", "--training.local_batch_size", "4"],
         "sft_dp2_zero3": [*sft, "--parallelism.zero_stage", "3", "--training.local_batch_size", "4"]},
    )
    assert_matches(runs.pop("sft_dp2_zero3"), sft_ref, param_tol=1e-4,
                   per_param={"tok_embeddings.weight": 1e-3})
    for name, result in runs.items():
        # The HF token table starts small (std 0.02), so a few rows of rare tokens get tiny gradients
        # that Adam's normalization turns float noise into ~1e-5..1e-4 differences (as the GPT-2 token
        # table in the layout tables); losses stay within 1e-5.
        assert_matches(result, ref, param_tol=1e-4, per_param={"tok_embeddings.weight": 1e-3})
    fresh = run_layouts(1, {"fresh": []})["fresh"]
    assert ref["losses"][0] != fresh["losses"][0]


def make_hf_qwen3_moe(folder: Path, seed: int = 0) -> "transformers.Qwen3MoeForCausalLM":
    """A random Qwen3MoeForCausalLM of the moe family's debug shape (the first block dense, 8 experts
    of which each token takes 2, per-head q/k norms), saved with each expert's linears apart."""
    return make_hf(folder, MOE, MOE.args("debug"), seed)


def moe_model(values):
    return build_from(MOE, MOE.args("debug"), values)


def test_qwen3_moe_import_gives_transformers_logits(tmp_path):
    """Experts stacked from their per-expert tensors, the router, q/k norms in HF's head order:
    the same logits as transformers' Qwen3-MoE within 1e-4."""
    hf = make_hf_qwen3_moe(tmp_path)
    model = moe_model(HFWeights(tmp_path, MOE, MOE.args("debug"), "debug"))
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_qwen3_moe_round_trip_is_bitwise(tmp_path):
    """HF -> torchpar -> HF in fp32: every tensor the same bit for bit, each expert's linears
    written apart again; reading back a slice of a stack reads only the experts asked for."""

    make_hf_qwen3_moe(tmp_path / "in")
    args = MOE.args("debug")
    weights = HFWeights(tmp_path / "in", MOE, args, "debug")
    model = moe_model(weights)
    params = dict(model.named_parameters())
    original, _ = exports_as_read(tmp_path, MOE, args, lambda name: params[name].detach(),
                                  max_shard_bytes=1 << 20)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in original
    w2 = weights["layers.2.feed_forward.experts.w2"]
    part = w2.read((slice(2, 4), slice(8, 40), slice(0, 16)))
    expected = params["layers.2.feed_forward.experts.w2"][2:4, 8:40, :16]
    torch.testing.assert_close(part, expected, rtol=0, atol=0)


def test_a_moe_flavour_without_a_hf_form_is_refused():
    """DeepSeek-shaped routing (sigmoid scores, a shared expert, a route scale) is not Qwen3-MoE."""
    problem = MOE.hf_problem(MODELS["deepseek_v3"].args("debug"))
    assert "score = 'sigmoid'" in problem and "shared_hidden = 64" in problem
    assert "Qwen3MoeForCausalLM" in problem
    assert MOE.hf_problem(MOE.args("debug")) is None


@pytest.mark.slow
def test_training_from_qwen3_moe_is_the_same_under_expert_parallelism(tmp_path):
    """Started from the HF model, each rank reading only its experts (and, with ZeRO-3 over the
    ranks holding them, its shard of them): ep 2 with 2 such ranks and ep 4 train like one process;
    so do LoRA adapters on it under ep 2 (the experts frozen), whose checkpoint exports as PEFT
    adapters that PEFT applies to the transformers model, as torchpar's merged model computes."""
    hf = make_hf_qwen3_moe(tmp_path / "base", seed=3)
    start = ["--model.name", "moe", "--checkpoint.initial_load_path", str(tmp_path / "base"),
             "--parallelism.zero_stage", "3"]
    # (the attention's layers: PEFT takes a mixture of experts' MLP projections for its fused experts)
    lora = [*start, "--lora.rank", "4", "--lora.alpha", "8", "--lora.modules", "layers.*.attention.*"]
    refs = run_layouts(1, {"ref": start, "ref_lora": lora})
    ref = refs["ref"]
    ep = ["--training.local_batch_size", "2", "--parallelism.expert_parallel_degree"]
    runs = run_layouts(4, {**{f"ep{n}": [*start, *ep, str(n)] for n in (2, 4)},
                           "ep2_lora": [*lora, *ep, "2", "--checkpoint.enable", "true", "--checkpoint.folder",
                                        str(tmp_path / "ckpt")]})
    assert_matches(runs.pop("ep2_lora"), refs["ref_lora"])
    done = run(["export", "--checkpoint", str(tmp_path / "ckpt"), "--format", "peft", "--out",
                str(tmp_path / "peft")])
    assert done.returncode == 0, done.stderr
    ours, _, _ = model_from(*open_merged(tmp_path / "ckpt"))
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        with_peft = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
        assert (ours(tokens) - with_peft(tokens).logits).abs().max() <= 1e-4
    for result in runs.values():
        # (the token table's rarely seen rows: Adam turns float noise in tiny gradients into ~1e-3,
        # as in the Llama case above; the losses agree within 1e-5)
        assert_matches(result, ref, param_tol=1e-4, per_param={"tok_embeddings.weight": 2e-3})
    fresh = run_layouts(1, {"fresh": ["--model.name", "moe"]})["fresh"]
    assert ref["losses"][0] != fresh["losses"][0]


# ---------------------------------------------------------------- DeepSeek-V3

DEEPSEEK = MODELS["deepseek_v3"]
# (no query latent: DeepSeek-V2's projection from x; YaRN: its temperature on the whole score)
DEEPSEEK_SHAPES = {"debug": {}, "no query latent": {"q_lora_rank": 0},
                   "yarn": {"yarn_factor": 4.0, "yarn_original_seq_len": 512}}


def deepseek_args(shape: dict):
    return replace(DEEPSEEK.args("debug"), **shape)  # (replace: a 0 field is the flavour's in args())




@pytest.mark.parametrize("shape", list(DEEPSEEK_SHAPES))
def test_deepseek_v3_import_gives_transformers_logits(tmp_path, shape):
    """Latent attention (HF's fused key/value-latent and rotary-key projection read as two), the
    routing bias, group-limited sigmoid routing, shared experts, the dense first block, YaRN's
    temperature on the whole score: transformers' logits within 2e-6 (float noise; logits ~1)."""
    args = deepseek_args(DEEPSEEK_SHAPES[shape])
    hf = make_hf(tmp_path, DEEPSEEK, args)
    model = build_from(DEEPSEEK, args, HFWeights(tmp_path, DEEPSEEK, args, "debug"))
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 2e-6, diff


def test_deepseek_v3_round_trip_is_bitwise(tmp_path):
    """HF -> torchpar -> HF in fp32: every tensor bit for bit, the fused projection written whole
    from its two parts, the routing bias from the trainer's state; a slice of the rotary key's rows
    reads only them."""

    args = deepseek_args({})
    make_hf(tmp_path / "in", DEEPSEEK, args)
    weights = HFWeights(tmp_path / "in", DEEPSEEK, args, "debug")
    model = build_from(DEEPSEEK, args, weights)
    state = {**{n: p.detach() for n, p in model.named_parameters()},
             "routing.expert_bias": weights["routing.expert_bias"].read()}
    original, _ = exports_as_read(tmp_path, DEEPSEEK, args, state.__getitem__, max_shard_bytes=1 << 20)
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in original
    assert "model.layers.3.mlp.gate.e_score_correction_bias" in original
    rope = weights["layers.2.attention.wk_rope.weight"].read((slice(2, 6), slice(0, 16)))
    fused = original["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]
    assert torch.equal(rope, fused[args.kv_lora_rank + 2:args.kv_lora_rank + 6, :16])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["q_lora_rank"] == 64 and config["n_group"] == 4 and config["num_nextn_predict_layers"] == 0


def test_deepseek_v3_prediction_depth_in_hf_layout_imports_and_round_trips(tmp_path):
    """A DeepSeek-V3 checkpoint with a prediction depth as DeepSeek ships one: a decoder layer after
    the model's own with enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and
    head. torchpar reads the depth (and transformers' model, which leaves it out, gives the same
    logits), and writes every tensor back bit for bit, the copies from the one embedding and head."""
    from safetensors.torch import load_file, save_file

    args = deepseek_args({"mtp_depth": 1})
    n, d = args.n_layers, args.dim
    make_hf(tmp_path / "in", DEEPSEEK, replace(args, n_layers=n + 1, mtp_depth=0))  # (layer n: the depth's)
    config_path = tmp_path / "in" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "num_hidden_layers": n, "num_nextn_predict_layers": 1}))
    tensors = load_file(tmp_path / "in" / "model.safetensors")
    g = torch.Generator().manual_seed(2)
    tensors.update({f"model.layers.{n}.{name}": torch.rand(shape, generator=g) + 0.5 for name, shape in
                    (("enorm.weight", (d,)), ("hnorm.weight", (d,)), ("shared_head.norm.weight", (d,)))})
    tensors[f"model.layers.{n}.eh_proj.weight"] = torch.randn(d, 2 * d, generator=g) * 0.05
    tensors[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    tensors[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file(tensors, tmp_path / "in" / "model.safetensors", metadata={"format": "pt"})
    weights = HFWeights(tmp_path / "in", DEEPSEEK, args, "debug")
    model = build_from(DEEPSEEK, args, weights)
    assert torch.equal(model.layers[str(n)].join.eh_proj.weight, tensors[f"model.layers.{n}.eh_proj.weight"])
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "in").eval()
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 2e-6
    state = {**{name: p.detach() for name, p in model.named_parameters()},
             "routing.expert_bias": weights["routing.expert_bias"].read()}
    exports_as_read(tmp_path, DEEPSEEK, args, state.__getitem__, tensors)
    # A model of no depths reads the same folder (its depth left unread); one of two is refused.
    HFWeights(tmp_path / "in", DEEPSEEK, deepseek_args({}), "debug")
    with pytest.raises(ConfigError, match="num_nextn_predict_layers = 1: the checkpoint holds fewer"):
        HFWeights(tmp_path / "in", DEEPSEEK, deepseek_args({"mtp_depth": 2}), "debug")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1


# ---------------------------------------------------------------- gpt-oss

GPT_OSS = MODELS["gpt_oss"]


def test_gpt_oss_import_gives_transformers_logits_and_round_trips_bitwise(tmp_path):
    """Biased routers and experts with the clamped SwiGLU (HF's gate and up interleaved in one stack,
    read as two), attention sinks and biases, a sliding window in every other layer, YaRN without
    the ramp's rounding, the experts' pre-activations past the clamp: transformers' logits within
    three times the float32 noise (torchpar's float32 logits against its float64 ones: ~2e-5 on
    logits ~1 at these magnitudes); HF -> torchpar -> HF bit for bit; a slice
    of the up projection's hidden units reads only its columns."""

    args = GPT_OSS.args("debug")
    hf = make_hf(tmp_path / "in", GPT_OSS, args)
    with torch.no_grad():  # (pre-activations past the clamp's limit of 7 in places)
        for layer in hf.model.layers:
            layer.mlp.experts.gate_up_proj.mul_(300)
    hf.save_pretrained(tmp_path / "in")
    weights = HFWeights(tmp_path / "in", GPT_OSS, args, "debug")
    model = build_from(GPT_OSS, args, weights)
    tokens = torch.randint(0, 4096, (2, 40), generator=torch.Generator().manual_seed(1))  # (past the window)
    exact = copy.deepcopy(model).double()  # (the float32 noise at these magnitudes: against float64)
    exact.reset_buffers(None)
    with torch.no_grad():
        got = model(tokens)
        diff, noise = ((got - other).abs().max().item() for other in (hf(tokens).logits, exact(tokens)))
    assert diff <= 3 * noise, (diff, noise)
    params = dict(model.named_parameters())
    original, _ = exports_as_read(tmp_path, GPT_OSS, args, lambda name: params[name].detach())
    up = weights["layers.1.feed_forward.experts.w3"].read((slice(2, 4), slice(0, 8), slice(5, 9)))
    assert torch.equal(up, original["model.layers.1.mlp.experts.gate_up_proj"][2:4, :8, 11:19:2])
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["layer_types"][:2] == ["sliding_attention", "full_attention"]
    assert config["rope_parameters"]["truncate"] is False
    # gpt-oss's released folders hold MXFP4 experts: one line, before any tensor is looked for
    (tmp_path / "out" / "config.json").write_text(json.dumps({**config, "quantization_config": {
        "quant_method": "mxfp4"}}))
    with pytest.raises(ConfigError, match=r"quantized \(mxfp4\); torchpar reads full precision only"):
        HFWeights(tmp_path / "out", GPT_OSS, args, "debug")


def test_deepseek_v3_yarn_in_another_form_is_one_line(tmp_path):
    """A checkpoint whose YaRN puts its temperature on cos and sin (no mscale fields) computes other
    scores than DeepSeek's: one line naming the field."""
    args = deepseek_args(DEEPSEEK_SHAPES["yarn"])
    make_hf(tmp_path, DEEPSEEK, args)
    config = json.loads((tmp_path / "config.json").read_text())
    for key in ("rope_parameters", "rope_scaling"):
        if config.get(key):
            config[key] = {k: v for k, v in config[key].items() if not k.startswith("mscale")}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="RoPE mscale = None"):
        HFWeights(tmp_path, DEEPSEEK, args, "debug")


@pytest.mark.slow
def test_deepseek_v3_trains_from_hf_under_expert_parallelism_and_exports_back(tmp_path):
    """Started from a DeepSeek-V3-shaped HF folder, each rank reading its own experts: ep 2 trains
    like one process; the imported routing bias is the run's starting bias (its range after one
    step is the import's, ~0.2, not one step's 0.02). The checkpoint exports back to a folder that
    transformers reads with the trained weights and bias: its logits are torchpar's; and to a
    torchpar weights file that holds the bias, which a model loaded from it routes with."""
    from torchpar.weights import load_model

    args = deepseek_args({})
    make_hf(tmp_path / "hf", DEEPSEEK, args, seed=3)
    start = ["--model.name", "deepseek_v3", "--checkpoint.initial_load_path", str(tmp_path / "hf"),
             "--parallelism.zero_stage", "3", "--model.bias_rate", "0.01"]
    ref = run_layouts(1, {"ref": start})["ref"]
    ep2 = run_layouts(2, {"ep2": [*start, "--training.local_batch_size", "4",
                                  "--parallelism.expert_parallel_degree", "2"]})["ep2"]
    assert_matches(ep2, ref, param_tol=1e-4, per_param={"tok_embeddings.weight": 2e-3})
    assert ref["step1"]["moe/bias_range"] > 0.1
    ckpt = tmp_path / "run"
    r = run(["train", "--config", str(TINY), *start, "--training.steps", "2", "--job.dump_folder", str(ckpt),
             "--checkpoint.enable", "true"])
    assert r.returncode == 0, r.stderr[-3000:]
    r = run(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out"), "--format", "hf"])
    assert r.returncode == 0, r.stderr[-3000:]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32).eval()
    ours, _ = load_model(ckpt)
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (hf(tokens).logits - ours(tokens)).abs().max().item()
    assert diff <= 2e-6, diff
    # A torchpar weights file holds the bias too, and a model loaded from it routes with it.
    r = run(["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "w.pt")])
    assert r.returncode == 0, r.stderr[-3000:]
    bias = torch.load(tmp_path / "w.pt", weights_only=True)["routing.expert_bias"]
    assert bias.shape == (3, 8) and bias.abs().max() > 0.05
    loaded, _ = load_model(tmp_path / "w.pt")
    assert torch.equal(loaded.layers["1"].feed_forward.router.expert_bias, bias[0])
    assert torch.equal(ours.layers["3"].feed_forward.router.expert_bias, bias[2])


# ---------------------------------------------------------------- Qwen3 (dense)

QWEN3 = MODELS["qwen3"]


@pytest.mark.parametrize("shape", [{}, {"head_size": 32, "tie_embeddings": True}],
                         ids=["debug", "wide-heads-tied"])
def test_qwen3_import_gives_transformers_logits_and_round_trips_bitwise(tmp_path, shape):
    """Per-head q/k norms (their weights permuted within the head, as q's and k's rows), heads wider
    than dim / heads, tied or not: transformers' logits within 2e-6; HF -> torchpar -> HF bit for bit.
    A Llama with q/k norms has no LlamaForCausalLM form (it would lose them): one line."""

    args = replace(QWEN3.args("debug"), **shape)
    hf = make_hf(tmp_path / "in", QWEN3, args)
    model = build_from(QWEN3, args, HFWeights(tmp_path / "in", QWEN3, args, "debug"))
    tokens = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (model(tokens) - hf(tokens).logits).abs().max().item()
    assert diff <= 2e-6, diff
    params = dict(model.named_parameters())
    original, _ = exports_as_read(tmp_path, QWEN3, args, lambda name: params[name].detach())
    assert "model.layers.0.self_attn.q_norm.weight" in original
    llama_with_norms = LLAMA.hf_problem(LLAMA.args("debug", qk_norm=True))
    assert "LlamaForCausalLM has no per-head query/key norms" in llama_with_norms
    for family in (LLAMA, QWEN3, MOE):  # (their HF classes hold no prediction depths)
        assert "mtp_depth" in family.hf_problem(family.args("debug", mtp_depth=1))
