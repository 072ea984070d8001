"""The project's attention backends inside diffusers' Wan transformer: a processor for ``WanAttention``.

diffusers' dispatcher (``diffusers.models.attention_dispatch``) offers FlashAttention-4 only as a kernel
downloaded from the Hub (``flash_4_hub``), and its registry is keyed by a closed enum, so a local backend
cannot be registered there. :class:`WanBackendAttnProcessor` is a ``WanAttnProcessor`` whose text-to-video
path (self-attention with RoPE, cross-attention to text) runs through
:func:`lightning_adaptiveload.ops.attention.attention` with the backend it is set to; with ``"sdpa"``, an
attention mask, or image conditioning (I2V's added key/value projections) it is diffusers' own processor,
unchanged. :func:`set_wan_attention_backend` installs it on every attention module of a transformer (or
sets its backend); it is cheap enough to call per batch.
"""

from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, _get_qkv_projections

from lightning_adaptiveload.ops.attention import ATTENTION_BACKENDS, attention

__all__ = ["WanBackendAttnProcessor", "set_wan_attention_backend"]


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # diffusers' Wan RoPE: interleaved pairs (x[2i], x[2i+1]) rotated by the angle whose cos / sin sit at the
    # even / odd positions of freqs_cos / freqs_sin; computed in the frequencies' dtype (fp32), cast back.
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class WanBackendAttnProcessor(WanAttnProcessor):
    """``WanAttnProcessor`` with the text-to-video path on a project attention backend.

    Args:
        backend: ``"sdpa"`` (diffusers' own path) or ``"fa4"``.
    """

    def __init__(self, backend: str = "sdpa") -> None:
        super().__init__()
        self.backend = backend

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


def set_wan_attention_backend(transformer: torch.nn.Module, backend: str) -> int:
    """Run every ``WanAttention`` of ``transformer`` through ``backend``; returns how many modules it set."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(
            f"`set_wan_attention_backend(backend={backend!r})` is not valid. Expected one of {list(ATTENTION_BACKENDS)}."
        )
    n = 0
    for module in transformer.modules():
        if isinstance(module, WanAttention):
            processor = module.processor
            if isinstance(processor, WanBackendAttnProcessor):
                processor.backend = backend
            else:
                module.set_processor(WanBackendAttnProcessor(backend))
            n += 1
    return n
