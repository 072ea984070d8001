"""``AdaLayerNorm``: the one module every norm + modulate site of the model goes through."""

from __future__ import annotations

import torch
from torch import nn

from lightning_adaptiveload.ops import adaln, adaln_ref


class AdaLayerNorm(nn.Module):
    """LayerNorm over the last dim followed by ``x̂ · (1 + scale) + shift`` (AdaLN modulation).

    Statistics are computed in fp32 (as Wan 2.1 does); the output has the promoted dtype of
    ``x``, ``scale`` and ``shift`` unless ``out_dtype`` is set.

    Args:
        dim: feature size D.
        eps: LayerNorm epsilon (Wan 2.1: 1e-6).
        elementwise_affine: learn a LayerNorm weight and bias (Wan 2.1: False).
        out_dtype: fixed output dtype, e.g. ``torch.bfloat16`` to save bytes.
    """

    def __init__(
        self,
        dim: int,
        eps: float = 1e-6,
        elementwise_affine: bool = False,
        out_dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"`AdaLayerNorm(dim={dim!r})` is not valid. Expected a positive integer.")
        if not eps > 0:
            raise ValueError(f"`AdaLayerNorm(eps={eps!r})` is not valid. Expected a positive float.")
        self.dim = dim
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.out_dtype = out_dtype
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.register_parameter("weight", None)
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """``out_dtype`` overrides the module's for this call (a caller that keeps its stream's dtype)."""
        return adaln_ref(x, scale, shift, self.weight, self.bias, self.eps, out_dtype or self.out_dtype)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class FusedAdaLayerNorm(AdaLayerNorm):
    """:class:`AdaLayerNorm` computed by the fused CUDA op (:func:`~lightning_adaptiveload.ops.adaln`).

    Same constructor, parameters and ``state_dict`` keys as :class:`AdaLayerNorm`, so checkpoints move
    freely between the two. On inputs the fused op does not cover it runs the reference and warns once.

    Example::

        fused = FusedAdaLayerNorm.from_module(model.blocks[0].norm1)  # shares the parameters
    """

    @classmethod
    def from_module(cls, module: AdaLayerNorm) -> FusedAdaLayerNorm:
        """A fused twin of ``module`` that shares its parameters (no copy, no re-initialisation)."""
        if not isinstance(module, AdaLayerNorm):
            raise TypeError(
                f"`FusedAdaLayerNorm.from_module({type(module).__name__})` is not valid. Expected an AdaLayerNorm."
            )
        fused = cls(module.dim, module.eps, elementwise_affine=False, out_dtype=module.out_dtype)
        fused.elementwise_affine = module.elementwise_affine
        fused.weight = module.weight
        fused.bias = module.bias
        fused.train(module.training)
        return fused

    def forward(self, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        return adaln(x, scale, shift, self.weight, self.bias, self.eps, out_dtype or self.out_dtype)
