"""Swap every AdaLN module of a model for its fused CUDA twin before the strategy wraps the model.

Lightning calls ``Callback.setup`` *before* ``LightningModule.configure_model`` and wraps the model
(DDP/FSDP) right after ``configure_model``, with no callback hook in between. So ``setup`` patches
what already exists and, when the module overrides ``configure_model``, wraps that method so the
modules it builds are patched as soon as it returns: always before FSDP/DDP wrapping, so FSDP sees
the same parameters (the swap shares them) and wraps the fused modules.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_adaptiveload.modules.adaln import AdaLayerNorm, FusedAdaLayerNorm
from lightning_adaptiveload.ops import adaln_build_error, load_adaln_extension

_REGISTRY: dict[type[nn.Module], Callable[[nn.Module], nn.Module]] = {
    AdaLayerNorm: FusedAdaLayerNorm.from_module,
}


def register_adaln_module(cls: type[nn.Module], converter: Callable[[nn.Module], nn.Module]) -> None:
    """Teach :func:`apply_fused_adaln` to swap modules of exactly type ``cls`` with ``converter(module)``.

    The converter must return a module with the same parameters (shared, not copied) that computes
    the same function, e.g. one whose ``forward`` calls :func:`lightning_adaptiveload.ops.adaln`.

    Raises:
        TypeError: if ``cls`` is not an ``nn.Module`` subclass or ``converter`` is not callable.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise TypeError(f"`register_adaln_module(cls={cls!r})` is not valid. Expected an nn.Module subclass.")
    if not callable(converter):
        raise TypeError(
            f"`register_adaln_module(converter={converter!r})` is not valid. Expected a callable module -> module."
        )
    _REGISTRY[cls] = converter


def apply_fused_adaln(model: nn.Module) -> int:
    """Replace, in place, every submodule whose exact type is registered by its fused twin.

    Exact types only: a subclass may change ``forward``, and the fused twins (subclasses of
    :class:`AdaLayerNorm`) are never patched twice. Returns the number of modules replaced.
    """
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in _REGISTRY
    ]
    for parent, name, child in targets:
        setattr(parent, name, _REGISTRY[type(child)](child))
    return len(targets)


class FusedAdaLNCallback(Callback):
    """Run every AdaLN site of the model through the fused CUDA kernel.

    Swaps registered modules (by default :class:`AdaLayerNorm` → :class:`FusedAdaLayerNorm`) before
    the strategy wraps the model; parameters and ``state_dict`` keys are untouched, so checkpoints
    load either way. Without CUDA, or when the kernel does not build on some rank, it does nothing
    and warns once (the model keeps its reference modules on every rank).

    Args:
        build: build the CUDA extension in ``setup`` (on every rank) instead of on the first step.

    Example::

        trainer = Trainer(callbacks=[FusedAdaLNCallback()])
    """

    def __init__(self, build: bool = True) -> None:
        if not isinstance(build, bool):
            raise TypeError(f"`FusedAdaLNCallback(build={build!r})` is not valid. Expected a bool.")
        self.build = build
        self.patched = 0
        self._wrapped: pl.LightningModule | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        device = trainer.strategy.root_device
        ok, reason = device.type == "cuda", f"the training device is {device.type}, not CUDA"
        if ok and self.build:
            with torch.cuda.device(device):
                ok = load_adaln_extension()
            reason = f"the CUDA extension did not build ({adaln_build_error()})"
        if not trainer.strategy.reduce_boolean_decision(ok, all=True):
            rank_zero_warn(f"FusedAdaLNCallback: not patching the model: {reason if not ok else 'another rank failed'}")
            return
        self.patched = apply_fused_adaln(pl_module)
        if is_overridden("configure_model", pl_module):
            original = pl_module.configure_model

            @functools.wraps(original)
            def configure_model_then_fuse() -> None:
                original()
                self.patched += apply_fused_adaln(pl_module)
                rank_zero_info(f"FusedAdaLNCallback: {self.patched} AdaLN modules use the fused kernel")

            pl_module.configure_model = configure_model_then_fuse
            self._wrapped = pl_module
        else:
            rank_zero_info(f"FusedAdaLNCallback: {self.patched} AdaLN modules use the fused kernel")

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            # Drop the instance attribute so the class's configure_model is visible again.
            del self._wrapped.__dict__["configure_model"]
            self._wrapped = None
