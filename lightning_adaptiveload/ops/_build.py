"""Builds the CUDA extensions of ``csrc/`` on first use, for the GPU they run on.

The target architecture goes to nvcc as an explicit ``-gencode`` flag (``torch.utils.cpp_extension``
then adds none of its own), so neither ``TORCH_CUDA_ARCH_LIST`` nor any other environment variable
is read or written. The build directory is named by a hash of the sources, the architecture, the
compiler flags and the torch/CUDA versions: an edit, another GPU or another toolkit builds anew
instead of loading a stale binary.
"""

from __future__ import annotations

import hashlib
import importlib.resources
from pathlib import Path
from types import ModuleType

import torch

_CFLAGS = ("-O3",)
_CUDA_CFLAGS = ("-O3", "-std=c++17")


def csrc_dir() -> Path:
    """Where the kernel sources live: the installed ``lightning_adaptiveload.csrc`` or a checkout's ``csrc/``."""
    try:
        return Path(str(importlib.resources.files("lightning_adaptiveload.csrc")))
    except ModuleNotFoundError:
        # A source checkout on PYTHONPATH without an install: csrc/ sits beside the package.
        return Path(__file__).resolve().parents[2] / "csrc"


def arch_flags(capability: tuple[int, int]) -> list[str]:
    """nvcc flags that compile for exactly one GPU architecture, e.g. ``(9, 0)`` → ``sm_90``."""
    major, minor = capability
    return [f"-gencode=arch=compute_{major}{minor},code=sm_{major}{minor}"]


def build_key(sources: list[Path], cuda_cflags: list[str]) -> str:
    """A short hash of everything the binary depends on: sources, nvcc flags, torch and CUDA versions."""
    digest = hashlib.sha256(f"torch {torch.__version__};cuda {torch.version.cuda}".encode())
    for flag in (*_CFLAGS, *cuda_cflags):
        digest.update(flag.encode() + b"\0")
    for path in sources:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def build_extension(name: str, sources: tuple[str, ...], headers: tuple[str, ...], device: torch.device) -> ModuleType:
    """Compiles (or loads the cached build of) ``csrc/<sources>`` for ``device``'s architecture.

    Raises whatever the compiler or the loader raises; callers turn that into a fallback.
    """
    from torch.utils.cpp_extension import load

    src = csrc_dir()
    cuda_cflags = [*_CUDA_CFLAGS, *arch_flags(torch.cuda.get_device_capability(device))]
    key = build_key([src / n for n in (*headers, *sources)], cuda_cflags)
    return load(
        name=f"{name}_{key}",
        sources=[str(src / n) for n in sources],
        extra_include_paths=[str(src)],
        extra_cflags=list(_CFLAGS),
        extra_cuda_cflags=cuda_cflags,
        verbose=False,
    )
