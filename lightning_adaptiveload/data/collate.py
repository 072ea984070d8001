"""Stack same-shape samples into one batch.

The batch sampler only ever groups samples of one token grid, so a shape mismatch here means the
dataset's ``token_grids()`` disagrees with what ``__getitem__`` returned. Padding would hide that
bug and waste compute on padded tokens, so we refuse instead.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from lightning_adaptiveload.data.bad_samples import BAD_KEY, BAD_SAMPLES_KEY, SAMPLE_WEIGHT_KEY

_KEYS = ("latents", "context", "index")


def _describe_shapes(samples: Sequence[Mapping], key: str) -> str:
    shapes: dict[tuple[int, ...], list[int]] = {}
    for pos, sample in enumerate(samples):
        shapes.setdefault(tuple(sample[key].shape), []).append(pos)
    parts = []
    for shape, positions in shapes.items():
        indices = [int(samples[p]["index"]) for p in positions]
        shown = ", ".join(map(str, indices[:8])) + (", ..." if len(indices) > 8 else "")
        parts.append(f"{list(shape)} at dataset indices [{shown}]")
    return "; ".join(parts)


def collate_batch(samples: Sequence[Mapping]) -> dict[str, torch.Tensor]:
    """Stack samples of one token grid into a batch.

    Args:
        samples: dicts with ``"latents"`` ``[C, F, H, W]``, ``"context"`` ``[L, D]`` and ``"index"``; a
            sample the dataset skipped (``on_bad_sample="skip"``) also has ``"bad"``, the message naming it.

    Returns:
        ``{"latents": [B, C, F, H, W], "context": [B, L, D], "index": LongTensor[B]}``; when some sample
        was skipped, also ``"sample_weight"`` (float32 ``[B]``, 0 for skipped samples, else 1: the loss
        leaves them out) and ``"bad_samples"`` (their messages). Batches without skipped samples carry
        neither key, so their loss is computed exactly as without this feature.

    Raises:
        ValueError: if the list is empty, a key is missing, or latents/context shapes differ (the
            message lists each shape with the dataset indices that have it).
    """
    if len(samples) == 0:
        raise ValueError("`collate_batch([])` got no samples. Expected a non-empty list of sample dicts.")
    for pos, sample in enumerate(samples):
        missing = [k for k in _KEYS if k not in sample]
        if missing:
            raise ValueError(
                f"`collate_batch`: sample {pos} has no {missing}; it has keys {sorted(sample)}. "
                f"Expected every sample to have {list(_KEYS)}."
            )
    for key in ("latents", "context"):
        first = samples[0][key].shape
        if any(s[key].shape != first for s in samples[1:]):
            raise ValueError(
                f"`collate_batch`: {key!r} shapes differ within one batch: {_describe_shapes(samples, key)}. "
                "A batch must hold a single token grid; check that the dataset's `token_grids()` "
                "matches the shapes `__getitem__` returns."
            )
    batch = {
        "latents": torch.stack([s["latents"] for s in samples]),
        "context": torch.stack([s["context"] for s in samples]),
        "index": torch.tensor([int(s["index"]) for s in samples], dtype=torch.long),
    }
    bad = [s.get(BAD_KEY) for s in samples]
    if any(bad):
        batch[SAMPLE_WEIGHT_KEY] = torch.tensor([0.0 if b else 1.0 for b in bad])
        batch[BAD_SAMPLES_KEY] = [str(b) for b in bad if b]
    return batch
