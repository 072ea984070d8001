"""Stack same-shape samples into one batch, keeping every key the dataset returns.

The batch sampler only ever groups samples of one token grid, so a shape mismatch here means the
dataset's ``token_grids()`` disagrees with what ``__getitem__`` returned, or a per-sample tensor (a text
context, its mask) has a length of its own. Padding would hide the first and waste compute on padded
tokens, and a padded length the model does not know would be profiled and costed wrongly, so we refuse
instead and say where to pad.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_adaptiveload.data.bad_samples import BAD_KEY, BAD_SAMPLES_KEY, SAMPLE_WEIGHT_KEY

#: Keys every sample must have.
_REQUIRED = ("latents", "index")


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


def _shape_fix(key: str) -> str:
    if key == "latents":
        return ("A batch must hold a single token grid; check that the dataset's `token_grids()` matches the shapes "
                "`__getitem__` returns.")
    return (f"Pad {key!r} to one stated length in the dataset (text: the module's text_len, which profiling and the "
            "cost model assume), or pass `AdaptiveLoadDataModule(collate_fn=...)` that pads it.")


def collate_batch(samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack samples of one token grid into a batch; every key of the samples is kept.

    Tensors are stacked along a new batch dimension (``"latents"`` ``[C, F, H, W]`` → ``[B, C, F, H, W]``,
    ``"context"`` ``[L, D]`` → ``[B, L, D]``, a ``"context_mask"`` ``[L]`` → ``[B, L]``, a pooled embedding
    ``[D]`` → ``[B, D]``); ``"index"`` becomes a ``LongTensor[B]``; any other value (a caption, a path) is
    kept as a list of the ``B`` values in order.

    Args:
        samples: dicts with ``"latents"``, ``"index"`` and whatever else the dataset returns (every sample
            the same keys); a sample the dataset skipped (``on_bad_sample="skip"``) also has ``"bad"``, the
            message naming it.

    Returns:
        The batch; when some sample was skipped, also ``"sample_weight"`` (float32 ``[B]``, 0 for skipped
        samples, else 1: the loss leaves them out) and ``"bad_samples"`` (their messages). Batches without
        skipped samples carry neither key, so their loss is computed exactly as without this feature.

    Raises:
        ValueError: the list is empty, a sample lacks a key another has (or ``latents``/``index``), or a
            tensor key's shapes differ within the batch (the message names the key, each shape with the
            dataset indices that have it, and the fix).
    """
    if len(samples) == 0:
        raise ValueError("`collate_batch([])` got no samples. Expected a non-empty list of sample dicts.")
    keys = [k for k in dict.fromkeys(k for s in samples for k in s) if k != BAD_KEY]
    expected = list(dict.fromkeys([*_REQUIRED, *keys]))
    for pos, sample in enumerate(samples):
        missing = [k for k in expected if k not in sample]
        if missing:
            raise ValueError(
                f"`collate_batch`: sample {pos} has no {missing}; it has keys {sorted(sample)}. "
                f"Expected every sample to have {expected}."
            )
    batch: dict[str, Any] = {}
    for key in keys:
        values = [s[key] for s in samples]
        if key == "index":
            batch[key] = torch.tensor([int(v) for v in values], dtype=torch.long)
        elif all(isinstance(v, torch.Tensor) for v in values):
            if any(v.shape != values[0].shape for v in values[1:]):
                raise ValueError(
                    f"`collate_batch`: {key!r} shapes differ within one batch: {_describe_shapes(samples, key)}. "
                    + _shape_fix(key)
                )
            batch[key] = torch.stack(values)
        else:
            batch[key] = values
    bad = [s.get(BAD_KEY) for s in samples]
    if any(bad):
        batch[SAMPLE_WEIGHT_KEY] = torch.tensor([0.0 if b else 1.0 for b in bad])
        batch[BAD_SAMPLES_KEY] = [str(b) for b in bad if b]
    return batch
