"""Indexed tar shards of encoded samples: the writer, the shape index and :class:`ShardedLatentDataset`.

Layout (what ``adaptiveload-prepare`` writes)::

    out/
      shards/shard-000000.tar   <key>.latents.npy  [C, F, H, W]  (float16 or float32)
                                <key>.context.npy  [L, D] text-encoder output, L = caption tokens
                                <key>.meta.json    source, caption, sizes, bucket, encoders
      index.parquet             one row per sample, see INDEX_COLUMNS
      summary.json              per-bucket samples and tokens, skipped inputs by reason

The tars are plain (uncompressed) POSIX tars, so WebDataset and ``tar -x`` read them as they are.
The index stores where each member's bytes start inside its tar, so a sample is one ranged read
(latents and context are adjacent members: one read covers both) and no tar is ever scanned; and a
CRC-32 of the two members' bytes, which the reader verifies on every read (indexes written before the
column existed load unverified, with a note).
"""

from __future__ import annotations

import io
import json
import logging
import os
import tarfile
import tempfile
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import Dataset

from lightning_adaptiveload._checks import ON_BAD, check_choice, check_positive
from lightning_adaptiveload.data.bad_samples import (
    MAX_ABS_VALUE,
    BadSampleError,
    skipped_sample,
    value_problem,
)
from lightning_adaptiveload.data.media import CorruptSampleError

log = logging.getLogger(__name__)

# The checksum column was added without a version bump: readers select columns by name, so older
# releases read newer indexes (ignoring it) and this one reads older indexes (unverified).
INDEX_VERSION = 1
# Column → arrow type. Offsets are of the member's data (past its tar header), in bytes.
INDEX_COLUMNS: dict[str, pa.DataType] = {
    "shard": pa.string(),  # tar path relative to the index's folder
    "shard_id": pa.int32(),  # position of `shard` in the index metadata's "shards" list
    "key": pa.string(),
    "latents_offset": pa.int64(),
    "latents_size": pa.int64(),
    "context_offset": pa.int64(),
    "context_size": pa.int64(),
    "meta_offset": pa.int64(),
    "meta_size": pa.int64(),
    "channels": pa.int32(),
    "latent_f": pa.int32(),
    "latent_h": pa.int32(),
    "latent_w": pa.int32(),
    "grid_f": pa.int32(),
    "grid_h": pa.int32(),
    "grid_w": pa.int32(),
    "seq_len": pa.int64(),
    "context_len": pa.int32(),
    "caption_hash": pa.string(),  # blake2b-64 hex of the caption as encoded
    "source": pa.string(),
    # zlib.crc32 of the latents member's bytes continued over the context member's (both .npy files whole):
    # exactly what a training read covers, minus the tar header between them. CRC-32 rather than a
    # cryptographic hash: it catches flipped bits and overwritten bytes, which is the point (not tampering),
    # and runs at ~3.3 GB/s on one core here against ~0.8 GB/s for hashlib.blake2b (a 480p 81-frame sample,
    # 8.4 MB in float16: 2.6 vs 11 ms). Null (or the column absent): written before checksums, unverified.
    "checksum": pa.uint32(),
}
INDEX_SCHEMA = pa.schema([pa.field(k, v) for k, v in INDEX_COLUMNS.items()])
_MEMBERS = ("latents", "context", "meta")


def atomic_write_bytes(path: str | os.PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temp file in the same folder and ``os.replace``."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; shards and indexes are meant to be shared
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def sample_checksum(latents: bytes | memoryview, context: bytes | memoryview) -> int:
    """The index's ``checksum`` of a sample: CRC-32 of its latents member's bytes, continued over its context's."""
    return zlib.crc32(context, zlib.crc32(latents))


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def _parse_npy(data: bytes | memoryview, where: str) -> np.ndarray:
    """``.npy`` bytes → array without copying the payload (header parsed by numpy's own reader)."""
    buf = io.BytesIO(data)
    try:
        version = np.lib.format.read_magic(buf)
        read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read_header(buf)
    except (ValueError, OSError) as err:
        raise CorruptSampleError(f"{where}: not a valid .npy member ({err})") from err
    count = int(np.prod(shape)) if shape else 1
    start = buf.tell()
    if len(data) - start < count * dtype.itemsize:
        raise CorruptSampleError(
            f"{where}: .npy member holds {len(data) - start} payload bytes, its header says {shape} {dtype}"
        )
    array = np.frombuffer(data, dtype=dtype, count=count, offset=start)
    return array.reshape(shape, order="F" if fortran else "C")


class ShardWriter:
    """Writes one tar shard through a temp file; :meth:`close` moves it into place with ``os.replace``.

    A crash leaves only a ``.tmp`` file behind, never a truncated shard under the real name.

    Args:
        path: the shard's final path (``.tar``).

    Example::

        with ShardWriter("shards/shard-000000.tar") as w:
            where = w.add("000000001", latents, context, {"caption": "a cat"})
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, self._tmp = tempfile.mkstemp(dir=self.path.parent, prefix=f".{self.path.name}.", suffix=".tmp")
        os.chmod(self._tmp, 0o644)
        self._fh = os.fdopen(fd, "wb")
        self._tar = tarfile.open(fileobj=self._fh, mode="w", format=tarfile.USTAR_FORMAT)
        self.num_samples = 0

    def _member(self, name: str, data: bytes) -> tuple[int, int]:
        info = tarfile.TarInfo(name)
        info.size = len(data)
        info.mode = 0o644
        before = self._tar.offset
        self._tar.addfile(info, io.BytesIO(data))
        padded = -(-len(data) // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE
        header = self._tar.offset - before - padded
        return before + header, len(data)

    def add(self, key: str, latents: np.ndarray, context: np.ndarray, meta: Mapping[str, Any]) -> dict[str, int]:
        """Append one sample; returns ``{"latents_offset", "latents_size", ..., "checksum"}`` for the index."""
        if "." in key or "/" in key:
            raise ValueError(f"`ShardWriter.add(key={key!r})`: a WebDataset key has no '.' or '/'.")
        where: dict[str, int] = {}
        payloads = (npy_bytes(latents), npy_bytes(context), json.dumps(dict(meta), sort_keys=True).encode())
        for member, data in zip(_MEMBERS, payloads, strict=True):
            suffix = "json" if member == "meta" else "npy"
            where[f"{member}_offset"], where[f"{member}_size"] = self._member(f"{key}.{member}.{suffix}", data)
        where["checksum"] = sample_checksum(payloads[0], payloads[1])
        self.num_samples += 1
        return where

    def close(self) -> int:
        """Finish the tar, fsync it and move it to :attr:`path`; returns its size in bytes."""
        self._tar.close()
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        os.replace(self._tmp, self.path)
        return self.path.stat().st_size

    def abort(self) -> None:
        """Drop the temp file (after an error)."""
        try:
            self._tar.close()
            self._fh.close()
        finally:
            if os.path.exists(self._tmp):
                os.unlink(self._tmp)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def write_index(path: str | os.PathLike, table: pa.Table, metadata: Mapping[str, Any]) -> None:
    """Write the shape index atomically; ``metadata`` (JSON-able) goes into the Parquet schema metadata.

    A table without a ``checksum`` column is written with nulls there (its samples read unverified).
    """
    if "checksum" not in table.column_names:
        table = table.append_column("checksum", pa.nulls(table.num_rows, INDEX_COLUMNS["checksum"]))
    table = table.select(list(INDEX_COLUMNS)).cast(INDEX_SCHEMA)
    table = table.replace_schema_metadata({b"adaptiveload": json.dumps({"version": INDEX_VERSION, **metadata})})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf, row_group_size=1 << 20)
    atomic_write_bytes(path, buf.getvalue().to_pybytes())


def read_index_metadata(path: str | os.PathLike, storage_options: Mapping[str, Any] | None = None) -> dict:
    """The index's ``adaptiveload`` metadata (shards list, text_len, dtype, encoders ...)."""
    with _open(str(path), storage_options) as fh:
        raw = (pq.read_schema(fh).metadata or {}).get(b"adaptiveload")
    if raw is None:
        raise ValueError(f"{path} is a Parquet file without `adaptiveload` metadata; expected an index written "
                         "by `adaptiveload-prepare`.")  # fmt: skip
    meta = json.loads(raw)
    if meta.get("version") != INDEX_VERSION:
        raise ValueError(f"{path}: index version {meta.get('version')!r}; this package reads {INDEX_VERSION}.")
    return meta


def _read_parquet(path: str, columns: list[str], storage_options: Mapping[str, Any] | None) -> pa.Table:
    """Local paths go to pyarrow's native reader (several times faster than through a Python file object)."""
    if _is_url(path):
        with _open(path, storage_options) as fh:
            return pq.read_table(fh, columns=columns)
    return pq.read_table(path.removeprefix("file://"), columns=columns)


def _is_url(path: str) -> bool:
    return "://" in path and not path.startswith("file://")


def _open(path: str, storage_options: Mapping[str, Any] | None):
    if _is_url(path):
        import fsspec

        return fsspec.open(path, "rb", **(storage_options or {})).open()
    return open(path.removeprefix("file://"), "rb")


def _join(base: str, relative: str) -> str:
    if _is_url(base):
        return base.rstrip("/") + "/" + relative
    return os.path.join(base.removeprefix("file://"), relative)


def _size(path: str, storage_options: Mapping[str, Any] | None) -> int | None:
    try:
        if _is_url(path):
            import fsspec

            fs, inner = fsspec.core.url_to_fs(path, **(storage_options or {}))
            return int(fs.size(inner))
        return os.stat(path).st_size
    except (OSError, FileNotFoundError):
        return None


@dataclass
class ShardReport:
    """What opening an index found.

    Attributes:
        index: the index path.
        num_rows: rows in the index.
        num_valid: rows kept.
        bad_shards: shard → reason, for shards that are missing or shorter than their rows need.
        skipped_rows: rows dropped with those shards (``on_bad_shard="skip"``).
        unverified_rows: kept rows without a checksum (an index written before checksums existed).
        bad_samples: samples read with a checksum mismatch or non-finite / out-of-range values and
            skipped with weight 0 (``on_bad_sample="skip"``); counted in the process that read them (each
            DataLoader worker keeps its own count).
        bad_sample_examples: messages for the first few of them.
    """

    index: str
    num_rows: int = 0
    num_valid: int = 0
    bad_shards: dict[str, str] = field(default_factory=dict)
    skipped_rows: int = 0
    unverified_rows: int = 0
    bad_samples: int = 0
    bad_sample_examples: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"{self.index}: {self.num_valid} of {self.num_rows} samples readable"]
        lines += [f"  {shard}: {reason}" for shard, reason in self.bad_shards.items()]
        if self.unverified_rows:
            lines.append(f"  {self.unverified_rows} samples without a checksum (read unverified)")
        if self.bad_samples:
            lines.append(f"  bad samples skipped (weight 0): {self.bad_samples}")
            lines += [f"    {m}" for m in self.bad_sample_examples[:_MAX_EXAMPLES]]
        return "\n".join(lines)


_MAX_EXAMPLES = 5
_READ_COLUMNS = ("shard_id", "latents_offset", "latents_size", "context_offset", "context_size",
                 "meta_offset", "meta_size", "grid_f", "grid_h", "grid_w")  # fmt: skip


def _row_end(b: Mapping[str, np.ndarray]) -> np.ndarray:
    """The byte after each row's last member (meta is written last, but do not rely on it)."""
    return np.maximum(b["meta_offset"] + b["meta_size"], b["context_offset"] + b["context_size"])


class ShardedLatentDataset(Dataset):
    """Random access into ``adaptiveload-prepare`` shards through their shape index.

    ``token_grids()`` comes straight from the index (no shard is opened); ``__getitem__`` reads one
    byte range of one tar (latents and context are adjacent members) and returns the same dict as
    :class:`~lightning_adaptiveload.data.manifest.ManifestDataset`: ``latents`` ``[C, F, H, W]``,
    ``context`` ``[text_len, D]`` (the stored caption tokens, zero-padded as Wan pads umT5 outputs)
    and ``index``. Files are opened lazily, once per process, so DataLoader workers each hold their
    own handles.

    Shards may live on a local path or behind an fsspec URL (``s3://...``, ``gs://...``, needs
    ``fsspec`` and the filesystem's package); with ``cache_dir`` each remote shard is copied once
    (temp file + ``os.replace``) and then read locally.

    Every read is verified against the index's CRC-32 of the sample's bytes, and its latents and context
    must be finite and within ``max_abs_value``. A sample failing either raises
    :class:`~lightning_adaptiveload.data.bad_samples.BadSampleError` naming the shard, the sample and the fix;
    with ``on_bad_sample="skip"`` it comes back as zeros marked ``"bad"``, which the collate gives
    ``sample_weight`` 0 (it does not train; the LightningModule counts and names it). An index without
    checksums (written before they existed) loads with a one-time note that its samples are unverified.

    Args:
        path: the ``index.parquet`` written by ``adaptiveload-prepare`` (local path or URL).
        text_len: context length L the model expects (Wan 2.1: 512); ``None``: the tokenizer length
            the corpus was prepared with. Stored contexts longer than this raise.
        text_dim: expected context width D (checked against the index); ``None``: the stored one.
        dtype: dtype of the returned tensors (stored as float16 or float32).
        check_shards: at construction, check that every shard exists and is long enough for the rows
            that point into it (one size lookup per shard).
        on_bad_shard: ``"error"`` (default): raise naming the shard; ``"skip"``: drop its rows and
            count them in :attr:`report`.
        on_bad_sample: ``"error"`` (default) or ``"skip"``: what a checksum mismatch or bad values do, see above.
        max_abs_value: the largest ``|value|`` accepted in latents and contexts (default
            :data:`~lightning_adaptiveload.data.bad_samples.MAX_ABS_VALUE`, 1e4); ``None``: refuse only NaN/Inf.
        cache_dir: local folder for copies of remote shards.
        storage_options: passed to ``fsspec.open`` for URLs.

    Raises:
        ValueError: an index that is not one, a ``text_dim`` that disagrees with it, or a missing /
            truncated shard with ``on_bad_shard="error"``.

    Example::

        ds = ShardedLatentDataset("/data/wan480p/index.parquet", text_len=512)
        dm = AdaptiveLoadDataModule(ds, policy, num_workers=8)
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        text_len: int | None = None,
        text_dim: int | None = None,
        dtype: str | torch.dtype = torch.float32,
        check_shards: bool = True,
        on_bad_shard: str = "error",
        on_bad_sample: str = "error",
        max_abs_value: float | None = MAX_ABS_VALUE,
        cache_dir: str | os.PathLike | None = None,
        storage_options: Mapping[str, Any] | None = None,
    ) -> None:
        cls = type(self).__name__
        check_choice(cls, "on_bad_shard", on_bad_shard, ON_BAD)
        self.on_bad_sample = check_choice(cls, "on_bad_sample", on_bad_sample, ON_BAD)
        self.max_abs_value = None if max_abs_value is None else check_positive(cls, "max_abs_value", max_abs_value)
        self.path = str(path)
        self.storage_options = dict(storage_options or {})
        self.cache_dir = None if cache_dir is None else Path(cache_dir)
        self.dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        meta = read_index_metadata(self.path, self.storage_options)
        self.metadata = meta
        stored_dim = int(meta["text_dim"])
        if text_dim is not None and int(text_dim) != stored_dim:
            raise ValueError(
                f"`{cls}(text_dim={text_dim})` disagrees with {self.path}, whose contexts are {stored_dim} wide "
                "(the text encoder's width). Use a model with that text_dim or re-prepare the corpus."
            )
        self.text_dim = stored_dim
        self.text_len = int(text_len if text_len is not None else meta["text_len"])
        base = self.path.rsplit("/", 1)[0] if _is_url(self.path) else str(Path(self.path).parent)
        self._shards = [_join(base, s) for s in meta["shards"]]
        cols, need = self._read_columns(check_shards)
        self.report = ShardReport(self.path, num_rows=len(cols["shard_id"]))
        keep = self._check_shards(need, on_bad_shard) if check_shards else None
        rows = None if keep is None or keep.all() else np.flatnonzero(keep)
        self._rows = rows  # dataset index → index row (None: identity)
        for name, array in cols.items():
            setattr(self, f"_{name}", array if rows is None or array is None else array[rows])
        self.report.num_valid = len(self._start)
        if self.report.num_valid == 0:
            raise ValueError(f"{self.path}: no readable samples.\n{self.report}")
        if self._checksum is None:
            self.report.unverified_rows = self.report.num_valid
        elif self._verified is not None:
            self.report.unverified_rows = int((~self._verified).sum())
            if not self.report.unverified_rows:
                self._verified = None
        if self.report.unverified_rows:
            rank_zero_warn(
                f"{self.path}: {self.report.unverified_rows} of {self.report.num_valid} samples have no checksum in "
                "the index (written before adaptiveload-prepare stored them), so their reads are unverified: a "
                "flipped bit in their shards would train silently. Prepare the corpus again into a new output "
                "folder to add checksums."
            )
        self._files: dict[int, Any] = {}
        self._pid = os.getpid()
        self._keys: pa.ChunkedArray | None = None

    def _parquet(self):
        """The index as a ParquetFile: local paths through pyarrow's native reader (several times faster
        than through a Python file object), URLs through fsspec."""
        if _is_url(self.path):
            return pq.ParquetFile(_open(self.path, self.storage_options))
        return pq.ParquetFile(self.path.removeprefix("file://"))

    def _batches(self, columns: Sequence[str]):
        # One row group at a time, each table dropped before the next is read: `iter_batches` keeps
        # what it decoded until the file is closed (~19 bytes a row, 1.9 GB at 10^8 rows).
        with self._parquet() as pf:
            for i in range(pf.metadata.num_row_groups):
                table = pf.read_row_group(i, columns=list(columns))
                yield from table.to_batches()
                del table
                pa.default_memory_pool().release_unused()

    def _read_columns(self, check_shards: bool) -> tuple[dict[str, np.ndarray], np.ndarray]:
        """Stream the index into compact arrays (26 bytes a row), and each shard's furthest byte needed.

        Streaming by row group keeps the peak near the final arrays instead of the whole Arrow table
        plus its NumPy copies (10^7 rows: see benchmarks/results/shards.json). Two columns are
        narrower than the index's while the values allow (widened once, on the first row that needs
        it): start offsets in tar blocks (uint32, shards up to 2 TiB) and token grids in int16.
        """
        with self._parquet() as pf:
            n = pf.metadata.num_rows
            has_checksum = "checksum" in pf.schema_arrow.names
        cols = {"shard_id": np.empty(n, np.int32), "start": np.empty(n, np.uint32),
                "latents_size": np.empty(n, np.int32), "context_start": np.empty(n, np.int32),
                "context_size": np.empty(n, np.int32), "grids": np.empty((n, 3), np.int16),
                "checksum": np.empty(n, np.uint32) if has_checksum else None,
                "verified": None}  # fmt: skip
        self._start_unit = tarfile.BLOCKSIZE
        need = np.zeros(len(self._shards), dtype=np.int64)
        pos = 0
        for batch in self._batches(_READ_COLUMNS + (("checksum",) if has_checksum else ())):
            b = {name: batch.column(name).to_numpy() for name in _READ_COLUMNS}
            m = len(b["shard_id"])
            sl = slice(pos, pos + m)
            context_start = b["context_offset"] - b["latents_offset"]
            if max(int(b["latents_size"].max()), int(context_start.max()), int(b["context_size"].max())) >= 2**31:
                raise ValueError(f"{self.path}: a sample's members exceed 2 GiB; this reader stores sizes in 32 bits.")
            start = b["latents_offset"]
            if self._start_unit > 1 and ((start % self._start_unit).any() or start.max() // self._start_unit >= 2**32):
                # Not a tar's block-aligned offsets (or a shard past 2 TiB): keep bytes in 64 bits.
                cols["start"] = cols["start"].astype(np.int64) * self._start_unit
                self._start_unit = 1
            cols["shard_id"][sl] = b["shard_id"]
            cols["start"][sl] = start // self._start_unit
            grids = np.stack([b["grid_f"], b["grid_h"], b["grid_w"]], axis=1)
            info = np.iinfo(cols["grids"].dtype)
            if m and (grids.max() > info.max or grids.min() < info.min):
                cols["grids"] = cols["grids"].astype(np.int32 if cols["grids"].dtype == np.int16 else np.int64)
            cols["grids"][sl] = grids
            cols["latents_size"][sl] = b["latents_size"]
            cols["context_start"][sl] = context_start
            cols["context_size"][sl] = b["context_size"]
            if has_checksum:
                checksum = batch.column("checksum")
                cols["checksum"][sl] = checksum.fill_null(0).to_numpy()
                if checksum.null_count:  # rows merged from parts written before checksums: those go unverified
                    if cols["verified"] is None:
                        cols["verified"] = np.ones(n, dtype=bool)
                    cols["verified"][sl] = ~checksum.is_null().to_numpy(zero_copy_only=False)
            if check_shards:
                np.maximum.at(need, b["shard_id"], _row_end(b))
            pos += m
        return cols, need

    def _first_row_past(self, shard: int, size: int) -> tuple[int, int]:
        """The first index row of ``shard`` that points past ``size`` bytes, and the byte it needs."""
        pos = 0
        for batch in self._batches(_READ_COLUMNS):
            b = {name: batch.column(name).to_numpy() for name in _READ_COLUMNS}
            end = _row_end(b)
            hit = np.flatnonzero((b["shard_id"] == shard) & (end > size))
            if len(hit):
                return pos + int(hit[0]), int(end[hit[0]])
            pos += len(end)
        return -1, size

    def _check_shards(self, need: np.ndarray, on_bad_shard: str) -> np.ndarray | None:
        bad = np.zeros(len(self._shards), dtype=bool)
        for s in np.flatnonzero(need).tolist():
            size = self._shard_size(s)
            if size is None:
                reason = "missing"
            elif size < need[s]:
                row, byte = self._first_row_past(s, size)
                reason = f"truncated: {size} bytes, but index row {row} points to byte {byte}"
            else:
                continue
            bad[s] = True
            self.report.bad_shards[self._shards[s]] = reason
        if not bad.any():
            return None
        keep = np.ones(self.report.num_rows, dtype=bool)
        pos = 0
        for batch in self._batches(["shard_id"]):
            sid = batch.column("shard_id").to_numpy()
            keep[pos : pos + len(sid)] = ~bad[sid]
            pos += len(sid)
        self.report.skipped_rows = int((~keep).sum())
        if on_bad_shard == "error":
            first = next(iter(self.report.bad_shards.items()))
            raise ValueError(
                f"shard {first[0]} is {first[1]} ({len(self.report.bad_shards)} bad shard(s), "
                f"{self.report.skipped_rows} index rows affected). Re-run `adaptiveload-prepare` on the same output "
                "folder to rebuild it, or pass `on_bad_shard='skip'` to train without those samples."
            )
        log.warning("%s", self.report)
        return keep

    def _shard_size(self, s: int) -> int | None:
        local = self._cached(s) if self.cache_dir is not None and _is_url(self._shards[s]) else None
        return _size(local or self._shards[s], self.storage_options)

    def __len__(self) -> int:
        return len(self._start)

    def token_grids(self) -> np.ndarray:
        """Per-sample token grid (f, h, w), ``[N, 3]`` int16 (int32 if an axis exceeds 32,767), from the index alone.

        A read-only view of the array the dataset keeps, not a copy: at 10^8 samples an int64 copy
        would cost 2.4 GB on every rank. Multiply its columns in a wider type (``astype(np.int64)``);
        ``prod`` and ``sum`` widen by themselves.
        """
        view = self._grids.view()
        view.flags.writeable = False
        return view

    def key(self, index: int) -> str:
        """The sample's key in its shard (read from the index on first use)."""
        if self._keys is None:
            self._keys = _read_parquet(self.path, ["key"], self.storage_options).column("key")
        row = index if self._rows is None else int(self._rows[index])
        return self._keys[row].as_py()

    def sample_label(self, index: int) -> str:
        """Where sample ``index`` comes from, for error messages: its key and the index file."""
        return f"sample {self.key(index)!r} of {self.path}"

    def _cached(self, s: int) -> str:
        url = self._shards[s]
        local = self.cache_dir / url.split("://", 1)[1].lstrip("/")
        if not local.exists():
            import fsspec

            local.parent.mkdir(parents=True, exist_ok=True)
            with fsspec.open(url, "rb", **self.storage_options) as src:
                atomic_write_bytes(local, src.read())
        return str(local)

    def _file(self, s: int):
        if self._pid != os.getpid():  # a forked DataLoader worker: never share the parent's handles
            self._files, self._pid = {}, os.getpid()
        fh = self._files.get(s)
        if fh is None:
            url = self._shards[s]
            if self.cache_dir is not None and _is_url(url):
                url = self._cached(s)
            fh = self._files[s] = _open(url, self.storage_options)
        return fh

    def _label(self, index: int) -> str:
        """``shard <path>, sample '<key>' (dataset index i)``: for messages only (reads the keys on first use)."""
        return f"shard {self._shards[int(self._shard_id[index])]}, sample {self.key(index)!r} (dataset index {index})"

    def _read(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        s = int(self._shard_id[index])
        start = int(self._start[index]) * self._start_unit
        length = int(self._context_start[index] + self._context_size[index])
        fh = self._file(s)
        data = bytearray(length)  # writable, so the tensors made from it are too
        if hasattr(fh, "fileno") and not _is_url(self._shards[s]):
            # pread: no shared file position, so handles inherited by forked workers cannot race.
            got = os.preadv(fh.fileno(), [data], start)
        else:
            fh.seek(start)
            got = fh.readinto(data)
        if got < length:
            raise CorruptSampleError(
                f"{self._label(index)} (bytes {start}..{start + length}): only {got} of {length} bytes could be "
                "read; the shard is truncated. Re-run `adaptiveload-prepare` on the same output folder to rebuild it."
            )
        view = memoryview(data)
        latents_size, c0 = int(self._latents_size[index]), int(self._context_start[index])
        context_view = view[c0 : c0 + int(self._context_size[index])]
        if self._checksum is not None and (self._verified is None or self._verified[index]):
            found, stored = sample_checksum(view[:latents_size], context_view), int(self._checksum[index])
            if found != stored:
                raise BadSampleError(
                    f"bytes {start}..{start + length} have CRC-32 {found:#010x}, the index says {stored:#010x}: the "
                    "shard changed after it was written (a flipped bit or an overwritten file)"
                )
        where = f"{self._label(index)} (bytes {start}..{start + length})"
        latents = _parse_npy(view[:latents_size], f"{where}, latents")
        context = _parse_npy(context_view, f"{where}, context")
        return latents, context

    def _bad_sample(self, index: int, err: BadSampleError, latents_shape: tuple[int, ...] | None) -> dict[str, Any]:
        shard = self._shards[int(self._shard_id[index])]
        message = f"{self._label(index)}: {err}"
        if self.on_bad_sample == "error":
            raise BadSampleError(
                f"{message}. Delete {shard} and re-run `adaptiveload-prepare` with the same inputs and output folder "
                "to rebuild it (inputs that encode to non-finite values are skipped there), or pass "
                "`on_bad_sample='skip'` to train without such samples (each is counted and named once)."
            ) from err
        self.report.bad_samples += 1
        if len(self.report.bad_sample_examples) < _MAX_EXAMPLES:
            self.report.bad_sample_examples.append(message)
        if latents_shape is None:  # the bytes are not to be trusted: the shape comes from the index
            row = self._index_row(index, ("channels", "latent_f", "latent_h", "latent_w"))
            latents_shape = (row["channels"], row["latent_f"], row["latent_h"], row["latent_w"])
        return skipped_sample(latents_shape, (self.text_len, self.text_dim), self.dtype, index, message)

    def _index_row(self, index: int, columns: Sequence[str]) -> dict[str, Any]:
        """Some columns of one index row, reading only the row group that holds it."""
        row = index if self._rows is None else int(self._rows[index])
        with self._parquet() as pf:
            for g in range(pf.metadata.num_row_groups):
                size = pf.metadata.row_group(g).num_rows
                if row < size:
                    table = pf.read_row_group(g, columns=list(columns))
                    return {c: table.column(c)[row].as_py() for c in columns}
                row -= size
        raise IndexError(f"{self.path} has no row for dataset index {index}")

    def __getitem__(self, index: int) -> dict[str, Any]:
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or not 0 <= index < len(self):
            raise IndexError(f"Index {index!r} is out of range for a dataset of {len(self)} samples.")
        index = int(index)
        try:
            latents, context = self._read(index)
        except BadSampleError as err:
            return self._bad_sample(index, err, None)
        if context.ndim != 2 or context.shape[1] != self.text_dim or context.shape[0] > self.text_len:
            raise CorruptSampleError(
                f"{self._label(index)}: context of shape {list(context.shape)}; expected "
                f"[L <= text_len={self.text_len}, {self.text_dim}]"
            )
        latents = torch.from_numpy(latents).to(self.dtype)
        padded = torch.zeros(self.text_len, self.text_dim, dtype=self.dtype)
        padded[: context.shape[0]] = torch.from_numpy(context)
        # Checked in the returned dtype: a float32 1e30 stored becomes inf in float16.
        for name, values in (("latents", latents), ("context", padded[: context.shape[0]])):
            problem = value_problem(name, values, self.max_abs_value)
            if problem is not None:
                return self._bad_sample(index, BadSampleError(problem), tuple(latents.shape))
        return {"latents": latents, "context": padded, "index": index}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_files"] = {}
        return state

    def __del__(self) -> None:
        for fh in getattr(self, "_files", {}).values():
            try:
                fh.close()
            except Exception:  # noqa: BLE001 - closing at interpreter exit may fail; nothing to do
                pass

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.path!r}, samples={len(self)}, shards={len(self._shards)}, "
            f"text_len={self.text_len}, text_dim={self.text_dim})"
        )


def index_rows_to_table(rows: Sequence[Mapping[str, Any]]) -> pa.Table:
    """Rows (dicts with every INDEX_COLUMNS key but ``shard_id``) → an index table (shard_id filled later)."""
    columns = {k: [r.get(k, 0 if k == "shard_id" else None) for r in rows] for k in INDEX_COLUMNS}
    return pa.table({k: pa.array(v, type=INDEX_COLUMNS[k]) for k, v in columns.items()})
