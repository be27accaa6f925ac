"""A save's commit point, without training: a process killed at any file-system change of a commit
leaves either a save the next start commits, or a checkpoint — never a complete save deleted."""

import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from torchpar.checkpoint.checkpointer import Checkpointer
from torchpar.checkpoint.files import (
    FORMAT,
    MANIFEST,
    commit,
    complete_checkpoints,
    file_crc32,
    pending_manifest,
    write_pending,
    write_rank_files,
)


class Killed(BaseException):
    """The process dying at that point (nothing after it runs)."""


def a_written_save(root: Path, ranks: int = 3) -> Path:
    """``step-00000004.partial`` as ``ranks`` ranks leave it once every file is written."""
    partial = root / "step-00000004.partial"
    write_pending(partial, {"format": FORMAT, "step": 4}, ranks)
    for rank in range(ranks):
        names = [f"__{rank}_0.distcp", *([".metadata"] if rank == 0 else [])]
        for i, name in enumerate(names):
            (partial / name).write_bytes(bytes([rank]) * (10 * (rank + 1) + i))
        write_rank_files(partial, rank, {n: [(partial / n).stat().st_size, file_crc32(partial / n)]
                                         for n in names})
    return partial


def test_a_commit_killed_at_any_point_keeps_the_checkpoint(tmp_path, monkeypatch):
    """Each of the commit's writes, renames and deletions in turn is where the process dies; the
    next start (rank 0's tidying) then holds step 4 complete, every file there, no note of the
    save left, no partial folder. (The commit once deleted the ranks' file lists before its
    rename: killed among them, the save was 'incomplete' and the next start deleted it.)"""
    ready = a_written_save(tmp_path / "ready")
    manifest = pending_manifest(ready)
    assert manifest is not None and len(manifest["files"]) == 4
    changes = {"os.replace": os.replace, "Path.unlink": Path.unlink}
    point = 0
    while True:
        root = tmp_path / f"kill-{point}"
        shutil.copytree(ready.parent, root)
        calls = []

        def dying(name):
            def change(*args, **kwargs):
                calls.append(name)
                if len(calls) > point:
                    raise Killed
                return changes[name](*args, **kwargs)
            return change

        monkeypatch.setattr(os, "replace", dying("os.replace"))
        monkeypatch.setattr(Path, "unlink", dying("Path.unlink"))
        try:
            commit(root / "step-00000004.partial", manifest)
            finished = True
        except Killed:
            finished = False
        monkeypatch.setattr(os, "replace", changes["os.replace"])
        monkeypatch.setattr(Path, "unlink", changes["Path.unlink"])
        tidy = SimpleNamespace(root=root, cfg=SimpleNamespace(load_step=-1),
                               _set_newer_aside=lambda start: None)
        Checkpointer._tidy(tidy, 0)
        final = root / "step-00000004"
        assert complete_checkpoints(root) == {4: final}, (point, calls)
        assert sorted(p.name for p in root.iterdir()) == ["step-00000004"], point
        assert sorted(p.name for p in final.iterdir()) == sorted([*manifest["files"], MANIFEST]), point
        for name, (size, crc) in manifest["files"].items():
            assert (final / name).stat().st_size == size and file_crc32(final / name) == crc
        if finished:
            break
        point += 1
    assert point >= 5  # (the manifest's write, the rename, three lists and the marker deleted)


def test_a_commit_is_on_the_disk_before_it_returns(tmp_path, monkeypatch):
    """The manifest's bytes, then the folder's rename, are synced to the disk: a node that dies
    just after a commit leaves no empty manifest behind a name that says the save was done."""
    partial = a_written_save(tmp_path)
    synced, fsync = [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}"))
                        or fsync(fd))
    final = commit(partial, pending_manifest(partial))
    assert str(partial / (MANIFEST + ".tmp")) in synced  # (its bytes, before its rename)
    assert synced.index(str(partial / (MANIFEST + ".tmp"))) < synced.index(str(tmp_path))
    assert synced[-1] == str(tmp_path) and (final / MANIFEST).stat().st_size > 0


@pytest.mark.parametrize("other", [4, 6])
def test_ranks_that_chose_different_resume_points_stop_in_one_line(tmp_path, monkeypatch, other):
    """Each rank picks its resume point from the folder as it sees it; a node whose view of a
    network file system lags would load an older step beside the others' newer one. One
    all-reduce finds it: the same line on every rank (another rank stands in by what the
    all-reduce brings back)."""
    import torch
    import torch.distributed as dist

    from torchpar.checkpoint.checkpointer import Checkpointer
    from torchpar.errors import ConfigError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        real = dist.all_reduce

        def with_another_rank(t, op):
            real(t, op=op)
            t.copy_(torch.maximum(t, torch.tensor([other, -other])))

        monkeypatch.setattr(dist, "all_reduce", with_another_rank)
        cfg = SimpleNamespace(enable=True, async_mode="off", load_step=-1)
        if other == 4:
            Checkpointer(cfg, tmp_path, {}, {}, tmp_path / "step-00000004", {"step": 4}).close()
            return
        with pytest.raises(ConfigError, match="the ranks chose different checkpoints to resume from in "
                                              f"{tmp_path} \\(step 4 to step 6\\)"):
            Checkpointer(cfg, tmp_path, {}, {}, tmp_path / "step-00000004", {"step": 4})
    finally:
        dist.destroy_process_group()


def test_only_a_restart_of_the_job_that_began_a_timeline_goes_on_from_its_latest(tmp_path, monkeypatch):
    """A start asking for checkpoint.load_step = 4 in a folder whose timeline its job began there:
    a restart of that job (torchrun's count above 0; the run id every node shares) goes on from the
    timeline's latest, step 8; a first start of any job, or a restart of another, takes step 4."""
    from torchpar.checkpoint.files import mark_timeline, restart_step

    for step in (4, 6, 8):
        (tmp_path / f"step-{step:08d}").mkdir()
        (tmp_path / f"step-{step:08d}" / MANIFEST).write_text("{}")
    for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    mark_timeline(tmp_path, 4)
    assert restart_step(tmp_path, 4) == 4  # (the same job started again by hand: as asked)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert restart_step(tmp_path, 4) == 8 and restart_step(tmp_path, 6) == 6
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert restart_step(tmp_path, 4) == 4


def test_a_folder_the_file_system_will_not_sync_still_commits(tmp_path, monkeypatch):
    """Some network and FUSE mounts refuse to sync a folder (EINVAL): the commit goes on."""
    import errno

    partial = a_written_save(tmp_path)
    fsync = os.fsync

    def no_folders(fd):
        if os.path.isdir(os.readlink(f"/proc/self/fd/{fd}")):
            raise OSError(errno.EINVAL, "Invalid argument")
        fsync(fd)

    monkeypatch.setattr(os, "fsync", no_folders)
    assert complete_checkpoints(tmp_path) == {}
    commit(partial, pending_manifest(partial))
    assert list(complete_checkpoints(tmp_path)) == [4]
