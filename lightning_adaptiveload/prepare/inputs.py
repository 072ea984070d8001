"""What to prepare: rows of a manifest or the media files of a folder, and a cheap probe of each.

A manifest (JSONL, CSV or Parquet) needs a ``path`` column and should have ``caption``; sizes
columns (``num_frames``, ``height``, ``width``) may be present but are not trusted: every input is
probed (image header, or the video's packet count) because its true size decides the bucket.
A folder is searched recursively for image and video files; a file's caption is the text of the
``.txt`` file with the same stem beside it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from lightning_adaptiveload.data.media import IMAGE_EXTENSIONS, VIDEO_EXTENSIONS
from lightning_adaptiveload.prepare.buckets import SkipSample

MANIFEST_SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "jsonl", ".csv": "csv",
                     ".parquet": "parquet", ".pq": "parquet"}  # fmt: skip


@dataclass(frozen=True)
class InputItem:
    """One input: its position in the source (the sample key), resolved path, given path and caption."""

    row: int
    path: str
    source: str
    caption: str | None


@dataclass(frozen=True)
class Probe:
    """Sizes of a source found without decoding pixels."""

    is_image: bool
    num_frames: int
    height: int
    width: int


def _read_table(path: Path) -> pa.Table:
    fmt = MANIFEST_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise ValueError(f"Manifest {str(path)!r} has an unknown extension. Expected one of {sorted(MANIFEST_SUFFIXES)}.")
    try:
        if fmt == "jsonl":
            import pyarrow.json as pajson

            return pajson.read_json(path)
        if fmt == "csv":
            import pyarrow.csv as pacsv

            types = {"path": pa.string(), "caption": pa.string()}
            return pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(column_types=types,
                                                                              strings_can_be_null=True))
        import pyarrow.parquet as pq

        return pq.read_table(path)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as err:
        raise ValueError(f"Cannot parse manifest {str(path)!r} as {fmt}: {err}") from err


def read_inputs(source: str | os.PathLike, root: str | os.PathLike | None = None) -> list[InputItem]:
    """A manifest file or a media folder → the inputs, in a stable order (manifest order, or sorted paths).

    Raises:
        ValueError: an unreadable manifest or one without a ``path`` column; a folder with no media.
        FileNotFoundError: ``source`` does not exist.
    """
    source = Path(source)
    if source.is_dir():
        files = sorted(
            p for p in source.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS + VIDEO_EXTENSIONS
        )
        if not files:
            raise ValueError(
                f"Folder {str(source)!r} holds no media; expected {IMAGE_EXTENSIONS + VIDEO_EXTENSIONS} files."
            )
        items = []
        for row, p in enumerate(files):
            txt = p.with_suffix(".txt")
            caption = txt.read_text(encoding="utf-8") if txt.is_file() else None
            items.append(InputItem(row, str(p), str(p.relative_to(source)), caption))
        return items
    if not source.is_file():
        raise FileNotFoundError(f"Input {str(source)!r} does not exist. Expected a manifest file or a media folder.")
    table = _read_table(source)
    if "path" not in table.column_names:
        raise ValueError(
            f"Manifest {str(source)!r} has no `path` column; it has {table.column_names}. Expected columns "
            "path, caption (+ optional num_frames, height, width)."
        )
    base = Path(root) if root is not None else source.parent
    paths = table.column("path").cast(pa.string()).to_pylist()
    captions = (
        table.column("caption").cast(pa.string()).to_pylist() if "caption" in table.column_names else [None] * len(paths)
    )
    return [
        InputItem(row, "" if p is None else str(base / p), "" if p is None else p, c)
        for row, (p, c) in enumerate(zip(paths, captions, strict=True))
    ]


def probe(path: str) -> Probe:
    """Image or video sizes without decoding pixels (Pillow header; PyAV packet count).

    Raises:
        SkipSample: ``missing file``, ``unknown extension``, ``unreadable`` or ``no frames``.
    """
    if not path or not os.path.isfile(path):
        raise SkipSample("missing file", f"{path or '(no path)'} does not exist")
    ext = Path(path).suffix.lower()
    if ext in IMAGE_EXTENSIONS:
        from PIL import Image, UnidentifiedImageError

        try:
            with Image.open(path) as img:
                width, height = img.size
        except (OSError, UnidentifiedImageError, Image.DecompressionBombError) as err:
            raise SkipSample("unreadable", f"{path}: {err}") from err
        return Probe(True, 1, int(height), int(width))
    if ext not in VIDEO_EXTENSIONS:
        raise SkipSample("unknown extension", f"{path}: {ext!r} is not one of {IMAGE_EXTENSIONS + VIDEO_EXTENSIONS}")
    import av

    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise SkipSample("no frames", f"{path} has no video stream")
            stream = container.streams.video[0]
            width, height = int(stream.codec_context.width), int(stream.codec_context.height)
            # Packets, not the container's stated count: that is missing or wrong in many files.
            frames = sum(1 for packet in container.demux(stream) if packet.size)
    except (av.FFmpegError, OSError, ValueError) as err:
        raise SkipSample("unreadable", f"{path}: {err}") from err
    if frames == 0 or width < 1 or height < 1:
        raise SkipSample("no frames", f"{path}: {frames} frames of {width}x{height}")
    return Probe(False, frames, height, width)
