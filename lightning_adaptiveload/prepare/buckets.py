"""Which bucket (frames, height, width) a source image or clip is encoded at.

A bucket is a pixel size that the Wan VAE and the DiT patchify map to a whole token grid: frame
counts of the form ``k·st + 1`` (Wan: 1, 5, 9, ..., 81) and sides that are multiples of
``vae_stride · patch_size`` (Wan: 16). The grid itself comes from
:func:`lightning_adaptiveload.geometry.pixel_token_grid`, the one rule the rest of the package uses.

Rules (applied in this order, each failure is a counted skip with this reason):

* ``too large``: the source has more than ``max_source_pixels`` pixels per frame (decoding it would
  cost more memory than any bucket is worth; a larger-than-bucket source below this limit is NOT
  skipped, it is resized to cover its bucket and centre-cropped).
* ``too short``: a video with fewer frames than the smallest frame bucket.
* ``too small``: no resolution bucket can be reached without upscaling by more than ``max_upscale``.

Otherwise the resolution bucket is the one closest in aspect ratio (log ratio) among those reachable,
the larger one on ties, and the frame bucket is the longest one the clip has frames for; frames are
then taken evenly across the whole clip.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from lightning_adaptiveload.geometry import PATCH_SIZE, VAE_STRIDE, pixel_token_grid

# Wan 2.1's 480p training sizes in both orientations plus square and 4:3-ish middles.
DEFAULT_RESOLUTIONS: tuple[tuple[int, int], ...] = ((480, 832), (832, 480), (624, 624), (544, 720), (720, 544))
DEFAULT_FRAME_BUCKETS: tuple[int, ...] = (17, 33, 49, 81)


class SkipSample(Exception):  # noqa: N818 - a control-flow signal carrying a reason, not an error
    """An input that is left out of the corpus, with a short ``reason`` (the summary's key) and details."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Bucket:
    """A pixel size and its token grid."""

    frames: int
    height: int
    width: int
    grid: tuple[int, int, int]

    @property
    def seq_len(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


class BucketRules:
    """Frame and resolution buckets, checked against the VAE stride and the patch size.

    Args:
        resolutions: ``(height, width)`` pairs; each side a multiple of ``vae_stride · patch_size``.
        frame_buckets: frame counts for videos, each ``k · vae_stride[0] + 1``; images are always 1.
        max_upscale: largest cover-scale allowed (1.0: never upscale).
        max_source_pixels: sources with more pixels per frame are skipped as ``too large``.
        vae_stride: VAE compression (t, h, w).
        patch_size: DiT patch (t, h, w).

    Raises:
        ValueError: a bucket that does not map to a whole token grid, or empty bucket lists.

    Example::

        rules = BucketRules(resolutions=[(480, 832)], frame_buckets=[33, 81])
        rules.choose(num_frames=120, height=1080, width=1920)  # Bucket(81, 480, 832, grid=(21, 30, 52))
    """

    def __init__(
        self,
        resolutions: Sequence[Sequence[int]] = DEFAULT_RESOLUTIONS,
        frame_buckets: Sequence[int] = DEFAULT_FRAME_BUCKETS,
        *,
        max_upscale: float = 1.0,
        max_source_pixels: int = 8192 * 8192,
        vae_stride: Sequence[int] = VAE_STRIDE,
        patch_size: Sequence[int] = PATCH_SIZE,
    ) -> None:
        self.vae_stride = tuple(int(v) for v in vae_stride)
        self.patch_size = tuple(int(v) for v in patch_size)
        st, sh, sw = self.vae_stride
        pt, ph, pw = self.patch_size
        if not resolutions:
            raise ValueError("`BucketRules(resolutions=[])` is not valid. Expected at least one (height, width).")
        self.resolutions = []
        for res in resolutions:
            if len(res) != 2 or int(res[0]) % (sh * ph) or int(res[1]) % (sw * pw) or min(res) < 1:
                raise ValueError(
                    f"`BucketRules(resolutions=[..., {list(res)!r}, ...])` is not valid. Expected (height, width) "
                    f"with height a multiple of {sh * ph} and width a multiple of {sw * pw}."
                )
            self.resolutions.append((int(res[0]), int(res[1])))
        frames = sorted({int(f) for f in frame_buckets})
        if not frames or any(f < 1 or (f - 1) % st or ((f - 1) // st + 1) % pt for f in frames):
            raise ValueError(
                f"`BucketRules(frame_buckets={list(frame_buckets)!r})` is not valid. Expected frame counts "
                f"k*{st}+1 (e.g. 17, 33, 49, 81)."
            )
        self.frame_buckets = frames
        if not max_upscale >= 1.0:
            raise ValueError(f"`BucketRules(max_upscale={max_upscale!r})` is not valid. Expected >= 1.0.")
        self.max_upscale = float(max_upscale)
        self.max_source_pixels = int(max_source_pixels)

    def choose(self, num_frames: int, height: int, width: int, is_image: bool = False) -> Bucket:
        """The bucket of a source with these sizes.

        Raises:
            SkipSample: ``too large``, ``too short`` or ``too small`` (see the module docstring).
        """
        if height * width > self.max_source_pixels:
            raise SkipSample(
                "too large", f"{width}x{height} has more than max_source_pixels={self.max_source_pixels} pixels"
            )
        if is_image:
            frames = 1
        else:
            fitting = [f for f in self.frame_buckets if f <= num_frames]
            if not fitting:
                raise SkipSample(
                    "too short",
                    f"{num_frames} frame(s), fewer than the smallest frame bucket {self.frame_buckets[0]}",
                )
            frames = fitting[-1]
        aspect = math.log(width / height)
        best: tuple[float, int, tuple[int, int]] | None = None
        for bh, bw in self.resolutions:
            if max(bh / height, bw / width) > self.max_upscale + 1e-9:
                continue
            key = (abs(math.log(bw / bh) - aspect), -bh * bw, (bh, bw))
            if best is None or key < best:
                best = key
        if best is None:
            raise SkipSample(
                "too small",
                f"{width}x{height} needs more than max_upscale={self.max_upscale} to cover any resolution bucket "
                f"{[f'{w}x{h}' for h, w in self.resolutions]}",
            )
        bh, bw = best[2]
        grid = pixel_token_grid(frames, bh, bw, self.vae_stride, self.patch_size)
        return Bucket(frames, bh, bw, grid)

    def __repr__(self) -> str:
        return (
            f"BucketRules(resolutions={self.resolutions}, frame_buckets={self.frame_buckets}, "
            f"max_upscale={self.max_upscale}, max_source_pixels={self.max_source_pixels})"
        )
