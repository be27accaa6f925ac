"""Typed job configuration: the sections (``sections.py``) and their loading (``load.py``)."""

from torchpar.config.load import config_from_text, help_text, load_config, parse_overrides, to_toml, validate
from torchpar.config.sections import (
    DTYPES,
    Checkpoint,
    Data,
    Job,
    JobConfig,
    LRScheduler,
    Metrics,
    Model,
    Optimizer,
    Parallelism,
    Profiling,
    Training,
    Validation,
    opt,
)

__all__ = [
    "config_from_text",
    "DTYPES",
    "Checkpoint",
    "Data",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Profiling",
    "Training",
    "Validation",
    "help_text",
    "load_config",
    "opt",
    "parse_overrides",
    "to_toml",
    "validate",
]
