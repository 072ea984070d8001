"""Media → buckets → VAE latents + umT5 context → tar shards + shape index. Lightning-free.

Work is cut into chunks of ``samples_per_shard`` consecutive inputs; chunk ``c`` becomes
``shards/shard-{c:06d}.tar`` and rank ``r`` of ``W`` does the chunks with ``c % W == r``. Chunking
depends on the input order only, so a rerun (with any world size) finds the same chunks and skips
those that are finished: a chunk is finished when its tar, its index part and its done-marker (written
last, each atomically) exist and agree on the tar's size. Decoding runs in DataLoader workers; the
main process groups decoded samples by bucket and encodes ``batch_size`` of one bucket at a time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_adaptiveload.data.bad_samples import MAX_ABS_VALUE, value_problem
from lightning_adaptiveload.data.media import CorruptSampleError, load_image, load_video, resize_center_crop
from lightning_adaptiveload.data.shards import (
    ShardWriter,
    atomic_write_bytes,
    index_rows_to_table,
    write_index,
)
from lightning_adaptiveload.geometry import latent_of_grid
from lightning_adaptiveload.prepare.buckets import Bucket, BucketRules, SkipSample
from lightning_adaptiveload.prepare.encoders import caption_hash, clean_caption
from lightning_adaptiveload.prepare.inputs import InputItem, probe

log = logging.getLogger(__name__)

STORE_DTYPES = {"float16": np.float16, "float32": np.float32}


class PrepareError(RuntimeError):
    """The corpus cannot be finished as asked (unfinished shards, nothing encodable, a wrong encoder)."""


@dataclass
class PrepareResult:
    """What one rank did, and (on the rank that merged) the corpus summary.

    Attributes:
        chunks_done: chunks this rank encoded.
        chunks_skipped: chunks found finished and left as they were.
        samples: samples this rank wrote.
        skipped: inputs this rank skipped, by reason.
        summary: the merged summary (``summary.json``), on the merging rank; else ``None``.
    """

    chunks_done: int = 0
    chunks_skipped: int = 0
    samples: int = 0
    skipped: Counter = field(default_factory=Counter)
    summary: dict[str, Any] | None = None


def chunk_name(chunk: int) -> str:
    return f"shard-{chunk:06d}"


def _identity(x: Any) -> Any:
    return x


class _Decode(Dataset):
    """Probe, pick the bucket and decode one input → pixels ``[3, F, H, W]`` float16, or a skip record."""

    def __init__(self, items: Sequence[tuple[int, InputItem]], rules: BucketRules, missing_caption: str) -> None:
        self.items, self.rules, self.missing_caption = list(items), rules, missing_caption

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        chunk, item = self.items[i]
        out: dict[str, Any] = {"chunk": chunk, "item": item}
        try:
            caption = clean_caption(item.caption) if item.caption is not None else ""
            if not caption:
                if self.missing_caption == "skip":
                    raise SkipSample("missing caption", f"{item.source or '(no path)'} has no caption")
            found = probe(item.path)
            bucket = self.rules.choose(found.num_frames, found.height, found.width, found.is_image)
            try:
                frames = load_image(item.path) if found.is_image else load_video(item.path, bucket.frames)
            except CorruptSampleError as err:
                raise SkipSample("unreadable", str(err)) from err
            pixels = resize_center_crop(frames, bucket.height, bucket.width).half()
        except SkipSample as skip:
            out["skip"] = (skip.reason, skip.detail)
            return out
        out.update(caption=caption, probe=found, bucket=bucket, pixels=pixels)
        return out


class _Chunk:
    """One shard being written: its writer, index rows, skip records and per-bucket pending samples."""

    def __init__(self, out_dir: Path, chunk: int) -> None:
        self.chunk = chunk
        self.name = chunk_name(chunk)
        self.writer = ShardWriter(out_dir / "shards" / f"{self.name}.tar")
        self.rows: list[dict[str, Any]] = []
        self.skips: list[dict[str, Any]] = []
        self.encode_skips: Counter = Counter()  # skips found at encoding (decoding's are counted as they come)
        self.pending: dict[Bucket, list[dict[str, Any]]] = defaultdict(list)


def _is_finished(out_dir: Path, chunk: int) -> bool:
    name = chunk_name(chunk)
    done, part = out_dir / "parts" / f"{name}.done.json", out_dir / "parts" / f"{name}.parquet"
    tar = out_dir / "shards" / f"{name}.tar"
    if not (done.is_file() and tar.is_file() and part.is_file()):
        return False
    try:
        marker = json.loads(done.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return marker.get("tar_bytes") == tar.stat().st_size


class Preparer:
    """Encodes a list of inputs into shards (one rank's share) and merges the index.

    Args:
        out_dir: output folder (created).
        rules: :class:`BucketRules`.
        vae: callable ``pixels [B, 3, F, H, W] → latents [B, C, f, h, w]`` (e.g. :class:`WanVaeEncoder`).
        text_encoder: callable ``captions → list of [L_i, D]`` (e.g. :class:`UMT5TextEncoder`), with
            attributes ``text_len`` and ``dim``.
        samples_per_shard: inputs per chunk (= per shard, minus skips).
        batch_size: samples of one bucket encoded together.
        num_workers: DataLoader workers that probe and decode.
        store_dtype: ``"float16"`` (default; bf16 encoder outputs fit it exactly in their usual range)
            or ``"float32"``.
        missing_caption: ``"skip"`` (default, counted) or ``"empty"`` (encode the empty caption).
        rank: this process's rank.
        world_size: number of ranks.
        encoder_names: recorded in every sample's meta and the index metadata.
        progress: show a tqdm bar (rank 0).
    """

    def __init__(
        self,
        out_dir: str | os.PathLike,
        rules: BucketRules,
        vae: Callable[[torch.Tensor], torch.Tensor],
        text_encoder: Callable[[Sequence[str]], list[torch.Tensor]],
        *,
        samples_per_shard: int = 256,
        batch_size: int = 1,
        num_workers: int = 0,
        store_dtype: str = "float16",
        missing_caption: str = "skip",
        rank: int = 0,
        world_size: int = 1,
        encoder_names: dict[str, str] | None = None,
        progress: bool = True,
    ) -> None:
        if store_dtype not in STORE_DTYPES:
            raise ValueError(f"`Preparer(store_dtype={store_dtype!r})` is not valid. Expected one of {list(STORE_DTYPES)}.")
        if missing_caption not in ("skip", "empty"):
            raise ValueError(f"`Preparer(missing_caption={missing_caption!r})` is not valid. Expected 'skip' or 'empty'.")
        for name, v in (("samples_per_shard", samples_per_shard), ("batch_size", batch_size)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"`Preparer({name}={v!r})` is not valid. Expected a positive integer.")
        if not 0 <= rank < world_size:
            raise ValueError(f"`Preparer(rank={rank}, world_size={world_size})` is not valid.")
        self.out_dir = Path(out_dir)
        self.rules, self.vae, self.text_encoder = rules, vae, text_encoder
        self.samples_per_shard, self.batch_size, self.num_workers = samples_per_shard, batch_size, num_workers
        self.store_dtype, self.missing_caption = store_dtype, missing_caption
        self.rank, self.world_size = rank, world_size
        self.encoder_names = dict(encoder_names or {})
        self.progress = progress

    # ------------------------------------------------------------------ encoding
    def num_chunks(self, num_inputs: int) -> int:
        return -(-num_inputs // self.samples_per_shard)

    def run(self, items: Sequence[InputItem]) -> PrepareResult:
        """Encode this rank's unfinished chunks. Does not merge (see :meth:`merge`)."""
        (self.out_dir / "shards").mkdir(parents=True, exist_ok=True)
        (self.out_dir / "parts").mkdir(parents=True, exist_ok=True)
        result = PrepareResult()
        todo: list[tuple[int, InputItem]] = []
        for chunk in range(self.rank, self.num_chunks(len(items)), self.world_size):
            if _is_finished(self.out_dir, chunk):
                result.chunks_skipped += 1
                continue
            start = chunk * self.samples_per_shard
            todo += [(chunk, item) for item in items[start : start + self.samples_per_shard]]
        if not todo:
            return result
        loader = DataLoader(
            _Decode(todo, self.rules, self.missing_caption),
            batch_size=None,
            num_workers=self.num_workers,
            collate_fn=_identity,
            prefetch_factor=4 if self.num_workers else None,
        )
        bar = None
        if self.progress and self.rank == 0:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(todo), desc=f"rank {self.rank}/{self.world_size} encoding", unit="input")
        current: _Chunk | None = None
        try:
            for record in loader:
                if current is None or record["chunk"] != current.chunk:
                    if current is not None:
                        self._finish(current, result)
                    current = _Chunk(self.out_dir, record["chunk"])
                item: InputItem = record["item"]
                if "skip" in record:
                    reason, detail = record["skip"]
                    current.skips.append({"row": item.row, "source": item.source, "reason": reason, "detail": detail})
                    result.skipped[reason] += 1
                else:
                    pending = current.pending[record["bucket"]]
                    pending.append(record)
                    if len(pending) == self.batch_size:
                        self._encode(current, record["bucket"])
                if bar is not None:
                    bar.update(1)
            if current is not None:
                self._finish(current, result)
                current = None
        finally:
            if current is not None:
                current.writer.abort()
            if bar is not None:
                bar.close()
        return result

    def _encode(self, chunk: _Chunk, bucket: Bucket) -> None:
        batch = chunk.pending.pop(bucket)
        pixels = torch.stack([r["pixels"] for r in batch])
        latents = self.vae(pixels).float().cpu().numpy().astype(STORE_DTYPES[self.store_dtype])
        contexts = self.text_encoder([r["caption"] for r in batch])
        dtype = STORE_DTYPES[self.store_dtype]
        for record, lat, ctx in zip(batch, latents, contexts, strict=True):
            item: InputItem = record["item"]
            key = f"{item.row:09d}"
            ctx_np = ctx.float().cpu().numpy().astype(dtype)
            expected_latent = latent_of_grid(bucket.grid, self.rules.patch_size)
            if tuple(lat.shape[1:]) != expected_latent:
                raise PrepareError(
                    f"the VAE turned {list(pixels.shape[1:])} pixels into latents {list(lat.shape)}; bucket "
                    f"{bucket} expects latent {list(expected_latent)}. "
                    "Check that --vae is a Wan 2.1 VAE (stride 4x8x8) and the bucket rules' vae_stride."
                )
            # Checked as stored: float16 turns |x| > 65,504 into inf. A sample that would fail the training
            # reader's value check is skipped here, counted with its reason, rather than written.
            problem = value_problem("latents", torch.from_numpy(lat), MAX_ABS_VALUE) or value_problem(
                "context", torch.from_numpy(ctx_np), MAX_ABS_VALUE
            )
            if problem is not None:
                reason = "non-finite or out-of-range values"
                chunk.skips.append({"row": item.row, "source": item.source, "reason": reason,
                                    "detail": f"{item.source}: {problem} after encoding ({self.store_dtype})"})
                chunk.encode_skips[reason] += 1
                continue
            found = record["probe"]
            meta = {
                "key": key,
                "source": item.source,
                "caption": record["caption"],
                "kind": "image" if found.is_image else "video",
                "source_size": [found.num_frames, found.height, found.width],
                "bucket": [bucket.frames, bucket.height, bucket.width],
                "latent_shape": list(lat.shape),
                "token_grid": list(bucket.grid),
                "dtype": self.store_dtype,
                **self.encoder_names,
            }
            where = chunk.writer.add(key, lat, ctx_np, meta)
            chunk.rows.append(
                {
                    "shard": f"shards/{chunk.name}.tar",
                    "key": key,
                    **where,
                    "channels": int(lat.shape[0]),
                    "latent_f": int(lat.shape[1]),
                    "latent_h": int(lat.shape[2]),
                    "latent_w": int(lat.shape[3]),
                    "grid_f": bucket.grid[0],
                    "grid_h": bucket.grid[1],
                    "grid_w": bucket.grid[2],
                    "seq_len": bucket.seq_len,
                    "context_len": int(ctx_np.shape[0]),
                    "caption_hash": caption_hash(record["caption"]),
                    "source": item.source,
                }
            )

    def _finish(self, chunk: _Chunk, result: PrepareResult) -> None:
        for bucket in list(chunk.pending):
            self._encode(chunk, bucket)
        tar_bytes = chunk.writer.close()
        parts = self.out_dir / "parts"
        buf = pa.BufferOutputStream()
        pq.write_table(index_rows_to_table(chunk.rows), buf)
        atomic_write_bytes(parts / f"{chunk.name}.parquet", buf.getvalue().to_pybytes())
        marker = {"tar_bytes": tar_bytes, "samples": len(chunk.rows), "skipped": chunk.skips}
        atomic_write_bytes(parts / f"{chunk.name}.done.json", json.dumps(marker, indent=1).encode())
        result.chunks_done += 1
        result.samples += len(chunk.rows)
        result.skipped.update(chunk.encode_skips)

    # ------------------------------------------------------------------ merging
    def merge(self, num_inputs: int) -> dict[str, Any]:
        """Merge every chunk's part into ``index.parquet`` + ``summary.json`` + ``skipped.jsonl``.

        Raises:
            PrepareError: some chunks are not finished (a rank failed); rerun to finish them.
        """
        chunks = range(self.num_chunks(num_inputs))
        missing = [chunk_name(c) for c in chunks if not _is_finished(self.out_dir, c)]
        if missing:
            raise PrepareError(
                f"{len(missing)} of {len(chunks)} shard(s) are not finished ({', '.join(missing[:5])}"
                f"{', ...' if len(missing) > 5 else ''}); a rank failed or was stopped. Rerun the same command: "
                "finished shards are kept and only these are encoded."
            )
        tables, skips = [], []
        for c in chunks:
            name = chunk_name(c)
            part = pq.read_table(self.out_dir / "parts" / f"{name}.parquet")
            # A part holds one shard's rows; its shard_id is the shard's position in the list below.
            part = part.set_column(part.schema.get_field_index("shard_id"), "shard_id",
                                   pa.array(np.full(part.num_rows, c, dtype=np.int32)))  # fmt: skip
            tables.append(part)
            skips += json.loads((self.out_dir / "parts" / f"{name}.done.json").read_text())["skipped"]
        # Parts written before the checksum column existed get nulls there (those samples read unverified).
        table = pa.concat_tables(tables, promote_options="default") if tables else index_rows_to_table([])
        shards = [f"shards/{chunk_name(c)}.tar" for c in chunks]
        channels = sorted(set(table.column("channels").to_pylist()))
        meta = {
            "shards": shards,
            "text_len": int(getattr(self.text_encoder, "text_len", 0)),
            "text_dim": int(getattr(self.text_encoder, "dim", 0)),
            "dtype": self.store_dtype,
            "vae_stride": list(self.rules.vae_stride),
            "patch_size": list(self.rules.patch_size),
            "latent_channels": channels,
            **self.encoder_names,
        }
        if table.num_rows == 0:
            raise PrepareError(
                f"No input could be encoded ({len(skips)} skipped: {dict(Counter(s['reason'] for s in skips))}); "
                f"see {self.out_dir / 'skipped.jsonl'}."
            )
        write_index(self.out_dir / "index.parquet", table, meta)
        summary = _summary(table, skips, num_inputs)
        atomic_write_bytes(self.out_dir / "summary.json", json.dumps(summary, indent=1).encode())
        lines = "".join(json.dumps(s) + "\n" for s in sorted(skips, key=lambda s: s["row"]))
        atomic_write_bytes(self.out_dir / "skipped.jsonl", lines.encode())
        return summary


def _summary(table: pa.Table, skips: list[dict[str, Any]], num_inputs: int) -> dict[str, Any]:
    grids = np.stack([table.column(c).to_numpy() for c in ("grid_f", "grid_h", "grid_w")], axis=1)
    seq = table.column("seq_len").to_numpy()
    buckets = []
    uniq, inverse, counts = np.unique(grids, axis=0, return_inverse=True, return_counts=True)
    for b, (grid, count) in enumerate(zip(uniq.tolist(), counts.tolist(), strict=True)):
        s = int(seq[inverse.ravel() == b][0])
        buckets.append({"token_grid": grid, "seq_len": s, "samples": count, "tokens": s * count})
    buckets.sort(key=lambda b: (b["seq_len"], b["token_grid"]))
    return {
        "inputs": num_inputs,
        "samples": int(table.num_rows),
        "tokens": int(seq.sum()),
        "skipped": len(skips),
        "skipped_by_reason": dict(sorted(Counter(s["reason"] for s in skips).items())),
        "buckets": buckets,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The per-bucket table and skip counts as text (what the CLI prints)."""
    lines = [f"{'token grid':>16} {'S':>8} {'samples':>9} {'tokens':>14}"]
    for b in summary["buckets"]:
        grid = "x".join(map(str, b["token_grid"]))
        lines.append(f"{grid:>16} {b['seq_len']:>8} {b['samples']:>9} {b['tokens']:>14}")
    lines.append(f"{'total':>16} {'':>8} {summary['samples']:>9} {summary['tokens']:>14}")
    lines.append(f"{summary['inputs']} inputs, {summary['samples']} samples, {summary['skipped']} skipped")
    lines += [f"  skipped ({reason}): {n}" for reason, n in summary["skipped_by_reason"].items()]
    return "\n".join(lines)

