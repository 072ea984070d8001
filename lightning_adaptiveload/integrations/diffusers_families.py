"""Per-family adapters of diffusers' video transformers for :class:`~lightning_adaptiveload.integrations.diffusers.DiffusersVideoModule`.

A family says, from the transformer's config alone, what the training module needs and cannot read
from a generic model: how to call the model on a batch (latents ``[B, C, F, H, W]``, the text context,
the family's extra inputs), its patch ``(t, h, w)``, which text tokens share self-attention with the
video tokens (joint attention: HunyuanVideo, CogVideoX) and which are only cross-attended (Wan,
LTX-Video), the blocks that checkpoint and compile, and the VAE stride its latents come from.

Everything a family builds that is not data (RoPE coordinates, guidance and ``ofs`` embeddings, packed
token layouts, all-ones masks when the data has none) is built here from the batch's shapes, so a user
writes no glue. The forward signatures followed are diffusers 0.42.1's
(``diffusers/models/transformers/transformer_{wan,hunyuan_video,ltx}.py``, ``cogvideox_transformer_3d.py``).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

import torch
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0
from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock, CogVideoXTransformer3DModel
from diffusers.models.transformers.transformer_hunyuan_video import (
    HunyuanVideoAttnProcessor2_0,
    HunyuanVideoSingleTransformerBlock,
    HunyuanVideoTokenReplaceSingleTransformerBlock,
    HunyuanVideoTokenReplaceTransformerBlock,
    HunyuanVideoTransformer3DModel,
    HunyuanVideoTransformerBlock,
)
from diffusers.models.transformers.transformer_ltx import (
    LTXVideoAttnProcessor,
    LTXVideoTransformer3DModel,
    LTXVideoTransformerBlock,
)
from diffusers.models.transformers.transformer_wan import (
    WanAttnProcessor,
    WanTransformer3DModel,
    WanTransformerBlock,
)
from torch import nn

from lightning_adaptiveload.integrations.diffusers_attention import (
    CogVideoXBackendAttnProcessor,
    HunyuanVideoBackendAttnProcessor,
    LTXVideoBackendAttnProcessor,
    WanBackendAttnProcessor,
)

__all__ = ["FAMILIES", "VideoFamily", "family_of"]

#: Batch key of the text mask ``[B, L]`` (1: a real token, 0: padding) and of a pooled text embedding
#: ``[B, pooled_dim]`` (HunyuanVideo's CLIP embedding).
CONTEXT_MASK = "context_mask"
POOLED = "pooled"


class VideoFamily:
    """What :class:`~lightning_adaptiveload.integrations.diffusers.DiffusersVideoModule` needs of one family.

    Subclasses set the class attributes and implement :meth:`patch_size` and :meth:`predict`.
    """

    #: ``family=`` name.
    name: str = ""
    #: The diffusers transformer class.
    model_class: type[nn.Module]
    #: Blocks that get per-bucket activation checkpointing and regional compilation.
    block_classes: tuple[type[nn.Module], ...] = ()
    #: Text tokens join the video tokens in self-attention (MMDiT): they count in attention's cost.
    joint_text: bool = False
    #: Stride (t, h, w) of the family's VAE, from pixels to latents.
    vae_stride: tuple[int, int, int] = (4, 8, 8)
    #: Config keys of the text embedding width and the latent channels.
    text_dim_key: str = "text_dim"
    in_channels_key: str = "in_channels"
    #: Extra batch keys the family reads (besides latents and context) and whether each is required.
    extra_keys: Mapping[str, bool] = {}
    #: Config keys of the repeated blocks' counts (the FLOP count is linear in each).
    layer_keys: tuple[str, ...] = ("num_layers",)
    #: The attention backends the family's processors run (:mod:`~lightning_adaptiveload.integrations.diffusers_attention`).
    attention_backends: tuple[str, ...] = ("sdpa",)

    def cfg(self, config: Mapping[str, Any], key: str) -> Any:
        """``config[key]``, or the constructor's default for a key the mapping leaves out."""
        if key in config:
            return config[key]
        return inspect.signature(self.model_class.__init__).parameters[key].default

    def patch_size(self, config: Mapping[str, Any]) -> tuple[int, int, int]:
        """The patch ``(t, h, w)`` a sample's latents ``[C, F, H, W]`` are cut into, one token each."""
        raise NotImplementedError

    def latent_channels(self, config: Mapping[str, Any]) -> int:
        """Channels C of the latents the data holds."""
        return int(self.cfg(config, self.in_channels_key))

    def text_dim(self, config: Mapping[str, Any]) -> int:
        return int(self.cfg(config, self.text_dim_key))

    def geometry(self, config: Mapping[str, Any]) -> dict[str, int]:
        """``dim``, ``num_heads``, ``num_layers`` (blocks of any kind) of the transformer."""
        heads, head_dim = int(self.cfg(config, "num_attention_heads")), int(self.cfg(config, "attention_head_dim"))
        return {"dim": heads * head_dim, "num_heads": heads, "num_layers": int(self.cfg(config, "num_layers"))}

    def extra_inputs(self, config: Mapping[str, Any]) -> dict[str, list[int]]:
        """Per-sample shapes of the extra tensors the data must hold (random ones in synthetic data)."""
        return {}

    def check_config(self, config: Mapping[str, Any], owner: str) -> None:
        """Refuse configs the adapter cannot train (one line naming the key and the fix)."""

    def prepare_model(self, model: nn.Module) -> None:
        """Once, after the model is built (or loaded) and its blocks set up: the family's own changes to it."""

    def set_attention_backend(self, model: nn.Module, backend: str) -> None:
        """Make ``model``'s attention run ``backend`` (one of :attr:`attention_backends`); by default on the
        processor :meth:`share_processor` installed."""
        processor = model.__dict__.get(_SHARED_PROCESSOR)
        if processor is None and backend == "sdpa":
            return  # diffusers' own processors run SDPA
        if processor is None:
            raise RuntimeError(f"`{type(self).__name__}.set_attention_backend`: the model was not prepared "
                               "(prepare_model installs its attention processor).")
        processor.backend = backend

    @staticmethod
    def share_processor(model: nn.Module, processor: Any, replaces: type) -> None:
        """Put one ``processor`` on every attention module of ``model`` whose processor is exactly ``replaces``
        (diffusers' own), and keep it on the model (outside its module tree) for :meth:`set_attention_backend`
        and :meth:`drop_mask_if_real`. Where a family builds a mask from the text mask (HunyuanVideo, LTX-Video)
        it does so even when every text token is real, and a masked SDPA cannot use the flash or cuDNN kernels,
        nor FA4 run at all: the shared processor drops it for the batches :meth:`drop_mask_if_real` found
        unpadded (the same attention)."""
        for module in model.modules():
            if type(getattr(module, "processor", None)) is replaces:
                module.set_processor(processor)
        model.__dict__[_SHARED_PROCESSOR] = processor

    def drop_mask_if_real(self, model: nn.Module, extras: Mapping[str, torch.Tensor], mask: torch.Tensor) -> None:
        """Before a forward: let the shared processor drop the model's text mask where every token is real."""
        processor = model.__dict__.get(_SHARED_PROCESSOR)
        if processor is not None:  # one host sync a step when the batch carries a mask
            processor.drop_mask = self.all_text_real(extras, mask)

    @staticmethod
    def all_text_real(extras: Mapping[str, torch.Tensor], mask: torch.Tensor) -> bool:
        """Whether every text token of the batch is real (no mask given, or an all-ones one)."""
        return CONTEXT_MASK not in extras or bool(mask.all())

    def check_text_len(self, config: Mapping[str, Any], text_len: int, owner: str) -> None:
        """Refuse a context length the model cannot take."""

    def predict(self, model: nn.Module, x: torch.Tensor, t: torch.Tensor, context: torch.Tensor,
                extras: Mapping[str, torch.Tensor], options: Mapping[str, Any]) -> torch.Tensor:
        """The model's velocity prediction ``[B, C, F, H, W]`` for latents ``x`` (in the model's dtype),
        timesteps ``t`` ``[B]`` in [0, num_train_timesteps], ``context`` ``[B, L, text_dim]`` and the
        batch's extra inputs (absent optional ones are built here)."""
        raise NotImplementedError

    @staticmethod
    def mask(extras: Mapping[str, torch.Tensor], context: torch.Tensor) -> torch.Tensor:
        """The batch's text mask, or all ones (every context token real) when it has none."""
        mask = extras.get(CONTEXT_MASK)
        if mask is None:
            return torch.ones(context.shape[:2], dtype=torch.long, device=context.device)
        return mask


class _Wan(VideoFamily):
    name = "wan"
    model_class = WanTransformer3DModel
    block_classes = (WanTransformerBlock,)
    attention_backends = ("sdpa", "fa4")

    def prepare_model(self, model: nn.Module) -> None:
        self.share_processor(model, WanBackendAttnProcessor(), WanAttnProcessor)

    def patch_size(self, config):
        return tuple(int(p) for p in self.cfg(config, "patch_size"))

    def check_config(self, config, owner):
        if self.cfg(config, "image_dim") is not None:
            raise ValueError(
                f"`{owner}(transformer={{'image_dim': {self.cfg(config, 'image_dim')}, ...}})`: image-conditioned Wan "
                "(I2V, CLIP image tokens) needs image embeddings the adapter does not read; train a T2V/TI2V config "
                "(image_dim: null)."
            )

    def predict(self, model, x, t, context, extras, options):
        return model(x, t, context, return_dict=False)[0]


class _HunyuanVideo(VideoFamily):
    name = "hunyuan_video"
    model_class = HunyuanVideoTransformer3DModel
    block_classes = (HunyuanVideoTransformerBlock, HunyuanVideoSingleTransformerBlock,
                     HunyuanVideoTokenReplaceTransformerBlock, HunyuanVideoTokenReplaceSingleTransformerBlock)
    joint_text = True
    text_dim_key = "text_embed_dim"
    extra_keys = {CONTEXT_MASK: False, POOLED: True}
    layer_keys = ("num_layers", "num_single_layers")
    attention_backends = ("sdpa", "fa4")

    def patch_size(self, config):
        p = int(self.cfg(config, "patch_size"))
        return int(self.cfg(config, "patch_size_t")), p, p

    def geometry(self, config):
        out = super().geometry(config)
        out["num_layers"] = int(self.cfg(config, "num_layers")) + int(self.cfg(config, "num_single_layers"))
        return out

    def extra_inputs(self, config):
        return {POOLED: [int(self.cfg(config, "pooled_projection_dim"))]}

    def check_config(self, config, owner):
        if self.cfg(config, "image_condition_type") is not None:
            raise ValueError(
                f"`{owner}(transformer={{'image_condition_type': {self.cfg(config, 'image_condition_type')!r}, ...}})`: "
                "image-to-video HunyuanVideo needs image latents the adapter does not read; train the T2V config "
                "(image_condition_type: null)."
            )

    def predict(self, model, x, t, context, extras, options):
        guidance = None
        if self.cfg(model.config, "guidance_embeds"):
            # The guidance-distilled release embeds the CFG scale like a timestep (x 1000).
            guidance = torch.full((x.shape[0],), float(options["guidance_scale"]) * 1000.0, device=x.device,
                                  dtype=x.dtype)
        mask = self.mask(extras, context)
        self.drop_mask_if_real(model, extras, mask)
        return model(x, t, context, mask, extras[POOLED].to(x.dtype), guidance=guidance, return_dict=False)[0]

    def prepare_model(self, model: nn.Module) -> None:
        # The joint [B, 1, 1, S + L] mask is dropped for unpadded batches (share_processor).
        self.share_processor(model, HunyuanVideoBackendAttnProcessor(), HunyuanVideoAttnProcessor2_0)


#: Where a prepared model keeps its blocks' shared attention processor (outside the module tree).
_SHARED_PROCESSOR = "_adaptiveload_shared_processor"


class _CogVideoX(VideoFamily):
    name = "cogvideox"
    model_class = CogVideoXTransformer3DModel
    block_classes = (CogVideoXBlock,)
    joint_text = True
    text_dim_key = "text_embed_dim"
    attention_backends = ("sdpa", "fa4")

    def prepare_model(self, model: nn.Module) -> None:
        self.share_processor(model, CogVideoXBackendAttnProcessor(), CogVideoXAttnProcessor2_0)

    def patch_size(self, config):
        p, pt = int(self.cfg(config, "patch_size")), self.cfg(config, "patch_size_t")
        return 1 if pt is None else int(pt), p, p

    def check_config(self, config, owner):
        if self.cfg(config, "use_learned_positional_embeddings"):
            raise ValueError(
                f"`{owner}(transformer={{'use_learned_positional_embeddings': true, ...}})`: learned positional "
                "embeddings (CogVideoX-5b-I2V) fix one resolution, which a bucketed corpus does not have; train a "
                "T2V config."
            )
        out = self.cfg(config, "out_channels") or self.cfg(config, "in_channels")
        if out != self.cfg(config, "in_channels"):
            raise ValueError(
                f"`{owner}(transformer={{'in_channels': {self.cfg(config, 'in_channels')}, 'out_channels': {out}, "
                "...}})`: image-to-video CogVideoX concatenates image latents the adapter does not read; train a T2V "
                "config (in_channels == out_channels)."
            )

    def check_text_len(self, config, text_len, owner):
        limit = int(self.cfg(config, "max_text_seq_length"))
        if not self.cfg(config, "use_rotary_positional_embeddings") and text_len != limit:
            # The sincos table holds max_text_seq_length text rows before the video rows.
            raise ValueError(
                f"`{owner}(text_len={text_len})`: CogVideoX with sincos positional embeddings takes exactly "
                f"max_text_seq_length={limit} text tokens. Set text_len={limit} (pad the contexts to it)."
            )

    def _rotary(self, model: nn.Module, grid: tuple[int, int, int], device: torch.device) -> Any:
        # What CogVideoX's pipelines build outside the model (RoPE for 5B and 1.5); the crop region of 1.0
        # is the centred fit of the grid into the config's base grid.
        from diffusers.models.embeddings import get_3d_rotary_pos_embed

        cfg = model.config
        f, h, w = grid
        p, pt = cfg.patch_size, cfg.patch_size_t
        base_w, base_h = cfg.sample_width // p, cfg.sample_height // p
        if pt is not None:
            return get_3d_rotary_pos_embed(cfg.attention_head_dim, None, (h, w), f, grid_type="slice",
                                           max_size=(base_h, base_w), device=device)
        if h / w > base_h / base_w:
            rh, rw = base_h, int(round(base_h / h * w))
        else:
            rw, rh = base_w, int(round(base_w / w * h))
        top, left = int(round((base_h - rh) / 2.0)), int(round((base_w - rw) / 2.0))
        return get_3d_rotary_pos_embed(cfg.attention_head_dim, ((top, left), (top + rh, left + rw)), (h, w), f,
                                       device=device)

    def predict(self, model, x, t, context, extras, options):
        cfg = model.config
        grid = _grid(x, self.patch_size(cfg))
        rotary = self._rotary(model, grid, x.device) if cfg.use_rotary_positional_embeddings else None
        # Same dtype as the latents: RoPE tables are built in fp32 and SDPA wants one dtype.
        rotary = None if rotary is None else tuple(r.to(x.dtype) for r in rotary)
        ofs = None if cfg.ofs_embed_dim is None else x.new_full((1,), 2.0)  # the value CogVideoX 1.5 I2V trains with
        out = model(x.transpose(1, 2), context, t, ofs=ofs, image_rotary_emb=rotary, return_dict=False)[0]
        return out.transpose(1, 2)  # CogVideoX's layout is [B, F, C, H, W]


class _LTXVideo(VideoFamily):
    name = "ltx_video"
    model_class = LTXVideoTransformer3DModel
    block_classes = (LTXVideoTransformerBlock,)
    vae_stride = (8, 32, 32)
    text_dim_key = "caption_channels"
    extra_keys = {CONTEXT_MASK: False}
    attention_backends = ("sdpa", "fa4")

    def patch_size(self, config):
        p = int(self.cfg(config, "patch_size"))
        return int(self.cfg(config, "patch_size_t")), p, p

    def prepare_model(self, model: nn.Module) -> None:
        # The cross-attention's text mask (a bias of zeros where every token is real) is dropped for unpadded
        # batches (share_processor); self-attention has none.
        self.share_processor(model, LTXVideoBackendAttnProcessor(), LTXVideoAttnProcessor)

    def latent_channels(self, config):
        pt, ph, pw = self.patch_size(config)
        return int(self.cfg(config, "in_channels")) // (pt * ph * pw)

    def check_config(self, config, owner):
        pt, ph, pw = self.patch_size(config)
        if int(self.cfg(config, "in_channels")) % (pt * ph * pw):
            raise ValueError(
                f"`{owner}(transformer={{'in_channels': {self.cfg(config, 'in_channels')}, ...}})`: LTX-Video packs "
                f"C x {pt * ph * pw} latent values per token, so in_channels must be a multiple of {pt * ph * pw}."
            )

    def predict(self, model, x, t, context, extras, options):
        b, c, frames, height, width = x.shape
        pt, ph, pw = self.patch_size(model.config)
        f, h, w = frames // pt, height // ph, width // pw
        # Pack [B, C, F, H, W] into tokens [B, f·h·w, C·pt·ph·pw] (feature order C, pt, ph, pw).
        tokens = x.reshape(b, c, f, pt, h, ph, w, pw).permute(0, 2, 4, 6, 1, 3, 5, 7).flatten(4).flatten(1, 3)
        st, sh, sw = options["vae_stride"]
        # RoPE coordinates in seconds and pixels, as LTX-Video's pipelines scale them.
        scale = (st / float(options["frame_rate"]), float(sh), float(sw))
        mask = self.mask(extras, context)
        self.drop_mask_if_real(model, extras, mask)
        out = model(tokens, context, t, mask, num_frames=f, height=h, width=w,
                    rope_interpolation_scale=scale, return_dict=False)[0]
        out = out.reshape(b, f, h, w, -1, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        return out.reshape(b, -1, frames, height, width)


def _grid(x: torch.Tensor, patch: tuple[int, int, int]) -> tuple[int, int, int]:
    return x.shape[2] // patch[0], x.shape[3] // patch[1], x.shape[4] // patch[2]


FAMILIES: dict[str, VideoFamily] = {f.name: f for f in (_Wan(), _HunyuanVideo(), _CogVideoX(), _LTXVideo())}
_BY_CLASS = {f.model_class.__name__: f for f in FAMILIES.values()}


def family_of(model_or_class: nn.Module | type | str) -> VideoFamily | None:
    """The family of a diffusers transformer (instance, class or class name, e.g. a config's
    ``_class_name``); ``None`` if it is none of :data:`FAMILIES`. Exact classes only (FSDP2's swapped
    classes resolve to the original)."""
    if isinstance(model_or_class, str):
        return _BY_CLASS.get(model_or_class)
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    index = getattr(cls, "_orig_cls_mro_index", None)
    if index is not None:
        cls = cls.__mro__[index]
    return _BY_CLASS.get(cls.__name__) if cls in {f.model_class for f in FAMILIES.values()} else None
