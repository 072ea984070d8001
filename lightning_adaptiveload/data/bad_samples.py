"""Samples that must not train: values that are not finite or absurdly large, and shard bytes that changed.

:class:`~lightning_adaptiveload.data.manifest.ManifestDataset` and
:class:`~lightning_adaptiveload.data.shards.ShardedLatentDataset` check every sample they return
(:func:`value_problem` on its latents and context; the shard reader also verifies the sample's checksum).
With ``on_bad_sample="error"`` (default) a bad sample raises :class:`BadSampleError` naming it and the fix.
With ``"skip"`` it is returned by :func:`skipped_sample`: zeros of the same shapes, so the batch keeps its
shape and every rank its number of steps, and ``"bad"`` set to the message. The collate turns that into
``batch["sample_weight"] = 0`` for the sample (and ``batch["bad_samples"]``, the messages); the
rectified-flow loss leaves it out, and the LightningModule counts and names it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lightning_adaptiveload.data.media import CorruptSampleError

#: The largest ``|value|`` a latent or text context may hold (``max_abs_value`` of the datasets).
#: Wan's VAE latents are normalised per channel (unit variance, |x| below ~10 in practice) and umT5's
#: output leaves an RMSNorm (|x| <= sqrt(4096) x its scale, a few hundred at most), so 1e4 is orders of
#: magnitude above any real value; it catches values that are finite but broken (1e30, a float16 store
#: near its 65,504 limit, a decoder that did not clamp), whose squared error (>= 1e8 an element) would
#: swamp the gradient of every other sample in the batch.
MAX_ABS_VALUE = 1e4

#: What the collate reads from a skipped sample, and what it writes into the batch.
BAD_KEY = "bad"
SAMPLE_WEIGHT_KEY = "sample_weight"
BAD_SAMPLES_KEY = "bad_samples"


class BadSampleError(CorruptSampleError):
    """A sample that must not train: non-finite or out-of-range values, or shard bytes that fail their checksum."""


def value_problem(name: str, tensor: torch.Tensor, max_abs: float | None = MAX_ABS_VALUE) -> str | None:
    """Why ``tensor`` must not train (NaN, Inf, or ``|x| > max_abs``), or ``None`` when its values are fine.

    The check is one ``aminmax`` pass (NaN propagates into both ends), about 1 ms for a 480p 81-frame
    latent on one CPU core; only a tensor that fails it is scanned again to describe what is wrong.
    """
    if tensor.numel() == 0:
        return None
    low, high = (float(v) for v in torch.aminmax(tensor))
    if math.isfinite(low) and math.isfinite(high) and (max_abs is None or max(-low, high) <= max_abs):
        return None
    values = tensor.detach().float()
    nonfinite = ~torch.isfinite(values)
    if nonfinite.any():
        bad = nonfinite
        counts = ((int(torch.isnan(values).sum()), "NaN"), (int(torch.isinf(values).sum()), "Inf"))
        what = " and ".join(f"{n} {kind}" for n, kind in counts if n) + " value(s)"
    else:
        bad = values.abs() > max_abs
        what = f"{int(bad.sum())} value(s) with |x| > {max_abs:g} (max |x| = {max(-low, high):.3g})"
    first = np.unravel_index(int(torch.argmax(bad.flatten().to(torch.uint8))), tuple(tensor.shape))
    return f"{name} {list(tensor.shape)} hold {what}, the first at {[int(i) for i in first]}"


def sample_problem(sample: Mapping[str, Any], max_abs: float | None) -> str | None:
    """The first of :func:`value_problem` for a sample's ``latents`` and ``context``, or ``None``."""
    for key in ("latents", "context"):
        problem = value_problem(key, sample[key], max_abs)
        if problem is not None:
            return problem
    return None


def skipped_sample(
    latents_shape: tuple[int, ...], context_shape: tuple[int, ...], dtype: torch.dtype, index: int, message: str
) -> dict[str, Any]:
    """A skipped sample: zero latents and context of the shapes it would have had, and ``"bad"`` = ``message``.

    Zeros, not the bad values: the loss multiplies the sample's error by a weight of 0, and 0 x NaN is NaN.
    """
    return {
        "latents": torch.zeros(latents_shape, dtype=dtype),
        "context": torch.zeros(context_shape, dtype=dtype),
        "index": index,
        BAD_KEY: message,
    }
