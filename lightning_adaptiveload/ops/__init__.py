"""Operators: AdaLN reference and fused CUDA op."""

from lightning_adaptiveload.ops.adaln import adaln, adaln_ref

__all__ = ["adaln", "adaln_ref"]
