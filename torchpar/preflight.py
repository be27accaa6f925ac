"""Everything a user can get wrong, checked before any process group exists: the model, the
tokenizer, the layout, the data, the checkpoint to resume from or the weights to start from.

``torchpar train --check`` (which ``run_train.sh`` runs once before torchrun) and every rank of
the trainer run the same checks, so a mistake is one line, never a hang or a traceback per rank.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import os
import socket
import sys
import time
from pathlib import Path
from typing import NamedTuple

from torchpar.checkpoint import checkpoint_root, find_resume, read_manifest, saved_folder, verify_files
from torchpar.checkpoint.files import restarted
from torchpar.composition import Features
from torchpar.config import JobConfig
from torchpar.console import progress, warn
from torchpar.data import build_source, chat_data, data_identity, loss_masked, resume_notes, source_specs
from torchpar.data.chat import TEMPLATES
from torchpar.data.streams import Mixture
from torchpar.data.tokenized import TokenizedCorpus, verify_prepared
from torchpar.device import compute_dtype, describe_generator, device_type, generator_identity, same_draws
from torchpar.errors import AlreadyTrained, ConfigError
from torchpar.fault_tolerance import check_fault_tolerance, replica_groups
from torchpar.hf import HFWeights, is_hf_dir
from torchpar.models import ModelAdapter, adapter, model_args
from torchpar.optim import check_optimizer, param_role
from torchpar.parallel.layout import Layout, expert_names, layout_features, layout_of, resolve_layout
from torchpar.tokenizer import Tokenizer, TokenizerError, load_tokenizer
from torchpar.weights import load_weights

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class Preflight(NamedTuple):
    model: ModelAdapter
    args: object  # the model's args dataclass
    tokenizer: Tokenizer
    layout: Layout
    sources: list  # training documents: one source, or a mixture's (see source_specs)
    shares: list[float]  # each source's share of the windows
    source_names: list[str]  # each source's name in the logs
    val_source: object | None  # held-out documents when [validation] is enabled
    resume: Path | None  # checkpoint to resume from
    weights: object | None  # initial weights by name (checkpoint.initial_load_path): tensors or LazyWeights
    data: dict  # what the data position depends on (data_identity), recorded in checkpoints
    resume_manifest: dict | None  # the manifest of ``resume``


def held_out_data(cfg: JobConfig):
    """The [data] section with [validation]'s split/path: where the held-out documents come from."""
    v = cfg.validation
    return dataclasses.replace(cfg.data, split=v.split, path=v.path or cfg.data.path)


def preflight(cfg: JobConfig, world: int) -> Preflight:
    """Every check that needs no process group: model, tokenizer, layout, data, the checkpoint to
    resume from or the weights to start from. Raises ConfigError."""
    model = adapter(cfg.model.name)
    args = model_args(cfg.model)
    capacity = getattr(args, "capacity_factor", 0.0)  # (a mixture of experts')
    if 0 < capacity < 1:
        warn(f"model.capacity_factor = {capacity:g} gives each expert {capacity:.1%} of an even share of a "
             f"sequence's slots (rounded up to whole slots): even perfectly balanced routing drops about "
             f"{1 - capacity:.1%} of them (counted in moe/dropped); 1 to 1.25 is usual, 0 = dropless")
    try:
        tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    except TokenizerError as e:
        raise ConfigError(f"model.tokenizer_path: {e}") from None
    if tokenizer.n_words > args.vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokenizer.n_words} tokens but model flavor {cfg.model.flavor!r} has "
            f"vocab_size {args.vocab_size}; use a matching tokenizer or flavour"
        )
    check_optimizer(cfg.optimizer, param_kinds(model, args))
    check_fault_tolerance(cfg.fault_tolerance)
    o = cfg.optimizer
    if o.state_dtype == "bfloat16" and 1 - o.beta2 < 2 ** -7:
        warn(f"optimizer.beta2 = {o.beta2:g} with state_dtype = 'bfloat16': a step moves AdamW's second "
             "moment v by (1 - beta2)(g^2 - v), which rounds back to v (half a bf16 unit is 2^-9 v) unless "
             f"g^2 is over {2 ** -9 / (1 - o.beta2):.0%} away from v, so v lags the gradients; use "
             "beta2 <= 0.99 or state_dtype = 'float32'")
    layout = resolve_layout(cfg.parallelism, cfg.training, model, args, world,
                            compute_dtype(cfg.training.mixed_precision_param), cfg.optimizer,
                            cfg.data.document_masking, overridden=cfg.overridden, quantize=cfg.quantize,
                            loss_mask=chat_data(cfg.data), lora=cfg.lora,
                            replicas=replica_groups(cfg.fault_tolerance), z_loss=cfg.loss.z_loss > 0)
    specs = source_specs(cfg.data)
    shares = [w for _, _, w in specs]
    if len(shares) > 1:
        Mixture(shares)  # weights it cannot make exact: one line here, not in every rank's loader
    window = cfg.training.seq_len + 1
    sources = [build_source(spec, cfg.training.seed, tokenizer, window) for _, spec, _ in specs]
    val_source = (build_source(held_out_data(cfg), cfg.training.seed, tokenizer, window)
                  if cfg.validation.enable else None)
    if any(loss_masked(s) for s in [*sources, val_source]):
        need = TEMPLATES[cfg.data.chat_template].vocab_size(tokenizer)
        if need > args.vocab_size:
            raise ConfigError(
                f"data.format = 'chat' with chat_template = {cfg.data.chat_template!r} uses token ids up to "
                f"{need - 1} (its turn markers), and model flavor "
                f"{cfg.model.flavor!r} has vocab_size {args.vocab_size}; set model.vocab_size = {need} or "
                "more")
    for source in prepared_corpora([*sources, val_source]):
        if source.tokenizer != tokenizer.fingerprint:
            raise ConfigError(f"data.path {str(source.folder)!r} was tokenized with another tokenizer "
                              f"({source.tokenizer}, here {tokenizer.fingerprint}); prepare it again with "
                              "this model.tokenizer_path, or use the tokenizer it was made with")
        verify_prepared(source, args.vocab_size, checksums=False)  # its shards' CRC32s: in --check
    tr = cfg.training
    data = data_identity(sources, tokenizer, tr.seq_len, tr.local_batch_size * layout.accum * layout.dp,
                         cfg.data.lanes, shares)
    resume = find_resume(cfg, args)
    manifest = read_manifest(resume) if resume is not None else None
    weights = None
    if manifest is not None:
        check_resume(cfg, resume, manifest)
        for note in resume_notes(manifest.get("data"), data, cfg.data.resume_position):
            warn(note)
        for note in resume_changes(cfg, resume, manifest):
            warn(note)
        if base_from_start(cfg) and cfg.checkpoint.initial_load_path:  # (the checkpoint holds no base)
            weights = initial_weights(cfg, model, args)
    elif cfg.checkpoint.initial_load_path:
        weights = initial_weights(cfg, model, args)
    return Preflight(model, args, tokenizer, layout, sources, shares, [n for n, _, _ in specs], val_source,
                     resume, weights, data, manifest)


def features_of(cfg: JobConfig, world: int, device: str | None = None) -> Features:
    """The job's value on every dimension of the composition table (torchpar.composition), as the
    trainer's check reads them, on ``world`` ranks of ``device`` (default: this machine's)."""
    model, args = adapter(cfg.model.name), model_args(cfg.model)
    tr = cfg.training
    dtype = compute_dtype(tr.mixed_precision_param, device)
    lay = layout_of(cfg.parallelism, tr, world, dtype, cfg.optimizer, cfg.quantize, lora=cfg.lora,
                    z_loss=cfg.loss.z_loss > 0)
    return layout_features(lay, model, args, cfg.data.document_masking, device or device_type(),
                           evaluation=cfg.validation.enable, chat=cfg.data.format == "chat")


def param_kinds(model: ModelAdapter, args) -> set[tuple[str, int]]:
    """(optimizer role, dimensions) of the model's parameters: vectors, matrices, stacks of experts'
    matrices (3-D), by the adapter's entries."""
    stacks = expert_names(model)
    kinds = set()
    for name, (_, cols), _ in model.stage_params(args, True, True, range(args.n_layers)):
        ndim = 3 if name in stacks else 1 if cols == 1 else 2
        kinds.add((param_role(name, ndim, model), ndim))
    return kinds


def prepared_corpora(sources) -> list[TokenizedCorpus]:
    """The prepared corpora among ``sources``, each folder once (the held-out one may be a training one)."""
    found = {}
    for source in sources:
        if isinstance(source, TokenizedCorpus):
            found.setdefault(source.folder.resolve(), source)
    return list(found.values())


def check_resume(cfg: JobConfig, path: Path, manifest: dict) -> None:
    """A resume that would not do what was asked: no step left to train, or DCP metadata that
    cannot be read (what every rank reads first; its CRC32 may not be checked)."""
    step = int(manifest["step"])
    if cfg.training.steps == step and restarted():
        raise AlreadyTrained(f"the checkpoint {path} is at step {step}, training.steps: the job had finished "
                             "before this restart, and there is nothing left to do")
    if cfg.training.steps <= step:
        raise ConfigError(f"training.steps = {cfg.training.steps}, but the checkpoint {path} is at step "
                          f"{step}, so there is nothing left to train; raise training.steps above {step} to "
                          "go on, or choose a new job.dump_folder to start over")
    saved = saved_config(manifest).get("optimizer", {}).get("name")
    if saved is not None and saved.lower() != cfg.optimizer.name.lower():
        raise ConfigError(f"optimizer.name = {cfg.optimizer.name!r}, but the checkpoint {path} was trained "
                          f"with {saved!r}, whose state the new optimizer cannot take; resume with "
                          f"optimizer.name = {saved!r}, or start the new optimizer from its weights: "
                          "checkpoint.initial_load_path = that folder, in a new job.dump_folder")
    problem = lora_resume_problem(cfg, saved_config(manifest), saved_generator(manifest))
    if problem:
        raise ConfigError(f"the checkpoint {path}: {problem}")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        FileSystemReader(str(saved_folder(path))).read_metadata()  # (its commit may be pending)
    except Exception as e:  # pickle raises many types on a damaged file; the user needs which file
        raise ConfigError(f"checkpoint {path} is damaged: its DCP metadata .metadata cannot be read "
                          f"({type(e).__name__}: {e}); delete this folder to fall back to the previous "
                          "checkpoint, or set checkpoint.load_step") from None


def saved_config(manifest: dict) -> dict:
    """The config snapshot a checkpoint's manifest holds, as a table ({} where it cannot be read:
    it then tells nothing, and the manifest's own fields were checked)."""
    try:
        return tomllib.loads(manifest.get("config", ""))
    except tomllib.TOMLDecodeError:
        return {}


def base_from_start(cfg: JobConfig) -> bool:
    """Whether this job's checkpoints leave out the frozen base (LoRA, lora.save_base = false): a
    resume then rebuilds it as the run began, from checkpoint.initial_load_path or the seed."""
    return cfg.lora.rank > 0 and not cfg.lora.save_base


def saved_generator(manifest: dict) -> dict:
    """The identity of the generator a checkpoint's run drew its seeded init from
    (:func:`torchpar.device.generator_identity`; an older manifest names the device's kind alone)."""
    return manifest.get("generator") or {"kind": manifest.get("device", "cpu")}


def lora_resume_problem(cfg: JobConfig, saved: dict, generator: dict | None = None) -> str | None:
    """Why a checkpoint trained with the [lora] of config snapshot ``saved`` cannot resume under
    ``cfg``'s (adapters of other shapes or scale, a base rebuilt from elsewhere — from the seed by
    ``generator``, the identity of the one that drew it), or None."""
    was = saved.get("lora", {})
    rank, now = int(was.get("rank", 0)), cfg.lora
    if not saved or rank == now.rank == 0:
        return None
    if rank == 0:
        return (f"it trained every parameter, and lora.rank = {now.rank} trains adapters on a frozen base; "
                "export it and start LoRA from its weights (checkpoint.initial_load_path = the export) in a "
                "new job.dump_folder, or resume with lora.rank = 0")
    if now.rank == 0:
        return (f"it holds LoRA adapters of rank {rank}; resume with lora.rank = {rank}, or export it merged "
                "(torchpar export) and train every parameter from that in a new job.dump_folder")
    for key in ("rank", "alpha", "modules", "exclude", "save_base"):
        if key in was and was[key] != getattr(now, key):
            return (f"it was trained with lora.{key} = {was[key]!r}, here {getattr(now, key)!r}; resume "
                    f"with lora.{key} = {was[key]!r} (the adapters and their base must be the ones trained)")
    if not was.get("save_base", False):  # the base comes back from where the run began
        path = saved.get("checkpoint", {}).get("initial_load_path", "")
        if path != cfg.checkpoint.initial_load_path:
            return (f"its LoRA base came from checkpoint.initial_load_path = {path!r}, here "
                    f"{cfg.checkpoint.initial_load_path!r}; the checkpoint holds the adapters alone, so "
                    f"resume with initial_load_path = {path!r}")
        seed = saved.get("training", {}).get("seed", cfg.training.seed)
        if not path and seed != cfg.training.seed:
            return (f"its LoRA base was initialized from training.seed = {seed}, here {cfg.training.seed}; "
                    f"the checkpoint holds the adapters alone, so resume with training.seed = {seed}")
        problem = None if path or generator is None else seeded_base_problem(generator, on_cpu=False)
        if problem:
            return f"its LoRA base {problem}"
    return None


def seeded_base_problem(generator: dict, on_cpu: bool) -> str | None:
    """Why this machine cannot draw again a base a run initialized from its seed by a generator of
    identity ``generator``, or None. ``on_cpu``: the base is drawn on the CPU where it was (a merge),
    whose draws are the same on any machine; a trainer draws on its own device."""
    here = generator_identity()
    if (on_cpu and generator.get("kind", "cpu") == "cpu") or same_draws(generator, here):
        return None
    if here["kind"] == "cuda" == generator.get("kind") and "multiprocessors" not in generator:
        warn("a checkpoint written before torchpar recorded its GPU's generator holds LoRA adapters whose "
             "base is drawn again from training.seed here: on a GPU of another multiprocessor count than "
             "the one that trained it, that base differs from the one the adapters were trained on")
        return None
    return (f"was initialized from training.seed on {describe_generator(generator)}, whose generator "
            f"draws other numbers than this machine's ({describe_generator(here)}), and the "
            "checkpoint holds the adapters alone; use it on that kind of device (train with "
            "lora.save_base = true, or from checkpoint.initial_load_path, to move between devices)")


def resume_changes(cfg: JobConfig, path: Path, manifest: dict) -> list[str]:
    """Settings a resume honours but that differ from what the checkpoint was trained with or
    that it overrides: a line for each (the manifest's config snapshot tells what they were)."""
    notes = []
    step, ck = manifest["step"], cfg.checkpoint
    if ck.initial_load_path and not base_from_start(cfg):
        notes.append(f"checkpoint.initial_load_path = {ck.initial_load_path!r} is not read: the run resumes "
                     f"from the checkpoint {path} (step {step}), whose weights win; initial weights apply "
                     "only to a checkpoint folder without checkpoints")
    saved = saved_config(manifest).get("data", {})
    masking = saved.get("document_masking")
    if masking is not None and masking != cfg.data.document_masking:
        effect = ("attention stays inside each document and positions restart at each one"
                  if cfg.data.document_masking else "attention and positions span the whole window")
        now, was = str(cfg.data.document_masking).lower(), str(masking).lower()
        notes.append(f"data.document_masking = {now}, but the checkpoint {path} (step {step}) was trained "
                     f"with {was}: from step {step + 1} on, {effect}; set it back to {was} to train on as "
                     "before")
    return notes


def verify_contents(cfg: JobConfig, pre: Preflight) -> None:
    """The checks that read every byte of the inputs, which the ranks share out among themselves
    (a checkpoint's CRC32s, in Checkpointer.load) or leave out (a prepared corpus's shards):
    ``torchpar train --check`` runs them before launch, in its one process, so that a damaged file
    is found before any rank starts."""
    if pre.resume is not None and cfg.checkpoint.verify_checksums:
        with progress(f"checking the CRC32s of {pre.resume}"):
            verify_files(saved_folder(pre.resume), pre.resume_manifest, checksums=True)
    for corpus in prepared_corpora([*pre.sources, pre.val_source]):
        with progress(f"checking the CRC32s and token ids of {corpus.folder}"):
            verify_prepared(corpus, pre.args.vocab_size, checksums=True)


def initial_weights(cfg: JobConfig, model: ModelAdapter, args):
    """``checkpoint.initial_load_path`` as a mapping from parameter names to full tensors (an
    export file) or to lazily read weights (a Hugging Face folder: each rank reads its shards)."""

    ck = cfg.checkpoint
    fmt = ck.initial_load_format
    if fmt == "auto":
        fmt = "hf" if is_hf_dir(ck.initial_load_path) else "torchpar"
    if fmt == "torchpar":
        return load_weights(ck.initial_load_path, cfg.model, args)[0]  # each rank reads its shards
    if not is_hf_dir(ck.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path = {ck.initial_load_path!r} is not a Hugging Face "
                          "model folder (no config.json there)")
    problem = model.hf_problem(args)
    if problem:
        raise ConfigError(f"checkpoint.initial_load_path is a Hugging Face folder, but {problem}; start "
                          f"model.name = {model.name!r} from a torchpar export instead")
    return HFWeights(ck.initial_load_path, model, args, cfg.model.flavor)


LOCK_FILE = "torchpar.lock"


class RunLock:
    """One run per dump folder: an advisory ``flock`` on ``<dump_folder>/torchpar.lock``, held by
    rank 0 for the run's life. The kernel drops it when the process ends however it ends, so a
    lock is never stale; the file says who holds it."""

    def __init__(self, dump_folder: Path):
        self.path = dump_folder / LOCK_FILE
        self.file = open(self.path, "a+")
        self.locked = True
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self.file.seek(0)
            owner = self.file.read().strip() or "another process"
            self.file.close()
            raise ConfigError(f"job.dump_folder {dump_folder} is in use by another run ({owner}); wait for "
                              "it to end, or choose another job.dump_folder") from None
        except OSError as e:  # (a file system without locks: some network mounts)
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                self.file.close()
                raise ConfigError(f"job.dump_folder {dump_folder}: cannot lock {self.path.name} "
                                  f"({e.strerror}); choose another job.dump_folder") from None
            self.locked = False
            warn(f"job.dump_folder {dump_folder} is on a file system without locks ({e.strerror}): a second "
                 "run on this folder is not refused; run one at a time there, or choose a folder on a file "
                 "system with locks")
        self.file.seek(0)
        self.file.truncate()
        self.file.write(
            f"host {socket.gethostname()}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        )
        self.file.flush()

    def release(self) -> None:
        if not self.file.closed:
            if self.locked:
                fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()


def _not_its_own(folder: Path) -> str:
    """What makes ``folder`` a place a run must not write into ('' if nothing): the file
    system's root, the home folder, the working folder or one above it, a Git repository's root."""
    where = folder.expanduser().resolve()
    if where == Path(where.anchor):
        return "the file system's root"
    try:
        home = Path.home().resolve()
    except RuntimeError:  # (no HOME and no password entry: no home folder to protect)
        home = None
    if where == home:
        return "the home folder"
    cwd = Path.cwd().resolve()
    if where == cwd:
        return "the working folder"
    if where in cwd.parents:
        return "a folder above the working folder"
    if (where / ".git").exists():
        return "a Git repository's root"
    return ""


def claim_folders(cfg: JobConfig, rank: int) -> RunLock | None:
    """The dump folder (and the checkpoint folder) exist and are writable folders, before
    training rather than at the first save; rank 0 takes the run lock."""

    folders = [("job.dump_folder", Path(cfg.job.dump_folder))]
    if cfg.checkpoint.enable:
        folders.append(("checkpoint.folder", checkpoint_root(cfg)))
    for field, folder in folders:
        shared = _not_its_own(folder)
        if shared:
            raise ConfigError(f"{field} = {folder} is {shared}: a run writes its checkpoints, logs, metrics "
                              f"and lock file there and prunes old checkpoints; give {field} a folder of its "
                              "own (e.g. ./outputs/<run name>)")
        if folder.exists() and not folder.is_dir():
            raise ConfigError(f"{field}: {folder} is a file, not a folder; choose another {field}")
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(
                f"{field}: cannot create {folder} ({e.strerror}); choose another {field}"
            ) from None
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ConfigError(f"{field}: {folder} is not writable; choose another {field}")
    return RunLock(Path(cfg.job.dump_folder)) if rank == 0 else None
