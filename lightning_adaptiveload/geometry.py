"""Token geometry, in one place: pixels ↔ latent shape ↔ token grid ↔ sequence length S.

Every other module asks this one how many tokens a sample or a batch has, so a patch size or VAE
stride is applied exactly once.

Wan 2.1's VAE compresses time by 4 (keeping the first frame: ``1 + (F - 1) // 4`` latent frames)
and space by 8; the DiT patchifies latents with patch (1, 2, 2). An 81-frame 832×480 clip is thus
21 latent frames of 60×104, i.e. a token grid of (21, 30, 52) and S = 32,760 tokens. An image is
one latent frame.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from lightning_adaptiveload._checks import check_triple

VAE_STRIDE: tuple[int, int, int] = (4, 8, 8)
PATCH_SIZE: tuple[int, int, int] = (1, 2, 2)


def latent_shape(
    num_frames: int, height: int, width: int, vae_stride: Sequence[int] = VAE_STRIDE
) -> tuple[int, int, int]:
    """Pixel clip shape (frames, height, width) → latent shape (f, h, w) of a causal video VAE.

    Spatial sizes are floored to a multiple of the stride (what a resize-and-crop to the bucket
    resolution produces); time keeps the first frame and compresses the rest.
    """
    st, sh, sw = check_triple("", "vae_stride", vae_stride)
    for name, v in (("num_frames", num_frames), ("height", height), ("width", width)):
        if int(v) != v or v < 1:
            raise ValueError(f"`{name}={v!r}` is not valid. Expected a positive integer.")
    if height < sh or width < sw:
        raise ValueError(
            f"A {height}x{width} frame is smaller than the VAE stride {vae_stride}; "
            "resize it or use a smaller `vae_stride`."
        )
    return 1 + (int(num_frames) - 1) // st, int(height) // sh, int(width) // sw


def token_grid(
    latent: Sequence[int], patch_size: Sequence[int] = PATCH_SIZE
) -> tuple[int, int, int]:
    """Latent shape (f, h, w) → token grid after patchify. The patch must divide the latent."""
    pt, ph, pw = check_triple("", "patch_size", patch_size)
    f, h, w = check_triple("", "latent", latent)
    if f % pt or h % ph or w % pw:
        raise ValueError(
            f"Latent shape (F, H, W)={tuple(latent)} is not divisible by patch_size={tuple(patch_size)}; "
            "crop or pad the sample to a multiple of vae_stride*patch_size."
        )
    return f // pt, h // ph, w // pw


def pixel_token_grid(
    num_frames: int,
    height: int,
    width: int,
    vae_stride: Sequence[int] = VAE_STRIDE,
    patch_size: Sequence[int] = PATCH_SIZE,
) -> tuple[int, int, int]:
    """Pixel clip shape → token grid, cropping the latent to a multiple of the patch."""
    f, h, w = latent_shape(num_frames, height, width, vae_stride)
    pt, ph, pw = check_triple("", "patch_size", patch_size)
    if f < pt or h < ph or w < pw:
        raise ValueError(
            f"Clip {num_frames}x{height}x{width} gives latent {(f, h, w)}, smaller than patch {tuple(patch_size)}."
        )
    return f // pt, h // ph, w // pw


def seq_len(grid: Sequence[int]) -> int:
    """Number of tokens S of a token grid (f, h, w)."""
    f, h, w = grid
    return int(f) * int(h) * int(w)


def latent_of_grid(grid: Sequence[int], patch_size: Sequence[int] = PATCH_SIZE) -> tuple[int, int, int]:
    """Token grid (f, h, w) → the latent shape (F, H, W) that patchifies to it."""
    pt, ph, pw = check_triple("", "patch_size", patch_size)
    f, h, w = check_triple("", "token_grid", grid)
    return f * pt, h * ph, w * pw


def pixel_shape_of_latent(latent: Any, vae_stride: Sequence[int] = VAE_STRIDE) -> tuple[Any, Any, Any]:
    """Latent shape (f, h, w) → the pixel clip (frames, height, width) a causal VAE encodes to exactly it
    (the inverse of :func:`latent_shape` on stride multiples); ints or int arrays."""
    st, sh, sw = check_triple("", "vae_stride", vae_stride)
    f, h, w = latent
    return (f - 1) * st + 1, h * sh, w * sw


def pixel_shape_of_grid(
    grid: Sequence[int], vae_stride: Sequence[int] = VAE_STRIDE, patch_size: Sequence[int] = PATCH_SIZE
) -> tuple[int, int, int]:
    """Token grid (f, h, w) → the pixel clip (frames, height, width) that encodes and patchifies to exactly it."""
    return pixel_shape_of_latent(latent_of_grid(grid, patch_size), vae_stride)


def tokens_of(latents: Any, patch_size: Sequence[int] = PATCH_SIZE) -> tuple[int, int]:
    """``(B, S)`` of a batch of latents ``[B, C, F, H, W]`` (a tensor, an array or its shape).

    S is the number of tokens per sample after patchify with ``patch_size``.

    Raises:
        ValueError: the latents are not 5-D, or a latent axis is not a multiple of the patch (a
            patch given for another model would silently miscount every sample otherwise).
    """
    shape = tuple(int(v) for v in (latents if isinstance(latents, (tuple, list)) else latents.shape))
    if len(shape) != 5:
        raise ValueError(
            f"latents of shape {shape} are not [B, C, F, H, W]; pass a batch of 5-D latents (or its shape)."
        )
    pt, ph, pw = check_triple("", "patch_size", patch_size)
    b, _, f, h, w = shape
    if f % pt or h % ph or w % pw:
        raise ValueError(
            f"latents of shape {shape} are not divisible by patch_size {(pt, ph, pw)}: the model's patch "
            "size and the data's latents disagree. Check `patch_size` of the model and the dataset."
        )
    return b, (f // pt) * (h // ph) * (w // pw)


def pixel_token_grids(
    num_frames: np.ndarray,
    height: np.ndarray,
    width: np.ndarray,
    vae_stride: Sequence[int] = VAE_STRIDE,
    patch_size: Sequence[int] = PATCH_SIZE,
) -> np.ndarray:
    """Vectorised :func:`pixel_token_grid` over arrays; returns an int64 array [N, 3].

    Inputs must already be validated positive integers (manifest readers do that per row so they
    can name the bad row).
    """
    st, sh, sw = check_triple("", "vae_stride", vae_stride)
    pt, ph, pw = check_triple("", "patch_size", patch_size)
    fr = np.asarray(num_frames, dtype=np.int64)
    f = (1 + (fr - 1) // st) // pt
    h = (np.asarray(height, dtype=np.int64) // sh) // ph
    w = (np.asarray(width, dtype=np.int64) // sw) // pw
    return np.stack([f, h, w], axis=1)
