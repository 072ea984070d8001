"""AdaLN: ``y = LayerNorm(x) * (1 + scale) + shift``.

``adaln_ref`` is the definition (pure PyTorch, statistics and modulation in fp32, x̂ never rounded
to a low precision before modulation). The fused CUDA op must compute the same function.
"""

from __future__ import annotations

import torch


def _out_dtype(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.dtype:
    # What eager PyTorch produces for LN(x.float()).to(x) * (1 + scale) + shift without autocast.
    return torch.promote_types(torch.promote_types(x.dtype, scale.dtype), shift.dtype)


def adaln_ref(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    weight: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    eps: float = 1e-6,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Reference AdaLN.

    Args:
        x: ``[B, N, D]`` activations (bf16, fp16 or fp32).
        scale, shift: ``[B, D]``, ``[B, 1, D]`` (per sample) or ``[B, N, D]`` (per token).
        weight, bias: optional LayerNorm affine ``[D]``.
        eps: LayerNorm epsilon.
        out_dtype: output dtype; defaults to the promoted dtype of ``x``, ``scale`` and ``shift``.
    """
    if x.dim() != 3:
        raise ValueError(f"adaln: `x` must be [B, N, D], got shape {tuple(x.shape)}")
    if scale.dim() == 2:
        scale = scale.unsqueeze(1)
    if shift.dim() == 2:
        shift = shift.unsqueeze(1)
    dtype = out_dtype or _out_dtype(x, scale, shift)
    xf = x.float()
    xhat = torch.nn.functional.layer_norm(
        xf,
        (x.shape[-1],),
        None if weight is None else weight.float(),
        None if bias is None else bias.float(),
        eps,
    )
    return (xhat * (1 + scale.float()) + shift.float()).to(dtype)
