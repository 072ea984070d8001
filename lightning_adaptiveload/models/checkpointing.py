"""Per-block activation checkpointing: the one mechanism of every model family.

Names, from the user to the kernel:

* ``activation_checkpointing=`` — the user setting, a hyperparameter of every LightningModule
  (:class:`~lightning_adaptiveload.models.FlowMatchingModule`,
  :class:`~lightning_adaptiveload.integrations.diffusers.DiffusersVideoModule`): ``"none"``, ``"selective"``,
  ``"full"``, ``"auto"`` (the shape benchmark chooses per bucket), ``true`` (``"full"``) or ``false``
  (``"none"``). :func:`checkpointing_setting` normalises it (:data:`CHECKPOINTING_SETTINGS`).
* ``module.checkpointing`` and ``module.set_checkpointing(mode)`` — the protocol's
  (:mod:`~lightning_adaptiveload.models.protocol`): the mode in use (``"auto"`` until chosen) and the switch
  the callbacks call per batch, with one of ``module.checkpointing_modes`` (:data:`CHECKPOINTING_MODES`).
  A module's ``_set_block_checkpointing(mode)`` hands the mode to its model's blocks.
* ``block.checkpointing`` — the mode one transformer block reads in its own forward, which runs its body
  through :func:`run_checkpointed`. :func:`apply_checkpointing` sets it on every block of a model, after
  :func:`install_checkpointed_forward` has given blocks that do not call :func:`run_checkpointed` themselves
  (diffusers' blocks) a per-instance forward that does.

The mechanism lives here: the modes, their parsing, :func:`run_checkpointed` (non-reentrant
``torch.utils.checkpoint`` inside the block, so a compiled block compiles the recompute with it, one graph per
mode) and the selective policy (:func:`keep_attention_outputs`: the attention kernels' outputs are saved,
everything else is recomputed). The model-specific wiring stays with the models:
:meth:`WanModel.set_gradient_checkpointing <lightning_adaptiveload.models.wan.WanModel.set_gradient_checkpointing>`
and :func:`~lightning_adaptiveload.integrations.diffusers.set_block_checkpointing` (diffusers' families).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_adaptiveload.ops.attention import FA4_OPS

__all__ = [
    "BODY",
    "CHECKPOINTING_MODES",
    "CHECKPOINTING_SETTINGS",
    "apply_checkpointing",
    "checkpointing_mode",
    "checkpointing_setting",
    "has_forward",
    "install_checkpointed_forward",
    "keep_attention_outputs",
    "run_checkpointed",
]

CHECKPOINTING_MODES = ("none", "selective", "full")
"""What backward recomputes, from most memory (fastest) to least memory (most recompute)."""

CHECKPOINTING_SETTINGS = (*CHECKPOINTING_MODES, "auto")
"""What ``activation_checkpointing=`` takes besides true/false: a mode, or ``"auto"`` (the shape benchmark chooses)."""

BODY = "_checkpointed_body"
"""Attribute under which :func:`install_checkpointed_forward` keeps a block's own forward (bound)."""


def checkpointing_mode(mode: bool | str) -> str:
    """Normalise an activation-checkpointing mode: ``True`` → ``"full"``, ``False`` → ``"none"``."""
    if isinstance(mode, bool):
        return "full" if mode else "none"
    if mode not in CHECKPOINTING_MODES:
        raise ValueError(
            f"Activation checkpointing {mode!r} is not valid. Expected one of {list(CHECKPOINTING_MODES)} "
            "(or true/false)."
        )
    return mode


def checkpointing_setting(setting: bool | str) -> str:
    """Normalise an ``activation_checkpointing=`` setting: ``"auto"`` stays, the rest as :func:`checkpointing_mode`."""
    return "auto" if setting == "auto" else checkpointing_mode(setting)


def _attention_ops() -> frozenset:
    """The ATen attention kernels SDPA may dispatch to (those that exist in this build), and FA4's ops."""
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",
    )
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n)) | set(FA4_OPS)


#: The ops whose outputs ``"selective"`` saves (what their backward needs besides q, k, v: output, log-sum-exp).
_ATTENTION_OPS = _attention_ops()


def _save_attention_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    # Selective checkpointing: the attention kernels' outputs are kept; everything else in the block is recomputed.
    if op in _ATTENTION_OPS:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def keep_attention_outputs() -> tuple[Any, Any]:
    """``context_fn`` of ``torch.utils.checkpoint.checkpoint`` for ``"selective"`` activation checkpointing:
    the SDPA kernels' outputs are saved, everything else in the checkpointed region is recomputed.
    Any block whose attention runs through ``F.scaled_dot_product_attention`` (or FA4) can use it."""
    return create_selective_checkpoint_contexts(_save_attention_policy)


def run_checkpointed(fn: Any, mode: str, *args: Any) -> Any:
    """``fn(*args)`` with activation checkpointing ``mode`` (one of :data:`CHECKPOINTING_MODES`) when
    gradients are enabled: ``"full"`` recomputes all of ``fn`` in backward, ``"selective"`` keeps the
    attention kernels' outputs (:func:`keep_attention_outputs`); non-reentrant ``torch.utils.checkpoint``,
    which ``torch.compile`` traces (a block that calls this inside its compiled forward compiles one
    graph per mode)."""
    if mode == "none" or not torch.is_grad_enabled():
        return fn(*args)
    if mode == "selective":
        return checkpoint(fn, *args, use_reentrant=False, context_fn=keep_attention_outputs)
    return checkpoint(fn, *args, use_reentrant=False)


def has_forward(block: nn.Module, forward: Callable[..., Any]) -> bool:
    """Whether ``block``'s per-instance forward is ``forward`` (a function taking the block first)."""
    return getattr(block.__dict__.get("forward"), "__func__", None) is forward


def install_checkpointed_forward(
    block: nn.Module, forward: Callable[..., Any], body: Callable[..., Any] | None = None
) -> None:
    """Give ``block`` the per-instance ``forward`` once, keeping ``body`` (default: its class's forward) bound as
    ``block._checkpointed_body`` (:data:`BODY`) and starting at ``block.checkpointing = "none"``. ``forward`` runs
    the body through :func:`run_checkpointed` under ``block.checkpointing``. A block whose forward is already
    ``forward`` is left as it is; the caller refuses blocks whose forward someone else replaced."""
    if has_forward(block, forward):
        return
    setattr(block, BODY, types.MethodType(type(block).forward if body is None else body, block))
    block.checkpointing = "none"
    block.forward = types.MethodType(forward, block)


def apply_checkpointing(
    model: nn.Module,
    mode: bool | str,
    is_block: Callable[[nn.Module], bool],
    install: Callable[[nn.Module], None] | None = None,
) -> int:
    """Set ``checkpointing = mode`` on every module of ``model`` that ``is_block``, in place, after ``install(block)``
    when given (e.g. :func:`install_checkpointed_forward`). Through ``model.modules()``, so a block inside a wrapper
    (FSDP1's) is reached, not the wrapper. Returns the number of blocks set.

    Raises:
        ValueError: ``mode`` is not a mode (:func:`checkpointing_mode`), before any block is changed.
    """
    mode = checkpointing_mode(mode)
    count = 0
    for module in model.modules():
        if not is_block(module):
            continue
        if install is not None:
            install(module)
        module.checkpointing = mode
        count += 1
    return count
