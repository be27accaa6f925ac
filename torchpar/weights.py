"""Whole-model weights outside DCP: ``torchpar export`` files, and loading a checkpoint or an
export into one process (generation, ``initial_load_path``).

An export is one ``torch.save`` file of full fp32 or bf16 tensors by canonical parameter name
(loadable with ``weights_only=True``) plus ``FILE.json`` with the model family, flavour, args,
tokenizer and step.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

from torchpar.checkpoint import MANIFEST, check_model_matches, complete_checkpoints, read_manifest, verify_files
from torchpar.config import ConfigError
from torchpar.models import adapter


def save_weights(state: dict[str, torch.Tensor], meta: dict, out: Path) -> None:
    """One ``torch.save`` file of full tensors (loadable with ``weights_only=True``) + ``<out>.json``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, out)
    out.with_name(out.name + ".json").write_text(json.dumps(meta, indent=1) + "\n")


def load_weights(path: str | Path, model_cfg=None, args=None) -> tuple[dict[str, torch.Tensor], dict]:
    """Read an exported weights file (never unpickles code) and, given the [model] section and
    its args, check that it holds that model."""
    path = Path(path)
    meta_path = path.with_name(path.name + ".json")
    if not path.exists() or not meta_path.exists():
        raise ConfigError(f"weights file {path} (and its {meta_path.name}) not found; make one with "
                          "`torchpar export --checkpoint DIR --out FILE`")
    try:
        meta = json.loads(meta_path.read_text())
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file: one line, not a traceback
        raise ConfigError(f"weights file {path} cannot be read ({type(e).__name__}: {e}); export it again") from None
    if args is not None:
        check_model_matches(f"weights file {path}", meta, model_cfg.name, model_cfg.flavor, args)
    return {k: v.float() for k, v in state.items()}, meta


# ---------------------------------------------------------------------- single-process use


def resolve_checkpoint(path: str | Path) -> Path:
    """A step folder as is; a checkpoint folder (or a job's dump folder) -> its latest complete step."""
    p = Path(path)
    if (p / MANIFEST).exists():
        return p
    found = complete_checkpoints(p) or complete_checkpoints(p / "checkpoint")
    if not found:
        raise ConfigError(f"no complete checkpoint in {p} (expected step-NNNNNNNN folders with {MANIFEST})")
    return found[max(found)]


def load_model(path: str | Path):
    """A whole model on the CPU in fp32 from a checkpoint folder or an exported weights file,
    with its metadata (model flavour and args, tokenizer path, step). No process group needed."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    if p.is_file():
        values, meta = load_weights(p)
    else:
        p = resolve_checkpoint(p)
        meta = read_manifest(p)
        verify_files(p, meta, checksums=True)
    family = adapter(meta.get("model_name", "llama3"))
    with torch.device("meta"):
        model = family.build(family.args_class(**meta["model_args"]))
    model.to_empty(device="cpu")
    model.tie_weights()
    if not p.is_file():
        sd = {"model": model.state_dict()}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            dcp.load(sd, checkpoint_id=str(p), no_dist=True)  # reads every shard into full tensors
        values = sd["model"]
    model.init_weights(0, values=values)
    model.eval()
    return model, meta


def export_main(argv: list[str]) -> int:
    """torchpar export --checkpoint DIR --out FILE [--dtype bf16|fp32]"""
    import argparse

    ap = argparse.ArgumentParser(prog="torchpar export", description="Consolidate a DCP checkpoint into one "
                                 "weights file (torch.save, loadable with weights_only=True) + FILE.json.")
    ap.add_argument("--checkpoint", required=True, help="step folder, checkpoint folder or dump folder (latest step)")
    ap.add_argument("--out", required=True, help="output file, e.g. model.pt")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    a = ap.parse_args(argv)
    try:
        model, meta = load_model(a.checkpoint)
    except ConfigError as e:
        print(f"torchpar: error: {e}", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    state = {k: v.detach().to(dtype) for k, v in model.state_dict().items()}
    keys = ("model_name", "model_flavor", "model_args", "tokenizer_path", "step", "tokens_seen")
    out_meta = {"format": "torchpar-weights-v1", "dtype": a.dtype, "source": str(a.checkpoint),
                **{k: meta[k] for k in keys if k in meta}}
    save_weights(state, out_meta, Path(a.out))
    n = sum(p.numel() for p in model.parameters())  # a tied table once
    print(f"torchpar: wrote {a.out} ({n / 1e6:.2f}M parameters, {a.dtype}, step {meta.get('step')}) and {a.out}.json")
    return 0
