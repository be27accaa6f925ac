"""The Checkpointer: saves and restores a dict of stateful parts with DCP, atomically."""

from __future__ import annotations

import functools
import itertools
import os
import shutil
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.tensor import DTensor

from torchpar import device as dev
from torchpar.checkpoint.files import (
    FORMAT,
    PARTIAL_MARKER,
    commit,
    complete_checkpoints,
    drop_save_notes,
    file_crc32,
    interrupted_saves,
    mark_timeline,
    pending_manifest,
    recoverable_saves,
    step_dir,
    verify_files,
    write_pending,
    write_rank_files,
)
from torchpar.console import warn
from torchpar.errors import ConfigError, SaveFailed


class Checkpointer:
    """Saves and restores a dict of stateful parts with DCP, atomically, under ``root``.

    ``manifest``: what to record beside the tensors (model, tokenizer, layout, config); each save
    adds the step, the time and every file's size and CRC32. ``resume_from``: a checkpoint
    validated in preflight, restored by :meth:`load`, and ``resume_manifest`` its manifest as
    preflight read it (so a resume reads it once). A part whose save writes only a share of what it
    holds (ranks with identical copies split the writing) says what a resume loads into with
    ``load_template()``; a value may be a list of chunks of its own (see :func:`chunked`).
    """

    def __init__(self, cfg, root: Path, parts: dict, manifest: dict, resume_from: Path | None,
                 resume_manifest: dict | None):
        import torch.distributed.checkpoint as dcp

        self.dcp, self.cfg, self.root = dcp, cfg, root
        self.parts, self.manifest = parts, manifest
        self.resume_from, self.resume_manifest = resume_from, resume_manifest
        self.rank = dist.get_rank()
        self.pending = None  # (future, step) of an async save: written and committed by its thread
        self.async_group = None
        self.executor = None
        self.staging = HostStaging(pin=dev.device_type() == "cuda")
        if cfg.enable and cfg.async_mode == "async":
            # The background writer's collectives need their own group (gloo works for any device).
            self.async_group = dist.new_group(backend="gloo", timeout=dev.group_timeout())
        self.loaded = ""  # how much a resume read, how fast
        self.branch: dict | None = None  # where a resume from an older step moved the newer checkpoints
        if cfg.enable:
            self._agree_on_resume()  # (every rank has chosen before rank 0 changes the folder)
            if self.rank == 0:
                self._tidy(int(resume_manifest["step"]) if resume_manifest else 0)
            dist.barrier()  # nobody writes or reads before the folder is tidy and the timeline is set

    def _agree_on_resume(self) -> None:
        """Every rank chose its resume point from the folder as it saw it: one line on every rank if
        they differ (a node whose view of a network file system lags loads an older step, and the
        job would mix two steps' shards), in one all-reduce."""
        step = int(self.resume_manifest["step"]) if self.resume_manifest else -1
        seen = torch.tensor([step, -step], device=dev.current_device())
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        newest, oldest = int(seen[0]), -int(seen[1])
        if newest != oldest:
            chose = " to ".join(f"step {s}" if s >= 0 else "none" for s in (oldest, newest))
            raise ConfigError(f"the ranks chose different checkpoints to resume from in {self.root} "
                              f"({chose}): the folder looks different from different nodes (a network file "
                              "system's stale cache?); start again once every node sees it alike, or set "
                              "checkpoint.load_step")

    def _tidy(self, start: int) -> None:
        """Interrupted saves: committed where every file was written, else removed; then this run's
        timeline starts at ``start``."""
        complete = complete_checkpoints(self.root)
        for folder in complete.values():
            if (folder / PARTIAL_MARKER).exists():  # (removed last: without it, nothing is left)
                drop_save_notes(folder)
        for step, (partial, manifest) in recoverable_saves(self.root).items():
            if step not in complete:
                print(f"torchpar: committed checkpoint {commit(partial, manifest)} (its save was interrupted "
                      "after every file was written)", flush=True)
        for d in interrupted_saves(self.root):
            shutil.rmtree(d, ignore_errors=True)
        self.branch = self._set_newer_aside(start)
        if start == self.cfg.load_step:  # (a restart that went on from a later step keeps the mark)
            mark_timeline(self.root, start)

    def _state(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def _set_newer_aside(self, start: int) -> dict | None:
        """This run's timeline starts at ``start``: complete checkpoints of later steps (a resume
        from an older step, or a fresh start in a folder with checkpoints) are moved, never
        deleted, into ``superseded-<time>-from-step-<start>/`` so that neither keep_latest_k nor this
        run's saves can touch them."""
        newer = {s: d for s, d in complete_checkpoints(self.root).items() if s > start}
        if not newer:
            return None
        aside = self.root / f"superseded-{time.strftime('%Y%m%d-%H%M%S')}-from-step-{start}"
        aside.mkdir()
        for d in newer.values():
            os.replace(d, aside / d.name)
        steps = ", ".join(map(str, sorted(newer)))
        warn(f"this run starts at step {start} but {self.root} held later checkpoints (steps {steps}); they "
              f"are kept in {aside} and a new timeline starts here")
        return {"branch_from_step": start, "moved_steps": sorted(newer), "moved_to": str(aside)}

    # -- save

    def due(self, step: int, force: bool = False) -> bool:
        return self.cfg.enable and (force or step % self.cfg.interval == 0)

    def latest(self) -> Path | None:
        """The newest complete checkpoint of this folder (after any save in flight)."""
        found = complete_checkpoints(self.root) if self.cfg.enable else {}
        return found[max(found)] if found else None

    def maybe_save(self, step: int, force: bool = False, **extra) -> None:
        """Save at every ``interval`` steps (or when ``force``); ``extra`` goes into the manifest.
        An async save is committed by its own thread as soon as its files are written."""
        if not self.due(step, force):
            return
        self.wait()  # one save in flight at a time
        partial = step_dir(self.root, step).with_name(step_dir(self.root, step).name + ".partial")
        if self.rank == 0:  # marks the folder as torchpar's, with what its commit will need
            write_pending(partial, {"format": FORMAT, "step": step, **extra,
                                    "time": time.strftime("%Y-%m-%d %H:%M:%S"), **self.manifest},
                          dist.get_world_size())
        state = self._state()
        if self.cfg.async_mode == "async":
            # A snapshot in host memory that keeps every DTensor's layout, with no second copy on the
            # device; DCP's ordinary save writes it from a thread on its own process group while
            # training goes on.
            snapshot = self.staging.stage(state)
            # The copies are queued on the training stream, so training cannot change the weights
            # before they are made; the writer waits for them alone, not for the whole device.
            copied = dev.record_event()
            future = self._writer().submit(self._save, snapshot, partial, step, self.async_group, copied)
            self.pending = (future, step)
        else:
            self._save(state, partial, step)

    def _save(self, state: dict, partial: Path, step: int, group=None, copied=None) -> None:
        """Write ``state`` into ``partial`` with DCP and commit it; on every rank the same outcome
        (a failed write on any rank is :class:`SaveFailed` everywhere, and nothing is committed).
        ``copied``: the device event after which ``state`` (host copies) is complete."""
        started = time.perf_counter()
        if copied is not None:
            copied.synchronize()
        try:
            self.dcp.save(state, checkpoint_id=str(partial), process_group=group,
                          planner=ChunkedSavePlanner())
            problem = None
        except (Exception, CheckpointException) as e:  # (a BaseException) the same on every rank
            problem = _reason(e)
        if problem is None:
            problem = self._list_files(partial)
            problems = [None] * dist.get_world_size(group)
            dist.all_gather_object(problems, problem, group=group)
            problem = next((p for p in problems if p), None)
        if problem is None:
            seconds = time.perf_counter() - started
            outcome = [self._commit(partial, seconds) if self.rank == 0 else None]
            dist.broadcast_object_list(outcome, src=0, group=group)
            problem = outcome[0] if outcome[0] != "" else None
        if problem is not None:
            latest = self.latest()
            raise SaveFailed(f"the checkpoint save of step {step} into {partial} failed: {problem} "
                             f"({_free_space(self.root)}); the "
                             f"latest complete checkpoint is {latest or 'none'} (intact); free space or fix "
                             "the folder, then run the same command to resume")

    def _list_files(self, partial: Path) -> str | None:
        """Each rank checksums the files it wrote (DCP names them ``__<rank>_<n>.distcp``; rank 0
        also writes the metadata) and writes their list beside them; returns what went wrong."""
        mine = [f for f in partial.glob(f"__{self.rank}_*") if f.is_file()]
        if self.rank == 0:
            mine += [f for f in partial.iterdir()
                     if f.is_file() and not f.name.startswith(("__", "torchpar."))]
        try:
            write_rank_files(partial, self.rank, {f.name: [f.stat().st_size, file_crc32(f)] for f in mine})
        except OSError as e:
            return _reason(e)
        return None

    def _commit(self, partial: Path, seconds: float) -> str:
        """Rank 0: the manifest and the rename, then keep_latest_k; returns what went wrong, or ""."""
        manifest = pending_manifest(partial)
        if manifest is None:
            return f"{partial} lacks a file its ranks listed"
        try:
            final = commit(partial, manifest)
        except OSError as e:
            return _reason(e)
        print(f"torchpar: saved checkpoint {final} "
              f"({_rate(sum(f[0] for f in manifest['files'].values()), seconds)})", flush=True)
        if self.cfg.keep_latest_k > 0:
            steps = sorted(complete_checkpoints(self.root))
            for old in steps[: -self.cfg.keep_latest_k]:
                shutil.rmtree(step_dir(self.root, old), ignore_errors=True)
        return ""

    def _writer(self):
        if self.executor is None:
            from concurrent.futures import ThreadPoolExecutor

            # The writer thread works on this rank's GPU, like the training thread.
            self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchpar-checkpoint",
                                               initializer=dev.bind_thread_to_device)
        return self.executor

    def wait(self) -> None:
        """Wait for the save in flight (if any); its failure is raised here, at the same step on
        every rank (the next save point, or the end of the run)."""
        if self.pending is None:
            return
        future, _ = self.pending
        self.pending = None
        future.result()

    def _verify_checksums(self, path: Path) -> None:
        """Every file's CRC32, read once: by one rank each (every world-th file); an error on any
        rank ends every rank with the same line, before anything is loaded."""
        if not self.cfg.verify_checksums:
            return
        manifest, world = self.resume_manifest, dist.get_world_size()
        try:
            verify_files(path, manifest, checksums=True, names=sorted(manifest["files"])[self.rank::world])
            problem = None
        except ConfigError as e:
            problem = str(e)
        problems = [None] * world
        dist.all_gather_object(problems, problem)
        if any(problems):
            raise ConfigError(next(p for p in problems if p))

    def close(self) -> None:
        self.wait()
        if self.cfg.enable:
            dist.barrier()  # the last checkpoint is in place before any rank moves on
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None
        if self.async_group is not None:
            dist.destroy_process_group(self.async_group)
            self.async_group = None

    # -- load

    def load(self, skip: tuple[str, ...] = ()) -> Path | None:
        """Restore every part but those named in ``skip`` from ``resume_from`` (validated in
        preflight); returns that path."""
        path = self.resume_from
        if path is None:
            return None
        self._verify_checksums(path)
        parts = {name: part for name, part in self.parts.items() if name not in skip}
        # DCP loads into these in place.
        state = {name: getattr(part, "load_template", part.state_dict)() for name, part in parts.items()}
        metadata = self.dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        for name, part in parts.items():
            if getattr(part, "keys_optional", False):  # (another layout's ranks, an older checkpoint)
                state[name] = {k: v for k, v in state[name].items() if f"{name}.{k}" in metadata}
        _check_tensors(path, state, metadata)
        started = time.perf_counter()
        try:
            self.dcp.load(state, checkpoint_id=str(path), planner=ChunkedLoadPlanner())
        except (Exception, CheckpointException) as e:  # DCP raises the same exception on every rank
            check = "" if self.cfg.verify_checksums else "; checkpoint.verify_checksums = true names the file"
            raise ConfigError(f"checkpoint {path} is damaged: reading it failed ({_reason(e)}){check}; "
                              "delete this folder to fall back to the previous checkpoint, or set "
                              "checkpoint.load_step") from None
        for name, part in parts.items():
            part.load_state_dict(state[name])
        seconds = time.perf_counter() - started
        self.loaded = _rate(sum(size for size, _ in self.resume_manifest["files"].values()), seconds)
        return path


def _check_tensors(path: Path, state: dict, metadata: dict) -> None:
    """Every tensor of the templates is in the checkpoint with the same shape: one clear line
    if not (DCP's own error is a traceback from deep inside the planner)."""
    def walk(prefix: str, obj):
        if isinstance(obj, dict):
            for k, v in obj.items():
                yield from walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(obj, torch.Tensor) or chunked(obj):
            yield prefix, obj

    for key, value in walk("", state):
        saved = metadata.get(key)
        if saved is None:
            raise ConfigError(
                f"checkpoint {path} has no tensor {key}; it was saved from another model or job"
            )
        if hasattr(saved, "size") and tuple(saved.size) != tuple(value.shape):
            raise ConfigError(
                f"checkpoint {path}: {key} is {tuple(saved.size)} there but {tuple(value.shape)} here; use "
                "the config it was saved with"
            )


def chunked(obj) -> bool:
    """Whether ``obj`` is a value made of chunks of its own, not a tensor: it gives DCP its chunks
    (``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__`` as DTensor
    does), its global ``shape`` and ``map(fn)``: the same chunks over ``fn(tensor)``."""
    return not isinstance(obj, torch.Tensor) and hasattr(obj, "__get_tensor_shard__")


def _lookup(state_dict: dict, index):
    obj = state_dict.get(index.fqn)
    return obj.__get_tensor_shard__(index) if chunked(obj) else None


class ChunkedSavePlanner(DefaultSavePlanner):
    """DCP's planner, which also finds the chunks of a :func:`chunked` value (its own looks chunks
    up in tensors only)."""

    def lookup_object(self, index):
        found = _lookup(self.state_dict, index)
        return super().lookup_object(index) if found is None else found


class ChunkedLoadPlanner(DefaultLoadPlanner):
    """The load side of :class:`ChunkedSavePlanner`: DCP reads into the chunks in place."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        # DCP's set-up makes meta tensors real and, in passing, replaces every value it does not
        # know with None: the chunked ones are put back, nested and flattened.
        kept = {}

        def keep(path: tuple, obj) -> None:
            if chunked(obj):
                kept[path] = obj
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    keep((*path, k), v)

        keep((), state_dict)
        super().set_up_planner(state_dict, metadata, is_coordinator)
        for path, obj in kept.items():
            functools.reduce(dict.__getitem__, path[:-1], state_dict)[path[-1]] = obj
        for fqn, path in getattr(self, "mappings", {}).items():
            if tuple(path) in kept:
                self.state_dict[fqn] = kept[tuple(path)]

    def lookup_tensor(self, index):
        found = _lookup(self.state_dict, index)
        return super().lookup_tensor(index) if found is None else found


class HostStaging:
    """Host copies of a state dict for async saves, made into buffers allocated at the first save
    and reused by every later one: torch's page-locked memory cache never returns a block to the
    system, so a fresh pinned copy per save would grow the process. A DTensor stays a DTensor of
    the same mesh, placements and global shape with its local piece on the host (DTensor.from_local
    would move it back to the mesh's device: a second copy there); a :func:`chunked` value keeps
    its chunks. torch 2.13's own stager deep-copies DTensors and fails on the flat ZeRO engine's
    views into one buffer ("Attempted to call copy_() on an invalid python storage")."""

    def __init__(self, pin: bool):
        self.pin = pin  # page-locked: the copy from a GPU runs at full bandwidth, asynchronously
        self.buffers: dict[tuple, torch.Tensor] = {}

    def stage(self, obj, key: tuple = ()):
        """``obj`` with every tensor copied to its host buffer (the copies are queued, not waited for)."""
        if isinstance(obj, DTensor):
            return DTensor(self.stage(obj._local_tensor, key), obj._spec, requires_grad=False)
        if isinstance(obj, torch.Tensor):
            buf = self.buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self.buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, pin_memory=self.pin)
            return buf.copy_(obj.detach(), non_blocking=self.pin)
        if chunked(obj):
            n = itertools.count()
            return obj.map(lambda t: self.stage(t, (*key, next(n))))
        if isinstance(obj, dict):
            return {k: self.stage(v, (*key, k)) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return type(obj)(self.stage(v, (*key, i)) for i, v in enumerate(obj))
        return obj

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


def _reason(e: BaseException) -> str:
    """The OS's words for a failed read or write (DCP wraps each rank's exception in its own;
    torch's file writer reports a short write as "unexpected pos")."""
    seen = e
    for failure in getattr(e, "failures", {}).values():  # DCP's CheckpointException: rank -> (exc, tb)
        seen = failure[0] if isinstance(failure, tuple) else failure
        break
    cause = seen
    while cause is not None and not isinstance(cause, OSError):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, OSError):
        return f"{cause.strerror or cause}" + (f" ({cause.filename})" if cause.filename else "")
    if "unexpected pos" in str(seen):
        return "a file was cut short while being written (a full disk or a file-size limit)"
    return f"{type(seen).__name__}: {seen}".strip().splitlines()[0]


def _free_space(folder: Path) -> str:
    try:
        return f"{shutil.disk_usage(folder).free / 2**20:,.0f} MiB free there"
    except OSError:
        return "free space unknown"


def _rate(nbytes: int, seconds: float) -> str:
    """Size, time and rate of a save or load, for a person watching it."""
    seconds = max(seconds, 1e-9)
    return f"{nbytes / 2**20:,.1f} MiB in {seconds:.1f} s, {nbytes / 2**20 / seconds:,.0f} MiB/s"
