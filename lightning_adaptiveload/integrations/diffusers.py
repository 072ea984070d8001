"""diffusers' ``WanTransformer3DModel`` (Wan 2.1 / 2.2) with lightning-adaptiveload.

Two pieces:

* :func:`patch_wan_transformer` routes the model's three modulated norm sites (``norm1`` and
  ``norm3`` of every ``WanTransformerBlock``, ``norm_out`` of the head) through
  :func:`lightning_adaptiveload.ops.adaln`. diffusers calls these norms with one argument and
  modulates inline in the parent's ``forward`` (``norm1(x.float()) * (1 + scale) + shift``), so a
  module swap cannot fuse them: the patch replaces ``forward`` of each block and of the model, per
  instance, with one that computes the same function and calls the op at those sites.
  ``norm2`` (cross-attention) has no modulation and stays as it is. :func:`unpatch_wan_transformer`
  restores the originals. :class:`~lightning_adaptiveload.callbacks.FusedAdaLNCallback` applies the
  patch by default.
* :func:`set_block_checkpointing` gives every block of a family activation checkpointing inside its own forward
  (``none``/``selective``/``full``, the mechanism of :mod:`lightning_adaptiveload.models.checkpointing`, which
  :class:`~lightning_adaptiveload.models.wan.WanAttentionBlock` uses too), so a compiled block compiles the
  recompute with it and switching modes is one attribute per block.
* :class:`DiffusersWanModule`, a LightningModule that trains the model with Wan's rectified-flow
  objective (:class:`~lightning_adaptiveload.models.rectified_flow.RectifiedFlowModule`) and provides the
  :class:`~lightning_adaptiveload.models.protocol.AdaptiveLoadModule` members the callbacks and the
  DataModule use.

A Wan block's fused AdaLN and its checkpointing share one per-instance ``forward`` (``_block_forward``): it
runs the block's body (``_checkpointed_body``: diffusers' forward, or the fused one once patched) under the
block's ``checkpointing`` mode.

Why per-instance ``forward`` and not a subclass swap: diffusers finds blocks by class name
(``_repeated_blocks`` for ``compile_repeated_blocks``, ``_no_split_modules`` for device maps) and by
class (its cache hooks' block registry); a subclass would fall out of all three. diffusers' own
hooks (caching, group offloading, context parallelism) also replace ``forward`` per instance, so a
module whose ``forward`` is already replaced is left alone (patch before enabling those).

The replacement forwards restate diffusers 0.42.1's ``WanTransformerBlock.forward`` and
``WanTransformer3DModel.forward``. To keep them from silently drifting apart from a newer diffusers,
the patch refuses (and warns) when the source of either original differs from the one it was
written against, unless ``strict=False``; ``tests/integrations/test_diffusers.py`` checks forward and
every gradient against the unpatched model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import inspect
import json
import types
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock
from diffusers.utils import apply_lora_scale
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_warn
from torch import nn
from typing_extensions import override

import lightning_adaptiveload.models.checkpointing as _checkpointing
from lightning_adaptiveload._checks import check_positive_int, check_triple
from lightning_adaptiveload.geometry import latent_of_grid, token_grid, tokens_of
from lightning_adaptiveload.integrations.diffusers_families import (
    CONTEXT_MASK,
    FAMILIES,
    VideoFamily,
    family_of,
)
from lightning_adaptiveload.models.compiling import (
    check_compile_options,
    compile_blocks,
    mark_dynamic,
    whole_block_graphs,
)
from lightning_adaptiveload.models.optim import check_optimizer_impl
from lightning_adaptiveload.models.rectified_flow import (
    RectifiedFlowModule,
    check_training_arguments,
)
from lightning_adaptiveload.models.wan import WanConfig
from lightning_adaptiveload.ops import adaln
from lightning_adaptiveload.ops.attention import check_attention_setting

__all__ = [
    "DiffusersVideoConfig",
    "DiffusersVideoModule",
    "DiffusersWanModule",
    "patch_wan_transformer",
    "set_block_checkpointing",
    "set_wan_checkpointing",
    "unpatch_wan_transformer",
]

# sha256[:16] of `inspect.getsource` of the forwards the replacements restate (diffusers 0.42.1).
_VERIFIED_SOURCES = {
    WanTransformerBlock: "21c15441b009932c",
    WanTransformer3DModel: "9f81a7225288656f",
}
# AdaLN sites one patch fuses: norm1 and norm3 of a block, norm_out of the head.
_SITES = {WanTransformerBlock: 2, WanTransformer3DModel: 1}


def _split(mod: torch.Tensor, per_token: bool) -> list[torch.Tensor]:
    """Modulation ``[B, n, D]`` → n views ``[B, 1, D]``; per token ``[B, N, n, D]`` → n views ``[B, N, D]``."""
    if per_token:
        return [m.squeeze(2) for m in mod.chunk(mod.shape[2], dim=2)]
    return list(mod.chunk(mod.shape[1], dim=1))


def _fused_block_forward(
    self: WanTransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    # temb: [B, 6, D] (Wan 2.1, Wan 2.2 14B) or [B, N, 6, D] per token (Wan 2.2 TI2V); the sum is fp32.
    per_token = temb.ndim == 4
    table = self.scale_shift_table.unsqueeze(0) if per_token else self.scale_shift_table
    shift_sa, scale_sa, gate_sa, shift_ff, scale_ff, gate_ff = _split(table + temb.float(), per_token)
    n1, n3 = self.norm1, self.norm3

    x = adaln(hidden_states, scale_sa, shift_sa, n1.weight, n1.bias, n1.eps, hidden_states.dtype)
    x = self.attn1(x, None, None, rotary_emb)
    hidden_states = (hidden_states.float() + x * gate_sa).type_as(hidden_states)

    x = self.norm2(hidden_states.float()).type_as(hidden_states)
    hidden_states = hidden_states + self.attn2(x, encoder_hidden_states, None, None)

    x = adaln(hidden_states, scale_ff, shift_ff, n3.weight, n3.bias, n3.eps, hidden_states.dtype)
    x = self.ffn(x)
    return (hidden_states.float() + x.float() * gate_ff).type_as(hidden_states)


@apply_lora_scale("attention_kwargs")
def _fused_model_forward(
    self: WanTransformer3DModel,
    hidden_states: torch.Tensor,
    timestep: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    encoder_hidden_states_image: torch.Tensor | None = None,
    return_dict: bool = True,
    attention_kwargs: dict[str, Any] | None = None,
) -> tuple[torch.Tensor] | Transformer2DModelOutput:
    b, _, frames, height, width = hidden_states.shape
    pt, ph, pw = self.config.patch_size
    f, h, w = token_grid((frames, height, width), (pt, ph, pw))
    rotary_emb = self.rope(hidden_states)
    x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()

    # timestep: [B], or [B, N] per token (Wan 2.2 TI2V), which the embedder takes flattened.
    per_token_t = timestep.ndim == 2
    temb, block_mod, context, context_image = self.condition_embedder(
        timestep.flatten() if per_token_t else timestep,
        encoder_hidden_states,
        encoder_hidden_states_image,
        timestep_seq_len=timestep.shape[1] if per_token_t else None,
    )
    block_mod = block_mod.unflatten(2 if per_token_t else 1, (6, -1))  # [B, (N,) 6, D]
    if context_image is not None:
        context = torch.concat([context_image, context], dim=1)

    checkpoint = torch.is_grad_enabled() and self.gradient_checkpointing
    for block in self.blocks:
        if checkpoint:
            x = self._gradient_checkpointing_func(block, x, context, block_mod, rotary_emb)
        else:
            x = block(x, context, block_mod, rotary_emb)

    # Head: temb is [B, D], or [B, N, D] per token.
    per_token = temb.ndim == 3
    table = self.scale_shift_table.to(temb.device)
    mod = table.unsqueeze(0) + temb.unsqueeze(2) if per_token else table + temb.unsqueeze(1)
    shift, scale = (m.to(x.device) for m in _split(mod, per_token))
    no = self.norm_out
    x = self.proj_out(adaln(x, scale, shift, no.weight, no.bias, no.eps, x.dtype))

    # Unpatchify: [B, f·h·w, pt·ph·pw·C] → [B, C, f·pt, h·ph, w·pw].
    x = x.reshape(b, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    out = x.reshape(b, x.shape[1], f * pt, h * ph, w * pw)
    return Transformer2DModelOutput(sample=out) if return_dict else (out,)


def _block_forward(
    self: WanTransformerBlock,
    hidden_states: torch.Tensor,
    encoder_hidden_states: torch.Tensor,
    temb: torch.Tensor,
    rotary_emb: torch.Tensor,
) -> torch.Tensor:
    # The body and the mode are attributes, so a compiled block guards on them: one graph per mode.
    return _checkpointing.run_checkpointed(
        self._checkpointed_body, self.checkpointing, hidden_states, encoder_hidden_states, temb, rotary_emb
    )


@functools.cache
def _source_matches(cls: type) -> bool:
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest()[:16] == _VERIFIED_SOURCES[cls]


def _wan_class(module: nn.Module) -> type | None:
    """The diffusers class whose forward ``module`` runs (``None`` if not one we patch)."""
    cls = type(module)
    index = getattr(cls, "_orig_cls_mro_index", None)  # FSDP2's fully_shard swaps in FSDP<cls>(FSDPModule, cls)
    if index is not None:
        cls = cls.__mro__[index]
    return cls if cls in _SITES else None


def _has_block_forward(module: nn.Module) -> bool:
    return _checkpointing.has_forward(module, _block_forward)


def _is_patched(module: nn.Module) -> bool:
    if _wan_class(module) is WanTransformerBlock:
        return getattr(module.__dict__.get(_checkpointing.BODY), "__func__", None) is _fused_block_forward
    return getattr(module.__dict__.get("forward"), "__func__", None) is _fused_model_forward


def _install_block_forward(block: nn.Module) -> None:
    """Give ``block`` the per-instance :func:`_block_forward` (diffusers' body, no checkpointing) once."""
    _checkpointing.install_checkpointed_forward(block, _block_forward, WanTransformerBlock.forward)


def _uninstall_block_forward(block: nn.Module) -> None:
    for name in ("forward", _checkpointing.BODY, "checkpointing"):
        del block.__dict__[name]


def _skip_reason(module: nn.Module, cls: type, strict: bool) -> str | None:
    """Why ``module`` (a block or the model, of diffusers class ``cls``) cannot be patched; ``None`` if it can."""
    if "forward" in module.__dict__ and not _has_block_forward(module):
        return (
            "its forward is already replaced (a diffusers hook: caching, group offloading, context "
            "parallelism; or another patch). Patch before enabling those"
        )
    for name in ("norm1", "norm3") if cls is WanTransformerBlock else ("norm_out",):
        norm = getattr(module, name, None)
        if type(norm) is not FP32LayerNorm:
            return f"`{name}` is a {type(norm).__name__}, not diffusers' FP32LayerNorm"
        if (norm.weight is None) != (norm.bias is None):
            return f"`{name}` has a weight but no bias (or a bias but no weight); the fused op takes both or neither"
    if strict and not _source_matches(cls):
        import diffusers

        return (
            f"diffusers {diffusers.__version__}'s `{cls.__name__}.forward` differs from the 0.42.1 one "
            "the fused forward restates. Check it with tests/integrations/test_diffusers.py and pass strict=False"
        )
    return None


def patch_wan_transformer(model: nn.Module, strict: bool = True) -> int:
    """Fuse the AdaLN sites of every diffusers Wan block and Wan head inside ``model``, in place.

    Patches modules of exactly type ``WanTransformerBlock`` (``norm1``, ``norm3``) and
    ``WanTransformer3DModel`` (``norm_out``), also after FSDP2's ``fully_shard`` (which swaps in a
    subclass), wherever they sit in ``model`` (a LightningModule, a pipeline's transformer, the
    transformer itself); subclasses of them are left alone, since they may change ``forward``. Parameters,
    buffers and ``state_dict`` are untouched; already patched modules are skipped, and a block's
    activation-checkpointing mode (:func:`set_wan_checkpointing`) is kept. Modules that cannot be patched
    are named in one warning.

    Args:
        model: any module containing diffusers' Wan modules.
        strict: refuse modules whose class's ``forward`` source differs from diffusers 0.42.1's.

    Returns:
        The number of AdaLN sites newly routed through :func:`lightning_adaptiveload.ops.adaln`
        (2 per block, 1 per head).

    Example::

        transformer = WanTransformer3DModel.from_pretrained(repo, subfolder="transformer")
        patch_wan_transformer(transformer)  # 2 * num_layers + 1 sites
    """
    sites, skipped = 0, {}
    for module in model.modules():
        cls = _wan_class(module)
        if cls is None or _is_patched(module):
            continue
        reason = _skip_reason(module, cls, strict)
        if reason is not None:
            skipped.setdefault(f"{cls.__name__}: {reason}", []).append(module)
            continue
        if cls is WanTransformerBlock:
            _install_block_forward(module)
            setattr(module, _checkpointing.BODY, types.MethodType(_fused_block_forward, module))
        else:
            module.forward = types.MethodType(_fused_model_forward, module)
        sites += _SITES[cls]
    for reason, modules in skipped.items():
        rank_zero_warn(f"patch_wan_transformer: left {len(modules)} module(s) unfused: {reason}.")
    return sites


def unpatch_wan_transformer(model: nn.Module) -> int:
    """Undo :func:`patch_wan_transformer` on every module of ``model``; returns the sites restored.

    A block keeps its per-instance forward while it checkpoints (mode other than ``"none"``)."""
    sites = 0
    for module in model.modules():
        cls = _wan_class(module)
        if cls is None or not _is_patched(module):
            continue
        if cls is WanTransformerBlock:
            if module.checkpointing == "none":
                _uninstall_block_forward(module)
            else:
                setattr(module, _checkpointing.BODY, types.MethodType(WanTransformerBlock.forward, module))
        else:
            del module.__dict__["forward"]
        sites += _SITES[cls]
    return sites


def set_wan_checkpointing(model: nn.Module, mode: str) -> int:
    """Make every diffusers ``WanTransformerBlock`` in ``model`` recompute as ``mode`` says, in place.

    ``"none"``, ``"selective"`` (the SDPA outputs are kept, the rest of the block is recomputed:
    :func:`~lightning_adaptiveload.models.checkpointing.keep_attention_outputs`) or ``"full"``. The checkpoint
    runs inside the block's forward (non-reentrant ``torch.utils.checkpoint``), so a compiled block
    compiles it with the block, one graph per mode; switching modes later sets one attribute per block.
    diffusers' own model-level ``gradient_checkpointing`` is turned off (it would recompute twice).
    Works with the fused-AdaLN patch in either order.

    Returns:
        The number of blocks set.

    Raises:
        ValueError: ``mode`` is not a mode, or a block's forward is replaced by someone else (a diffusers
            hook): set the mode before enabling such hooks.
    """
    return _set_checkpointing(model, mode, (WanTransformerBlock,), "set_wan_checkpointing")


def _unviewed(freqs: Any) -> Any:
    # detach() gives the same storage without the view's base (no copy); RoPE tables need no gradient.
    if isinstance(freqs, torch.Tensor) and freqs._base is not None and not freqs.requires_grad:
        return freqs.detach()
    return freqs


def _mark_diffusers_block_inputs(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Pre-hook of a compiled ``WanTransformerBlock`` called as ``block(hidden_states [B, S, D],
    encoder_hidden_states [B, L, D], temb [B, 6, D] or [B, S, 6, D], rotary_emb ([1, S, 1, d], ...))``:
    B and S symbolic.

    It also hands the block RoPE tables that are not views: diffusers' tables are views of a
    ``[F, H, W, d]`` tensor, dynamo guards on a view input's base, and under activation checkpointing a
    graph compiled for video then guarded F >= 2, so images (F = 1) compiled one more graph per mode.
    """
    if len(args) < 4 or not isinstance(args[0], torch.Tensor) or args[0].ndim != 3:
        return None
    hidden, context, temb, rotary = args[:4]
    mark_dynamic(hidden, 0, 1)
    if isinstance(context, torch.Tensor):
        mark_dynamic(context, 0)
    if isinstance(temb, torch.Tensor):
        mark_dynamic(temb, *((0, 1) if temb.ndim == 4 else (0,)))
    rotary = type(rotary)(_unviewed(f) for f in rotary) if isinstance(rotary, (tuple, list)) else _unviewed(rotary)
    for freqs in rotary if isinstance(rotary, (tuple, list)) else (rotary,):
        if isinstance(freqs, torch.Tensor) and freqs.ndim >= 2:
            mark_dynamic(freqs, 1)
    return (hidden, context, temb, rotary, *args[4:])


def _generic_block_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # A non-Wan family's block: its own forward under the block's checkpointing mode (an attribute, so a
    # compiled block guards on it: one graph per mode). Keyword arguments ride in the checkpointed function.
    body = self._checkpointed_body
    if kwargs:
        body = functools.partial(body, **kwargs)
    return _checkpointing.run_checkpointed(body, self.checkpointing, *args)


def set_block_checkpointing(model: nn.Module, mode: str, block_classes: Sequence[type]) -> int:
    """Make every block of a diffusers video family (``block_classes``: exact types, or ``WanTransformerBlock``,
    also after FSDP2's class swap) recompute as ``mode`` says inside its own forward, through
    :func:`~lightning_adaptiveload.models.checkpointing.run_checkpointed`; diffusers' model-level
    ``gradient_checkpointing`` is turned off. The Wan blocks' forward is shared with the fused-AdaLN patch
    (:func:`set_wan_checkpointing`). Returns the number of blocks set.

    Raises:
        ValueError: ``mode`` is not a mode, or a block's forward is replaced by someone else (a diffusers
            hook): set the mode before enabling such hooks.
    """
    return _set_checkpointing(model, mode, block_classes, "set_block_checkpointing")


def _checkpointed_forward_of(module: nn.Module, classes: Sequence[type]) -> Any:
    """The per-instance forward a block of ``classes`` checkpoints through (``None``: not such a block): Wan's
    (:func:`_block_forward`, also after FSDP2's class swap) when ``classes`` has ``WanTransformerBlock``, else the
    generic one for blocks of exactly those types."""
    if WanTransformerBlock in classes:
        return _block_forward if _wan_class(module) is WanTransformerBlock else None
    return _generic_block_forward if type(module) in classes else None


def _set_checkpointing(model: nn.Module, mode: str, block_classes: Sequence[type], owner: str) -> int:
    """:func:`set_block_checkpointing` (``owner`` names the caller in errors): diffusers' model-level
    ``gradient_checkpointing`` off, then :func:`~lightning_adaptiveload.models.checkpointing.apply_checkpointing`
    with each block's checkpointed forward installed."""
    mode = _checkpointing.checkpointing_mode(mode)
    classes = tuple(block_classes)
    for module in model.modules():
        if isinstance(module, ModelMixin) and getattr(module, "gradient_checkpointing", False):
            module.disable_gradient_checkpointing()

    def install(module: nn.Module) -> None:
        forward = _checkpointed_forward_of(module, classes)
        if "forward" in module.__dict__ and not _checkpointing.has_forward(module, forward):
            name = WanTransformerBlock.__name__ if forward is _block_forward else type(module).__name__
            raise ValueError(
                f"{owner}(mode={mode!r}): a {name}'s forward is already replaced (a "
                "diffusers hook: caching, group offloading, context parallelism). Set the mode before enabling those."
            )
        body = WanTransformerBlock.forward if forward is _block_forward else None
        _checkpointing.install_checkpointed_forward(module, forward, body)

    return _checkpointing.apply_checkpointing(
        model, mode, lambda module: _checkpointed_forward_of(module, classes) is not None, install
    )


def _mark_block_inputs(block: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    """Pre-hook of a compiled non-Wan block called with ``hidden_states`` [B, S, D] first (HunyuanVideo's blocks;
    blocks called with keywords get dynamo's automatic dynamic shapes): B and S symbolic from the first graph
    on, in it and in the other tensor arguments (the batch dim of [B, ...] tensors and their first other dim when
    it has S entries, RoPE tables [S, d], or S + L, a joint attention mask [B, 1, 1, S + L]), so a new bucket
    does not compile another graph.

    It also hands the block tensors that are not views: dynamo guards on a view's base, whose shape is the
    latents' [B, C, F, H, W] for the first block's input (a transpose of the patch embedding), so a new frame
    count compiled another graph. Views that need no gradient are detached (same storage); the first block's
    input is copied once a step.
    """
    if not args or not isinstance(args[0], torch.Tensor) or args[0].ndim != 3:
        return None
    hidden = args[0].clone() if args[0]._base is not None else args[0]
    b, s = hidden.shape[:2]
    mark_dynamic(hidden, 0, 1)
    sizes = {s}
    if len(args) > 1 and isinstance(args[1], torch.Tensor) and args[1].ndim == 3:
        sizes.add(s + args[1].shape[1])  # a joint-attention mask over video + text [B, 1, 1, S + L]

    def marked(tensor: Any) -> Any:
        if not isinstance(tensor, torch.Tensor) or tensor.ndim < 2:
            return tensor
        tensor = _unviewed(tensor)
        # The batch dim, and the first other dim larger than 1 when it has S (or S + L) entries: only that one,
        # since a width that happens to equal S (the text's [B, L, D] at S = D) would change the marked set,
        # which itself recompiles.
        batch = [0] if tensor.shape[0] == b else []
        first = next((d for d in range(len(batch), tensor.ndim) if tensor.shape[d] != 1), None)
        per_token = not batch or tensor.ndim >= 3  # [B, D] (an embedding) has no token dim
        tokens = [first] if per_token and first is not None and tensor.shape[first] in sizes else []
        mark_dynamic(tensor, *batch, *tokens)
        return tensor

    rest = [type(a)(marked(t) for t in a) if isinstance(a, (tuple, list)) else marked(a) for a in args[1:]]
    return (hidden, *rest)


@dataclasses.dataclass(frozen=True)
class DiffusersVideoConfig:
    """What the library reads of a diffusers video transformer: the data geometry (``adaptiveload-train`` fills
    the data config's null ``text_len``, ``text_dim``, ``patch_size``, ``vae_stride``, ``extra_inputs`` from it),
    the sizes sequence parallelism plans with, and the whole ``transformer`` config (the calibration key's
    architecture fingerprint)."""

    family: str
    transformer: dict[str, Any]
    dim: int
    num_heads: int
    num_layers: int
    in_dim: int
    text_dim: int
    text_len: int
    patch_size: tuple[int, int, int]
    vae_stride: tuple[int, int, int]
    extra_inputs: dict[str, list[int]]
    #: Text tokens that share self-attention with the video tokens (joint attention), else 0.
    joint_text_len: int


def _quadratic_through(points: Sequence[tuple[int, int]]) -> tuple[Fraction, Fraction, Fraction]:
    """Exact coefficients (a, b, c) of ``a + b·s + c·s²`` through three (s, y) points."""
    (s0, y0), (s1, y1), (s2, y2) = ((Fraction(s), Fraction(y)) for s, y in points)
    d01, d12 = (y1 - y0) / (s1 - s0), (y2 - y1) / (s2 - s1)
    c = (d12 - d01) / (s2 - s0)
    b = d01 - c * (s0 + s1)
    return y0 - b * s0 - c * s0 * s0, b, c


class DiffusersVideoModule(RectifiedFlowModule):
    """Trains a diffusers video transformer with Wan's rectified-flow objective, any family of
    :data:`~lightning_adaptiveload.integrations.diffusers_families.FAMILIES`.

    Families (``family=``, detected from the transformer's class or a config's ``_class_name``):
    ``"wan"`` (``WanTransformer3DModel``: Wan 2.1, Wan 2.2 incl. the 5B TI2V config), ``"hunyuan_video"``
    (``HunyuanVideoTransformer3DModel``), ``"cogvideox"`` (``CogVideoXTransformer3DModel``) and
    ``"ltx_video"`` (``LTXVideoTransformer3DModel``). A family's adapter builds the model's inputs from a
    batch (:mod:`~lightning_adaptiveload.integrations.diffusers_families`): the latents' layout (CogVideoX's
    ``[B, F, C, H, W]``, LTX-Video's packed tokens), RoPE coordinates, guidance and ``ofs`` embeddings, an
    all-ones text mask when the batch has no ``context_mask``; it reads the patch from the model's config
    and names the blocks that checkpoint and compile.

    For clean latents ``x0`` and Gaussian ``noise``: ``u ~ U(0, 1)``, ``t = shift·u / (1 + (shift-1)·u)``,
    ``x_t = (1 - t)·x0 + t·noise``; the loss is the fp32 MSE between the prediction for
    ``(x_t, t · num_train_timesteps, context)`` and the velocity ``noise - x0``. Batches are
    ``{"latents": [B, C, F, H, W], "context": [B, L, text_dim]}`` as the project's collate builds
    them, plus the family's extra keys: ``"context_mask"`` ``[B, L]`` (HunyuanVideo, LTX-Video; optional:
    all ones without it) and ``"pooled"`` ``[B, pooled_projection_dim]`` (HunyuanVideo's CLIP embedding,
    required); other key names: ``batch_keys``. Every batch may have its own (F, H, W); all contexts have
    ``text_len`` tokens.

    The shared machinery (draw-seeded timesteps and noise, so a resumed run has the uninterrupted run's
    losses; the training step and its logs; AdamW and clipping; the checks of the data made before
    profiling) is :class:`~lightning_adaptiveload.models.rectified_flow.RectifiedFlowModule`'s.
    Provides the :class:`~lightning_adaptiveload.models.protocol.AdaptiveLoadModule` members
    (``compute_loss``, ``synthetic_batch``, ``batch_shape``, ``patch_size``, ``attention_tokens``,
    ``flops_per_sample``, ``checkpointing``/``checkpointing_modes``/``set_checkpointing``, ``calibration_key``).

    Args:
        transformer: the diffusers transformer (e.g. from ``from_pretrained``), or the keyword arguments of its
            constructor; then the model is built in :meth:`configure_model` (inside the strategy's init context)
            with fresh weights, or loaded from ``pretrained``. ``None`` with ``pretrained``: the directory's config.
        text_len: text tokens L per sample: the context length of the training data, which
            :meth:`synthetic_batch` (profiling), :meth:`attention_tokens` and :meth:`flops_per_sample` use (Wan:
            512, HunyuanVideo: 256, CogVideoX: 226, LTX-Video: 128). Checked against dataset samples before
            profiling and against every training batch.
        lr, weight_decay, betas, eps: AdamW settings.
        timestep_shift: Wan's schedule shift (5.0 for 480p/720p video; 1.0: uniform t).
        num_train_timesteps: scale of the timestep the model sees (1000).
        gradient_checkpointing: deprecated alias: ``True`` is ``activation_checkpointing="full"``.
        optimizer_impl: AdamW's implementation, ``"auto"`` (fused on CUDA with replicated parameters),
            ``"fused"`` or ``"foreach"`` (:mod:`lightning_adaptiveload.models.optim`).
        compile: compile every transformer block with ``torch.compile`` in :meth:`configure_model`
            (regional compilation, like diffusers' ``compile_repeated_blocks``, plus what a bucketed
            corpus needs: batch and sequence sizes symbolic from the first graph, the recompile limit
            raised with hitting it an error, one graph per block under DDP; see
            :func:`lightning_adaptiveload.models.compiling.compile_blocks`), one graph per checkpointing mode.
        compile_options: inductor options for the compiled blocks, checked against
            ``torch._inductor.config``; needs ``compile=True``.
        activation_checkpointing: what backward recomputes in every block (:func:`set_block_checkpointing`):
            ``"none"`` (or ``False``), ``"selective"`` (keep the attention outputs), ``"full"`` (or ``True``),
            or ``"auto"``: chosen per bucket by
            :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback` from measured
            memory (without it, ``"auto"`` trains with ``"full"`` and warns). A ``transformer`` with diffusers'
            ``enable_gradient_checkpointing()`` on counts as ``"full"`` unless this is set.
        seed: seed of the timestep and noise draws; ``None``: the seed of ``lightning.seed_everything``, or 0.
        warmup_steps: linear learning-rate warmup over this many optimizer steps (0: none).
        batch_keys: the batch's key names where they differ from ours, e.g.
            ``{"latents": "hidden_states", "context": "encoder_hidden_states", "pooled": "pooled_prompt_embeds"}``.
        family: the adapter, one of ``"wan"``, ``"hunyuan_video"``, ``"cogvideox"``, ``"ltx_video"``; ``None``:
            detected from the transformer.
        pretrained: a local directory written by ``save_pretrained`` (or a model directory with a
            ``transformer/`` subfolder): :meth:`configure_model` loads it with ``from_pretrained``.
        vae_stride: the (t, h, w) stride of the VAE that encoded the data; ``None``: the family's
            (Wan 2.1, HunyuanVideo, CogVideoX: (4, 8, 8); Wan 2.2 TI2V's 48-channel VAE: (4, 16, 16);
            LTX-Video: (8, 32, 32)). Data configs take it from here; LTX-Video's RoPE scales with it.
        guidance_scale: HunyuanVideo's embedded guidance (guidance-distilled configs, ``guidance_embeds``).
        frame_rate: LTX-Video's frames per second of the training clips (its RoPE time axis is in seconds).

    Example::

        module = DiffusersVideoModule(HunyuanVideoTransformer3DModel.from_pretrained(path, subfolder="transformer"),
                                      text_len=256)
        trainer = Trainer(precision="bf16-mixed", callbacks=[FusedAdaLNCallback()])
        trainer.fit(module, datamodule=dm)
    """

    #: The family when neither ``family`` nor the transformer names one.
    _default_family: str | None = None

    def __init__(
        self,
        transformer: nn.Module | Mapping[str, Any] | None = None,
        text_len: int = 512,
        lr: float = 1e-4,
        weight_decay: float = 0.0,
        betas: Sequence[float] = (0.9, 0.999),
        eps: float = 1e-8,
        timestep_shift: float = 5.0,
        num_train_timesteps: int = 1000,
        gradient_checkpointing: bool | None = None,
        optimizer_impl: str = "auto",
        compile: bool = False,
        compile_options: Mapping[str, Any] | None = None,
        activation_checkpointing: bool | str | None = None,
        seed: int | None = None,
        warmup_steps: int = 0,
        batch_keys: Mapping[str, str] | None = None,
        family: str | None = None,
        pretrained: str | None = None,
        vae_stride: Sequence[int] | None = None,
        guidance_scale: float = 6.0,
        frame_rate: float = 25.0,
        attention: str = "auto",
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        check_attention_setting(attention, cls)
        check_optimizer_impl(optimizer_impl, cls)
        compile_options = check_compile_options(compile_options, compile, cls)
        fam, config, model, subfolder = _resolve_transformer(cls, transformer, family, pretrained,
                                                             self._default_family)
        fam.check_config(config, cls)
        check_positive_int(cls, "text_len", text_len)
        fam.check_text_len(config, int(text_len), cls)
        if vae_stride is not None:
            vae_stride = list(check_triple(cls, "vae_stride", vae_stride))
        for name, value in (("guidance_scale", guidance_scale), ("frame_rate", frame_rate)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"`{cls}({name}={value!r})` is not valid. Expected a positive number.")
        activation_checkpointing = _resolve_checkpointing(
            cls, activation_checkpointing, gradient_checkpointing,
            model is not None and bool(getattr(model, "gradient_checkpointing", False)))
        check_training_arguments(
            cls, activation_checkpointing=activation_checkpointing, lr=lr, weight_decay=weight_decay, betas=betas,
            eps=eps, warmup_steps=warmup_steps, timestep_shift=timestep_shift,
            num_train_timesteps=num_train_timesteps, seed=seed,
        )
        batch_keys = _check_batch_keys(cls, batch_keys, fam)
        # hparams keep the config, not the module, so `load_from_checkpoint` rebuilds the model; the alias
        # is resolved into activation_checkpointing.
        transformer, gradient_checkpointing, family = config, None, fam.name
        betas = tuple(float(b) for b in betas)
        self.save_hyperparameters()
        self.family = fam
        self.transformer_config = config
        self._pretrained = (pretrained, subfolder)
        self.patch_size: tuple[int, int, int] = fam.patch_size(config)
        self.batch_keys.update(batch_keys or {})
        self.transformer: nn.Module | None = None
        self._blocks_compiled = False
        self._flops_fit: tuple[Fraction, Fraction, Fraction] | None = None
        self._init_attention(attention)
        if model is not None:
            self._prepare_blocks(model)
            self.transformer = model

    def _cfg(self, key: str) -> Any:
        # Constructor defaults for keys the mapping leaves out.
        return self.family.cfg(self.transformer_config, key)

    @property
    def vae_stride(self) -> tuple[int, int, int]:
        """The VAE stride of the data (the ``vae_stride`` argument or the family's)."""
        stride = self.hparams.get("vae_stride")
        if stride is not None:
            return tuple(int(s) for s in stride)  # type: ignore[return-value]
        if self.family.name == "wan" and self.family.latent_channels(self.transformer_config) == 48:
            return (4, 16, 16)  # Wan 2.2's 48-channel VAE (the TI2V 5B config)
        return self.family.vae_stride

    @property
    def wan_config(self) -> WanConfig | DiffusersVideoConfig:
        """The model's geometry the base class reads (``text_len``, ``text_dim``, ``in_dim``): a
        :class:`WanConfig` for the Wan family, a :class:`DiffusersVideoConfig` for the others; built on first use."""
        if getattr(self, "_wan_config", None) is None:
            fam, cfg, text_len = self.family, self.transformer_config, int(self.hparams.text_len)
            if fam.name == "wan":
                heads, head_dim = self._cfg("num_attention_heads"), self._cfg("attention_head_dim")
                self._wan_config = WanConfig(
                    dim=heads * head_dim, ffn_dim=self._cfg("ffn_dim"), num_heads=heads,
                    num_layers=self._cfg("num_layers"), in_dim=self._cfg("in_channels"),
                    out_dim=self._cfg("out_channels") or self._cfg("in_channels"), text_dim=self._cfg("text_dim"),
                    text_len=text_len, freq_dim=self._cfg("freq_dim"),
                    patch_size=tuple(self._cfg("patch_size")), vae_stride=self.vae_stride,
                )
            else:
                self._wan_config = DiffusersVideoConfig(
                    family=fam.name, transformer=_plain_config(cfg), **fam.geometry(cfg),
                    in_dim=fam.latent_channels(cfg), text_dim=fam.text_dim(cfg), text_len=text_len,
                    patch_size=self.patch_size, vae_stride=self.vae_stride, extra_inputs=fam.extra_inputs(cfg),
                    joint_text_len=text_len if fam.joint_text else 0,
                )
        return self._wan_config

    @property
    def config(self) -> WanConfig | DiffusersVideoConfig:
        """:attr:`wan_config` under the name ``adaptiveload-train`` reads the data geometry from (patch,
        VAE stride, text length and width, extra inputs) and the calibration key fingerprints."""
        return self.wan_config

    def _built_model(self) -> nn.Module | None:
        return self.transformer

    def _set_block_checkpointing(self, mode: str) -> None:
        set_block_checkpointing(self._require_model(), mode, self.family.block_classes)

    def _fused_adaln_sites(self) -> int:
        model = self.transformer
        if model is None:
            return 0
        from lightning_adaptiveload.integrations.diffusers_norms import _TWINS

        twins = tuple(_TWINS.values())
        return sum(_SITES[_wan_class(m)] if _wan_class(m) is not None and _is_patched(m) else
                   int(isinstance(m, twins)) for m in model.modules())

    def _keys_fix(self) -> str:
        return (f"Name the batch's keys: `{type(self).__name__}(batch_keys={{'latents': ..., 'context': ...}})` "
                f"(now {self.batch_keys}).")

    def _text_len_fix(self, length: int) -> str:
        return (f"Set `{type(self).__name__}(text_len={length})` if every context has "
                "that length, or pad the contexts to text_len in the dataset.")

    def _prepare_blocks(self, model: nn.Module) -> None:
        set_block_checkpointing(model, self._initial_checkpointing(), self.family.block_classes)
        self.family.prepare_model(model)
        if self._attention_backend != "sdpa" and self._attention_backend in self.attention_backends:
            # (One the family cannot run is refused at fit start, naming the fix: `_check_attention`.)
            self._set_model_attention(self._attention_backend, model)

    # ------------------------------------------------------------------ attention backend
    @property
    def attention_backends(self) -> tuple[str, ...]:
        """The family's (``("sdpa", "fa4")`` for each of diffusers' video families: their attention processors run
        the project's backends, :mod:`~lightning_adaptiveload.integrations.diffusers_attention`)."""
        return self.family.attention_backends

    @property
    def attention_heads(self) -> tuple[int, int]:
        return int(self._cfg("num_attention_heads")), int(self._cfg("attention_head_dim"))

    def _set_model_attention(self, backend: str, model: nn.Module | None = None) -> None:
        model = model if model is not None else self.transformer
        if model is not None:
            self.family.set_attention_backend(model, backend)

    @override
    def configure_model(self) -> None:
        """Build the transformer from its config, or load ``pretrained``, once (Lightning calls this in the
        strategy's init context)."""
        if self.transformer is None:
            path, subfolder = self._pretrained
            cls = self.family.model_class
            if path is not None:
                if cls._keep_in_fp32_modules and importlib.util.find_spec("accelerate") is None:
                    raise ImportError(
                        f"`{type(self).__name__}(pretrained={path!r})`: loading a {cls.__name__} needs accelerate "
                        "(diffusers keeps its fp32 modules through it). Install `lightning-adaptiveload[diffusers]`."
                    )
                model = cls.from_pretrained(path, **({"subfolder": subfolder} if subfolder else {}))
            else:
                model = cls(**self.transformer_config)
            self._prepare_blocks(model)
            self.transformer = model
        if self.hparams.get("compile", False) and not self._blocks_compiled:
            # Lazy: the forwards that FusedAdaLNCallback patches in before the first step are traced.
            options = dict(self.hparams.get("compile_options") or {})
            classes = self.family.block_classes
            blocks = [m for m in self.transformer.modules() if type(m) in classes]
            mark = _mark_diffusers_block_inputs if self.family.name == "wan" else _mark_block_inputs
            if self.family.name != "wan":
                # Inductor's coalescing tiling analysis asserts (tiling_utils.get_pw_red_splits) on the first
                # B > 1 graph of a HunyuanVideo block with symbolic B and S (torch 2.11, H200); it is a
                # heuristic for static shapes only, so the non-Wan blocks go without it unless the user says.
                options.setdefault("triton.coalesce_tiling_analysis", False)
            compile_blocks(blocks, mark, **({"options": options} if options else {}))
            self._blocks_compiled = True

    # ------------------------------------------------------------------ protocol
    def attention_tokens(self, seq_len: int) -> int:
        """Tokens one sample of ``seq_len`` video tokens has in self-attention: ``seq_len + text_len`` for the
        joint-attention families (HunyuanVideo, CogVideoX), ``seq_len`` for the cross-attention ones (Wan,
        LTX-Video), whose text tokens are only keys and values of cross-attention."""
        return int(seq_len) + (int(self.hparams.text_len) if self.family.joint_text else 0)

    def _check_patch(self, latents: torch.Tensor) -> None:
        """A ``patch_size`` other than the transformer's miscounts every sample's tokens: refuse it."""
        actual = self.family.patch_size(self.transformer_config)
        if tuple(self.patch_size) == actual:
            return
        shape = list(latents.shape)
        try:
            wrong = f"{tokens_of(latents, self.patch_size)[1]} tokens a sample instead of {tokens_of(latents, actual)[1]}"
        except ValueError:
            wrong = "a token count the latents do not divide into"
        raise MisconfigurationException(
            f"`{type(self).__name__}.patch_size` is {tuple(self.patch_size)}, but the transformer patchifies latents "
            f"{shape} by {actual} (its config): batch_shape would count {wrong}. Do not set patch_size; it is read "
            "from the transformer's config."
        )

    @override
    def batch_shape(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """``(B, S)`` of a batch: samples, and tokens per sample after patchify of its latents ``[B,C,F,H,W]``
        (a ``patch_size`` that differs from the transformer's is refused)."""
        latents = self._get(batch, "latents")
        self._check_patch(latents)
        return tokens_of(latents, self.patch_size)

    def _extras(self, batch: Any, where: str = "a batch") -> dict[str, torch.Tensor]:
        """The family's extra inputs of ``batch`` (a required one missing is an error naming the fix)."""
        out = {}
        for key, required in self.family.extra_keys.items():
            name = self.batch_keys.get(key, key)
            if isinstance(batch, Mapping) and batch.get(name) is not None:
                out[key] = batch[name]
            elif required:
                shape = self.family.extra_inputs(self.transformer_config).get(key)
                keys = sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__
                raise MisconfigurationException(
                    f"`{type(self).__name__}` ({self.family.name}): {where} has no {name!r} ([B, {shape[0] if shape else '...'}], "
                    f"the pooled text embedding the model requires); it has {keys}. Store it in every sample "
                    f"(SyntheticMixedDataset(extra_inputs={{{key!r}: {shape}}}) makes random ones) or name the key: "
                    f"`batch_keys={{{key!r}: ...}}`."
                )
        return out

    @override
    def check_batch(self, batch: Any, where: str = "a training batch") -> None:
        """The base's checks, the patch size against the latents and the family's required extra inputs."""
        super().check_batch(batch, where)
        self._check_patch(self._get(batch, "latents", where))
        self._extras(batch, where)

    @override
    def setup(self, stage: str) -> None:
        """The base's data checks, then one collated sample's extra inputs, before the shape benchmark profiles."""
        super().setup(stage)
        datamodule = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        dataset = getattr(datamodule, "dataset", None)
        if stage != "fit" or not self.family.extra_keys or dataset is None:
            return
        try:
            sample = dataset[0]
        except Exception:  # noqa: BLE001 - the base's checks and the DataModule name dataset errors
            return
        collate = getattr(datamodule, "collate_fn", None)
        if collate is None:
            from lightning_adaptiveload.data.collate import collate_batch as collate
        self._extras(collate([sample]), "dataset[0] (collated)")

    @override
    def synthetic_batch(
        self,
        batch_size: int,
        grid: Sequence[int],
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> dict[str, Any]:
        """The base's random batch plus the family's extra inputs: ``context_mask`` (all ones) where the family
        reads one, ``pooled`` (random, from its own generator) where it needs one."""
        batch = super().synthetic_batch(batch_size, grid, device, seed)
        context = batch[self.batch_keys["context"]]
        if CONTEXT_MASK in self.family.extra_keys:
            batch[self.batch_keys.get(CONTEXT_MASK, CONTEXT_MASK)] = torch.ones(
                context.shape[:2], dtype=torch.long, device=context.device)
        gen = torch.Generator(device=context.device).manual_seed(seed + 1)
        for key, shape in self.family.extra_inputs(self.transformer_config).items():
            batch[self.batch_keys.get(key, key)] = torch.randn(batch_size, *shape, device=context.device, generator=gen)
        return batch

    @override
    def _model_inputs(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """For the base's ``compute_loss``: the latents' patch checked, then the family's extra inputs
        (``context_mask``, ``pooled``) the model is called with. No sequence-parallel path here: the base
        refuses ``sp_degree > 1``."""
        self._check_patch(self._get(batch, "latents"))
        return self._extras(batch)

    def _counted_forward_flops(self, lengths: Sequence[int], config: Mapping[str, Any]) -> list[int]:
        """FLOPs (FlopCounterMode) of one forward of one sample of each of ``lengths`` tokens (grid (1, 1, S)) of
        the model of ``config``, run on the meta device: shapes only, no memory, no weights."""
        from torch.utils.flop_counter import FlopCounterMode

        cfg, extra = self.config, self.family.extra_inputs(config)
        with torch.device("meta"):
            model = self.family.model_class(**config)
        out = []
        for seq_len in lengths:
            with torch.device("meta"):
                latents = torch.empty(1, cfg.in_dim, *latent_of_grid((1, 1, seq_len), self.patch_size))
                context = torch.empty(1, cfg.text_len, cfg.text_dim)
                extras = {key: torch.empty(1, *shape) for key, shape in extra.items()}
                if CONTEXT_MASK in self.family.extra_keys:
                    extras[CONTEXT_MASK] = torch.ones(1, cfg.text_len, dtype=torch.long)
                t = torch.full((1,), 500.0)
            counter = FlopCounterMode(display=False)
            with torch.no_grad(), counter:
                self.family.predict(model, latents, t, context, extras, self._options())
            out.append(int(counter.get_total_flops()))
        return out

    def _forward_flops_fit(self) -> tuple[Fraction, Fraction, Fraction]:
        """Exact ``(a, b, c)`` of the forward's FLOPs ``a + b·S + c·S²`` for one sample of S video tokens.

        Counted on models with one block of each repeated kind and with two of one kind, then scaled to the
        config's block counts (a block's FLOPs do not depend on how many there are): a 60-block model's count
        costs a few small forwards instead of one large one (HunyuanVideo 13B: 4 s instead of 13 s on a 2-core CPU)."""
        lengths = (1, 2, 3)
        keys = [k for k in self.family.layer_keys if int(self._cfg(k)) > 0]
        ones = {**self.transformer_config, **{k: 1 for k in keys}}
        base = self._counted_forward_flops(lengths, ones)
        total = list(base)
        for key in keys:
            two = self._counted_forward_flops(lengths, {**ones, key: 2})
            total = [t + (int(self._cfg(key)) - 1) * (b2 - b1) for t, b1, b2 in zip(total, base, two, strict=True)]
        return _quadratic_through(list(zip(lengths, total, strict=True)))

    @override
    def flops_per_sample(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward for one sample of ``seq_len`` video tokens: 3 × the forward.

        Wan: :func:`~lightning_adaptiveload.models.wan.wan_forward_flops`. The other families: the forward's
        matmuls as ``torch.utils.flop_counter`` counts them, on the meta device (no weights, no memory), at
        three lengths once (:meth:`_forward_flops_fit`); the forward is exactly quadratic in ``seq_len``
        (attention over video + text for the joint-attention families, so their text tokens are counted),
        which the three points determine.
        Recomputation under activation checkpointing is not counted.
        """
        if self.family.name == "wan":
            return super().flops_per_sample(seq_len)
        if self._flops_fit is None:
            self._flops_fit = self._forward_flops_fit()
        a, b, c = self._flops_fit
        s = int(seq_len)
        return 3.0 * float(a + b * s + c * s * s)

    def _options(self) -> dict[str, Any]:
        hp = self.hparams
        return {"guidance_scale": hp.get("guidance_scale", 6.0), "frame_rate": hp.get("frame_rate", 25.0),
                "vae_stride": self.vae_stride}

    @override
    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor, **extras: torch.Tensor) -> torch.Tensor:
        """Velocity prediction for latents ``x``, timesteps ``t`` in [0, num_train_timesteps], ``context`` and the
        family's extra inputs (``context_mask``, ``pooled``)."""
        model = self._require_model()
        self._attention_for_latents(x)
        dtype = model.dtype
        with whole_block_graphs() if self._blocks_compiled else contextlib.nullcontext():
            return self.family.predict(model, x.to(dtype), t, context.to(dtype), extras, self._options())


class DiffusersWanModule(DiffusersVideoModule):
    """:class:`DiffusersVideoModule` for diffusers' ``WanTransformer3DModel`` (Wan 2.1, Wan 2.2): ``family``
    defaults to ``"wan"``, also for a config mapping without ``_class_name``.

    Example::

        module = DiffusersWanModule(WanTransformer3DModel.from_pretrained(repo, subfolder="transformer"))
        trainer = Trainer(precision="bf16-mixed", callbacks=[FusedAdaLNCallback()])
        trainer.fit(module, datamodule=dm)
    """

    _default_family = "wan"


def _plain_config(config: Mapping[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(dict(config), sort_keys=True, default=str))


def _resolve_transformer(
    cls: str, transformer: Any, family: str | None, pretrained: str | None, default: str | None
) -> tuple[VideoFamily, dict[str, Any], nn.Module | None, str | None]:
    """(family, constructor config, the given model or None, the pretrained subfolder) of the arguments."""
    if family is not None and family not in FAMILIES:
        raise ValueError(f"`{cls}(family={family!r})` is not valid. Expected one of {sorted(FAMILIES)} (or None: "
                         "detected from the transformer).")
    classes = ", ".join(f.model_class.__name__ for f in FAMILIES.values())
    subfolder, dir_config = None, None
    if pretrained is not None:
        path = Path(str(pretrained))
        if not (path / "config.json").is_file() and (path / "transformer" / "config.json").is_file():
            subfolder = "transformer"
        config_file = path / (subfolder or "") / "config.json"
        if not config_file.is_file():
            raise ValueError(
                f"`{cls}(pretrained={str(pretrained)!r})` is not valid: no config.json there (nor in transformer/). "
                "Expected a local directory written by the transformer's save_pretrained (download hub models first)."
            )
        dir_config = json.loads(config_file.read_text())
    model = transformer if isinstance(transformer, nn.Module) else None
    if model is not None:
        fam = family_of(model)
        if fam is None:
            raise TypeError(f"`{cls}(transformer={type(model).__name__})` is not valid. Expected one of {classes} "
                            "or the keyword arguments of its constructor.")
        config = dict(model.config)
    elif isinstance(transformer, Mapping) or (transformer is None and dir_config is not None):
        config = dict(dir_config if transformer is None else transformer)
        named = config.get("_class_name") or (dir_config or {}).get("_class_name")
        fam = family_of(named) if named else None
        if named and fam is None:
            raise ValueError(f"`{cls}(transformer={{'_class_name': {named!r}, ...}})` is not a supported family. "
                             f"Expected one of {classes}.")
    else:
        raise TypeError(f"`{cls}(transformer={type(transformer).__name__})` is not valid. Expected one of {classes}, "
                        "the keyword arguments of its constructor, or None with `pretrained=<directory>`.")
    if family is not None:
        if fam is not None and fam.name != family:
            raise ValueError(f"`{cls}(family={family!r})` disagrees with the transformer, a {fam.model_class.__name__} "
                             f"(family {fam.name!r}). Leave family unset.")
        fam = FAMILIES[family]
    if fam is None:
        fam = FAMILIES.get(default) if default else None
    if fam is None:
        raise ValueError(f"`{cls}(transformer={{...}})` does not say which model it configures. Pass "
                         f"`family=` ({sorted(FAMILIES)}) or a config with `_class_name`.")
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    if dir_config is not None:
        stored = {k: v for k, v in dir_config.items() if not k.startswith("_")}
        different = sorted(k for k in config if k in stored and _plain_config({k: config[k]}) != _plain_config(
            {k: stored[k]}))
        if different:
            raise ValueError(f"`{cls}(transformer=..., pretrained={str(pretrained)!r})`: {different} differ from the "
                             "directory's config.json. Pass transformer=None to use the directory's config.")
        config = {**stored, **config}
    # Every constructor argument, defaults filled in: the same architecture has the same config (hence the same
    # calibration key) whether it comes from a short mapping, a model or a save_pretrained directory.
    defaults = {name: p.default for name, p in inspect.signature(fam.model_class.__init__).parameters.items()
                if name != "self" and p.default is not inspect.Parameter.empty}
    return fam, {**defaults, **config}, model, subfolder


def _resolve_checkpointing(cls: str, setting: bool | str | None, alias: bool | None, model_flag: bool) -> bool | str:
    """``activation_checkpointing`` from itself, the deprecated ``gradient_checkpointing`` alias and the given
    model's diffusers flag (each of the last two means ``"full"``); a conflict is an error."""
    if alias is not None:
        if not isinstance(alias, bool):
            raise ValueError(f"`{cls}(gradient_checkpointing={alias!r})` is not valid. Expected true or false.")
        if alias:
            rank_zero_deprecation(
                f"`{cls}(gradient_checkpointing=True)` is deprecated; use `activation_checkpointing='full'` (or "
                "'selective', or 'auto' to let the shape benchmark choose per bucket)."
            )
        if setting is not None and _checkpointing.checkpointing_setting(setting) != (
                "full" if alias else "none"):
            raise ValueError(
                f"`{cls}(gradient_checkpointing={alias}, activation_checkpointing={setting!r})` disagree. Pass "
                "`activation_checkpointing` only."
            )
        return "full" if alias else "none" if setting is None else setting
    if setting is None:
        return "full" if model_flag else "none"
    return setting


def _check_batch_keys(cls: str, keys: Mapping[str, str] | None, family: VideoFamily) -> dict[str, str] | None:
    if keys is None:
        return None
    allowed = ["latents", "context", *family.extra_keys]
    if not isinstance(keys, Mapping) or not set(keys) <= set(allowed) or not all(
            isinstance(v, str) and v for v in keys.values()):
        raise ValueError(
            f"`{cls}(batch_keys={keys!r})` is not valid. Expected a mapping from {allowed} ({family.name}) to the "
            "batch's key names, e.g. {'latents': 'hidden_states', 'context': 'encoder_hidden_states'}."
        )
    return dict(keys)
