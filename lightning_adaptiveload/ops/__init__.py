"""Operators: the fused AdaLN CUDA op, its reference and the seams around the kernels' build.

Import from here; ``_adaln`` (the op) and ``_build`` (compiling ``csrc/``) are internal.
"""

import sys

from lightning_adaptiveload.ops import _adaln
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

# The op's module used to live at `lightning_adaptiveload.ops.adaln`, the name of the function
# above. Old `from lightning_adaptiveload.ops.adaln import adaln, adaln_ref` lines still resolve
# (to the implementation module) without rebinding `ops.adaln`, which stays the function; delete
# this alias once no importer uses that path.
sys.modules.setdefault(f"{__name__}.adaln", _adaln)

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
