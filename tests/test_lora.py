"""LoRA: the adapted model against the merged one and against PEFT applying the same adapters to
the same transformers model; the planner's entries against the model's parameters; and, end to
end, fine-tuning a Hugging Face model with adapters, its resume, and both exports read back by
transformers and PEFT."""

import json
import os
import types
from pathlib import Path

import pytest
import torch
from harness import ROOT, cli, run_layouts

from torchpar.adapters import open_merged, peft_adapters
from torchpar.hf import HFWeights, write_hf
from torchpar.models import MODELS
from torchpar.models.lora import A, B, adapted_layers, add_adapters, merge_weights, spec, with_adapters
from torchpar.weights import build_from, model_from

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

LLAMA = MODELS["llama3"]
RANK, ALPHA = 4, 8.0


def lora(modules=("layers.*",), exclude=("*.gate",)):
    return types.SimpleNamespace(rank=RANK, alpha=ALPHA, dropout=0.0, modules=list(modules),
                                 exclude=list(exclude))


def adapted_model(family, args, values=None, seed: int = 0):
    """``family``'s model with ``args`` and adapters on every block's linear layer (their B random,
    not zero, so that they change the logits), its base from ``values`` or the seed."""
    with torch.device("meta"):
        model = family.build(args)
    add_adapters(model, family, lora())
    model.to_empty(device="cpu")
    model.init_weights(seed, values=values)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(B):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model.eval()


def make_hf_llama(folder: Path, seed: int = 0, **shape):
    """A random LlamaForCausalLM of the debug flavour's shape (with ``shape``'s fields), its norms
    away from 1."""
    fields = {k: v for k, v in LLAMA.hf_config(LLAMA.args("debug", **shape)).items()
              if k not in ("architectures", "rope_parameters")}
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return model


TOKENS = torch.randint(0, 4096, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", ["llama3", "gpt2", "moe", "deepseek_v3", "gpt_oss", "qwen3"])
def test_planner_entries_are_the_models_parameters(family):
    """The planner's entries with adapters (each adapted layer's A and B after its weight and bias)
    are the adapted model's parameters, names and shapes, in order: what its bytes are counted from."""
    model = MODELS[family]
    args = model.args("debug") if "debug" in model.flavors else model.args(next(iter(model.flavors)))
    with torch.device("meta"):
        module = model.build(args)
    add_adapters(module, model, lora())
    adapted = adapted_layers(model, args, spec(lora()))
    assert adapted and not any(name.endswith("gate") for name in adapted)
    for layer in range(args.n_layers):
        real = [(n.removeprefix(f"layers.{layer}."), tuple(p.shape)) for n, p in module.named_parameters()
                if n.startswith(f"layers.{layer}.")]
        entries = with_adapters(model.block_params(args, layer), layer, adapted, RANK)
        planned = [(n, (r,) if c == 1 and not n.endswith((A, B)) else (r, c)) for n, (r, c), _ in entries]
        assert [n for n, _ in real] == [n for n, _ in planned]
        assert all(s == p or len(s) > 2 for (_, s), (_, p) in zip(real, planned)), family


def test_peft_format_refuses_what_peft_would_apply_elsewhere():
    """PEFT takes a mixture of experts' MLP projection names for its fused experts: adapters on a
    dense block's MLP of such a model are refused in one line naming the layer and the way out."""
    from torchpar.errors import ConfigError

    moe = MODELS["moe"]
    args = moe.args("debug")
    with pytest.raises(ConfigError, match=r"layers\.0\.feed_forward\.w1 is model\.layers\.0\.mlp\.gate_proj"):
        peft_adapters(moe, args, spec(lora()), ALPHA, 0.0, lambda name: torch.zeros(1))


def test_adapters_start_at_the_base_and_merge_into_its_weights():
    """With B = 0 (the init) the adapted model is the base; with trained adapters, the plain model
    holding W + (alpha / r) B A gives its logits."""
    args = LLAMA.args("debug")
    with torch.device("meta"):
        plain = LLAMA.build(args)
    plain.to_empty(device="cpu")
    plain.init_weights(0)
    with torch.device("meta"):
        fresh = LLAMA.build(args)
    add_adapters(fresh, LLAMA, lora())
    fresh.to_empty(device="cpu")
    fresh.init_weights(0)
    with torch.no_grad():
        assert torch.equal(fresh(TOKENS), plain.eval()(TOKENS))
    model = adapted_model(LLAMA, args)
    merged = build_from(LLAMA, args, merge_weights(dict(model.state_dict()), ALPHA / RANK))
    with torch.no_grad():
        ours, theirs = model(TOKENS), merged(TOKENS)
        assert (ours - plain(TOKENS)).abs().max() > 1e-2  # the adapters change the logits
        assert (ours - theirs).abs().max() <= 1e-4


def test_peft_applies_our_adapters_to_transformers_as_we_do(tmp_path):
    """Our adapters, written in PEFT's format, applied by PEFT to the transformers model whose weights
    we started from, give our adapted model's logits; merged into the weights and exported as a
    Hugging Face folder, transformers alone gives them too."""
    from safetensors.torch import save_file

    hf = make_hf_llama(tmp_path / "base")
    args = LLAMA.args("debug")
    model = adapted_model(LLAMA, args, HFWeights(tmp_path / "base", LLAMA, args, "debug"))
    values = {k: v.detach() for k, v in model.state_dict().items()}
    tensors, config = peft_adapters(LLAMA, args, spec(lora()), ALPHA, 0.0, values.__getitem__)
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps(config))
    with_peft = peft.PeftModel.from_pretrained(hf, folder).eval()
    with torch.no_grad():
        ours = model(TOKENS)
        assert (ours - with_peft(TOKENS).logits).abs().max() <= 1e-4
    merged = merge_weights(values, ALPHA / RANK)
    write_hf(tmp_path / "merged", LLAMA, args, merged.__getitem__, torch.float32)
    exported = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        assert (ours - exported(TOKENS).logits).abs().max() <= 1e-4


CHATS = str(ROOT / "tests" / "data" / "short_chat.jsonl")
LORA = ["--lora.rank", str(RANK), "--lora.alpha", str(ALPHA)]


@pytest.mark.slow
def test_lora_fine_tuning_from_hf_resumes_and_exports_to_transformers_and_peft(tmp_path):
    """Supervised fine-tuning of a transformers Llama on conversations with adapters: ZeRO-3 over 2
    ranks trains as one process; a resume rebuilds the frozen base from the HF folder and goes on
    bitwise; the checkpoint (adapters alone) exports as a merged HF folder transformers reads, and
    as PEFT adapters PEFT applies to the original model, both giving the logits torchpar's merged
    model gives; the merged folder imports back as that model."""
    base = tmp_path / "base"
    make_hf_llama(base, seed=5, vocab_size=4104)  # (its vocabulary holds the chat template's markers)
    job = ["--checkpoint.initial_load_path", str(base), "--model.vocab_size", "4104", "--data.dataset",
           "files", "--data.format", "chat", "--data.path", CHATS, "--validation.path", CHATS,
           "--training.steps", "6", "--validation.enable", "true", "--validation.freq", "2", *LORA]
    saving = [*job, "--checkpoint.enable", "true", "--checkpoint.interval", "3", "--checkpoint.folder",
              str(tmp_path / "ckpt")]
    one = run_layouts(1, {"one": saving})["one"]
    resumed = run_layouts(1, {"resumed": [*saving, "--checkpoint.load_step", "3"]})["resumed"]
    assert resumed["losses"] == one["losses"][3:]
    assert all(torch.equal(resumed["params"][k], v) for k, v in one["params"].items())
    assert one["val_losses"][-1][1] < one["val_losses"][0][1]  # it learns the answers
    zero3 = run_layouts(2, {"zero3": [*job, "--parallelism.zero_stage", "3", "--training.local_batch_size",
                                      "4"]})["zero3"]
    assert max(abs(a - b) for a, b in zip(zero3["losses"], one["losses"])) < 1e-5

    env = dict(os.environ)
    step = str(tmp_path / "ckpt")
    for fmt in ("hf", "peft"):
        done = cli(["export", "--checkpoint", step, "--format", fmt, "--out", str(tmp_path / fmt)], env)
        assert done.returncode == 0, done.stderr
    ours, _, _ = model_from(*open_merged(step))
    tokens = torch.randint(0, 4104, (2, 24), generator=torch.Generator().manual_seed(2))
    merged = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    original = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    with torch.no_grad():
        logits = ours(tokens)
        assert (logits - original(tokens).logits).abs().max() > 1e-3  # the adapters were trained
        assert (logits - merged(tokens).logits).abs().max() <= 1e-4
        with_peft = peft.PeftModel.from_pretrained(original, tmp_path / "peft").eval()
        assert (logits - with_peft(tokens).logits).abs().max() <= 1e-4
        # ...and the merged export imports back as the model it holds (a plain model now)
        args = LLAMA.args("debug", vocab_size=4104)
        again = build_from(LLAMA, args, HFWeights(tmp_path / "hf", LLAMA, args, "debug"))
        assert (logits - again(tokens)).abs().max() <= 1e-5
        # ...and the merged export imports back as the model it holds (a plain model now)
        args = LLAMA.args("debug", vocab_size=4104)
        again = build_from(LLAMA, args, HFWeights(tmp_path / "hf", LLAMA, args, "debug"))
        assert (logits - again(tokens)).abs().max() <= 1e-5


def test_a_base_seeded_by_another_generator_is_refused_in_one_line(monkeypatch):
    """Adapters whose base was initialized from the seed (no saved base, no initial weights) can be
    merged or resumed only where the generator draws the same numbers: not on a CPU for a GPU's
    base, nor on a GPU of another multiprocessor count (torch's random kernels size their launch
    grid by it: an A100's draws are not an H100's); a CPU's base is merged anywhere (drawn on the
    CPU), but a trainer on a GPU would draw it there."""
    import torchpar.preflight
    from torchpar.adapters import _base_reader
    from torchpar.config import load_config
    from torchpar.errors import ConfigError
    from torchpar.models import adapter
    from torchpar.preflight import lora_resume_problem

    cfg = load_config(ROOT / "train_configs" / "debug_model.toml", ["--lora.rank", "4"])
    args = adapter(cfg.model.name).args(cfg.model.flavor)
    h100 = {"kind": "cuda", "name": "NVIDIA H100 80GB HBM3", "multiprocessors": 132, "threads": 2048}
    a100 = {**h100, "name": "NVIDIA A100-SXM4-80GB", "multiprocessors": 108}
    h200 = {**h100, "name": "NVIDIA H200"}
    meta = {"model_name": cfg.model.name, "model_args": args.to_dict(), "device": "cuda"}
    monkeypatch.setattr(torchpar.preflight, "generator_identity", lambda: {"kind": "cpu"})
    with pytest.raises(ConfigError, match="ckpt/step-10 holds LoRA adapters whose base was initialized from "
                                          "training.seed on a cuda device, whose generator draws other"):
        _base_reader(meta, cfg, None, "ckpt/step-10")  # (an older manifest: the device's kind alone)
    base = _base_reader({**meta, "device": "cpu"}, cfg, None, "ckpt/step-10")
    assert base("layers.0.attention.wq.weight").shape == (args.dim, args.dim)
    monkeypatch.setattr(torchpar.preflight, "generator_identity", lambda: a100)
    with pytest.raises(ConfigError, match=r"on NVIDIA H100 80GB HBM3 \(132 multiprocessors x 2048 "
                                          r"threads\), whose generator draws other numbers than this "
                                          r"machine's \(NVIDIA A100"):
        _base_reader({**meta, "generator": h100}, cfg, None, "ckpt/step-10")
    saved = {"lora": {"rank": 4}, "training": {"seed": cfg.training.seed}}
    assert "use it on that kind of device" in lora_resume_problem(cfg, saved, h100)
    assert lora_resume_problem(cfg, saved, {"kind": "cuda"}) is None  # (an older manifest: warned)
    monkeypatch.setattr(torchpar.preflight, "generator_identity", lambda: h200)  # (as many multiprocessors)
    assert lora_resume_problem(cfg, saved, h100) is None
    cpu = {"kind": "cpu"}
    assert "initialized from training.seed on a cpu device" in lora_resume_problem(cfg, saved, cpu)
    monkeypatch.setattr(torchpar.preflight, "generator_identity", lambda: cpu)
    assert lora_resume_problem(cfg, saved, cpu) is None


def test_zero3_keeps_the_frozen_base_in_the_compute_dtype():
    """Under FSDP2 a LoRA base is stored in the compute dtype (nothing updates it: an fp32 copy
    would only be cast at every all-gather); the adapters stay fp32, a tied pair stays one."""
    from torch import nn

    from torchpar.parallel.fsdp import frozen_in

    model = nn.ModuleDict({"embed": nn.Embedding(8, 4), "head": nn.Linear(4, 8, bias=False),
                           "adapter": nn.Linear(4, 4)})
    model["head"].weight = model["embed"].weight
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("adapter"))
    before = model["embed"].weight.detach().clone()
    frozen_in(model, torch.bfloat16)
    assert model["head"].weight is model["embed"].weight and model["embed"].weight.dtype == torch.bfloat16
    assert not model["embed"].weight.requires_grad
    assert torch.equal(model["embed"].weight, before.to(torch.bfloat16))
    assert {p.dtype for n, p in model.named_parameters() if n.startswith("adapter")} == {torch.float32}
