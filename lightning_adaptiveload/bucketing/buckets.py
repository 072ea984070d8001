"""Buckets of a corpus: one per distinct token grid, keyed by the grid packed into one int64.

Shared by the sampler, the calibration and the reports; memory stays near 8 bytes a sample, so it
serves 10^8-sample corpora.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_adaptiveload.bucketing.policy import CostPredictor

__all__ = ["CHUNK", "batch_costs", "count_buckets"]

# Token-grid axes are packed into one int64 key (21 bits each) so bucketing is a 1-D np.unique
# instead of a much slower row-wise unique over an [N, 3] array.
_AXIS_BITS = 21
#: Rows handled at a time when indexing shapes (bounds the temporaries at 10^8 samples).
CHUNK = 1 << 22


def _as_grids(shapes: Any) -> np.ndarray:
    """``shapes`` as an integer ``[N, 3]`` array in its own dtype (no int64 copy: 2.4 GB at 10^8)."""
    grids = np.asarray(shapes)
    if grids.ndim != 2 or grids.shape[1] != 3 or grids.dtype.kind not in "iu":
        raise ValueError(
            f"`shapes` must be an integer array [N, 3] of token grids (f, h, w); got shape "
            f"{grids.shape} and dtype {grids.dtype}."
        )
    if grids.shape[0] == 0:
        raise ValueError("`shapes` is empty: the dataset has no samples to batch.")
    return grids


def _packed_keys(grids: np.ndarray) -> np.ndarray:
    """One int64 key per sample, built chunk by chunk; raises naming the first invalid grid."""
    bad = (grids.min(axis=1) < 1) | (grids.max(axis=1) >= (1 << _AXIS_BITS))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"Sample {i} has token grid {tuple(grids[i].tolist())}; expected three positive integers "
            f"below {1 << _AXIS_BITS}. Check the dataset's `token_grids()`."
        )
    n = len(grids)
    packed = np.empty(n, dtype=np.int64)
    for start in range(0, n, CHUNK):
        packed[start:start + CHUNK] = _pack_grids(grids[start:start + CHUNK].astype(np.int64))
    return packed


def _distinct(packed: np.ndarray) -> np.ndarray:
    """Sorted distinct keys: unique per chunk, then of the union (no sorted copy of all N keys)."""
    return np.unique(np.concatenate([np.unique(packed[s:s + CHUNK]) for s in range(0, len(packed), CHUNK)]))


def _unpack(keys: np.ndarray) -> np.ndarray:
    mask = (1 << _AXIS_BITS) - 1
    return np.stack([keys >> (2 * _AXIS_BITS), (keys >> _AXIS_BITS) & mask, keys & mask], axis=1).astype(np.int64)


def count_buckets(shapes: Any) -> tuple[np.ndarray, np.ndarray]:
    """Distinct token grids ``[K, 3]`` (int64, sorted) and how many samples have each ``[K]``.

    What the sampler buckets by, for callers that need only the buckets (calibration, reports):
    memory stays near 8 bytes a sample, so it serves 10^8-sample corpora.
    """
    packed = _packed_keys(_as_grids(shapes))
    keys = _distinct(packed)
    counts = np.zeros(len(keys), dtype=np.int64)
    for start in range(0, len(packed), CHUNK):
        counts += np.bincount(np.searchsorted(keys, packed[start:start + CHUNK]), minlength=len(keys))
    return _unpack(keys), counts


def _pack_grids(grids: np.ndarray) -> np.ndarray:
    return (grids[:, 0] << (2 * _AXIS_BITS)) | (grids[:, 1] << _AXIS_BITS) | grids[:, 2]


def batch_costs(
    batch_sizes: np.ndarray, seq_lens: np.ndarray, cost_model: CostPredictor | None, p: float
) -> np.ndarray:
    """Predicted cost per batch: ``cost_model.predict(B, S)`` if given, else ``B * S**p``."""
    b = np.asarray(batch_sizes, dtype=np.int64)
    s = np.asarray(seq_lens, dtype=np.int64)
    if cost_model is not None:
        return np.asarray(cost_model.predict(b, s), dtype=np.float64) * np.ones(b.shape)
    return b * np.power(s.astype(np.float64), p)
