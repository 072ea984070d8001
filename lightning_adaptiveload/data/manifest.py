"""Manifest-backed dataset: shapes from a JSONL/CSV/Parquet manifest (read and checked by
:mod:`.manifest_reader`), items from latents or raw media."""

from __future__ import annotations

import logging
import os
import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.utilities import rank_zero_warn
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from torch.utils.data import Dataset

from lightning_adaptiveload._checks import (
    ON_BAD,
    check_choice,
    check_positive,
    check_positive_int,
    check_triple,
)
from lightning_adaptiveload.data.bad_samples import (
    MAX_ABS_VALUE,
    BadSampleError,
    skipped_sample,
    value_problem,
)
from lightning_adaptiveload.data.manifest_reader import (
    KIND_LATENT,
    MAX_EXAMPLES,
    ManifestReport,
    read_manifest_shapes,
    read_rows,
)
from lightning_adaptiveload.data.media import CorruptSampleError, PatchPoolEncoder, load_pixels
from lightning_adaptiveload.geometry import PATCH_SIZE, VAE_STRIDE, pixel_shape_of_grid

__all__ = ["ManifestDataset", "ManifestReport", "read_manifest_shapes"]

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------- loading
def _load_tensors(path: str, what: str) -> dict[str, torch.Tensor]:
    """Load a ``.safetensors`` file or a ``.pt`` file (``weights_only=True``) into a dict of tensors."""
    try:
        if path.lower().endswith(".safetensors"):
            return load_safetensors(path, device="cpu")
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError, SafetensorError) as err:
        raise CorruptSampleError(f"cannot read {what} file {path}: {err}") from err
    if isinstance(obj, torch.Tensor):
        return {what: obj}
    if isinstance(obj, dict) and all(isinstance(v, torch.Tensor) for v in obj.values()):
        return obj
    raise CorruptSampleError(
        f"{path} holds a {type(obj).__name__}; expected a tensor or a dict of tensors with key {what!r}"
    )


class ContextMismatchError(ValueError):
    """A latent file's text context has another text encoder's width or length than the model's: the manifest
    was written for another model (a setting to change, not a corrupt file to skip)."""


class ManifestDataset(Dataset):
    """Samples listed in a manifest: precomputed latents, or images/videos encoded on the fly.

    Shapes (and thus buckets) come from the manifest's ``num_frames, height, width`` columns only —
    or, for precomputed latents, from ``latent_frames, latent_height, latent_width`` (the latent
    shape; used when the pixel columns are absent).
    Each item is fitted to its bucket: the token grid those pixels give (VAE stride, then patch;
    sizes that are not a multiple of ``vae_stride x patch_size`` are cropped down).

    * Latent files (``.safetensors`` with key ``"latents"``, optionally ``"context"``; or ``.pt``
      holding a tensor or such a dict, read with ``weights_only=True``) must have shape
      ``[latent_channels, f·pt, h·ph, w·pw]``, or the VAE shape of the manifest's pixels (a few
      extra rows/columns/frames, trimmed at the end), optionally with a leading batch dim of 1.
    * Images (Pillow) and videos (PyAV) are scaled to cover the bucket's pixel size
      (latent x stride), center-cropped, the bucket's frame count is taken evenly across the clip,
      and ``encoder(pixels [3, F, H, W] in [-1, 1])`` makes latents. The default encoder is
      :class:`~lightning_adaptiveload.data.media.PatchPoolEncoder`, a stand-in that is not a VAE.
    * Text context, first that applies: the ``text_embedding`` file (key ``"context"`` or its
      only tensor), the latent file's ``"context"``, ``text_encoder(caption)``, else zeros (with a
      one-time warning). It is ``[L, text_dim]``, zero-padded to ``text_len``.

    Bad rows (missing fields, non-positive or non-integer sizes, unknown extensions, an image with
    ``num_frames > 1``, sizes below one token, missing files) raise a ``ValueError`` naming the row,
    or with ``on_bad_row="skip"`` are dropped, counted in :attr:`report` and warned about once.
    A file that fails to load raises :class:`~lightning_adaptiveload.data.media.CorruptSampleError`,
    or with ``on_corrupt="skip"`` is logged, counted and replaced by the next loadable sample of the
    same token grid (so a batch stays one shape); the item keeps the requested ``"index"``.
    Latents or a context holding NaN, Inf or values beyond ``max_abs_value`` raise
    :class:`~lightning_adaptiveload.data.bad_samples.BadSampleError` naming the row, the file and the first
    bad element, or with ``on_bad_sample="skip"`` come back as zeros marked ``"bad"``: the collate gives
    them ``sample_weight`` 0, so they do not train, and the LightningModule counts and names them
    (:mod:`lightning_adaptiveload.data.bad_samples`).

    Args:
        path: manifest file: ``.jsonl`` (one JSON object per line), ``.csv`` (header row) or
            ``.parquet``; rows are numbered from 1 in messages (CSV: line = row + 1).
        root: directory relative paths resolve against (default: the manifest's directory).
        latent_channels: latent channels C (Wan 2.1: 16).
        text_len: context length L (Wan 2.1: 512).
        text_dim: context size D (Wan 2.1: 4096).
        vae_stride: VAE compression (t, h, w).
        patch_size: DiT patch (t, h, w).
        on_bad_row: ``"error"`` or ``"skip"``, see above.
        on_corrupt: ``"error"`` or ``"skip"``, see above.
        on_bad_sample: ``"error"`` or ``"skip"``, see above.
        max_abs_value: the largest ``|value|`` accepted in latents and contexts (default
            :data:`~lightning_adaptiveload.data.bad_samples.MAX_ABS_VALUE`, 1e4); ``None``: refuse only NaN/Inf.
        encoder: callable ``pixels [3, F, H, W] → latents [C, 1 + (F-1)//st, H//sh, W//sw]`` for raw
            media; it receives CPU tensors inside DataLoader workers.
        text_encoder: callable ``caption: str → [L, text_dim]`` used when a row has no embedding.
        check_files: check at construction that every file exists (one listing per directory).
        latents_key: name of the latent tensor in latent files (default ``"latents"``).
        context_key: name of the text context tensor in latent and embedding files (default ``"context"``).

    Attributes:
        report: :class:`ManifestReport` of skipped rows, replaced corrupt samples and skipped bad samples
            (the last two counted in the process that loaded them).

    Example::

        ds = ManifestDataset("data/manifest.jsonl", on_bad_row="skip")
        print(ds.report)
        grids = ds.token_grids()  # int64 [N, 3], no decoding
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        root: str | os.PathLike | None = None,
        latent_channels: int = 16,
        text_len: int = 512,
        text_dim: int = 4096,
        vae_stride: Sequence[int] = VAE_STRIDE,
        patch_size: Sequence[int] = PATCH_SIZE,
        on_bad_row: str = "error",
        on_corrupt: str = "error",
        on_bad_sample: str = "error",
        max_abs_value: float | None = MAX_ABS_VALUE,
        encoder: Callable[[torch.Tensor], torch.Tensor] | None = None,
        text_encoder: Callable[[str], torch.Tensor] | None = None,
        check_files: bool = True,
        latents_key: str = "latents",
        context_key: str = "context",
    ) -> None:
        cls = type(self).__name__
        for name, value in (("latents_key", latents_key), ("context_key", context_key)):
            if not isinstance(value, str) or not value:
                raise ValueError(f"`{cls}({name}={value!r})` is not valid. Expected a non-empty tensor name.")
        self.latents_key, self.context_key = latents_key, context_key
        for name, value in (
            ("latent_channels", latent_channels),
            ("text_len", text_len),
            ("text_dim", text_dim),
        ):
            check_positive_int(cls, name, value)
        self.path = Path(path)
        self.root = Path(root if root is not None else self.path.parent).absolute()
        self.latent_channels, self.text_len, self.text_dim = latent_channels, text_len, text_dim
        self.vae_stride = check_triple(cls, "vae_stride", vae_stride)
        self.patch_size = check_triple(cls, "patch_size", patch_size)
        self.on_bad_row = check_choice(cls, "on_bad_row", on_bad_row, ON_BAD)
        self.on_corrupt = check_choice(cls, "on_corrupt", on_corrupt, ON_BAD)
        self.on_bad_sample = check_choice(cls, "on_bad_sample", on_bad_sample, ON_BAD)
        self.max_abs_value = None if max_abs_value is None else check_positive(cls, "max_abs_value", max_abs_value)
        self.text_encoder = text_encoder
        rows = read_rows(self.path, self.root, self.vae_stride, self.patch_size, self.on_bad_row, check_files)
        self._grids, self._rows, self._paths, self._kinds = rows.grids, rows.rows, rows.paths, rows.kinds
        self._captions, self._embeddings = rows.captions, rows.text_embeddings
        self.report = rows.report
        num_media = int((self._kinds != KIND_LATENT).sum())
        if encoder is None and num_media:
            rank_zero_warn(
                f"{cls}: {num_media} of {len(self)} samples in {self.path} are raw images/videos and no `encoder` was "
                "given, so `PatchPoolEncoder` is used: a deterministic stand-in for trying the pipeline, "
                "NOT a VAE. Pass `encoder=` your VAE encoder, or precompute latents."
            )
        self.encoder = encoder if encoder is not None else PatchPoolEncoder(latent_channels, self.vae_stride)
        self._warned_no_text = False
        self._bad_indices: set[int] = set()
        self._same_grid: dict[tuple[int, int, int], np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._grids)

    def token_grids(self) -> np.ndarray:
        """Per-sample token grid (f, h, w) after VAE + patchify, int64 ``[N, 3]`` (a copy)."""
        return self._grids.copy()

    def _where(self, index: int) -> str:
        return f"manifest row {int(self._rows[index]) + 1} ({self._paths[index].as_py()})"

    def sample_label(self, index: int) -> str:
        """Where sample ``index`` comes from, for error messages: ``manifest row 17 (clip_0042.mp4)``."""
        return self._where(index)

    def _resolve(self, relative: str) -> str:
        return os.path.join(self.root, relative)

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self):
            raise IndexError(f"Index {index!r} is out of range for a dataset of {len(self)} samples.")
        index = int(index)
        try:
            sample = self._load(index)
        except BadSampleError as err:
            sample = self._bad_sample(index, err)
        except CorruptSampleError as err:
            if self.on_corrupt == "error":
                raise CorruptSampleError(
                    f"{self._where(index)}: {err}. Fix or remove the file, or pass `on_corrupt='skip'` to "
                    "replace corrupt samples with another sample of the same shape."
                ) from err
            sample = self._replacement(index, err)
        sample["index"] = index
        return sample

    def _bad_sample(self, index: int, err: BadSampleError) -> dict[str, Any]:
        message = f"{self._where(index)}: {err}"
        if self.on_bad_sample == "error":
            raise BadSampleError(
                f"{message}. Re-encode the file or remove its row, or pass `on_bad_sample='skip'` to train without "
                "such samples (each is counted and named once)."
            ) from err
        self.report.bad_samples += 1
        if len(self.report.bad_sample_examples) < MAX_EXAMPLES:
            self.report.bad_sample_examples.append(message)
        return skipped_sample(self._latent_shape(index), (self.text_len, self.text_dim), torch.float32, index, message)

    def _latent_shape(self, index: int) -> tuple[int, int, int, int]:
        grid = self._grids[index]
        pt, ph, pw = self.patch_size
        return self.latent_channels, int(grid[0]) * pt, int(grid[1]) * ph, int(grid[2]) * pw

    def _replacement(self, index: int, err: Exception) -> dict[str, Any]:
        self._note_corrupt(index, err)
        grid = tuple(int(g) for g in self._grids[index])
        if grid not in self._same_grid:
            self._same_grid[grid] = np.flatnonzero((self._grids == np.asarray(grid)).all(axis=1))
        same = self._same_grid[grid]
        start = int(np.searchsorted(same, index, side="right"))
        for candidate in np.concatenate([same[start:], same[:start]]).tolist():
            if candidate in self._bad_indices:
                continue
            try:
                sample = self._load(candidate)
            except CorruptSampleError as next_err:
                self._note_corrupt(candidate, next_err)
                continue
            log.warning(
                "%s is corrupt (%s); using %s instead.", self._where(index), err, self._where(candidate)
            )
            return sample
        raise CorruptSampleError(
            f"{self._where(index)}: {err}; and every other sample with token grid {grid} is corrupt too, "
            "so there is nothing to replace it with. Fix the files or remove their rows."
        ) from err

    def _note_corrupt(self, index: int, err: Exception) -> None:
        if index in self._bad_indices:
            return
        self._bad_indices.add(index)
        self.report.corrupt += 1
        if len(self.report.corrupt_examples) < MAX_EXAMPLES:
            self.report.corrupt_examples.append(f"{self._where(index)}: {err}")

    def _load(self, index: int) -> dict[str, Any]:
        path = self._resolve(self._paths[index].as_py())
        grid = self._grids[index]
        expected = self._latent_shape(index)
        file_context = None
        if self._kinds[index] == KIND_LATENT:
            key = self.latents_key
            tensors = _load_tensors(path, key)
            if key not in tensors:
                raise CorruptSampleError(
                    f"{path} has no {key!r} tensor (keys: {sorted(tensors)}); set "
                    f"`{type(self).__name__}(latents_key=...)` to the name your files use"
                )
            latents = self._fit_latents(tensors[key], expected, path)
            file_context = tensors.get(self.context_key)
        else:
            pixels = load_pixels(path, *pixel_shape_of_grid(grid, self.vae_stride, self.patch_size))
            latents = self.encoder(pixels)
            if tuple(latents.shape) != expected:
                raise ValueError(
                    f"The encoder turned {list(pixels.shape)} pixels into latents of shape {list(latents.shape)}; "
                    f"expected {list(expected)} (latent_channels, then 1 + (F-1)//{self.vae_stride[0]} frames "
                    f"and H, W divided by {self.vae_stride[1:]}). Check `encoder` and `vae_stride`."
                )
        latents = latents.float().contiguous()
        problem = value_problem("latents", latents, self.max_abs_value)
        if problem is not None:
            raise BadSampleError(problem if self._kinds[index] == KIND_LATENT else f"{problem} (the encoder's output)")
        context = self._context(index, file_context, path)
        return {"latents": latents, "context": context}

    def _fit_latents(self, latents: torch.Tensor, expected: tuple[int, ...], path: str) -> torch.Tensor:
        if latents.dim() == 5 and latents.shape[0] == 1:
            latents = latents[0]
        shape = tuple(latents.shape)
        # The VAE latent of the manifest's pixel size can exceed the bucket by less than one patch
        # (the token grid floors it); trim that remainder at the end, as cropping the pixels would.
        fits = (
            latents.dim() == 4
            and shape[0] == expected[0]
            and all(e <= s < e + p for s, e, p in zip(shape[1:], expected[1:], self.patch_size, strict=True))
        )
        if not fits:
            raise CorruptSampleError(
                f"latents in {path} have shape {list(shape)}, but the manifest's num_frames/height/width "
                f"give {list(expected)} (latent_channels x token grid x patch {self.patch_size}); "
                "re-encode the file or fix the row's sizes"
            )
        return latents[:, : expected[1], : expected[2], : expected[3]]

    def _context(self, index: int, file_context: torch.Tensor | None, path: str) -> torch.Tensor:
        source = path
        embedding = None if self._embeddings is None else self._embeddings[index].as_py()
        if embedding and embedding.strip():
            source = self._resolve(embedding)
            tensors = _load_tensors(source, self.context_key)
            if self.context_key in tensors:
                context = tensors[self.context_key]
            elif len(tensors) == 1:
                context = next(iter(tensors.values()))
            else:
                raise CorruptSampleError(
                    f"{source} has no {self.context_key!r} tensor (keys: {sorted(tensors)}); set "
                    f"`{type(self).__name__}(context_key=...)`"
                )
        elif file_context is not None:
            context = file_context
        elif self.text_encoder is not None and self._captions is not None and self._captions[index].as_py():
            context = self.text_encoder(self._captions[index].as_py())
            source = "text_encoder"
        else:
            if not self._warned_no_text:
                self._warned_no_text = True
                rank_zero_warn(
                    f"{self._where(index)} has no text embedding (no `text_embedding` column value, no "
                    "'context' in its latent file, no `text_encoder` with a caption); using zeros for it and "
                    "any others like it."
                )
            return torch.zeros(self.text_len, self.text_dim)
        if context.dim() == 3 and context.shape[0] == 1:
            context = context[0]
        if context.dim() == 2 and context.shape[1] != self.text_dim:
            # Not a corrupt file: the manifest was encoded for another model's text encoder (on_corrupt='skip'
            # would skip every sample), so a settings error, raised past on_corrupt.
            raise ContextMismatchError(
                f"{self._where(index)}: text context from {source} has shape {list(context.shape)}, but the model "
                f"takes [L <= text_len={self.text_len}, text_dim={self.text_dim}]: the manifest was written for "
                "another model. Train with the model it was written for, e.g. `adaptiveload-train "
                "experiment=wan2_1_1_3b_480p data=manifest ...` for a Wan 2.1 manifest (umT5: text_len 512, "
                "text_dim 4096), or `model=...`"
            )
        if context.dim() != 2 or context.shape[0] > self.text_len:
            raise CorruptSampleError(
                f"text context from {source} has shape {list(context.shape)}; expected [L, {self.text_dim}] "
                f"with L <= text_len={self.text_len}"
            )
        context = context.float()
        problem = value_problem("context", context, self.max_abs_value)
        if problem is not None:
            raise BadSampleError(problem if source == path else f"{problem} (from {source})")
        if context.shape[0] < self.text_len:
            # Wan 2.1 zero-pads umT5 outputs to text_len the same way.
            context = torch.cat([context, context.new_zeros(self.text_len - context.shape[0], self.text_dim)])
        return context.contiguous()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, samples={len(self)}, "
            f"skipped_rows={self.report.num_skipped}, corrupt={self.report.corrupt}, "
            f"bad_samples={self.report.bad_samples})"
        )
