"""The project's attention backends inside diffusers' video transformers: processors for Wan, HunyuanVideo,
CogVideoX and LTX-Video.

diffusers' dispatcher (``diffusers.models.attention_dispatch``) offers FlashAttention-4 only as a kernel
downloaded from the Hub (``flash_4_hub``), and its registry is keyed by a closed enum, so a local backend
cannot be registered there. Each processor here is a subclass of the family's own diffusers processor whose
unmasked path runs through :func:`lightning_adaptiveload.ops.attention.attention` in the ``(B, S, H, D)``
layout with the backend it is set to; with ``"sdpa"``, an attention mask or a path it does not cover it is
diffusers' own processor, unchanged:

- :class:`WanBackendAttnProcessor`: Wan's self-attention with RoPE and cross-attention to text (not image
  conditioning's added key/value projections); :func:`set_wan_attention_backend` installs it.
- :class:`HunyuanVideoBackendAttnProcessor`: HunyuanVideo's joint attention of both block kinds (dual-stream:
  the text's own projections; single-stream: text and video in one sequence), RoPE on the video tokens. It
  also drops diffusers' all-true joint mask while ``drop_mask`` is set (every text token real), so the
  unmasked kernels run.
- :class:`CogVideoXBackendAttnProcessor`: CogVideoX's joint attention (text first), RoPE on the video tokens.
- :class:`LTXVideoBackendAttnProcessor`: LTX-Video's self-attention (RoPE over the flat channels) and its
  cross-attention to text, which, like HunyuanVideo's, drops the text mask while ``drop_mask`` is set.

``DiffusersVideoModule`` puts one instance on every attention of a model
(:meth:`~lightning_adaptiveload.integrations.diffusers_families.VideoFamily.share_processor`) and switches its
backend per batch (an attribute).
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.attention_processor import Attention, CogVideoXAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from diffusers.models.transformers.transformer_ltx import LTXVideoAttnProcessor
from diffusers.models.transformers.transformer_ltx import apply_rotary_emb as ltx_rotary
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, _get_qkv_projections

from lightning_adaptiveload.ops.attention import ATTENTION_BACKENDS, attention

__all__ = [
    "CogVideoXBackendAttnProcessor",
    "HunyuanVideoBackendAttnProcessor",
    "LTXVideoBackendAttnProcessor",
    "WanBackendAttnProcessor",
    "set_wan_attention_backend",
]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan RoPE: interleaved pairs (x[2i], x[2i+1]) rotated by the angle whose cos / sin sit at the
    # even / odd positions of freqs_cos / freqs_sin; computed in the frequencies' dtype (fp32), cast back.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


def _check_backend(backend: str, who: str) -> None:
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"`{who}(backend={backend!r})` is not valid. Expected one of {list(ATTENTION_BACKENDS)}.")


class _OnBackend:
    """What the processors below share: the backend their unmasked path runs (``"sdpa"``: the diffusers
    processor's own path) and, for the families that build a text mask, :attr:`drop_mask`."""

    #: Every text token of the batch is real, so the mask diffusers built from the text mask changes nothing
    #: and is left out (a masked SDPA cannot use the flash or cuDNN kernels, nor FA4 run at all). Set per
    #: batch by the family (:meth:`~lightning_adaptiveload.integrations.diffusers_families.VideoFamily.drop_mask_if_real`).
    drop_mask = False

    def __init__(self, backend: str = "sdpa") -> None:
        super().__init__()
        _check_backend(backend, type(self).__name__)
        self.backend = backend


class WanBackendAttnProcessor(_OnBackend, WanAttnProcessor):
    """``WanAttnProcessor`` with the text-to-video path on a project attention backend.

    Args:
        backend: ``"sdpa"`` (diffusers' own path) or ``"fa4"``.
    """

    def __call__(
        self,
        attn: Any,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if self.backend == "sdpa" or attention_mask is not None or attn.add_k_proj is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)
        query, key, value = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = _rotate(query, *rotary_emb), _rotate(key, *rotary_emb)
        out = attention(query, key, value, self.backend).flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def _heads(x: torch.Tensor, attn: Any) -> torch.Tensor:
    return x.unflatten(2, (attn.heads, -1))  # [B, S, H·D] -> [B, S, H, D]


def _rope(x: torch.Tensor, rotary: Any, start: int, stop: int | None) -> torch.Tensor:
    """``x [B, S, H, D]`` with diffusers' RoPE (:func:`apply_rotary_emb`, real pairs) on tokens ``start:stop``."""
    end = x.shape[1] if stop is None else stop
    parts = [x[:, :start], apply_rotary_emb(x[:, start:end], rotary, sequence_dim=1), x[:, end:]]
    return torch.cat([p for p in parts if p.shape[1]], dim=1)


class HunyuanVideoBackendAttnProcessor(_OnBackend, HunyuanVideoAttnProcessor2_0):
    """``HunyuanVideoAttnProcessor2_0`` with its unmasked path on a project attention backend, and without the
    joint mask while :attr:`drop_mask` is set.

    Args:
        backend: ``"sdpa"`` (diffusers' own path) or ``"fa4"``.
    """

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        mask = None if self.drop_mask else attention_mask
        if self.backend == "sdpa" or mask is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, mask, image_rotary_emb)
        text = 0 if encoder_hidden_states is None else encoder_hidden_states.shape[1]
        single = attn.add_q_proj is None and text > 0  # single-stream: text rides behind the video tokens
        x = torch.cat([hidden_states, encoder_hidden_states], dim=1) if single else hidden_states
        query, key, value = (_heads(proj(x), attn) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:  # on the video tokens only
            video = x.shape[1] - text if single else None
            query, key = _rope(query, image_rotary_emb, 0, video), _rope(key, image_rotary_emb, 0, video)
        if attn.add_q_proj is not None and text:  # dual-stream: the text's own projections, appended
            eq, ek, ev = (_heads(proj(encoder_hidden_states), attn)
                          for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                eq = attn.norm_added_q(eq)
            if attn.norm_added_k is not None:
                ek = attn.norm_added_k(ek)
            query, key, value = (torch.cat(pair, dim=1) for pair in ((query, eq), (key, ek), (value, ev)))
        out = attention(query, key, value, self.backend).flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, None
        out, text_out = out[:, :-text], out[:, -text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return out, text_out


class CogVideoXBackendAttnProcessor(_OnBackend, CogVideoXAttnProcessor2_0):
    """``CogVideoXAttnProcessor2_0`` with its unmasked path on a project attention backend.

    Args:
        backend: ``"sdpa"`` (diffusers' own path) or ``"fa4"``.
    """

    def __call__(self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> Any:
        if self.backend == "sdpa" or attention_mask is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        text = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # text first
        query, key, value = (_heads(proj(x), attn) for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:  # over the head dim, in either layout
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:  # on the video tokens only
            query = _rope(query, image_rotary_emb, text, None)
            if not attn.is_cross_attention:
                key = _rope(key, image_rotary_emb, text, None)
        out = attention(query, key, value, self.backend).flatten(2, 3)
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, text:], out[:, :text]


class LTXVideoBackendAttnProcessor(_OnBackend, LTXVideoAttnProcessor):
    """``LTXVideoAttnProcessor`` with its unmasked path on a project attention backend, and without the text
    mask while :attr:`drop_mask` is set.

    Args:
        backend: ``"sdpa"`` (diffusers' own path) or ``"fa4"``.
    """

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
                 attention_mask: torch.Tensor | None = None, image_rotary_emb: Any = None) -> torch.Tensor:
        mask = None if self.drop_mask else attention_mask
        if self.backend == "sdpa" or mask is not None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, mask, image_rotary_emb)
        source = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        query = attn.norm_q(attn.to_q(hidden_states))
        key = attn.norm_k(attn.to_k(source))
        if image_rotary_emb is not None:  # over the flat channels, before the heads split (LTX's RoPE)
            query, key = ltx_rotary(query, image_rotary_emb), ltx_rotary(key, image_rotary_emb)
        out = attention(_heads(query, attn), _heads(key, attn), _heads(attn.to_v(source), attn), self.backend)
        out = out.flatten(2, 3).to(query.dtype)
        return attn.to_out[1](attn.to_out[0](out))


def set_wan_attention_backend(transformer: torch.nn.Module, backend: str) -> int:
    """Run every ``WanAttention`` of ``transformer`` through ``backend`` (for a diffusers Wan trained outside
    ``DiffusersVideoModule``, which installs one shared processor itself); returns how many modules it set."""
    _check_backend(backend, "set_wan_attention_backend")
    n = 0
    for module in transformer.modules():
        if isinstance(module, WanAttention):
            if isinstance(module.processor, WanBackendAttnProcessor):
                module.processor.backend = backend
            else:
                module.set_processor(WanBackendAttnProcessor(backend))
            n += 1
    return n
