"""Hugging Face format: safetensors + config.json in and out, for families with an HF mapping.

Writing streams tensor by tensor: each file's header (names, dtypes, shapes, offsets) is known
from the shapes alone and written first, then every tensor is read from its source, converted
and written before the next is read — host memory peaks at about two copies of the largest
tensor (the fp32 value and its converted copy), whatever the model's size.

Reading is lazy: a :class:`~torchpar.weights.LazyWeight` reads only the rows and columns asked
of it (safetensors slices), so each rank of a parallel job reads just its own shard of every
tensor.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path

import torch

from torchpar.errors import ConfigError
from torchpar.models import DEFAULT_FAMILY, adapter
from torchpar.models.common import Copy, Interleaved, RowsOf, StackRow
from torchpar.outputs import read_marker, replacing, write_marker, write_text
from torchpar.tokenizer import TokenizerError, load_tokenizer
from torchpar.weights import LazyWeight

DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}
DEFAULT_SHARD_BYTES = 5 * 2**30  # transformers' own default for save_pretrained


def is_hf_dir(path: str | Path) -> bool:
    p = Path(path)
    return p.is_dir() and (p / "config.json").exists()


# ---------------------------------------------------------------------- writing


class _Accounting:
    """Bytes of tensors held at once while writing (the streaming claim, checked in tests)."""

    def __init__(self):
        self.held = self.peak = 0

    def hold(self, *tensors: torch.Tensor) -> None:
        self.held = sum(t.numel() * t.element_size() for t in tensors)
        self.peak = max(self.peak, self.held)


def _shards(entries: list[tuple[str, tuple, torch.dtype]], max_bytes: int) -> list[list]:
    shards, size = [[]], 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        if shards[-1] and size + n > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape, dtype))
        size += n
    return shards


def _write_file(path: Path, entries: list, produce, acct: _Accounting) -> None:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype in entries:
        n = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for name, shape, dtype in entries:
            t = produce(name)
            if tuple(t.shape) != tuple(shape) or t.dtype != dtype:
                raise ValueError(f"{name}: produced {tuple(t.shape)} {t.dtype}, header says {shape} {dtype}")
            f.write(memoryview(t.contiguous().view(torch.uint8).numpy()))  # no third copy of the tensor
            acct.hold()


EXPORT_COMMAND = "torchpar export --format hf"  # the name in the folder's marker (torchpar.outputs)
# The names write_hf gives its files: the only ones an export removes as an earlier export's
EXPORT_FILES = re.compile(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json|"
                          r"(generation_)?config\.json")


def is_own_export(folder: Path) -> bool:
    """A folder an earlier HF export wrote (it may be written again)."""
    return read_marker(folder, EXPORT_COMMAND) is not None


def write_hf(out: Path, model, args, read, dtype: torch.dtype, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
             extra_config: dict | None = None) -> dict:
    """Write ``model`` (an adapter with an HF mapping) with ``args`` to the folder ``out``:
    safetensors (sharded above ``max_shard_bytes``, with an index), config.json (+
    ``extra_config``, e.g. the tokenizer's BOS/EOS ids) and generation_config.json, each file
    whole or not at all, after a marker naming them (torchpar.outputs.MARKER): files an earlier
    export into the same folder wrote and this one does not (shards of another size) are removed,
    no other file is touched.
    ``read(torchpar_name)`` returns one full fp32 tensor at a time.
    Returns the files written, their total bytes and the peak bytes held."""
    out.mkdir(parents=True, exist_ok=True)
    mapping = model.hf_tensors(args)
    shapes = full_shapes(model, args)
    entries = [(hf, shape, dtype) for hf, shape in hf_shapes(model, args, mapping, shapes).items()]
    source: dict[str, list] = {}
    for tp, hf, how in mapping:
        source.setdefault(hf, []).append((tp, how))
    acct = _Accounting()
    last = {}  # the last tensor read: an expert stack gives one HF tensor per expert, in a row

    def produce(hf_name: str) -> torch.Tensor:
        parts = []
        for tp_name, how in source[hf_name]:  # (several: torchpar tensors fused as rows of one)
            if tp_name not in last:
                last.clear()
                last[tp_name] = read(tp_name)
            parts.append(model.to_hf(last[tp_name], how).to(dtype))
        if isinstance(source[hf_name][0][1], Interleaved):  # (their last dims' entries in turn, by part)
            order = [how.part for _, how in source[hf_name]]
            converted = torch.stack([parts[order.index(i)] for i in range(len(parts))], dim=-1).flatten(-2)
        else:
            converted = parts[0] if len(parts) == 1 else torch.cat(parts)
        acct.hold(*last.values(), converted)
        return converted

    shards = _shards(entries, max_shard_bytes)
    files = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    written = files + ["config.json", "generation_config.json"] + \
        (["model.safetensors.index.json"] if len(files) > 1 else [])
    earlier = read_marker(out, EXPORT_COMMAND) or {"files": []}
    write_marker(out, EXPORT_COMMAND, written)
    for stale in set(earlier["files"]) - set(written):
        if EXPORT_FILES.fullmatch(Path(stale).name):  # (a marker edited by hand names no file of the user's)
            (out / Path(stale).name).unlink(missing_ok=True)
    for file, shard in zip(files, shards):
        _write_file(out / file, shard, produce, acct)
    total = sum(math.prod(s) * d.itemsize for _, s, d in entries)
    if len(files) > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {name: file for file, shard in zip(files, shards) for name, _, _ in shard}}
        write_text(out / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
    config = {**model.hf_config(args), "torch_dtype": {torch.bfloat16: "bfloat16"}.get(dtype, "float32"),
              **(extra_config or {})}
    write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    generation = {k: v for k, v in config.items() if k in ("bos_token_id", "eos_token_id")}
    write_text(out / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    return {"files": files, "bytes": total, "peak_bytes": acct.peak}


def full_shapes(model, args) -> dict[str, tuple[int, ...]]:
    """Every parameter's full shape by canonical name, from a meta-device build (no memory), and
    the shapes of the state beside them an HF form holds (:meth:`ModelAdapter.extra_state`)."""
    with torch.device("meta"):
        module = model.build(args)
    return {**{name: tuple(p.shape) for name, p in module.named_parameters()}, **model.extra_state(args)}


def hf_shapes(model, args, mapping: list, shapes: dict) -> dict[str, tuple[int, ...]]:
    """Each HF tensor's shape, in the mapping's order: a :class:`RowsOf` tensor's rows summed over
    its parts."""
    out = {}
    for tp, hf, how in mapping:
        shape = model.hf_shape(shapes[tp], how)
        if isinstance(how, RowsOf) and hf in out:
            shape = (out[hf][0] + shape[0], *shape[1:])
        out[hf] = shape
    return out


# ---------------------------------------------------------------------- reading


def read_config(path: Path) -> dict:
    try:
        return json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"{path}/config.json cannot be read ({e}); is this a Hugging Face model folder?"
        ) from None


def _rope(config: dict) -> tuple[object, str, dict]:
    """(theta, type, parameters) of RoPE however transformers spelled it (4.x: rope_theta +
    rope_scaling; 5.x: rope_parameters)."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    return theta, params.get("rope_type", params.get("type", "default")), params


# YaRN's fields in config.json, with transformers' defaults for the two it may leave out
_YARN = {"factor": None, "original_max_position_embeddings": None, "beta_fast": 32.0, "beta_slow": 1.0}
# ... and where its temperature goes, absent unless a family sets them (DeepSeek's: on the whole score)
_YARN_TEMPERATURE = ("mscale", "mscale_all_dim", "attention_factor")


def _check_rope(path: Path, config: dict, expected: dict, flavor: str) -> object:
    """RoPE's type and YaRN's fields against the model's: one line naming the first that differs.
    Returns theta."""
    theta, kind, params = _rope(config)
    want = expected["rope_parameters"]
    if kind not in ("default", "yarn"):
        raise ConfigError(f"{path}/config.json: RoPE type {kind!r}; torchpar implements the default RoPE "
                          "and YaRN (model.yarn_factor)")
    if kind != want["rope_type"]:
        raise ConfigError(f"{path}/config.json: RoPE type {kind!r}, but model.flavor = {flavor!r} has "
                          f"{want['rope_type']!r}; set model.yarn_factor and model.yarn_original_seq_len "
                          "to the checkpoint's (or 0 for default RoPE)")
    for key, default in _YARN.items() if kind == "yarn" else ():
        have = params.get(key, default)
        if not (isinstance(have, (int, float)) and math.isclose(have, want[key], rel_tol=1e-9)):
            raise ConfigError(f"{path}/config.json: RoPE {key} = {have!r}, but the model has {want[key]!r}; "
                              "set model.yarn_factor and model.yarn_original_seq_len to the checkpoint's")
    truncate = params.get("truncate", True) if kind == "yarn" else True
    if truncate != want.get("truncate", True):
        raise ConfigError(f"{path}/config.json: RoPE truncate = {truncate!r}, but the model's YaRN has "
                          f"{want.get('truncate', True)!r}; set model.yarn_truncate = "
                          f"{str(truncate).lower()}")
    for key in _YARN_TEMPERATURE if kind == "yarn" else ():
        have, model_value = params.get(key), want.get(key)
        if have != model_value and not (None not in (have, model_value)
                                        and math.isclose(have, model_value, rel_tol=1e-9)):
            raise ConfigError(f"{path}/config.json: RoPE {key} = {have!r}, but the model's YaRN has "
                              f"{model_value!r} (where its temperature applies); torchpar reads only that "
                              "form")
    return theta


def check_config(path: Path, config: dict, model, args, flavor: str) -> None:
    """config.json against the model torchpar builds: one line naming the first field that differs."""
    if (config.get("architectures") or [None])[0] != model.hf_architecture:
        raise ConfigError(
            f"{path}/config.json: architectures = {config.get('architectures')}, but model.name = "
            f"{model.name!r} reads {model.hf_architecture}"
        )
    if config.get("quantization_config"):  # (gpt-oss ships its experts in MXFP4, as blocks and scales)
        method = config["quantization_config"].get("quant_method", "?")
        raise ConfigError(f"{path}/config.json: the weights are quantized ({method}); torchpar reads full "
                          "precision only: dequantize them first (transformers loads and saves them in bf16)")
    expected = model.hf_config(args)
    theta = _check_rope(path, config, expected, flavor)
    have_all = {**config, "rope_theta": theta}
    # transformers' defaults equal torchpar's; its generations name the expert count apart
    optional = {"head_dim", "attention_bias", "mlp_bias", "num_experts", "num_local_experts"}
    for key, want in expected.items():
        if key in ("architectures", "model_type", "max_position_embeddings", "rope_parameters",
                   "rope_scaling"):
            continue  # the position limit changes no math below it; RoPE is checked above
        have = have_all.get(key, want if key in optional else None)
        if key == "num_nextn_predict_layers":  # (a checkpoint's depths past the model's are left unread)
            if not (isinstance(have, int) and have >= want):
                raise ConfigError(f"{path}/config.json: {key} = {have!r}: the checkpoint holds fewer "
                                  f"prediction depths than model.mtp_depth = {want}; set model.mtp_depth to "
                                  "at most that")
            continue
        close = (
            isinstance(want, float)
            and isinstance(have, (int, float))
            and math.isclose(have, want, rel_tol=1e-9)
        )
        if have != want and not close:
            raise ConfigError(
                f"{path}/config.json: {key} = {have!r}, but model.flavor = {flavor!r} has {want!r}; choose "
                "the flavour (and model.n_layers) that matches the checkpoint"
            )


class HFWeights:
    """A Hugging Face folder's tensors as a mapping from torchpar names to :class:`LazyWeight`."""

    def __init__(self, path: str | Path, model, args, flavor: str):
        from safetensors import safe_open

        self.path, self.model = Path(path), model
        check_config(self.path, read_config(self.path), model, args, flavor)
        index = self.path / "model.safetensors.index.json"
        try:
            if index.exists():
                weight_map = json.loads(index.read_text())["weight_map"]
            else:
                with safe_open(self.path / "model.safetensors", framework="pt") as f:
                    weight_map = dict.fromkeys(f.keys(), "model.safetensors")
        except Exception as e:  # a damaged file: one line, not a traceback
            raise ConfigError(f"{self.path}: cannot read the safetensors index or file ({type(e).__name__}: "
                              f"{e}); is the download complete?") from None
        self.shapes = full_shapes(model, args)
        self.entries: dict[str, list] = {}  # torchpar name -> [(file, HF name, how)]: several for a stack
        # (a copy is read from the tensor it repeats, whether or not the checkpoint holds it)
        mapping = [entry for entry in model.hf_tensors(args) if not isinstance(entry[2], Copy)]
        for tp_name, hf_name, how in mapping:
            if hf_name not in weight_map:
                raise ConfigError(f"{self.path}: no tensor {hf_name} in the checkpoint; it holds another "
                                  "model")
            self.entries.setdefault(tp_name, []).append((weight_map[hf_name], hf_name, how))
        if args.tie_embeddings and "output.weight" in self.shapes:
            self.entries["output.weight"] = self.entries["tok_embeddings.weight"]
        self._files = {}
        # Every shape from the files' headers (no tensor is read), so a mismatch is found before launch.
        for hf_name, shape in hf_shapes(model, args, mapping, self.shapes).items():
            file = weight_map[hf_name]
            have = tuple(self._slice(file, hf_name).get_shape())
            if have != shape:
                raise ConfigError(f"{self.path / file}: {hf_name} is {have}, torchpar expects {shape} "
                                  "for model.flavor (and its overrides); choose the flavour the weights "
                                  "were made for")

    def _slice(self, file: str, name: str):
        from safetensors import safe_open

        if file not in self._files:
            self._files[file] = safe_open(self.path / file, framework="pt")
        try:
            return self._files[file].get_slice(name)
        except Exception as e:
            raise ConfigError(f"{self.path / file}: cannot read {name} ({type(e).__name__}: {e})") from None

    def __getitem__(self, name: str) -> LazyWeight:
        parts, shape = self.entries[name], self.shapes[name]
        if isinstance(parts[0][2], StackRow):
            def stacked(index: tuple[slice, ...]) -> torch.Tensor:
                stack, *rest = index
                if not parts[0][2].transposed:  # a vector per row of the stack
                    return torch.stack([self._slice(file, hf_name)[rest[0]]
                                        for file, hf_name, _ in parts[stack]])
                rows, cols = rest  # each expert's HF tensor is [cols, rows]: read and turn it
                return torch.stack([self._slice(file, hf_name)[cols, rows].t()
                                    for file, hf_name, _ in parts[stack]])

            return LazyWeight(shape, stacked)
        (file, hf_name, heads), = parts

        def read(index: tuple[slice, ...]) -> torch.Tensor:
            part = self._slice(file, hf_name)  # its shape was checked when the folder was opened
            if isinstance(heads, RowsOf):  # this tensor's rows of the HF one
                rows, *cols = index
                return part[(slice(rows.start + heads.start, rows.stop + heads.start), *cols)]
            if isinstance(heads, Interleaved):  # every other entry of the HF one's last dimension
                *lead, last = index
                return part[(*lead, slice(2 * last.start, 2 * last.stop))][..., heads.part::2]
            if heads is None:
                return part[index]
            if len(index) == 1:  # a vector over one head (a q/k norm's weight): small, read whole
                return self.model.from_hf(part[:], heads)[index]
            # Rows are permuted within each head: read the whole heads the rows fall in.
            rows, cols = index
            head_rows = shape[0] // heads
            first, last = rows.start // head_rows, -(-rows.stop // head_rows)
            block = part[first * head_rows:last * head_rows, cols]
            block = self.model.from_hf(block, last - first)
            return block[rows.start - first * head_rows:rows.stop - first * head_rows]

        return LazyWeight(shape, read)

    def keys(self):
        return self.entries.keys()

    def __contains__(self, name: str) -> bool:
        return name in self.entries


def export_hf(meta: dict, read, out: Path, dtype: torch.dtype, max_shard_mb: float) -> str:

    family = adapter(meta.get("model_name", DEFAULT_FAMILY))
    args = family.args_class(**meta["model_args"]) if family.hf_architecture else None
    problem = family.hf_problem(args)
    if problem:
        raise ConfigError(f"{problem}; export with --format torchpar")
    try:
        tok = load_tokenizer(meta.get("tokenizer_path", "builtin"))
        ids = {"bos_token_id": tok.bos_id, "eos_token_id": tok.eos_id}
    except TokenizerError:  # the tokenizer moved since training: the weights still export
        ids = {}
    stats = write_hf(out, family, args, read, dtype, int(max_shard_mb * 2**20), extra_config=ids)
    return (f"{len(stats['files'])} safetensors file(s) of {stats['bytes'] / 2**20:.1f} MiB + config.json, "
            f"peak {stats['peak_bytes'] / 2**20:.1f} MiB of tensors held")
