"""``torchpar export``: a checkpoint consolidated into one weights file, or a Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import torch

from torchpar.adapters import is_own_peft, open_merged, write_peft
from torchpar.checkpoint import (
    MANIFEST,
)
from torchpar.console import ArgumentParser, at_least
from torchpar.errors import ConfigError
from torchpar.hf import export_hf, is_own_export
from torchpar.outputs import add_overwrite, claim
from torchpar.weights import meta_path, model_from, save_weights


def _refuse_checkpoint_target(out: Path) -> None:
    """An export never writes into a checkpoint: it could replace the files it is made from."""
    for folder in (out, out.parent):
        if (folder / MANIFEST).exists() or (folder / ".metadata").exists():
            raise ConfigError(f"--out {out} is inside checkpoint {folder}; writing there could overwrite it, "
                              "choose a path outside the checkpoint folders")


def export_main(argv: list[str]) -> int:
    """torchpar export --checkpoint DIR --out FILE|DIR [--format torchpar|hf] [--dtype bf16|fp32]"""

    ap = ArgumentParser(prog="torchpar export", description="Consolidate a DCP checkpoint into one "
                        "weights file (torch.save, loadable with weights_only=True) + FILE.json, "
                        "or into a Hugging Face folder (safetensors + config.json). An existing FILE "
                        "is not replaced, nor a folder holding files an earlier export did not write, "
                        "unless --overwrite.")
    ap.add_argument("--checkpoint", required=True,
                    help="step folder, checkpoint folder or dump folder (latest step), or an export file")
    ap.add_argument("--out", required=True, help="output file (e.g. model.pt), or folder with --format hf")
    ap.add_argument("--format", default="torchpar", choices=("torchpar", "hf", "peft"),
                    help="torchpar: one weights file; hf: a Hugging Face folder; peft: a LoRA checkpoint's "
                         "adapters alone, as PEFT loads them (hf and torchpar merge them into the weights)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    ap.add_argument("--max-shard-mb", type=float, default=5 * 1024,
                    help="--format hf: start a new safetensors file above this size (default 5 GiB, as HF)")
    add_overwrite(ap)
    a = ap.parse_args(argv)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    at_least("--max-shard-mb", a.max_shard_mb, 0, exclusive=True)
    hf, folder = a.format == "hf", a.format in ("hf", "peft")
    _refuse_checkpoint_target(Path(a.out).expanduser())  # even with --overwrite
    own = {"hf": is_own_export, "peft": is_own_peft}.get(a.format)
    out = claim("--out", a.out, folder=folder, overwrite=a.overwrite, own=own)
    if not folder:
        claim("--out", meta_path(out), overwrite=a.overwrite)  # the metadata written beside it
    if a.format == "peft":
        print(f"torchpar: wrote {a.out}: {write_peft(a.checkpoint, out, dtype)}")
        return 0
    if hf:
        meta, read = open_merged(a.checkpoint)
        what = export_hf(meta, read, out, dtype, a.max_shard_mb)
        print(f"torchpar: wrote {a.out}: {what} (step {meta.get('step')})")
        return 0
    if out.exists() and out.resolve() == Path(a.checkpoint).expanduser().resolve():
        raise ConfigError(f"--out {out} is the --checkpoint being exported; choose another file")
    model, meta, extra = model_from(*open_merged(a.checkpoint))
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    state.update(extra)  # (the routers' balancing bias, in fp32: a few numbers)
    keys = ("model_name", "model_flavor", "model_args", "tokenizer_path", "step", "tokens_seen")
    out_meta = {"format": "torchpar-weights-v1", "dtype": a.dtype, "source": str(a.checkpoint),
                **{k: meta[k] for k in keys if k in meta}}
    save_weights(state, out_meta, out)
    n = sum(p.numel() for p in model.parameters())  # a tied table once
    print(f"torchpar: wrote {a.out} ({n / 1e6:.2f}M parameters, {a.dtype}, step {meta.get('step')}) and "
          f"{a.out}.json")
    return 0
