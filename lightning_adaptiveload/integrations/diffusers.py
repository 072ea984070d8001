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
* :func:`set_wan_checkpointing` gives every block activation checkpointing inside its own forward
  (``none``/``selective``/``full``, the protocol of :class:`~lightning_adaptiveload.models.wan.WanAttentionBlock`),
  so a compiled block compiles the recompute with it and switching modes is one attribute per block.
* :class:`DiffusersWanModule`, a LightningModule that trains the model with Wan's rectified-flow
  objective (:class:`~lightning_adaptiveload.models.rectified_flow.RectifiedFlowModule`) and provides the
  :class:`~lightning_adaptiveload.models.protocol.AdaptiveLoadModule` members the callbacks and the
  DataModule use.

A block's fused AdaLN and its checkpointing share one per-instance ``forward`` (``_block_forward``): it
runs the block's body (``_wan_body``: diffusers' forward, or the fused one once patched) under the
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
import functools
import hashlib
import inspect
import types
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.modeling_utils import ModelMixin
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock
from diffusers.utils import apply_lora_scale
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_adaptiveload._checks import check_positive_int
from lightning_adaptiveload.geometry import token_grid
from lightning_adaptiveload.models.compiling import (
    check_compile_options,
    compile_blocks,
    mark_dynamic,
    whole_block_graphs,
)
from lightning_adaptiveload.models.optim import check_optimizer_impl
from lightning_adaptiveload.models.rectified_flow import RectifiedFlowModule, check_training_arguments
from lightning_adaptiveload.models.wan import WanConfig, checkpointing_mode, run_checkpointed
from lightning_adaptiveload.ops import adaln

__all__ = ["DiffusersWanModule", "patch_wan_transformer", "set_wan_checkpointing", "unpatch_wan_transformer"]

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
    return run_checkpointed(self._wan_body, self.checkpointing, hidden_states, encoder_hidden_states, temb, rotary_emb)


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
    return getattr(module.__dict__.get("forward"), "__func__", None) is _block_forward


def _is_patched(module: nn.Module) -> bool:
    if _wan_class(module) is WanTransformerBlock:
        return getattr(module.__dict__.get("_wan_body"), "__func__", None) is _fused_block_forward
    return getattr(module.__dict__.get("forward"), "__func__", None) is _fused_model_forward


def _install_block_forward(block: nn.Module) -> None:
    """Give ``block`` the per-instance :func:`_block_forward` (diffusers' body, no checkpointing) once."""
    if _has_block_forward(block):
        return
    block._wan_body = types.MethodType(WanTransformerBlock.forward, block)
    block.checkpointing = "none"
    block.forward = types.MethodType(_block_forward, block)


def _uninstall_block_forward(block: nn.Module) -> None:
    for name in ("forward", "_wan_body", "checkpointing"):
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
            module._wan_body = types.MethodType(_fused_block_forward, module)
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
                module._wan_body = types.MethodType(WanTransformerBlock.forward, module)
        else:
            del module.__dict__["forward"]
        sites += _SITES[cls]
    return sites


def set_wan_checkpointing(model: nn.Module, mode: str) -> int:
    """Make every diffusers ``WanTransformerBlock`` in ``model`` recompute as ``mode`` says, in place.

    ``"none"``, ``"selective"`` (the SDPA outputs are kept, the rest of the block is recomputed:
    :func:`~lightning_adaptiveload.models.wan.keep_attention_outputs`) or ``"full"``. The checkpoint
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
    mode = checkpointing_mode(mode)
    count = 0
    for module in model.modules():
        if isinstance(module, ModelMixin) and getattr(module, "gradient_checkpointing", False):
            module.disable_gradient_checkpointing()
        if _wan_class(module) is not WanTransformerBlock:
            continue
        if "forward" in module.__dict__ and not _has_block_forward(module):
            raise ValueError(
                f"set_wan_checkpointing(mode={mode!r}): a WanTransformerBlock's forward is already replaced (a "
                "diffusers hook: caching, group offloading, context parallelism). Set the mode before enabling those."
            )
        _install_block_forward(module)
        module.checkpointing = mode
        count += 1
    return count


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


class DiffusersWanModule(RectifiedFlowModule):
    """Trains diffusers' ``WanTransformer3DModel`` with Wan's rectified-flow objective.

    For clean latents ``x0`` and Gaussian ``noise``: ``u ~ U(0, 1)``, ``t = shift·u / (1 + (shift-1)·u)``,
    ``x_t = (1 - t)·x0 + t·noise``; the loss is the fp32 MSE between the prediction for
    ``(x_t, t · num_train_timesteps, context)`` and the velocity ``noise - x0``. Batches are
    ``{"latents": [B, C, F, H, W], "context": [B, L, text_dim]}`` as the project's collate builds
    them (other key names: ``batch_keys``); every batch may have its own (F, H, W), all contexts have
    ``text_len`` tokens.

    The shared machinery (draw-seeded timesteps and noise, so a resumed run has the uninterrupted run's
    losses; the training step and its logs; AdamW and clipping; the FLOP count; the checks of the data
    made before profiling) is :class:`~lightning_adaptiveload.models.rectified_flow.RectifiedFlowModule`'s.
    Provides the :class:`~lightning_adaptiveload.models.protocol.AdaptiveLoadModule` members
    (``compute_loss``, ``synthetic_batch``, ``batch_shape``, ``patch_size``, ``flops_per_sample``,
    ``checkpointing``/``checkpointing_modes``/``set_checkpointing``, ``calibration_key``).

    Args:
        transformer: a ``WanTransformer3DModel`` (e.g. from ``from_pretrained``), or the keyword
            arguments of its constructor; then the model is built in :meth:`configure_model` (inside the
            strategy's init context) with fresh weights.
        text_len: text tokens L per sample: the context length of the training data, which
            :meth:`synthetic_batch` (profiling) and :meth:`flops_per_sample` use (Wan: 512). Checked against
            dataset samples before profiling and against every training batch.
        lr, weight_decay, betas, eps: AdamW settings.
        timestep_shift: Wan's schedule shift (5.0 for 480p/720p video; 1.0: uniform t).
        num_train_timesteps: scale of the timestep the model sees (Wan: 1000).
        gradient_checkpointing: deprecated alias: ``True`` is ``activation_checkpointing="full"``.
        optimizer_impl: AdamW's implementation, ``"auto"`` (fused on CUDA with replicated parameters),
            ``"fused"`` or ``"foreach"`` (:mod:`lightning_adaptiveload.models.optim`).
        compile: compile every ``WanTransformerBlock`` with ``torch.compile`` in :meth:`configure_model`
            (regional compilation, like diffusers' ``compile_repeated_blocks``, plus what a bucketed
            corpus needs: batch and sequence sizes symbolic from the first graph, the recompile limit
            raised with hitting it an error, one graph per block under DDP; see
            :func:`lightning_adaptiveload.models.compiling.compile_blocks`), one graph per checkpointing mode.
        compile_options: inductor options for the compiled blocks, checked against
            ``torch._inductor.config``; needs ``compile=True``.
        activation_checkpointing: what backward recomputes in every block (:func:`set_wan_checkpointing`):
            ``"none"`` (or ``False``), ``"selective"`` (keep the attention outputs), ``"full"`` (or ``True``),
            or ``"auto"``: chosen per bucket by
            :class:`~lightning_adaptiveload.callbacks.shape_benchmark.ShapeBenchmarkCallback` from measured
            memory (without it, ``"auto"`` trains with ``"full"`` and warns). A ``transformer`` with diffusers'
            ``enable_gradient_checkpointing()`` on counts as ``"full"`` unless this is set.
        seed: seed of the timestep and noise draws; ``None``: the seed of ``lightning.seed_everything``, or 0.
        warmup_steps: linear learning-rate warmup over this many optimizer steps (0: none).
        batch_keys: the batch's key names where they differ from ours, e.g.
            ``{"latents": "hidden_states", "context": "encoder_hidden_states"}``.

    Example::

        module = DiffusersWanModule(WanTransformer3DModel.from_pretrained(repo, subfolder="transformer"))
        trainer = Trainer(precision="bf16-mixed", callbacks=[FusedAdaLNCallback()])
        trainer.fit(module, datamodule=dm)
    """

    def __init__(
        self,
        transformer: WanTransformer3DModel | Mapping[str, Any],
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
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        check_optimizer_impl(optimizer_impl, cls)
        compile_options = check_compile_options(compile_options, compile, cls)
        if isinstance(transformer, WanTransformer3DModel):
            config = {k: v for k, v in transformer.config.items() if not k.startswith("_")}
        elif isinstance(transformer, Mapping):
            config = dict(transformer)
        else:
            raise TypeError(
                f"`{cls}(transformer={type(transformer).__name__})` is not valid. Expected a "
                "WanTransformer3DModel or the keyword arguments of its constructor."
            )
        check_positive_int(cls, "text_len", text_len)
        activation_checkpointing = _resolve_checkpointing(
            cls, activation_checkpointing, gradient_checkpointing,
            isinstance(transformer, WanTransformer3DModel) and transformer.gradient_checkpointing)
        check_training_arguments(
            cls, activation_checkpointing=activation_checkpointing, lr=lr, weight_decay=weight_decay, betas=betas,
            eps=eps, warmup_steps=warmup_steps, timestep_shift=timestep_shift,
            num_train_timesteps=num_train_timesteps, seed=seed,
        )
        batch_keys = _check_batch_keys(cls, batch_keys)
        model = transformer if isinstance(transformer, WanTransformer3DModel) else None
        # hparams keep the config, not the module, so `load_from_checkpoint` rebuilds the model; the alias
        # is resolved into activation_checkpointing.
        transformer, gradient_checkpointing = config, None
        betas = tuple(float(b) for b in betas)
        self.save_hyperparameters()
        self.transformer_config = config
        self.patch_size: tuple[int, int, int] = tuple(int(p) for p in self._cfg("patch_size"))  # type: ignore[assignment]
        self.batch_keys.update(batch_keys or {})
        self.transformer: WanTransformer3DModel | None = None
        self._blocks_compiled = False
        if model is not None:
            self._prepare_blocks(model)
            self.transformer = model

    def _cfg(self, key: str) -> Any:
        # Constructor defaults for keys the mapping leaves out.
        if key in self.transformer_config:
            return self.transformer_config[key]
        return inspect.signature(WanTransformer3DModel.__init__).parameters[key].default

    @property
    def wan_config(self) -> WanConfig:
        """The transformer's architecture as a :class:`WanConfig` (with ``text_len``), built on first use."""
        if getattr(self, "_wan_config", None) is None:
            heads, head_dim = self._cfg("num_attention_heads"), self._cfg("attention_head_dim")
            self._wan_config = WanConfig(
                dim=heads * head_dim, ffn_dim=self._cfg("ffn_dim"), num_heads=heads,
                num_layers=self._cfg("num_layers"), in_dim=self._cfg("in_channels"),
                out_dim=self._cfg("out_channels") or self._cfg("in_channels"), text_dim=self._cfg("text_dim"),
                text_len=int(self.hparams.text_len), freq_dim=self._cfg("freq_dim"),
                patch_size=tuple(self._cfg("patch_size")),
            )
        return self._wan_config

    @property
    def config(self) -> WanConfig:
        """:attr:`wan_config` under the name ``adaptiveload-train`` reads the data geometry from (patch,
        VAE stride, text length and width) and the calibration key fingerprints."""
        return self.wan_config

    def _built_model(self) -> WanTransformer3DModel | None:
        return self.transformer

    def _set_block_checkpointing(self, mode: str) -> None:
        set_wan_checkpointing(self._require_model(), mode)

    def _fused_adaln_sites(self) -> int:
        model = self.transformer
        return 0 if model is None else sum(_SITES[_wan_class(m)] for m in model.modules()
                                           if _wan_class(m) is not None and _is_patched(m))

    def _keys_fix(self) -> str:
        return (f"Name the batch's keys: `{type(self).__name__}(batch_keys={{'latents': ..., 'context': ...}})` "
                f"(now {self.batch_keys}).")

    def _text_len_fix(self, length: int) -> str:
        return (f"Set `{type(self).__name__}(text_len={length})` if every context has "
                "that length, or pad the contexts to text_len in the dataset.")

    def _prepare_blocks(self, model: WanTransformer3DModel) -> None:
        set_wan_checkpointing(model, self._initial_checkpointing())

    @override
    def configure_model(self) -> None:
        """Build the transformer from its config once (Lightning calls this in the strategy's init context)."""
        if self.transformer is None:
            model = WanTransformer3DModel(**self.transformer_config)
            self._prepare_blocks(model)
            self.transformer = model
        if self.hparams.get("compile", False) and not self._blocks_compiled:
            # Lazy: the forwards that FusedAdaLNCallback patches in before the first step are traced.
            options = self.hparams.get("compile_options")
            blocks = [m for m in self.transformer.modules() if isinstance(m, WanTransformerBlock)]
            compile_blocks(blocks, _mark_diffusers_block_inputs, **({"options": dict(options)} if options else {}))
            self._blocks_compiled = True

    @override
    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Velocity prediction for latents ``x``, timesteps ``t`` in [0, num_train_timesteps] and ``context``."""
        model = self._require_model()
        dtype = model.patch_embedding.weight.dtype
        with whole_block_graphs() if self._blocks_compiled else contextlib.nullcontext():
            return model(x.to(dtype), t, context.to(dtype), return_dict=False)[0]


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
        if setting is not None and (checkpointing_mode(setting) if setting != "auto" else "auto") != (
                "full" if alias else "none"):
            raise ValueError(
                f"`{cls}(gradient_checkpointing={alias}, activation_checkpointing={setting!r})` disagree. Pass "
                "`activation_checkpointing` only."
            )
        return "full" if alias else "none" if setting is None else setting
    if setting is None:
        return "full" if model_flag else "none"
    return setting


def _check_batch_keys(cls: str, keys: Mapping[str, str] | None) -> dict[str, str] | None:
    if keys is None:
        return None
    if not isinstance(keys, Mapping) or not set(keys) <= {"latents", "context"} or not all(
            isinstance(v, str) and v for v in keys.values()):
        raise ValueError(
            f"`{cls}(batch_keys={keys!r})` is not valid. Expected a mapping from 'latents' and/or 'context' to the "
            "batch's key names, e.g. {'latents': 'hidden_states', 'context': 'encoder_hidden_states'}."
        )
    return dict(keys)
