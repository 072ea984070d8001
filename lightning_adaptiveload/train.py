"""``python -m lightning_adaptiveload.train`` and the imports of earlier releases: the entry point
lives in :mod:`lightning_adaptiveload.cli.train` (checks and wording in :mod:`~.cli.checks`)."""

from lightning_adaptiveload.cli.checks import ConfigError, MissingSettingError, as_overrides, check_required
from lightning_adaptiveload.cli.components import configure_cuda_allocator
from lightning_adaptiveload.cli.train import Run, build, main, train

__all__ = [
    "ConfigError",
    "MissingSettingError",
    "Run",
    "as_overrides",
    "build",
    "check_required",
    "configure_cuda_allocator",
    "main",
    "train",
]

if __name__ == "__main__":
    main()
