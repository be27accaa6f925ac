"""Whole-model weights outside DCP: ``torchpar export`` files, and loading a checkpoint or an
export into one process (generation, ``initial_load_path``).

An export is one ``torch.save`` file of full fp32 or bf16 tensors by canonical parameter name
(loadable with ``weights_only=True``) plus ``FILE.json`` with the model family, flavour, args,
tokenizer and step.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch

from torchpar.checkpoint import (
    MANIFEST,
    check_model_matches,
    complete_checkpoints,
    read_manifest,
    verify_files,
)
from torchpar.errors import ConfigError
from torchpar.models import DEFAULT_FAMILY, adapter
from torchpar.outputs import replacing, write_text


def save_weights(state: dict[str, torch.Tensor], meta: dict, out: Path) -> None:
    """One ``torch.save`` file of full tensors (loadable with ``weights_only=True``) + ``<out>.json``,
    each written whole or not at all."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:
        torch.save(state, tmp)
    write_text(meta_path(out), json.dumps(meta, indent=1) + "\n")


def meta_path(path: Path) -> Path:
    """The metadata file beside an exported weights file."""
    return path.with_name(path.name + ".json")


class LazyWeight:
    """One parameter, read on demand: ``read(index)`` returns the part ``index`` (a tuple of
    slices, one per dim; () = all) without reading the rest — how each rank of a parallel job
    reads only its own shard of a weights file (``init_weights`` accepts these for tensors)."""

    def __init__(self, shape: tuple[int, ...], read):
        self.shape, self._read = tuple(shape), read

    def read(self, index: tuple = ()) -> torch.Tensor:
        index = tuple(index) + (slice(None),) * (len(self.shape) - len(index))
        return self._read(tuple(slice(*s.indices(n)) for s, n in zip(index, self.shape)))


def load_weights(path: str | Path, model_cfg=None, args=None) -> tuple[dict[str, LazyWeight], dict]:
    """An exported weights file (never unpickles code), memory-mapped, as lazy fp32 weights by
    name; given the [model] section and its args, check first that it holds that model."""
    path = Path(path)
    meta_file = meta_path(path)
    if not path.exists() or not meta_file.exists():
        raise ConfigError(f"weights file {path} (and its {meta_file.name}) not found; make one with "
                          "`torchpar export --checkpoint DIR --out FILE`")
    try:
        meta = json.loads(meta_file.read_text())
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a damaged file: one line, not a traceback
        raise ConfigError(f"weights file {path} cannot be read ({type(e).__name__}: {e}); export it "
                          "again") from None
    if args is not None:
        check_model_matches(f"weights file {path}", meta, model_cfg.name, model_cfg.flavor, args)
    return {k: LazyWeight(v.shape, lambda index, v=v: v[index].float()) for k, v in state.items()}, meta


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


def open_source(path: str | Path) -> tuple[dict, object]:
    """(metadata, read) for a checkpoint folder or an exported weights file, where
    ``read(name)`` returns one parameter as a full fp32 tensor and reads nothing else: a DCP
    checkpoint is read tensor by tensor, an export file is memory-mapped. No process group."""
    import torch.distributed.checkpoint as dcp

    p = Path(path)
    if p.is_file():
        weights, meta = load_weights(p)
        return meta, lambda name: weights[name].read()
    p = resolve_checkpoint(p)
    meta = read_manifest(p)
    verify_files(p, meta, checksums=True)
    sizes = dcp.FileSystemReader(str(p)).read_metadata().state_dict_metadata

    def read(name: str) -> torch.Tensor:
        # a parameter's name, or the full key of the state beside them (extra_state)
        part, key = ("model", name) if f"model.{name}" in sizes else name.split(".", 1)
        sd = {part: {key: torch.empty(tuple(sizes[f"{part}.{key}"].size))}}
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore")
            dcp.load(sd, checkpoint_id=str(p), no_dist=True)  # this tensor's shards, gathered whole
        return sd[part][key]

    return meta, read


def load_model(path: str | Path):
    """A whole model on the CPU in fp32 from a checkpoint folder or an exported weights file,
    with its metadata (model family, flavour and args, tokenizer path, step)."""
    model, meta, _ = open_model(path)
    return model, meta


def open_model(path: str | Path):
    """:func:`load_model`'s model and metadata, and the state beside the parameters the source
    holds (:func:`extra_state`; the model's routers already follow it), read once."""
    return model_from(*open_source(path))


def model_from(meta: dict, read):
    """:func:`open_model` of a source already opened (:func:`open_source`'s metadata and ``read``)."""
    family = adapter(meta.get("model_name", DEFAULT_FAMILY))
    args = family.args_class(**meta["model_args"])
    extra = extra_state(family, args, read)
    return build_from(family, args, _Reading(read, extra)), meta, extra


class _Reading(dict):
    """Values by name for :func:`build_from`: the ones given, and any other read from the source
    when asked (so a parameter is read as it is filled, not all of them first)."""

    def __init__(self, read, given: dict):
        super().__init__(given)
        self.read = read

    def __missing__(self, name: str) -> torch.Tensor:
        return self.read(name)


def build_from(family, args, values):
    """``family``'s model with ``args`` on the CPU in fp32 (eval mode), its parameters from
    ``values`` by name (tensors or LazyWeights: an export, a Hugging Face folder), its routers
    following the balancing bias ``values`` holds, if it holds one."""
    with torch.device("meta"):
        model = family.build(args)
    model.to_empty(device="cpu")
    model.tie_weights()
    model.init_weights(0, values=values)
    routing = family.routing([model], args)
    if routing is not None:
        routing.start_from(values)
    return model.eval()


def extra_state(family, args, read) -> dict[str, torch.Tensor]:
    """The state beside the parameters a source holds (the routers' balancing bias), by name; none
    that a file exported before it held."""
    out = {}
    for name in family.extra_state(args):
        try:
            out[name] = read(name)
        except KeyError:
            pass
    return out
