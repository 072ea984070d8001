"""A synthetic mixed image + video dataset: realistic shapes, random tensors, no files."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from lightning_adaptiveload._checks import check_positive_int, check_triple, is_int
from lightning_adaptiveload.data.mixtures import get_mixture
from lightning_adaptiveload.geometry import PATCH_SIZE, VAE_STRIDE, latent_of_grid, pixel_token_grid

_ENTRY_KEYS = ("num_frames", "height", "width")

# Separates the per-item tensor stream from the shape draw, which is seeded with `seed` alone.
_ITEM_STREAM = 1


def _validate_mixture(
    mixture: Sequence[Mapping[str, Any]],
    vae_stride: Sequence[int],
    patch_size: Sequence[int],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Check a mixture; return pixel shapes [K, 3], token grids [K, 3] and weights [K]."""
    if isinstance(mixture, (str, bytes)) or not isinstance(mixture, Sequence) or len(mixture) == 0:
        raise ValueError(
            f"`SyntheticMixedDataset(mixture={mixture!r})` is not valid. Expected a mixture name or a "
            "non-empty list of {num_frames, height, width, weight} dicts."
        )
    pixels, grids, weights = [], [], []
    for i, entry in enumerate(mixture):
        where = f"mixture entry {i} ({entry!r})"
        if not isinstance(entry, Mapping):
            raise ValueError(f"{where} is not a dict. Expected {{num_frames, height, width, weight}}.")
        unknown = sorted(set(entry) - {*_ENTRY_KEYS, "weight"})
        if unknown:
            raise ValueError(
                f"{where} has unknown keys {unknown}. Expected only num_frames, height, width, weight."
            )
        for key in _ENTRY_KEYS:
            if key not in entry:
                raise ValueError(f"{where} has no {key!r}. Expected num_frames, height and width in pixels.")
            if not is_int(entry[key]) or entry[key] < 1:
                raise ValueError(f"{where}: {key}={entry[key]!r}; expected a positive integer.")
        weight = entry.get("weight", 1.0)
        if (
            isinstance(weight, bool)
            or not isinstance(weight, numbers.Real)
            or not math.isfinite(weight)
            or weight < 0
        ):
            raise ValueError(f"{where}: weight={weight!r}; expected a finite number >= 0.")
        try:
            grid = pixel_token_grid(
                entry["num_frames"], entry["height"], entry["width"], vae_stride, patch_size
            )
        except ValueError as err:
            raise ValueError(f"{where}: {err}") from None
        pixels.append([int(entry[k]) for k in _ENTRY_KEYS])
        grids.append(grid)
        weights.append(float(weight))
    w = np.asarray(weights, dtype=np.float64)
    if w.sum() <= 0:
        raise ValueError(f"All mixture weights are zero ({weights}). Expected at least one positive weight.")
    return np.asarray(pixels, dtype=np.int64), np.asarray(grids, dtype=np.int64), w / w.sum()


def _check_extra_inputs(cls: str, extra: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[int, ...]]:
    if extra is None:
        return {}
    reserved = {"latents", "context", "index"}
    try:
        out = {str(k): tuple(int(v) for v in shape) for k, shape in extra.items()
               if k not in reserved and all(is_int(v) and v >= 1 for v in shape)}
    except (AttributeError, TypeError, ValueError):
        out = {}
    if not isinstance(extra, Mapping) or len(out) != len(extra):
        raise ValueError(
            f"`{cls}(extra_inputs={extra!r})` is not valid. Expected a mapping from key names (not latents, "
            "context, index) to per-sample shapes of positive integers, e.g. {'pooled': [768]}."
        )
    return out


class SyntheticMixedDataset(Dataset):
    """Random latents and text context with the shape mix of a real image + video corpus.

    Each sample's pixel shape is drawn from ``mixture`` once, at construction, by a seeded and
    vectorised draw (10M samples take a fraction of a second), so :meth:`token_grids` costs no
    tensor generation. ``__getitem__`` is a pure function of ``(seed, index)``: any worker, rank or
    resume produces the same tensors for the same index. Sample ``i``'s shape does not depend on
    ``num_samples``, so a smaller dataset is a prefix of a larger one.

    Args:
        num_samples: dataset length.
        mixture: a name from :data:`~lightning_adaptiveload.data.mixtures.MIXTURES` or a list of
            ``{num_frames, height, width, weight}`` dicts in pixels (images: ``num_frames=1``);
            weights are shares of samples and are normalised (default 1 each).
        latent_channels: VAE latent channels C (Wan 2.1: 16).
        text_len: text context length L (Wan 2.1: 512).
        text_dim: text embedding size D (Wan 2.1's umT5: 4096).
        vae_stride: VAE compression (t, h, w).
        patch_size: DiT patch (t, h, w).
        seed: seeds both the shape draw and the per-item tensors.
        extra_inputs: further per-sample tensors a model reads besides latents and context, as
            ``{key: shape}`` (e.g. HunyuanVideo's pooled text embedding ``{"pooled": [768]}``); drawn
            after the context from the same stream, so latents and context do not change with them.

    Raises:
        ValueError: on a bad argument or mixture entry (the message names the entry).

    Example::

        ds = SyntheticMixedDataset(1000, "wan_mixed_480p_720p", seed=0)
        ds.token_grids()[:2]     # e.g. [[21, 30, 52], [1, 30, 52]]
        ds[0]["latents"].shape   # torch.Size([16, 21, 60, 104]) for an 81-frame 480p clip
    """

    def __init__(
        self,
        num_samples: int,
        mixture: str | Sequence[Mapping[str, Any]],
        latent_channels: int = 16,
        text_len: int = 512,
        text_dim: int = 4096,
        vae_stride: Sequence[int] = VAE_STRIDE,
        patch_size: Sequence[int] = PATCH_SIZE,
        seed: int = 0,
        extra_inputs: Mapping[str, Sequence[int]] | None = None,
    ) -> None:
        cls = type(self).__name__
        self.extra_inputs = _check_extra_inputs(cls, extra_inputs)
        self.num_samples = check_positive_int(cls, "num_samples", num_samples)
        self.latent_channels = check_positive_int(cls, "latent_channels", latent_channels)
        self.text_len = check_positive_int(cls, "text_len", text_len)
        self.text_dim = check_positive_int(cls, "text_dim", text_dim)
        if not is_int(seed) or seed < 0:
            raise ValueError(f"`{cls}(seed={seed!r})` is not valid. Expected an integer >= 0.")
        self.seed = int(seed)
        self.vae_stride = check_triple(cls, "vae_stride", vae_stride)
        self.patch_size = check_triple(cls, "patch_size", patch_size)
        if isinstance(mixture, str):
            mixture = get_mixture(mixture)
        self._pixels, self._grids, self._weights = _validate_mixture(
            mixture, self.vae_stride, self.patch_size
        )
        self.mixture = [dict(e) for e in mixture]
        self._component = self._draw_components()

    def _draw_components(self) -> np.ndarray:
        # float32 draws are ~10x faster than float64 and resolve weights to 6e-8, plenty for shares.
        cdf = np.cumsum(self._weights).astype(np.float32)
        # Round-off can leave cdf[-1] just below 1; pin everything from the last positive weight on
        # so u < 1 always lands on an entry with positive weight.
        cdf[np.flatnonzero(self._weights > 0)[-1] :] = 1.0
        u = np.random.default_rng(self.seed).random(self.num_samples, dtype=np.float32)
        component = np.searchsorted(cdf, u, side="right")
        dtype = np.uint8 if len(cdf) <= 256 else np.int32
        return component.astype(dtype)

    def __len__(self) -> int:
        return self.num_samples

    def token_grids(self) -> np.ndarray:
        """Per-sample token grid (f, h, w) after VAE + patchify, int64 ``[N, 3]`` (a new array)."""
        return self._grids[self._component]

    def pixel_shapes(self) -> np.ndarray:
        """Per-sample pixel shape (num_frames, height, width) drawn from the mixture, int64 ``[N, 3]``."""
        return self._pixels[self._component]

    def latent_grid(self, index: int) -> tuple[int, int, int]:
        """Latent (frames, height, width) of sample ``index``: its token grid times the patch."""
        return latent_of_grid(self._grids[self._component[index]], self.patch_size)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if not is_int(index) or not 0 <= index < self.num_samples:
            raise IndexError(f"Index {index!r} is out of range for a dataset of {self.num_samples} samples.")
        index = int(index)
        state = np.random.SeedSequence([self.seed, _ITEM_STREAM, index]).generate_state(2, dtype=np.uint32)
        gen = torch.Generator().manual_seed(int(state[0]) << 31 | int(state[1]) >> 1)
        latents = torch.randn((self.latent_channels, *self.latent_grid(index)), generator=gen)
        context = torch.randn((self.text_len, self.text_dim), generator=gen)
        sample = {"latents": latents, "context": context, "index": index}
        for key, shape in self.extra_inputs.items():
            sample[key] = torch.randn(shape, generator=gen)
        return sample

    def describe(self) -> list[dict[str, Any]]:
        """One row per mixture entry: pixel shape, token grid, S, target weight and drawn count.

        Rows are plain dicts (``num_frames, height, width, token_grid, seq_len, weight, count,
        fraction``) so callers can print them as a table or log them.
        """
        counts = np.bincount(self._component, minlength=len(self._grids))
        rows = []
        for (frames, height, width), grid, weight, count in zip(
            self._pixels, self._grids, self._weights, counts, strict=True
        ):
            rows.append(
                {
                    "num_frames": int(frames),
                    "height": int(height),
                    "width": int(width),
                    "token_grid": tuple(int(g) for g in grid),
                    "seq_len": int(np.prod(grid)),
                    "weight": float(weight),
                    "count": int(count),
                    "fraction": float(count) / self.num_samples,
                }
            )
        return rows

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(num_samples={self.num_samples}, shapes={len(self._grids)}, "
            f"latent_channels={self.latent_channels}, text_len={self.text_len}, "
            f"text_dim={self.text_dim}, seed={self.seed})"
        )
