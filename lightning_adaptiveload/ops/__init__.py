"""Operators: the fused AdaLN CUDA op, its reference and the seams around the kernels' build.

Import from here; ``_adaln`` (the op) and ``_build`` (compiling ``csrc/``) are internal.
"""

from lightning_adaptiveload.ops._adaln import (
    ADALN_MAX_D,
    ADALN_MAX_D_ANY,
    AdaLNLaunchOptions,
    adaln,
    adaln_build_error,
    adaln_ref,
    adaln_unsupported_reason,
    load_adaln_extension,
)

__all__ = [
    "ADALN_MAX_D",
    "ADALN_MAX_D_ANY",
    "AdaLNLaunchOptions",
    "adaln",
    "adaln_build_error",
    "adaln_ref",
    "adaln_unsupported_reason",
    "load_adaln_extension",
]
