"""Raw media → bucket-sized pixels → latents: decoding (Pillow, PyAV), resize/crop, frame sampling.

A sample's bucket is its token grid; the pixel clip that grid implies is
``frames = (f·pt - 1)·st + 1``, ``height = h·ph·sh``, ``width = w·pw·sw`` (an 81-frame 832x480 clip
maps to itself). Media are scaled to cover that size, center-cropped, and ``frames`` frames are taken
evenly across the clip, so every sample of a bucket yields latents of one shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from lightning_adaptiveload.geometry import VAE_STRIDE

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp")
VIDEO_EXTENSIONS = (".mp4", ".mov", ".mkv", ".webm", ".avi")
LATENT_EXTENSIONS = (".safetensors", ".pt")


class CorruptSampleError(RuntimeError):
    """A sample's file exists but cannot be decoded or does not have the shape its manifest row says."""


def sample_frame_indices(num_available: int, num_frames: int) -> np.ndarray:
    """``num_frames`` frame indices spread evenly over ``[0, num_available)`` (repeats if too few)."""
    if num_available < 1 or num_frames < 1:
        raise ValueError(
            f"`sample_frame_indices(num_available={num_available}, num_frames={num_frames})` is not valid. "
            "Expected positive counts."
        )
    return np.round(np.linspace(0, num_available - 1, num_frames)).astype(np.int64)


def load_image(path: str | Path) -> torch.Tensor:
    """Decode an image with Pillow → uint8 ``[1, H, W, 3]`` (RGB).

    Raises:
        CorruptSampleError: if Pillow cannot read it.
    """
    from PIL import Image

    try:
        with Image.open(path) as img:
            rgb = np.asarray(img.convert("RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as err:
        raise CorruptSampleError(f"cannot decode image {path}: {err}") from err
    return torch.from_numpy(rgb.copy()).unsqueeze(0)


def _decode_frames(path: str | Path, wanted: np.ndarray | None) -> tuple[dict[int, np.ndarray], int]:
    """Decode the first video stream, keeping only frames in ``wanted`` (all if None).

    Returns the kept frames by index and the number of frames decoded.
    """
    import av

    keep: dict[int, np.ndarray] = {}
    wanted_set = None if wanted is None else set(wanted.tolist())
    last = None if wanted is None else int(wanted.max())
    count = 0
    with av.open(str(path)) as container:
        if not container.streams.video:
            raise CorruptSampleError(f"{path} has no video stream")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for frame in container.decode(stream):
            if wanted_set is None or count in wanted_set:
                keep[count] = frame.to_ndarray(format="rgb24")
            count += 1
            if last is not None and count > last:
                break
    return keep, count


def load_video(path: str | Path, num_frames: int) -> torch.Tensor:
    """Decode ``num_frames`` frames spread evenly over a video with PyAV → uint8 ``[F, H, W, 3]``.

    When the container states its frame count, only the chosen frames are kept in memory; if the
    stream turns out shorter than stated, the frames are chosen again over what was decoded.

    Raises:
        CorruptSampleError: if PyAV cannot open or decode it, or it has no frames.
    """
    import av

    try:
        with av.open(str(path)) as container:
            streams = container.streams.video
            stated = int(streams[0].frames) if streams else 0
        wanted = sample_frame_indices(stated, num_frames) if stated > 0 else None
        keep, count = _decode_frames(path, wanted)
        if count == 0:
            raise CorruptSampleError(f"video {path} has no decodable frames")
        if wanted is None or (count < stated and count <= int(wanted.max())):
            wanted = sample_frame_indices(count, num_frames)
            if not set(wanted.tolist()) <= keep.keys():
                keep, _ = _decode_frames(path, wanted)
    except (av.FFmpegError, OSError, ValueError) as err:
        raise CorruptSampleError(f"cannot decode video {path}: {err}") from err
    return torch.from_numpy(np.stack([keep[int(i)] for i in wanted]))


def resize_center_crop(frames: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """uint8 ``[F, H0, W0, 3]`` → float ``[3, F, height, width]`` in [-1, 1].

    Scales (antialiased bilinear) so the frame covers ``height x width`` while keeping its aspect
    ratio, then crops the center.
    """
    x = frames.permute(0, 3, 1, 2).float()
    h0, w0 = x.shape[-2:]
    scale = max(height / h0, width / w0)
    new_h, new_w = max(height, round(h0 * scale)), max(width, round(w0 * scale))
    if (new_h, new_w) != (h0, w0):
        x = F.interpolate(x, size=(new_h, new_w), mode="bilinear", antialias=True, align_corners=False)
    top, left = (new_h - height) // 2, (new_w - width) // 2
    x = x[:, :, top : top + height, left : left + width]
    return (x / 127.5 - 1.0).clamp_(-1.0, 1.0).permute(1, 0, 2, 3).contiguous()


def load_pixels(path: str | Path, num_frames: int, height: int, width: int) -> torch.Tensor:
    """Decode an image or video and fit it to a bucket → float ``[3, num_frames, height, width]``.

    An image is repeated over ``num_frames`` (1 for image buckets).

    Raises:
        CorruptSampleError: if the file cannot be decoded.
        ValueError: if the extension is not a known image or video extension.
    """
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        frames = load_image(path).expand(num_frames, -1, -1, -1)
    elif ext in VIDEO_EXTENSIONS:
        frames = load_video(path, num_frames)
    else:
        raise ValueError(
            f"`load_pixels({str(path)!r})`: unknown extension {ext!r}. "
            f"Expected one of {IMAGE_EXTENSIONS + VIDEO_EXTENSIONS}."
        )
    return resize_center_crop(frames, height, width)


class PatchPoolEncoder(nn.Module):
    """A deterministic stand-in for a video VAE encoder, to try the raw-media pipeline without one.

    It is NOT a VAE: its latents carry no more than local mean colours, so a model trained on them
    learns nothing useful. It only has the VAE's interface and shapes: a causal temporal
    compression (first frame alone, then groups of ``vae_stride[0]`` frames averaged), spatial
    average pooling by ``vae_stride[1:]``, and a fixed seeded 3 → ``latent_channels`` projection.
    Replace it with a real encoder (any callable ``pixels [3, F, H, W] in [-1, 1] → latents
    [C, 1 + (F-1)//st, H//sh, W//sw]``), or better, precompute latents offline.

    Args:
        latent_channels: output channels C (Wan 2.1: 16).
        vae_stride: compression (t, h, w) (Wan 2.1: (4, 8, 8)).
        seed: seeds the projection matrix.
    """

    def __init__(
        self, latent_channels: int = 16, vae_stride: Sequence[int] = VAE_STRIDE, seed: int = 0
    ) -> None:
        super().__init__()
        if latent_channels < 1:
            raise ValueError(
                f"`PatchPoolEncoder(latent_channels={latent_channels!r})` is not valid. Expected a positive integer."
            )
        if len(vae_stride) != 3 or any(int(s) != s or s < 1 for s in vae_stride):
            raise ValueError(
                f"`PatchPoolEncoder(vae_stride={tuple(vae_stride)!r})` is not valid. Expected three positive integers."
            )
        self.latent_channels = int(latent_channels)
        self.vae_stride = tuple(int(s) for s in vae_stride)
        gen = torch.Generator().manual_seed(seed)
        self.register_buffer("weight", torch.randn(latent_channels, 3, generator=gen) / math.sqrt(3.0))

    @torch.no_grad()
    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[3, F, H, W]`` (or ``[B, 3, F, H, W]``) → ``[C, 1 + (F-1)//st, H//sh, W//sw]`` (same batching)."""
        batched = pixels.dim() == 5
        x = pixels if batched else pixels.unsqueeze(0)
        if x.dim() != 5 or x.shape[1] != 3:
            raise ValueError(
                f"`PatchPoolEncoder` got pixels of shape {list(pixels.shape)}. Expected [3, F, H, W] or [B, 3, F, H, W]."
            )
        st, sh, sw = self.vae_stride
        b, _, frames, height, width = x.shape
        if height < sh or width < sw:
            raise ValueError(
                f"`PatchPoolEncoder`: a {height}x{width} frame is smaller than the stride {self.vae_stride}."
            )
        groups = (frames - 1) // st
        rest = x[:, :, 1 : 1 + groups * st].reshape(b, 3, groups, st, height, width).mean(dim=3)
        x = torch.cat([x[:, :, :1], rest], dim=2).float()
        x = F.avg_pool3d(x, kernel_size=(1, sh, sw), stride=(1, sh, sw))
        latents = torch.einsum("oc,bcfhw->bofhw", self.weight, x)
        return latents if batched else latents.squeeze(0)

    def extra_repr(self) -> str:
        return f"latent_channels={self.latent_channels}, vae_stride={self.vae_stride}"
