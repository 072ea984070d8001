"""Reading a manifest: its columns, the row checks (a table of named functions), the token grids.

A manifest has one row per sample with columns ``path, num_frames, height, width`` (pixels of the
source clip; images have ``num_frames=1``) and optionally ``caption`` and ``text_embedding`` (a path).
Token grids come from those columns alone, so a 10M-row manifest is bucketed without opening a single
media file. Checks are vectorised (pyarrow + numpy); only the file-existence check touches the
filesystem, one directory listing per directory. :mod:`.manifest` loads the samples.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from lightning.pytorch.utilities import rank_zero_warn

from lightning_adaptiveload._checks import ON_BAD, check_choice, check_triple
from lightning_adaptiveload.data.media import IMAGE_EXTENSIONS, LATENT_EXTENSIONS, VIDEO_EXTENSIONS
from lightning_adaptiveload.geometry import (
    PATCH_SIZE,
    VAE_STRIDE,
    pixel_shape_of_grid,
    pixel_shape_of_latent,
    pixel_token_grids,
)

REQUIRED_COLUMNS = ("path", "num_frames", "height", "width")
OPTIONAL_COLUMNS = ("caption", "text_embedding")
# Instead of the pixel sizes, precomputed latents may give their latent shape (F, H, W).
LATENT_COLUMNS = ("latent_frames", "latent_height", "latent_width")
MANIFEST_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                    ".parquet": "parquet", ".pq": "parquet"}  # fmt: skip
KIND_LATENT, KIND_IMAGE, KIND_VIDEO = 0, 1, 2
#: How many bad rows (and corrupt samples) a report quotes.
MAX_EXAMPLES = 5
_DIMS = ("num_frames", "height", "width")
_OK, _MISSING, _NOT_INT = 0, 1, 2
_INT_STRING = r"^[+-]?[0-9]+(\.0*)?$"


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
        bad_samples: samples whose values were not finite or out of range, skipped with weight 0
            (``on_bad_sample="skip"``); counted in the process that loaded them, like ``corrupt``.
        bad_sample_examples: messages for the first few of them.
    """

    manifest: str
    num_rows: int = 0
    num_valid: int = 0
    skipped: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)
    corrupt: int = 0
    corrupt_examples: list[str] = field(default_factory=list)
    bad_samples: int = 0
    bad_sample_examples: list[str] = field(default_factory=list)

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
        if self.bad_samples:
            lines.append(f"bad samples skipped (weight 0): {self.bad_samples}")
            lines += [f"  {m}" for m in self.bad_sample_examples]
        return "\n".join(lines)


@dataclass
class ManifestRows:
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


# ----------------------------------------------------------------------------------------- checks
@dataclass
class _Table:
    """A manifest's columns and what the row checks read from them."""

    manifest: Path
    base: Path
    vae_stride: tuple[int, int, int]
    patch_size: tuple[int, int, int]
    columns: dict[str, Any]  # with the pixel sizes derived from latent sizes when those are given
    num_rows: int
    malformed: dict[int, str]  # row → why it is not a JSON object
    latent_sizes: bool  # the rows give latent_* sizes instead of pixel sizes
    paths: pa.Array
    sizes: dict[str, tuple[np.ndarray, np.ndarray]]  # column → (int values, _OK / _MISSING / _NOT_INT)
    ext: pa.Array
    is_image: np.ndarray
    is_video: np.ndarray
    is_latent: np.ndarray
    embeddings: pa.Array | None
    has_embedding: np.ndarray
    _names: dict[int, str] = field(default_factory=dict)

    def label(self, row: int) -> str:
        if row not in self._names:
            self._names[row] = os.path.basename(self.paths[row].as_py() or "") or "no path"
        return f"manifest row {row + 1} ({self._names[row]})"

    def dim(self, name: str) -> np.ndarray:
        return self.sizes[name][0]


def _table(manifest: Path, base: Path, vae_stride: tuple[int, int, int], patch_size: tuple[int, int, int]) -> _Table:
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
    sizes = {}
    if latent_sizes:
        sizes = {c: _int_column(columns[c]) for c in LATENT_COLUMNS}
        # The pixel sizes whose VAE latent has this shape (rows with bad latent sizes are reported
        # by their own check first, so their placeholder 1s are never read).
        latent = [np.maximum(sizes[c][0], 1) for c in LATENT_COLUMNS]
        frames, height, width = pixel_shape_of_latent(latent, vae_stride)
        columns = {**columns, "num_frames": pa.array(frames), "height": pa.array(height), "width": pa.array(width)}
    sizes.update({c: _int_column(columns[c]) for c in _DIMS})
    paths = _string_array(columns["path"])
    ext = _extensions(paths)
    embeddings = _string_array(columns["text_embedding"]) if "text_embedding" in columns else None
    has_embedding = np.zeros(n, dtype=bool)
    if embeddings is not None:
        has_embedding = ~_blank(embeddings)
    return _Table(
        manifest, base, vae_stride, patch_size, columns, n, malformed, latent_sizes, paths, sizes, ext,
        _is_in(ext, IMAGE_EXTENSIONS), _is_in(ext, VIDEO_EXTENSIONS), _is_in(ext, LATENT_EXTENSIONS),
        embeddings, has_embedding,
    )


def _blank(strings: pa.Array) -> np.ndarray:
    return pc.fill_null(pc.equal(pc.utf8_trim_whitespace(strings), ""), True).to_numpy(zero_copy_only=False)


def _is_in(ext: pa.Array, extensions: Sequence[str]) -> np.ndarray:
    return pc.is_in(ext, pa.array(extensions)).to_numpy(zero_copy_only=False)


# A check takes the table and the rows already found bad, and returns the rows it finds bad and the
# message of one such row, or None where it does not apply to this manifest.
_Found = tuple[np.ndarray, Callable[[int], str]] | None


def _malformed_row(t: _Table, bad: np.ndarray) -> _Found:
    mask = np.zeros(t.num_rows, dtype=bool)
    mask[list(t.malformed)] = True
    return mask, lambda r: f"manifest row {r + 1}: {t.malformed[r]}"


def _missing_path(t: _Table, bad: np.ndarray) -> _Found:
    return _blank(t.paths), lambda r: f"{t.label(r)}: path is missing; expected a file path"


def _bad_size(name: str) -> Callable[[_Table, np.ndarray], _Found]:
    def check(t: _Table, bad: np.ndarray) -> _Found:
        if name not in t.sizes:
            return None
        values, status = t.sizes[name]

        def message(r: int) -> str:
            if status[r] == _MISSING:
                return f"{t.label(r)}: {name} is missing; expected a positive integer"
            return f"{t.label(r)}: {name}={_raw(t.columns[name], r)}; expected a positive integer"

        return (status != _OK) | (values < 1), message

    check.__name__ = f"_bad_{name}"
    return check


def _unknown_extension(t: _Table, bad: np.ndarray) -> _Found:
    known = (
        f"{', '.join(LATENT_EXTENSIONS)} (latents), {', '.join(IMAGE_EXTENSIONS)} (images) or "
        f"{', '.join(VIDEO_EXTENSIONS)} (videos)"
    )
    return ~(t.is_image | t.is_video | t.is_latent), (
        lambda r: f"{t.label(r)}: unknown extension {t.ext[r].as_py() or '(none)'!r}; expected {known}"
    )


def _raw_media_without_pixel_sizes(t: _Table, bad: np.ndarray) -> _Found:
    if not t.latent_sizes:
        return None
    return t.is_image | t.is_video, lambda r: (
        f"{t.label(r)}: a raw image/video needs num_frames, height and width columns; the latent_* "
        "columns describe precomputed latent files only"
    )


def _image_with_frames(t: _Table, bad: np.ndarray) -> _Found:
    frames = t.dim("num_frames")
    return t.is_image & (frames > 1), lambda r: (
        f"{t.label(r)}: num_frames={frames[r]} but the file is an image; expected num_frames=1"
    )


def _smaller_than_one_token(t: _Table, bad: np.ndarray) -> _Found:
    # The smallest clip that gives one token: the pixels of a one-token grid.
    minimum = dict(zip(_DIMS, pixel_shape_of_grid((1, 1, 1), t.vae_stride, t.patch_size), strict=True))
    too_small = {name: t.dim(name) < minimum[name] for name in _DIMS}
    return too_small["num_frames"] | too_small["height"] | too_small["width"], lambda r: next(
        f"{t.label(r)}: {name}={t.dim(name)[r]} is smaller than one token (vae_stride x patch_size); "
        f"expected at least {minimum[name]}"
        for name in _DIMS
        if too_small[name][r]
    )


def _bad_text_embedding(t: _Table, bad: np.ndarray) -> _Found:
    if t.embeddings is None:
        return None
    embeddings = t.embeddings
    return t.has_embedding & ~_is_in(_extensions(embeddings), LATENT_EXTENSIONS), lambda r: (
        f"{t.label(r)}: text_embedding={embeddings[r].as_py()!r} has an unknown extension; "
        f"expected {' or '.join(LATENT_EXTENSIONS)}"
    )


def _missing_file(t: _Table, bad: np.ndarray) -> _Found:
    candidates = np.flatnonzero(~bad)
    missing = np.zeros(t.num_rows, dtype=bool)
    missing[candidates] = _missing_files(t.paths, candidates, t.base)
    return missing, lambda r: (
        f"{t.label(r)}: file not found at {os.path.join(t.base, t.paths[r].as_py())}; fix the path or "
        f"the root it resolves against ({t.base})"
    )


def _missing_text_embedding_file(t: _Table, bad: np.ndarray) -> _Found:
    if t.embeddings is None:
        return None
    embeddings = t.embeddings
    candidates = np.flatnonzero(~bad & t.has_embedding)
    missing = np.zeros(t.num_rows, dtype=bool)
    missing[candidates] = _missing_files(embeddings, candidates, t.base)
    return missing, lambda r: (
        f"{t.label(r)}: text_embedding file not found at {os.path.join(t.base, embeddings[r].as_py())}; "
        f"fix the path or the root it resolves against ({t.base})"
    )


#: The row checks in order, by the name a skipped row is counted under; a row is reported under
#: the first check it fails. The file checks run only on rows every earlier check passed.
ROW_CHECKS: tuple[tuple[str, Callable[[_Table, np.ndarray], _Found]], ...] = (
    ("malformed row", _malformed_row),
    ("missing path", _missing_path),
    *((f"bad {name}", _bad_size(name)) for name in (*LATENT_COLUMNS, *_DIMS)),
    ("unknown extension", _unknown_extension),
    ("raw media without pixel sizes", _raw_media_without_pixel_sizes),
    ("image with num_frames > 1", _image_with_frames),
    ("smaller than one token", _smaller_than_one_token),
    ("bad text_embedding", _bad_text_embedding),
)
FILE_CHECKS: tuple[tuple[str, Callable[[_Table, np.ndarray], _Found]], ...] = (
    ("missing file", _missing_file),
    ("missing text_embedding file", _missing_text_embedding_file),
)


def read_rows(
    manifest: Path,
    base: Path,
    vae_stride: tuple[int, int, int],
    patch_size: tuple[int, int, int],
    on_bad_row: str,
    check_files: bool,
) -> ManifestRows:
    """Read and check a manifest (:data:`ROW_CHECKS`, then :data:`FILE_CHECKS` with ``check_files``).

    Raises:
        ValueError: a required column is missing, the manifest is empty, every row is bad, or (with
            ``on_bad_row="error"``) a row is bad; the message names the first bad row and why.
    """
    t = _table(manifest, base, vae_stride, patch_size)
    n = t.num_rows
    bad = np.zeros(n, dtype=bool)
    found: list[tuple[str, np.ndarray, Callable[[int], str]]] = []
    for name, check in ROW_CHECKS + (FILE_CHECKS if check_files else ()):
        result = check(t, bad)
        if result is not None:
            found.append((name, result[0], result[1]))
            bad |= result[0]

    report = ManifestReport(manifest=str(manifest), num_rows=n)
    if bad.any():
        reason = np.full(n, -1, dtype=np.int16)
        for k, (_, mask, _) in enumerate(found):
            reason[mask & (reason < 0)] = k
        examples = [found[reason[r]][2](int(r)) for r in np.flatnonzero(bad)[:MAX_EXAMPLES]]
        if on_bad_row == "error":
            raise ValueError(
                f"{examples[0]} (in {manifest}). Fix the row, or pass `on_bad_row='skip'` to skip and "
                "count bad rows."
            )
        counts = np.bincount(reason[bad], minlength=len(found))
        report.skipped = {found[k][0]: int(c) for k, c in enumerate(counts) if c}
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
    kinds = np.where(t.is_image, KIND_IMAGE, np.where(t.is_video, KIND_VIDEO, KIND_LATENT)).astype(np.int8)
    captions = _string_array(t.columns["caption"]).take(take) if "caption" in t.columns else None
    return ManifestRows(
        grids=pixel_token_grids(
            t.dim("num_frames")[keep], t.dim("height")[keep], t.dim("width")[keep], vae_stride, patch_size
        ),
        rows=keep.astype(np.int64),
        paths=t.paths.take(take),
        kinds=kinds[keep],
        captions=captions,
        text_embeddings=t.embeddings.take(take) if t.embeddings is not None else None,
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
    rows = read_rows(
        manifest,
        Path(root if root is not None else manifest.parent).absolute(),
        check_triple(name, "vae_stride", vae_stride),
        check_triple(name, "patch_size", patch_size),
        check_choice(name, "on_bad_row", on_bad_row, ON_BAD),
        check_files,
    )
    return rows.grids, rows.report
