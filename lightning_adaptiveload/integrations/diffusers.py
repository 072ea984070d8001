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
* :class:`DiffusersWanModule`, a LightningModule that trains the model with Wan's rectified-flow
  objective and provides the :class:`~lightning_adaptiveload.models.protocol.AdaptiveLoadModule`
  members the callbacks and the DataModule use.

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
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from diffusers.models.modeling_outputs import Transformer2DModelOutput
from diffusers.models.normalization import FP32LayerNorm
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel, WanTransformerBlock
from diffusers.utils import apply_lora_scale
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from typing_extensions import override

from lightning_adaptiveload.geometry import tokens_of
from lightning_adaptiveload.models.compiling import (
    check_compile_options,
    compile_blocks,
    mark_dynamic,
    whole_block_graphs,
)
from lightning_adaptiveload.models.flow_matching import rectified_flow_loss
from lightning_adaptiveload.models.optim import adamw, check_optimizer_impl, clip_gradients
from lightning_adaptiveload.ops import adaln

__all__ = ["DiffusersWanModule", "patch_wan_transformer", "unpatch_wan_transformer"]

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
    f, h, w = frames // pt, height // ph, width // pw
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


_FUSED_FORWARDS = {WanTransformerBlock: _fused_block_forward, WanTransformer3DModel: _fused_model_forward}


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
    return cls if cls in _FUSED_FORWARDS else None


def _is_patched(module: nn.Module) -> bool:
    fwd = module.__dict__.get("forward")
    return getattr(fwd, "__func__", None) in _FUSED_FORWARDS.values()


def _skip_reason(module: nn.Module, cls: type, strict: bool) -> str | None:
    """Why ``module`` (a block or the model, of diffusers class ``cls``) cannot be patched; ``None`` if it can."""
    if "forward" in module.__dict__:
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
    transformer itself); subclasses of them are left alone, since they may change ``forward``. Parameters, buffers and ``state_dict`` are
    untouched; already patched modules are skipped. Modules that cannot be patched are named in
    one warning.

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
        module.forward = types.MethodType(_FUSED_FORWARDS[cls], module)
        sites += _SITES[cls]
    for reason, modules in skipped.items():
        rank_zero_warn(f"patch_wan_transformer: left {len(modules)} module(s) unfused: {reason}.")
    return sites


def unpatch_wan_transformer(model: nn.Module) -> int:
    """Undo :func:`patch_wan_transformer` on every module of ``model``; returns the sites restored."""
    sites = 0
    for module in model.modules():
        cls = _wan_class(module)
        if cls is not None and _is_patched(module):
            del module.__dict__["forward"]
            sites += _SITES[cls]
    return sites


def _forward_macs(config: Mapping[str, Any], seq_len: int, text_len: int) -> int:
    """Multiply-accumulates of one text-to-video forward of one sample (matmuls, convs, attention)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    p = math.prod(config["patch_size"])
    s, n = int(seq_len), int(text_len)
    c_out = config["out_channels"] or config["in_channels"]
    embed = s * config["in_channels"] * p * d  # patch embedding
    embed += config["freq_dim"] * d + d * d + d * 6 * d  # time embedding and its 6 modulations
    embed += n * (config["text_dim"] * d + d * d)  # text projection
    self_attn = 4 * s * d * d + 2 * s * s * d  # q, k, v, o; q·kᵀ and attn·v
    cross_attn = 2 * s * d * d + 2 * n * d * d + 2 * s * n * d  # q, o; k, v of the text; q·kᵀ, attn·v
    ffn = 2 * s * d * config["ffn_dim"]
    head = s * d * c_out * p
    return embed + config["num_layers"] * (self_attn + cross_attn + ffn) + head


def _mark_diffusers_block_inputs(block: nn.Module, args: tuple[Any, ...]) -> None:
    """Pre-hook of a compiled ``WanTransformerBlock`` called as ``block(hidden_states [B, S, D],
    encoder_hidden_states [B, L, D], temb [B, 6, D] or [B, S, 6, D], rotary_emb ([1, S, 1, d], ...))``:
    B and S symbolic."""
    if len(args) < 4 or not isinstance(args[0], torch.Tensor) or args[0].ndim != 3:
        return
    hidden, context, temb, rotary = args[:4]
    mark_dynamic(hidden, 0, 1)
    if isinstance(context, torch.Tensor):
        mark_dynamic(context, 0)
    if isinstance(temb, torch.Tensor):
        mark_dynamic(temb, *((0, 1) if temb.ndim == 4 else (0,)))
    for freqs in rotary if isinstance(rotary, (tuple, list)) else (rotary,):
        if isinstance(freqs, torch.Tensor) and freqs.ndim >= 2:
            mark_dynamic(freqs, 1)


class DiffusersWanModule(pl.LightningModule):
    """Trains diffusers' ``WanTransformer3DModel`` with Wan's rectified-flow objective.

    For clean latents ``x0`` and Gaussian ``noise``: ``u ~ U(0, 1)``, ``t = shift·u / (1 + (shift-1)·u)``,
    ``x_t = (1 - t)·x0 + t·noise``; the loss is the fp32 MSE between the prediction for
    ``(x_t, t · num_train_timesteps, context)`` and the velocity ``noise - x0``. Batches are
    ``{"latents": [B, C, F, H, W], "context": [B, L, text_dim]}`` as the project's collate builds
    them; every batch may have its own (F, H, W).

    Provides the :class:`~lightning_adaptiveload.models.protocol.AdaptiveLoadModule` members
    (``compute_loss``, ``synthetic_batch``, ``batch_shape``, ``patch_size``, ``flops_per_sample``).

    Args:
        transformer: a ``WanTransformer3DModel`` (e.g. from ``from_pretrained``), or the keyword
            arguments of its constructor; then the model is built in :meth:`configure_model` (inside the
            strategy's init context) with fresh weights.
        text_len: text tokens L per sample in :meth:`synthetic_batch` and :meth:`flops_per_sample`
            (Wan: 512).
        lr, weight_decay, betas, eps: AdamW settings.
        timestep_shift: Wan's schedule shift (5.0 for 480p/720p video; 1.0: uniform t).
        num_train_timesteps: scale of the timestep the model sees (Wan: 1000).
        gradient_checkpointing: diffusers' per-block activation checkpointing.
        optimizer_impl: AdamW's implementation, ``"auto"`` (fused on CUDA with replicated parameters),
            ``"fused"`` or ``"foreach"`` (:mod:`lightning_adaptiveload.models.optim`).
        compile: compile every ``WanTransformerBlock`` with ``torch.compile`` in :meth:`configure_model`
            (regional compilation, like diffusers' ``compile_repeated_blocks``, plus what a bucketed
            corpus needs: batch and sequence sizes symbolic from the first graph, the recompile limit
            raised with hitting it an error, one graph per block under DDP; see
            :func:`lightning_adaptiveload.models.compiling.compile_blocks`).
        compile_options: inductor options for the compiled blocks, checked against
            ``torch._inductor.config``; needs ``compile=True``.

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
        gradient_checkpointing: bool = False,
        optimizer_impl: str = "auto",
        compile: bool = False,
        compile_options: Mapping[str, Any] | None = None,
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
        for name, value, ok, expected in (
            ("text_len", text_len, int(text_len) == text_len and text_len >= 1, "a positive integer"),
            ("lr", lr, lr > 0, "a positive float"),
            ("weight_decay", weight_decay, weight_decay >= 0, "a float >= 0"),
            ("betas", betas, len(betas) == 2 and all(0 <= b < 1 for b in betas), "two floats in [0, 1)"),
            ("eps", eps, eps > 0, "a positive float"),
            ("timestep_shift", timestep_shift, timestep_shift > 0, "a positive float"),
            ("num_train_timesteps", num_train_timesteps, num_train_timesteps > 0, "a positive number"),
        ):
            if not ok:
                raise ValueError(f"`{cls}({name}={value!r})` is not valid. Expected {expected}.")
        model = transformer if isinstance(transformer, WanTransformer3DModel) else None
        # hparams keep the config, not the module, so `load_from_checkpoint` rebuilds the model.
        transformer = config
        betas = tuple(float(b) for b in betas)
        self.save_hyperparameters()
        self.transformer_config = config
        self.patch_size: tuple[int, int, int] = tuple(int(p) for p in self._cfg("patch_size"))  # type: ignore[assignment]
        self.transformer: WanTransformer3DModel | None = model
        self._blocks_compiled = False
        if model is not None and gradient_checkpointing:
            model.enable_gradient_checkpointing()

    def _cfg(self, key: str) -> Any:
        # Constructor defaults for keys the mapping leaves out.
        if key in self.transformer_config:
            return self.transformer_config[key]
        return inspect.signature(WanTransformer3DModel.__init__).parameters[key].default

    @override
    def configure_model(self) -> None:
        """Build the transformer from its config once (Lightning calls this in the strategy's init context)."""
        if self.transformer is None:
            self.transformer = WanTransformer3DModel(**self.transformer_config)
            if self.hparams.gradient_checkpointing:
                self.transformer.enable_gradient_checkpointing()
        if self.hparams.get("compile", False) and not self._blocks_compiled:
            # Lazy: the forwards that FusedAdaLNCallback patches in before the first step are traced.
            options = self.hparams.get("compile_options")
            blocks = [m for m in self.transformer.modules() if isinstance(m, WanTransformerBlock)]
            compile_blocks(blocks, _mark_diffusers_block_inputs, **({"options": dict(options)} if options else {}))
            self._blocks_compiled = True

    def _require_model(self) -> WanTransformer3DModel:
        if self.transformer is None:
            raise RuntimeError(
                f"`{type(self).__name__}.transformer` is not built yet. Call `configure_model()` first "
                "(the Trainer does this in `fit`)."
            )
        return self.transformer

    @override
    def forward(self, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Velocity prediction for latents ``x``, timesteps ``t`` in [0, num_train_timesteps] and ``context``."""
        model = self._require_model()
        dtype = model.patch_embedding.weight.dtype
        with whole_block_graphs() if self._blocks_compiled else contextlib.nullcontext():
            return model(x.to(dtype), t, context.to(dtype), return_dict=False)[0]

    def compute_loss(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Rectified-flow loss (fp32 scalar) of a batch with ``latents [B,C,F,H,W]`` and ``context [B,L,D]``."""
        if batch.get("sp_degree", 1) != 1:
            raise NotImplementedError(
                f"A batch has sp_degree={batch['sp_degree']!r}: `DiffusersWanModule` has no sequence-parallel "
                "path. Plan data-parallel batches only (sp_degree 1), or train FlowMatchingModule."
            )
        return rectified_flow_loss(self, batch, self.hparams.timestep_shift, self.hparams.num_train_timesteps)

    def batch_shape(self, batch: Mapping[str, torch.Tensor]) -> tuple[int, int]:
        """``(B, S)``: samples and tokens per sample after patchify."""
        return tokens_of(batch["latents"], self.patch_size)

    def synthetic_batch(
        self,
        batch_size: int,
        token_grid: Sequence[int],
        device: torch.device | str | None = None,
        seed: int = 0,
    ) -> dict[str, torch.Tensor]:
        """Random batch for token grid ``(f, h, w)``, shaped like the collated data, from its own generator.

        Returns:
            ``{"latents": [B, in_channels, f·pt, h·ph, w·pw], "context": [B, text_len, text_dim],
            "index": LongTensor[B] of -1}``.
        """
        if len(token_grid) != 3 or any(int(g) != g or g < 1 for g in token_grid):
            raise ValueError(
                f"`token_grid={tuple(token_grid)!r}` is not valid. Expected three positive integers (f, h, w)."
            )
        if int(batch_size) != batch_size or batch_size < 1:
            raise ValueError(f"`batch_size={batch_size!r}` is not valid. Expected a positive integer.")
        device = self.device if device is None else torch.device(device)
        gen = torch.Generator(device=device).manual_seed(seed)
        shape = [int(g) * p for g, p in zip(token_grid, self.patch_size, strict=True)]
        text = (batch_size, self.hparams.text_len, self._cfg("text_dim"))
        return {
            "latents": torch.randn(batch_size, self._cfg("in_channels"), *shape, device=device, generator=gen),
            "context": torch.randn(text, device=device, generator=gen),
            "index": torch.full((batch_size,), -1, dtype=torch.long, device=device),
        }

    def flops_per_sample(self, seq_len: int) -> float:
        """Model FLOPs of forward + backward of one sample of ``seq_len`` tokens (3 × the forward's).

        Counts every matmul, the patch embedding and both attention products, with ``text_len`` text
        tokens; elementwise work, recomputation by checkpointing and image conditioning are not counted.
        """
        names = ("num_attention_heads", "attention_head_dim", "patch_size", "in_channels", "out_channels",
                 "freq_dim", "text_dim", "ffn_dim", "num_layers")
        config = {k: self._cfg(k) for k in names}
        return 3.0 * 2.0 * _forward_macs(config, seq_len, self.hparams.text_len)

    @override
    def training_step(self, batch: Mapping[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.compute_loss(batch)
        self.log("train/loss", loss, prog_bar=True, batch_size=int(batch["latents"].shape[0]))
        return loss

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        hp = self.hparams
        return adamw(self, (p for p in self.parameters() if p.requires_grad), hp.get("optimizer_impl", "auto"),
                     lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps, weight_decay=hp.weight_decay)

    @override
    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Lightning's clipping, also for the fused AdamW under bf16 (:func:`~lightning_adaptiveload.models.optim.clip_gradients`)."""
        clip_gradients(self, optimizer, gradient_clip_val, gradient_clip_algorithm)
