"""Fused twins of diffusers' AdaLN-Zero norms, for :class:`~lightning_adaptiveload.callbacks.FusedAdaLNCallback`.

``AdaLayerNormZero``, ``AdaLayerNormZeroSingle`` and ``AdaLayerNormContinuous``
(``diffusers.models.normalization``; HunyuanVideo's dual- and single-stream blocks and its head, Flux,
SD3, ...) compute the modulation from an embedding, then ``norm(x) * (1 + scale) + shift``: LayerNorm +
modulate, what :func:`lightning_adaptiveload.ops.adaln` fuses. Each twin is a subclass with the same
parameters (shared, not copied), ``state_dict`` keys and return values whose ``forward`` routes that line
through the op; :func:`fused_twin` builds one, or returns ``None`` where the math is not LayerNorm +
modulate (an RMSNorm, an affine norm with a weight but no bias).

Numerics: in fp32 the twin is bit for bit diffusers' module on the reference path (CPU). Its output dtype
is diffusers' (under autocast LayerNorm returns fp32, so the modulated output is fp32). In lower precision
the op keeps ``x̂`` and ``1 + scale`` in fp32 up to the one rounding of the output, where diffusers rounds
``1 + scale`` (and without autocast ``x̂`` and each product) to bf16: the results agree to bf16 rounding,
not bit for bit.
"""

from __future__ import annotations

import torch
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero, AdaLayerNormZeroSingle
from torch import nn

from lightning_adaptiveload.ops import adaln

__all__ = [
    "FusedAdaLayerNormContinuous",
    "FusedAdaLayerNormZero",
    "FusedAdaLayerNormZeroSingle",
    "fused_twin",
]


def _fusable(norm: nn.Module) -> bool:
    # nn.LayerNorm (diffusers' `LayerNorm` on torch >= 2.1) and FP32LayerNorm over the last dim; the op takes
    # a weight and a bias together or neither.
    return (isinstance(norm, nn.LayerNorm) and len(norm.normalized_shape) == 1
            and (norm.weight is None) == (norm.bias is None))


def _modulate(norm: nn.LayerNorm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift`` (scale, shift ``[B, 1, D]``) through the op, in diffusers' output dtype."""
    # The dtype diffusers' norm returns here (autocast's rules differ by device: on CUDA layer_norm returns fp32),
    # read from the norm itself on an empty slice of x.
    normed = norm(x.narrow(-2, 0, 0)).dtype
    out = torch.promote_types(torch.promote_types(normed, scale.dtype), shift.dtype)
    return adaln(x, scale, shift, norm.weight, norm.bias, norm.eps, out)


class FusedAdaLayerNormZero(AdaLayerNormZero):
    """``AdaLayerNormZero`` whose norm + modulate runs through :func:`~lightning_adaptiveload.ops.adaln`."""

    def forward(self, x, timestep=None, class_labels=None, hidden_dtype=None, emb=None):  # noqa: D102
        if self.emb is not None:
            emb = self.emb(timestep, class_labels, hidden_dtype=hidden_dtype)
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = emb.chunk(6, dim=1)
        return _modulate(self.norm, x, scale_msa[:, None], shift_msa[:, None]), gate_msa, shift_mlp, scale_mlp, gate_mlp


class FusedAdaLayerNormZeroSingle(AdaLayerNormZeroSingle):
    """``AdaLayerNormZeroSingle`` whose norm + modulate runs through :func:`~lightning_adaptiveload.ops.adaln`."""

    def forward(self, x, emb=None):  # noqa: D102
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa = emb.chunk(3, dim=1)
        return _modulate(self.norm, x, scale_msa[:, None], shift_msa[:, None]), gate_msa


class FusedAdaLayerNormContinuous(AdaLayerNormContinuous):
    """``AdaLayerNormContinuous`` (LayerNorm) whose norm + modulate runs through :func:`~lightning_adaptiveload.ops.adaln`."""

    def forward(self, x, conditioning_embedding):  # noqa: D102
        emb = self.linear(self.silu(conditioning_embedding).to(x.dtype))
        scale, shift = torch.chunk(emb, 2, dim=1)
        return _modulate(self.norm, x, scale[:, None], shift[:, None])


_TWINS: dict[type[nn.Module], type[nn.Module]] = {
    AdaLayerNormZero: FusedAdaLayerNormZero,
    AdaLayerNormZeroSingle: FusedAdaLayerNormZeroSingle,
    AdaLayerNormContinuous: FusedAdaLayerNormContinuous,
}


def fused_twin(module: nn.Module) -> nn.Module | None:
    """The fused twin of a diffusers AdaLN-Zero norm (exact types of :data:`_TWINS`), sharing its
    submodules and parameters; ``None`` when its norm is not a LayerNorm the op computes."""
    twin_cls = _TWINS.get(type(module))
    if twin_cls is None or not _fusable(module.norm):
        return None
    twin = twin_cls.__new__(twin_cls)
    # The same submodules, parameters, buffers and hooks under the twin's class (the containers copied, so the
    # original stays a module of its own).
    twin.__dict__.update({k: v.copy() if isinstance(v, dict) else v for k, v in module.__dict__.items()})
    return twin
