"""Checkpoints: exact resume, resharding across layouts, consolidated export.

A checkpoint is a folder ``step-00000042`` written by ``torch.distributed.checkpoint`` (DCP)
plus ``torchpar.json``, the manifest: step, model args, layout, config snapshot and the size and
CRC32 of every file. Ranks write into ``step-00000042.partial``; only when DCP has written its
metadata (every rank done) does rank 0 write the manifest and rename the folder — one atomic
``rename`` — so a crash mid-save never leaves a folder that looks complete. An asynchronous save
commits from its writer thread as soon as its files are written. The ``.partial`` folder holds the
manifest-to-be and each rank's list of its files with their CRC32s, so a save interrupted after
every file was written is committed at the next start instead of being thrown away.

What is saved is a dict of *stateful parts*, each with ``state_dict`` / ``load_state_dict``
(DCP's ``Stateful`` protocol); the checkpointer knows nothing else about the trainer. The
trainer's parts, all keyed by names of the unsplit model so any layout can load them:

- ``model``: ``get_model_state_dict`` of each pipeline stage (DTensors for TP/FSDP shards);
- ``optimizer``: Adam moments and step per parameter (``state.<name>.exp_avg`` ...), laid out like
  the parameter — written in the same format by FSDP2 (ZeRO-3) and the flat ZeRO 0-2 engine;
- ``lr_scheduler``, ``train_state`` (step, tokens seen), ``dataloader`` (the global data position);
- ``rng``: each rank's RNG state under its own key (restored when the rank exists in the new
  layout: parts marked ``keys_optional`` may lack some of their keys in a checkpoint).

A part is added with one line in the trainer's ``stateful_parts``.
"""

from torchpar.checkpoint.checkpointer import Checkpointer
from torchpar.checkpoint.files import (
    FORMAT,
    MANIFEST,
    PARTIAL_MARKER,
    check_model_matches,
    checkpoint_root,
    complete_checkpoints,
    find_resume,
    interrupted_saves,
    read_manifest,
    recoverable_saves,
    saved_folder,
    step_dir,
    unexpected_folders,
    verify_files,
)

__all__ = ["FORMAT", "MANIFEST", "PARTIAL_MARKER", "Checkpointer", "check_model_matches",
           "checkpoint_root", "complete_checkpoints", "find_resume", "interrupted_saves", "read_manifest",
           "recoverable_saves", "saved_folder", "step_dir", "unexpected_folders", "verify_files"]
