"""Typed job configuration: the sections (``sections.py``) and their loading (``load.py``)."""

from torchpar.config.load import did_you_mean, help_text, load_config, parse_overrides, to_toml, validate
from torchpar.config.sections import (
                                      DTYPES,
                                      Checkpoint,
                                      ConfigError,
                                      Data,
                                      Job,
                                      JobConfig,
                                      LRScheduler,
                                      Metrics,
                                      Model,
                                      Optimizer,
                                      Parallelism,
                                      Training,
                                      Validation,
                                      opt,
)

__all__ = [
    "DTYPES",
    "Checkpoint",
    "ConfigError",
    "Data",
    "Job",
    "JobConfig",
    "LRScheduler",
    "Metrics",
    "Model",
    "Optimizer",
    "Parallelism",
    "Training",
    "Validation",
    "did_you_mean",
    "help_text",
    "load_config",
    "opt",
    "parse_overrides",
    "to_toml",
    "validate",
]
