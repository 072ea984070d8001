"""Laying an epoch's batches out as global steps (the pure part of a plan: arrays in, arrays out).

``arrange_steps`` is the one step layout of data-parallel and sequence-parallel plans; the helpers sort
by bucket and by cost chunk by chunk, so that planning 10^8 samples keeps its temporaries small.
"""

from __future__ import annotations

import numpy as np

from lightning_adaptiveload.bucketing.buckets import CHUNK as _CHUNK
from lightning_adaptiveload.bucketing.buckets import _distinct

__all__ = ["arrange_steps"]


def _stable_sort_by_bucket(idx: np.ndarray, bucket_of: np.ndarray, num_buckets: int) -> tuple[np.ndarray, np.ndarray]:
    """``idx`` stably sorted by ``bucket_of[idx]``, and the count of each bucket.

    Chunk by chunk: each chunk is sorted on its own (numpy's radix sort for small integer keys),
    and every chunk's run of a bucket is copied after the earlier chunks' runs of that bucket. The
    result is exactly ``idx[np.argsort(bucket_of[idx], kind="stable")]``, without an int64 argsort of
    all N samples (at 10^8 samples that array alone is 800 MB).
    """
    n = len(idx)
    counts = np.zeros(num_buckets, dtype=np.int64)
    for start in range(0, n, _CHUNK):
        counts += np.bincount(bucket_of[idx[start:start + _CHUNK]], minlength=num_buckets)
    out = np.empty_like(idx)
    next_pos = np.cumsum(counts) - counts  # where each bucket's next sample goes
    for start in range(0, n, _CHUNK):
        chunk = idx[start:start + _CHUNK]
        keys = bucket_of[chunk]
        chunk = chunk[np.argsort(keys, kind="stable")]
        chunk_counts = np.bincount(keys, minlength=num_buckets)
        offsets = np.cumsum(chunk_counts) - chunk_counts
        for b in np.flatnonzero(chunk_counts).tolist():
            c = int(chunk_counts[b])
            out[next_pos[b]:next_pos[b] + c] = chunk[offsets[b]:offsets[b] + c]
            next_pos[b] += c
    return out, counts


def _by_descending_cost(ids: np.ndarray, cost: np.ndarray) -> np.ndarray:
    """``ids[np.argsort(-cost[ids], kind="stable")]`` as a counting sort of cost ranks.

    A bucket's batches share one cost (its last batch may have another), so ranks fit 16 bits and
    :func:`_stable_sort_by_bucket` sorts them chunk by chunk: no float64 copy, int64 argsort and
    gather of every batch (~1 GB at 3.5e7 batches), and faster.
    """
    if len(ids) == 0:
        return ids
    distinct = _distinct(cost)
    if len(distinct) > 1 << 16 or np.isnan(distinct[-1]):  # many distinct costs (or NaN): sort them as floats
        return ids[np.argsort(-cost[ids], kind="stable")]
    rank = np.empty(len(cost), dtype=np.uint16)  # 0: the most expensive
    for start in range(0, len(cost), _CHUNK):
        rank[start:start + _CHUNK] = len(distinct) - 1 - np.searchsorted(distinct, cost[start:start + _CHUNK])
    return _stable_sort_by_bucket(ids, rank, len(distinct))[0]


def _lex_first(first: np.ndarray, second: np.ndarray, k: int) -> np.ndarray:
    """``np.lexsort((second, first))[:k]`` in O(n): two partitions find the k-th key, one small sort orders the k."""
    if len(first) <= k:
        return np.lexsort((second, first))
    f = np.partition(first, k - 1)[k - 1]
    less, tie = np.flatnonzero(first < f), np.flatnonzero(first == f)
    need = k - len(less)
    s = np.partition(second[tie], need - 1)[need - 1]
    below = tie[second[tie] < s]
    # Each part is in ascending position and no two parts share a key: the stable sort keeps positions.
    pick = np.concatenate([less, below, tie[second[tie] == s][: need - len(below)]])
    if len(pick) != k:  # NaN keys: order them the slow way
        return np.lexsort((second, first))[:k]
    return pick[np.lexsort((second[pick], first[pick]))]


def _fewest_samples(ids: np.ndarray, batch_len: np.ndarray, cost: np.ndarray, k: int) -> np.ndarray:
    """Positions in ``ids`` of its ``k`` batches of fewest samples, then cheapest, then first:
    ``np.lexsort((cost[ids], batch_len[ids]))[:k]``, chunk by chunk (k is below the world size)."""
    best = np.empty(0, dtype=np.int64)
    for start in range(0, len(ids), _CHUNK):
        chunk = ids[start:start + _CHUNK]
        local = _lex_first(batch_len[chunk], cost[chunk], k) + start
        cand = np.concatenate([best, local])  # ascending positions: earlier chunks first
        best = cand[_lex_first(batch_len[ids[cand]], cost[ids[cand]], k)]
    return best


def arrange_steps(
    ids: np.ndarray,
    batch_len: np.ndarray,
    cost: np.ndarray,
    num_replicas: int,
    degree: np.ndarray | None = None,
    *,
    drop_last: bool,
    balance: str,
    shuffle: bool,
    rng: np.random.Generator,
) -> tuple[np.ndarray, int, int, int, int]:
    """Lay batches out as ``steps[num_steps, num_replicas]`` of batch ids: the one step layout of
    data-parallel and sequence-parallel plans.

    ``degree[b]`` is batch ``b``'s SP degree (``None``: every batch is data parallel, one slot). An SP
    batch of degree k fills k consecutive slots starting at a multiple of k: SP batches come first, by
    descending degree (with a divisibility chain this aligns every group), then the data-parallel
    batches. ``balance="cost"`` orders each part by descending predicted cost, so the units of a step
    take nearly equal time. Slots are made a multiple of ``num_replicas`` by dropping (``drop_last``;
    smallest degree first, fewest samples first) or by padding with repeats of the batches with fewest
    samples, then cheapest (data-parallel ones when there are any). Steps are shuffled where the layout
    sorted them (cost balance, SP groups); otherwise ``ids`` keep their (shuffled) order.

    Returns:
        ``(steps, padded_batches, padded_samples, dropped_batches, dropped_samples)``.
    """
    ids = np.asarray(ids)
    rem = (len(ids) if degree is None else int(degree[ids].sum())) % num_replicas
    dropped_batches = dropped_samples = 0
    if drop_last and rem:
        keep = np.ones(len(batch_len), dtype=bool)
        for d in [1] if degree is None else np.unique(degree[ids]).tolist():
            of_d = ids if degree is None else ids[degree[ids] == d]
            j = min(len(of_d), rem // d)
            drop = of_d[np.argsort(batch_len[of_d], kind="stable")[:j]]
            keep[drop] = False
            dropped_batches += j
            dropped_samples += int(batch_len[drop].sum())
            rem -= j * d
            if rem == 0:
                break
        assert rem == 0, "a divisibility chain of degrees always drops to a multiple of the world size"
        ids = ids[keep[ids]]
    sp, dp = (ids[:0], ids) if degree is None else (ids[degree[ids] > 1], ids[degree[ids] == 1])
    if balance == "cost":
        sp = sp[np.lexsort((-cost[sp], -degree[sp]))] if len(sp) else sp
        dp = _by_descending_cost(dp, cost)
    elif len(sp):
        sp = sp[np.argsort(-degree[sp], kind="stable")]
    pad = ids[:0]
    padded_batches = padded_samples = 0
    if rem:
        pool = dp if len(dp) else sp[degree[sp] == degree[sp].min()]
        n_pad = (num_replicas - rem) // (1 if len(dp) else int(degree[pool[0]]))
        fewest = pool[_fewest_samples(pool, batch_len, cost, max(n_pad, 1))]
        pad = fewest[np.arange(n_pad) % len(fewest)]
        padded_batches, padded_samples = n_pad, int(batch_len[pad].sum())
    # Pads go last: 1-slot pads never misalign, and SP pads (no data-parallel batch) have the smallest degree.
    order = np.concatenate([sp, dp, pad]) if len(sp) or len(pad) else dp
    steps = (order if degree is None else np.repeat(order, degree[order])).reshape(-1, num_replicas)
    if shuffle and (balance == "cost" or len(sp)):
        steps = steps[rng.permutation(steps.shape[0])]
    return steps, padded_batches, padded_samples, dropped_batches, dropped_samples
