"""Manifest-backed dataset: shapes from a JSONL/CSV/Parquet manifest, items from latents or raw media.

A manifest has one row per sample with columns ``path, num_frames, height, width`` (pixels of the
source clip; images have ``num_frames=1``) and optionally ``caption`` and ``text_embedding`` (a path).
Token grids come from those columns alone, so a 10M-row manifest is bucketed without opening a single
media file. Validation is vectorised (pyarrow + numpy); only the file-existence check touches the
filesystem, one directory listing per directory.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from lightning.pytorch.utilities import rank_zero_warn
from safetensors import SafetensorError
from safetensors.torch import load_file as load_safetensors
from torch.utils.data import Dataset

from lightning_adaptiveload._checks import ON_BAD, check_choice, check_positive_int, check_triple
from lightning_adaptiveload.data.media import (
    IMAGE_EXTENSIONS,
    LATENT_EXTENSIONS,
    VIDEO_EXTENSIONS,
    CorruptSampleError,
    PatchPoolEncoder,
    load_pixels,
)
from lightning_adaptiveload.geometry import (
    PATCH_SIZE,
    VAE_STRIDE,
    pixel_shape_of_grid,
    pixel_shape_of_latent,
    pixel_token_grids,
)

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("path", "num_frames", "height", "width")
OPTIONAL_COLUMNS = ("caption", "text_embedding")
# Instead of the pixel sizes, precomputed latents may give their latent shape (F, H, W).
LATENT_COLUMNS = ("latent_frames", "latent_height", "latent_width")
MANIFEST_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                    ".parquet": "parquet", ".pq": "parquet"}  # fmt: skip
_DIMS = ("num_frames", "height", "width")
_KIND_LATENT, _KIND_IMAGE, _KIND_VIDEO = 0, 1, 2
_OK, _MISSING, _NOT_INT = 0, 1, 2
_INT_STRING = r"^[+-]?[0-9]+(\.0*)?$"
_MAX_EXAMPLES = 5


@dataclass
class ManifestReport:
    """What reading a manifest found, and what loading has had to replace so far.

    Attributes:
        manifest: the manifest path.
        num_rows: data rows in the file.
        num_valid: rows kept.
        skipped: bad rows skipped, by reason (only with ``on_bad_row="skip"``).
        examples: messages for the first few skipped rows.
        corrupt: samples that failed to load and were replaced (``on_corrupt="skip"``). Counted
            in the process that loaded them: with DataLoader workers each worker keeps its own count.
        corrupt_examples: messages for the first few corrupt samples.
    """

    manifest: str
    num_rows: int = 0
    num_valid: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    corrupt: int = 0
    corrupt_examples: list[str] = field(default_factory=list)

    @property
    def num_skipped(self) -> int:
        return sum(self.skipped.values())

    def __str__(self) -> str:
        lines = [f"{self.manifest}: {self.num_valid} of {self.num_rows} rows valid"]
        if self.skipped:
            lines.append("skipped: " + ", ".join(f"{k}: {v}" for k, v in self.skipped.items()))
        lines += [f"  {m}" for m in self.examples]
        if self.corrupt:
            lines.append(f"corrupt samples replaced: {self.corrupt}")
            lines += [f"  {m}" for m in self.corrupt_examples]
        return "\n".join(lines)


@dataclass
class _Rows:
    """Validated manifest rows (valid rows only), as compact arrays."""

    grids: np.ndarray  # int64 [N, 3]
    rows: np.ndarray  # int64 [N]: 0-based row number in the file
    paths: pa.Array  # string [N]
    kinds: np.ndarray  # int8 [N]
    captions: pa.Array | None
    text_embeddings: pa.Array | None
    report: ManifestReport


# ----------------------------------------------------------------------------------------- reading
def _read_jsonl_python(path: Path) -> tuple[dict[str, list], int, dict[int, str]]:
    """Slower, forgiving JSONL reader for files pyarrow rejects (mixed types, broken lines).

    Returns the manifest's columns as lists, the row count and messages for rows that are not
    JSON objects (blank lines are not rows).
    """
    records: list[dict] = []
    malformed: dict[int, str] = {}
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line or line.isspace():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                record, malformed[len(records)] = {}, f"not valid JSON ({err.msg} at column {err.colno})"
            if not isinstance(record, dict):
                record, malformed[len(records)] = {}, f"not a JSON object ({type(record).__name__})"
            records.append(record)
    columns = {
        key: [r.get(key) for r in records]
        for key in (*REQUIRED_COLUMNS, *OPTIONAL_COLUMNS, *LATENT_COLUMNS)
        if any(key in r for r in records)
    }
    return columns, len(records), malformed


def _read_columns(path: Path) -> tuple[dict[str, Any], int, dict[int, str]]:
    """Read a manifest → (columns as pyarrow arrays or lists, row count, malformed-row messages)."""
    fmt = MANIFEST_FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(
            f"Manifest {str(path)!r} has an unknown extension. Expected one of {sorted(MANIFEST_FORMATS)}."
        )
    if not path.is_file():
        raise FileNotFoundError(
            f"Manifest {str(path)!r} does not exist. Expected a JSONL, CSV or Parquet file."
        )
    try:
        if fmt == "jsonl":
            import pyarrow.json as pajson

            try:
                table = pajson.read_json(path)
            except (pa.ArrowInvalid, pa.ArrowTypeError):
                # pyarrow needs one type per column; fall back to a per-line parse that can name
                # the offending rows instead of failing the whole file.
                return _read_jsonl_python(path)
        elif fmt == "csv":
            import pyarrow.csv as pacsv

            strings = {name: pa.string() for name in ("path", *OPTIONAL_COLUMNS)}
            table = pacsv.read_csv(
                path, convert_options=pacsv.ConvertOptions(column_types=strings, strings_can_be_null=True)
            )
        else:
            import pyarrow.parquet as pq

            table = pq.read_table(path)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as err:
        raise ValueError(
            f"Cannot parse manifest {str(path)!r} as {fmt}: {err}. Fix the file (every row needs the "
            f"columns {', '.join(REQUIRED_COLUMNS)})."
        ) from err
    columns = {name: table.column(name).combine_chunks() for name in table.column_names}
    return columns, table.num_rows, {}


def _string_array(column: Any) -> pa.Array:
    if isinstance(column, list):
        return pa.array([None if v is None else str(v) for v in column], type=pa.string())
    return pc.cast(column, pa.string())


def _python_int(value: Any) -> tuple[int, int]:
    if value is None:
        return 0, _MISSING
    if isinstance(value, bool):
        return 0, _NOT_INT
    if isinstance(value, int):
        return value, _OK
    if isinstance(value, float):
        return (int(value), _OK) if value.is_integer() else (0, _NOT_INT)
    if isinstance(value, str):
        text = value.strip()
        try:
            number = float(text)
        except ValueError:
            return 0, _NOT_INT
        return (int(number), _OK) if number.is_integer() else (0, _NOT_INT)
    return 0, _NOT_INT


def _int_column(column: Any) -> tuple[np.ndarray, np.ndarray]:
    """A dimension column → (int64 values, status: _OK / _MISSING / _NOT_INT), vectorised for arrow."""
    if isinstance(column, list):
        try:
            column = pa.array(column)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            # Mixed types (e.g. 480 and "abc"): only this column pays for a per-value parse.
            pairs = [_python_int(v) for v in column]
            return np.array([p[0] for p in pairs], dtype=np.int64), np.array(
                [p[1] for p in pairs], dtype=np.int8
            )
    null = column.is_null().to_numpy(zero_copy_only=False)
    kind = column.type
    if pa.types.is_integer(kind):
        values = column.fill_null(0).to_numpy().astype(np.int64)
        is_int = ~null
    elif pa.types.is_floating(kind):
        f = column.fill_null(0).to_numpy().astype(np.float64)
        is_int = ~null & np.isfinite(f) & (f == np.trunc(f)) & (np.abs(f) < 2.0**62)
        values = np.where(is_int, f, 0).astype(np.int64)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        text = pc.utf8_trim_whitespace(column)
        is_int = pc.match_substring_regex(text, _INT_STRING).fill_null(False).to_numpy(zero_copy_only=False)
        numbers = pc.cast(pc.if_else(pa.array(is_int), text, "0"), pa.float64())
        values = numbers.to_numpy(zero_copy_only=False).astype(np.int64)
    else:
        values, is_int = np.zeros(len(column), dtype=np.int64), np.zeros(len(column), dtype=bool)
    status = np.where(null, _MISSING, np.where(is_int, _OK, _NOT_INT)).astype(np.int8)
    return values, status


def _raw(column: Any, row: int) -> str:
    value = column[row] if isinstance(column, list) else column[row].as_py()
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return repr(value)


def _list_dir(directory: str, cache: dict[str, frozenset[str]]) -> frozenset[str]:
    if directory not in cache:
        try:
            cache[directory] = frozenset(os.listdir(directory or "."))
        except OSError:
            cache[directory] = frozenset()
    return cache[directory]


def _missing_files(paths: pa.Array, rows: np.ndarray, base: Path) -> np.ndarray:
    """Boolean mask over ``rows``: the file at ``paths[row]`` (relative to ``base``) does not exist.

    One ``listdir`` per directory instead of one ``stat`` per file: manifests put many samples in few
    directories, and on network filesystems a stat costs a round trip.
    """
    cache: dict[str, frozenset[str]] = {}
    missing = np.zeros(len(rows), dtype=bool)
    chunk = 1 << 20  # bounds the Python strings alive at once on 10M-row manifests
    for start in range(0, len(rows), chunk):
        sub = rows[start : start + chunk]
        for j, rel in enumerate(paths.take(pa.array(sub)).to_pylist()):
            directory, name = os.path.split(os.path.join(base, rel))
            missing[start + j] = name not in _list_dir(directory, cache)
    return missing


def _extensions(paths: pa.Array) -> pa.Array:
    match = pc.extract_regex(paths, r"(?P<ext>\.[^./\\]*)$")
    return pc.utf8_lower(pc.struct_field(match, "ext")).fill_null("")


def _validate(
    manifest: Path,
    base: Path,
    vae_stride: tuple[int, int, int],
    patch_size: tuple[int, int, int],
    on_bad_row: str,
    check_files: bool,
) -> _Rows:
    columns, n, malformed = _read_columns(manifest)
    latent_sizes = all(c in columns for c in LATENT_COLUMNS) and not any(c in columns for c in _DIMS)
    required = ("path",) if latent_sizes else REQUIRED_COLUMNS
    missing_cols = [c for c in required if c not in columns]
    if missing_cols:
        raise ValueError(
            f"Manifest {str(manifest)!r} has no column(s) {missing_cols}; it has {sorted(columns)}. Expected "
            f"columns {', '.join(REQUIRED_COLUMNS)} (or, for precomputed latents, path and "
            f"{', '.join(LATENT_COLUMNS)}) (+ optional {', '.join(OPTIONAL_COLUMNS)})."
        )
    if n == 0:
        raise ValueError(f"Manifest {str(manifest)!r} has no rows. Expected at least one sample.")

    paths = _string_array(columns["path"])
    path_list_cache: dict[int, str] = {}

    def label(row: int) -> str:
        if row not in path_list_cache:
            path_list_cache[row] = os.path.basename(paths[row].as_py() or "") or "no path"
        return f"manifest row {row + 1} ({path_list_cache[row]})"

    # Checks run in order; a row is reported under the first one it fails.
    checks: list[tuple[str, np.ndarray, Callable[[int], str]]] = []
    bad_json = np.zeros(n, dtype=bool)
    bad_json[list(malformed)] = True
    checks.append(("malformed row", bad_json, lambda r: f"manifest row {r + 1}: {malformed[r]}"))
    no_path = (pc.fill_null(pc.equal(pc.utf8_trim_whitespace(paths), ""), True)).to_numpy(
        zero_copy_only=False
    )
    checks.append(("missing path", no_path, lambda r: f"{label(r)}: path is missing; expected a file path"))

    def positive_ints(names: Sequence[str], cols: dict[str, Any]) -> dict[str, np.ndarray]:
        """Integer values of size columns, with a check per column that names the bad value."""
        out = {}
        for name in names:
            values, status = _int_column(cols[name])
            out[name] = values
            checks.append(
                (
                    f"bad {name}",
                    (status != _OK) | (values < 1),
                    lambda r, name=name, status=status, cols=cols: (
                        f"{label(r)}: {name} is missing; expected a positive integer"
                        if status[r] == _MISSING
                        else f"{label(r)}: {name}={_raw(cols[name], r)}; expected a positive integer"
                    ),
                )
            )
        return out

    if latent_sizes:
        latent_dims = positive_ints(LATENT_COLUMNS, columns)
        # The pixel sizes whose VAE latent has this shape (rows with bad latent sizes are already
        # reported above, so their placeholder 1s are never read).
        latent = [np.maximum(latent_dims[c], 1) for c in LATENT_COLUMNS]
        frames, height, width = pixel_shape_of_latent(latent, vae_stride)
        columns = {**columns, "num_frames": pa.array(frames), "height": pa.array(height), "width": pa.array(width)}
    dims = positive_ints(_DIMS, columns)

    ext = _extensions(paths)
    is_image = pc.is_in(ext, pa.array(IMAGE_EXTENSIONS)).to_numpy(zero_copy_only=False)
    is_video = pc.is_in(ext, pa.array(VIDEO_EXTENSIONS)).to_numpy(zero_copy_only=False)
    is_latent = pc.is_in(ext, pa.array(LATENT_EXTENSIONS)).to_numpy(zero_copy_only=False)
    known = (
        f"{', '.join(LATENT_EXTENSIONS)} (latents), {', '.join(IMAGE_EXTENSIONS)} (images) or "
        f"{', '.join(VIDEO_EXTENSIONS)} (videos)"
    )
    checks.append(
        (
            "unknown extension",
            ~(is_image | is_video | is_latent),
            lambda r: f"{label(r)}: unknown extension {ext[r].as_py() or '(none)'!r}; expected {known}",
        )
    )
    if latent_sizes:
        checks.append(
            (
                "raw media without pixel sizes",
                is_image | is_video,
                lambda r: (
                    f"{label(r)}: a raw image/video needs num_frames, height and width columns; the latent_* "
                    "columns describe precomputed latent files only"
                ),
            )
        )
    checks.append(
        (
            "image with num_frames > 1",
            is_image & (dims["num_frames"] > 1),
            lambda r: (
                f"{label(r)}: num_frames={dims['num_frames'][r]} but the file is an image; expected num_frames=1"
            ),
        )
    )

    # The smallest clip that gives one token: the pixels of a one-token grid.
    min_frames, min_height, min_width = pixel_shape_of_grid((1, 1, 1), vae_stride, patch_size)
    too_small = {
        "num_frames": dims["num_frames"] < min_frames,
        "height": dims["height"] < min_height,
        "width": dims["width"] < min_width,
    }
    minimum = {"num_frames": min_frames, "height": min_height, "width": min_width}
    checks.append(
        (
            "smaller than one token",
            too_small["num_frames"] | too_small["height"] | too_small["width"],
            lambda r: next(
                f"{label(r)}: {name}={dims[name][r]} is smaller than one token (vae_stride x patch_size); "
                f"expected at least {minimum[name]}"
                for name in _DIMS
                if too_small[name][r]
            ),
        )
    )

    embeddings = _string_array(columns["text_embedding"]) if "text_embedding" in columns else None
    has_embedding = np.zeros(n, dtype=bool)
    if embeddings is not None:
        has_embedding = ~pc.fill_null(pc.equal(pc.utf8_trim_whitespace(embeddings), ""), True).to_numpy(
            zero_copy_only=False
        )
        emb_ext = _extensions(embeddings)
        checks.append(
            (
                "bad text_embedding",
                has_embedding
                & ~pc.is_in(emb_ext, pa.array(LATENT_EXTENSIONS)).to_numpy(zero_copy_only=False),
                lambda r: (
                    f"{label(r)}: text_embedding={embeddings[r].as_py()!r} has an unknown extension; "
                    f"expected {' or '.join(LATENT_EXTENSIONS)}"
                ),
            )
        )

    bad = np.zeros(n, dtype=bool)
    for _, mask, _ in checks:
        bad |= mask
    if check_files:
        candidates = np.flatnonzero(~bad)
        missing = np.zeros(n, dtype=bool)
        missing[candidates] = _missing_files(paths, candidates, base)
        checks.append(
            (
                "missing file",
                missing,
                lambda r: (
                    f"{label(r)}: file not found at {os.path.join(base, paths[r].as_py())}; fix the path or "
                    f"the root it resolves against ({base})"
                ),
            )
        )
        if embeddings is not None:
            candidates = np.flatnonzero(~bad & ~missing & has_embedding)
            missing_emb = np.zeros(n, dtype=bool)
            missing_emb[candidates] = _missing_files(embeddings, candidates, base)
            checks.append(
                (
                    "missing text_embedding file",
                    missing_emb,
                    lambda r: (
                        f"{label(r)}: text_embedding file not found at {os.path.join(base, embeddings[r].as_py())}; "
                        f"fix the path or the root it resolves against ({base})"
                    ),
                )
            )
            bad |= missing_emb
        bad |= missing

    report = ManifestReport(manifest=str(manifest), num_rows=n)
    if bad.any():
        reason = np.full(n, -1, dtype=np.int16)
        for k, (_, mask, _) in enumerate(checks):
            reason[mask & (reason < 0)] = k
        first_rows = np.flatnonzero(bad)[:_MAX_EXAMPLES]
        examples = [checks[reason[r]][2](int(r)) for r in first_rows]
        if on_bad_row == "error":
            raise ValueError(
                f"{examples[0]} (in {manifest}). Fix the row, or pass `on_bad_row='skip'` to skip and "
                "count bad rows."
            )
        counts = np.bincount(reason[bad], minlength=len(checks))
        report.skipped = {checks[k][0]: int(c) for k, c in enumerate(counts) if c}
        report.examples = examples
    valid = ~bad
    report.num_valid = int(valid.sum())
    if report.num_valid == 0:
        raise ValueError(
            f"Every row of manifest {str(manifest)!r} is bad ({report.skipped}); first: {report.examples[0]}."
        )
    if report.num_skipped:
        rank_zero_warn(
            f"Skipped {report.num_skipped} of {n} rows of manifest {manifest} ("
            + ", ".join(f"{k}: {v}" for k, v in report.skipped.items())
            + f"); first: {report.examples[0]}. The full count is in the dataset's `report`."
        )

    keep = np.flatnonzero(valid)
    take = pa.array(keep)
    kinds = np.where(is_image, _KIND_IMAGE, np.where(is_video, _KIND_VIDEO, _KIND_LATENT)).astype(np.int8)
    captions = _string_array(columns["caption"]).take(take) if "caption" in columns else None
    return _Rows(
        grids=pixel_token_grids(
            dims["num_frames"][keep], dims["height"][keep], dims["width"][keep], vae_stride, patch_size
        ),
        rows=keep.astype(np.int64),
        paths=paths.take(take),
        kinds=kinds[keep],
        captions=captions,
        text_embeddings=embeddings.take(take) if embeddings is not None else None,
        report=report,
    )


def read_manifest_shapes(
    path: str | os.PathLike,
    *,
    root: str | os.PathLike | None = None,
    vae_stride: Sequence[int] = VAE_STRIDE,
    patch_size: Sequence[int] = PATCH_SIZE,
    on_bad_row: str = "error",
    check_files: bool = False,
) -> tuple[np.ndarray, ManifestReport]:
    """Token grids of a manifest's samples, from its metadata alone (for planning and simulation).

    Args:
        path: a ``.jsonl``, ``.csv`` or ``.parquet`` manifest.
        root: directory relative paths resolve against (default: the manifest's directory).
        vae_stride: VAE compression (t, h, w).
        patch_size: DiT patch (t, h, w).
        on_bad_row: ``"error"`` raises on the first bad row; ``"skip"`` drops and counts bad rows.
        check_files: also check each file exists (off by default: simulating needs no files).

    Returns:
        int64 ``[N, 3]`` token grids of the valid rows, in file order, and a :class:`ManifestReport`.
    """
    name = "read_manifest_shapes"
    manifest = Path(path)
    rows = _validate(
        manifest,
        Path(root if root is not None else manifest.parent).absolute(),
        check_triple(name, "vae_stride", vae_stride),
        check_triple(name, "patch_size", patch_size),
        check_choice(name, "on_bad_row", on_bad_row, ON_BAD),
        check_files,
    )
    return rows.grids, rows.report


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
        encoder: callable ``pixels [3, F, H, W] → latents [C, 1 + (F-1)//st, H//sh, W//sw]`` for raw
            media; it receives CPU tensors inside DataLoader workers.
        text_encoder: callable ``caption: str → [L, text_dim]`` used when a row has no embedding.
        check_files: check at construction that every file exists (one listing per directory).
        latents_key: name of the latent tensor in latent files (default ``"latents"``).
        context_key: name of the text context tensor in latent and embedding files (default ``"context"``).

    Attributes:
        report: :class:`ManifestReport` of skipped rows and replaced corrupt samples.

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
        self.text_encoder = text_encoder
        rows = _validate(self.path, self.root, self.vae_stride, self.patch_size, self.on_bad_row, check_files)
        self._grids, self._rows, self._paths, self._kinds = rows.grids, rows.rows, rows.paths, rows.kinds
        self._captions, self._embeddings = rows.captions, rows.text_embeddings
        self.report = rows.report
        num_media = int((self._kinds != _KIND_LATENT).sum())
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
        except CorruptSampleError as err:
            if self.on_corrupt == "error":
                raise CorruptSampleError(
                    f"{self._where(index)}: {err}. Fix or remove the file, or pass `on_corrupt='skip'` to "
                    "replace corrupt samples with another sample of the same shape."
                ) from err
            sample = self._replacement(index, err)
        sample["index"] = index
        return sample

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
        if len(self.report.corrupt_examples) < _MAX_EXAMPLES:
            self.report.corrupt_examples.append(f"{self._where(index)}: {err}")

    def _load(self, index: int) -> dict[str, Any]:
        path = self._resolve(self._paths[index].as_py())
        grid = self._grids[index]
        pt, ph, pw = self.patch_size
        expected = (self.latent_channels, int(grid[0]) * pt, int(grid[1]) * ph, int(grid[2]) * pw)
        file_context = None
        if self._kinds[index] == _KIND_LATENT:
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
        context = self._context(index, file_context, path)
        return {"latents": latents.float().contiguous(), "context": context}

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
        if context.dim() != 2 or context.shape[1] != self.text_dim or context.shape[0] > self.text_len:
            raise CorruptSampleError(
                f"text context from {source} has shape {list(context.shape)}; expected [L, {self.text_dim}] "
                f"with L <= text_len={self.text_len}"
            )
        context = context.float()
        if context.shape[0] < self.text_len:
            # Wan 2.1 zero-pads umT5 outputs to text_len the same way.
            context = torch.cat([context, context.new_zeros(self.text_len - context.shape[0], self.text_dim)])
        return context.contiguous()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({str(self.path)!r}, samples={len(self)}, "
            f"skipped_rows={self.report.num_skipped}, corrupt={self.report.corrupt})"
        )
