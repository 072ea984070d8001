"""Route every AdaLN site of a model through the fused CUDA kernel before the strategy wraps the model.

Two mechanisms, both registries: module swaps (a module type → its fused twin, for models whose
norm modules take the modulation, like :class:`AdaLayerNorm`) and patchers (``model -> sites
patched``, for models that modulate inline in a parent's ``forward``, like diffusers' Wan blocks,
where only the parent's ``forward`` can be replaced).

Lightning calls ``Callback.setup`` *before* ``LightningModule.configure_model`` and wraps the model
(DDP/FSDP) right after ``configure_model``, with no callback hook in between. So ``setup`` patches
what already exists and, when the module overrides ``configure_model``, wraps that method so the
modules it builds are patched as soon as it returns: always before FSDP/DDP wrapping, so FSDP sees
the same parameters (the swap shares them) and wraps the fused modules.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
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

# A converter returns the fused twin, or None where this instance's math is not LayerNorm + modulate.
_REGISTRY: dict[type[nn.Module], Callable[[nn.Module], nn.Module | None]] = {
    AdaLayerNorm: FusedAdaLayerNorm.from_module,
}


def _patch_diffusers_wan(model: nn.Module) -> int:
    # A model can only hold diffusers' Wan modules once their module is imported, so this never
    # imports diffusers for models that do not use it.
    if "diffusers.models.transformers.transformer_wan" not in sys.modules:
        return 0
    from lightning_adaptiveload.integrations.diffusers import patch_wan_transformer

    return patch_wan_transformer(model)


_PATCHERS: dict[str, Callable[[nn.Module], int]] = {}
_DIFFUSERS = importlib.util.find_spec("diffusers") is not None  # finds the package without importing it
if _DIFFUSERS:
    _PATCHERS["diffusers_wan"] = _patch_diffusers_wan


# diffusers' AdaLN-Zero norm types unregistered by the user (by class name: their module may not be imported yet).
_UNREGISTERED_DIFFUSERS: set[str] = set()


def _diffusers_norms() -> dict[type[nn.Module], Callable[[nn.Module], nn.Module | None]]:
    """The converters of diffusers' AdaLN-Zero norms once diffusers' normalization module is imported (a model
    can only hold them then; a model without diffusers never imports it), less those unregistered."""
    if not _DIFFUSERS or "diffusers.models.normalization" not in sys.modules:
        return {}
    from lightning_adaptiveload.integrations import diffusers_norms

    return {cls: diffusers_norms.fused_twin for cls in diffusers_norms._TWINS
            if cls.__name__ not in _UNREGISTERED_DIFFUSERS}


def _registry() -> dict[type[nn.Module], Callable[[nn.Module], nn.Module | None]]:
    return {**_diffusers_norms(), **_REGISTRY}


def register_adaln_module(cls: type[nn.Module], converter: Callable[[nn.Module], nn.Module | None]) -> None:
    """Teach :func:`apply_fused_adaln` to swap modules of exactly type ``cls`` with ``converter(module)``.

    The converter must return a module with the same parameters (shared, not copied) that computes
    the same function, e.g. one whose ``forward`` calls :func:`lightning_adaptiveload.ops.adaln`, or
    ``None`` to leave an instance it cannot fuse alone (it is then not counted). diffusers'
    ``AdaLayerNormZero``, ``AdaLayerNormZeroSingle`` and ``AdaLayerNormContinuous`` are registered while
    diffusers is imported (:mod:`lightning_adaptiveload.integrations.diffusers_norms`); registering one of
    them replaces its converter, unregistering it stops its fusion.

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


def unregister_adaln_module(cls: type[nn.Module]) -> Callable[[nn.Module], nn.Module | None]:
    """Stop swapping modules of type ``cls``; returns the converter that was registered.

    Raises:
        ValueError: if ``cls`` is not registered.
    """
    if cls in _REGISTRY:
        return _REGISTRY.pop(cls)
    converter = _diffusers_norms().get(cls)
    if converter is None:
        raise ValueError(
            f"`unregister_adaln_module({cls!r})` is not valid. Registered: {[c.__name__ for c in _registry()]}."
        )
    _UNREGISTERED_DIFFUSERS.add(cls.__name__)
    return converter


def register_adaln_patcher(name: str, patcher: Callable[[nn.Module], int]) -> None:
    """Teach :func:`apply_fused_adaln` to call ``patcher(model)``, which fuses what it finds in place.

    A patcher is for models that modulate inline in a parent's ``forward``, where swapping the norm
    module cannot help. It must patch only what it has not patched yet, return the number of AdaLN
    sites it newly routed through :func:`lightning_adaptiveload.ops.adaln`, leave parameters and
    ``state_dict`` keys alone, and compute the same function. ``"diffusers_wan"``
    (:func:`lightning_adaptiveload.integrations.diffusers.patch_wan_transformer`) is registered when
    diffusers is installed.

    Raises:
        TypeError: if ``name`` is not a string or ``patcher`` is not callable.
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"`register_adaln_patcher(name={name!r})` is not valid. Expected a non-empty string.")
    if not callable(patcher):
        raise TypeError(
            f"`register_adaln_patcher(patcher={patcher!r})` is not valid. Expected a callable model -> int."
        )
    _PATCHERS[name] = patcher


def unregister_adaln_patcher(name: str) -> Callable[[nn.Module], int]:
    """Stop calling the patcher registered as ``name``; returns it.

    Raises:
        ValueError: if no patcher is registered as ``name``.
    """
    if name not in _PATCHERS:
        raise ValueError(f"`unregister_adaln_patcher({name!r})` is not valid. Registered: {sorted(_PATCHERS)}.")
    return _PATCHERS.pop(name)


def apply_fused_adaln(model: nn.Module) -> int:
    """Fuse, in place, every AdaLN site of ``model`` that a registered swap or patcher covers.

    First replaces every submodule whose exact type is registered by its fused twin (exact types
    only: a subclass may change ``forward``, and the fused twins, subclasses of the types they fuse,
    are never swapped twice), then runs every registered patcher. Returns the number of sites newly
    fused: one per swapped module plus what the patchers report.
    """
    registry = _registry()
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) in registry
    ]
    swapped = 0
    for parent, name, child in targets:
        fused = registry[type(child)](child)
        if fused is not None:
            setattr(parent, name, fused)
            swapped += 1
    return swapped + sum(int(patcher(model)) for patcher in list(_PATCHERS.values()))


class FusedAdaLNCallback(Callback):
    """Run every AdaLN site of the model through the fused CUDA kernel.

    Calls :func:`apply_fused_adaln` before the strategy wraps the model: registered module swaps (by
    default :class:`AdaLayerNorm` → :class:`FusedAdaLayerNorm` and, when diffusers is installed, its
    ``AdaLayerNormZero`` / ``AdaLayerNormZeroSingle`` / ``AdaLayerNormContinuous`` → their fused twins)
    and registered patchers (by default diffusers' ``WanTransformer3DModel``). Parameters and ``state_dict``
    keys are untouched, so checkpoints load either way. Without CUDA, or when the kernel does not
    build on some rank, it does nothing and warns once (the model keeps its reference path on every
    rank). It also warns when it finds nothing to fuse on CUDA: the model's AdaLN sites are then
    neither a registered module type nor covered by a patcher (see :func:`register_adaln_module` and
    :func:`register_adaln_patcher`).

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
                self._report(pl_module)

            pl_module.configure_model = configure_model_then_fuse
            self._wrapped = pl_module
        else:
            self._report(pl_module)

    def _report(self, pl_module: pl.LightningModule) -> None:
        if self.patched:
            rank_zero_info(f"FusedAdaLNCallback: {self.patched} AdaLN sites use the fused kernel")
            return
        rank_zero_warn(
            f"FusedAdaLNCallback: found no AdaLN site to fuse in {type(pl_module).__name__}; its norm + "
            f"modulate sites run unfused. Registered module types: {[c.__name__ for c in _registry()]}, "
            f"patchers: {sorted(_PATCHERS)}. Register the model's with `register_adaln_module(cls, converter)` "
            "or `register_adaln_patcher(name, patcher)`, or drop the callback."
        )

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._wrapped is not None:
            # Drop the instance attribute so the class's configure_model is visible again.
            del self._wrapped.__dict__["configure_model"]
            self._wrapped = None
