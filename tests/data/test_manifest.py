import csv
import json
import warnings

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from lightning_adaptiveload.data.bad_samples import BadSampleError
from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.manifest import ContextMismatchError, ManifestDataset, read_manifest_shapes
from lightning_adaptiveload.data.media import (
    CorruptSampleError,
    PatchPoolEncoder,
    load_video,
    resize_center_crop,
    sample_frame_indices,
)
from lightning_adaptiveload.geometry import pixel_shape_of_grid, pixel_token_grids

# Rows without embeddings fall back to zeros with a warning; the tests that care assert it.
pytestmark = pytest.mark.filterwarnings("ignore:.*has no text embedding:UserWarning")

TEXT = {"text_len": 6, "text_dim": 8}
COLUMNS = ("path", "num_frames", "height", "width", "caption", "text_embedding")


def write_manifest(tmp_path, rows, fmt="jsonl", name="manifest"):
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif fmt == "csv":
        columns = [c for c in COLUMNS if any(c in r for r in rows)]
        with open(path, "w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=columns)
            writer.writeheader()
            writer.writerows(rows)
    else:
        pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def save_latents(path, shape, context=None, seed=0):
    latents = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    tensors = {"latents": latents} if context is None else {"latents": latents, "context": context}
    save_file(tensors, str(path))
    return latents


def row(path, num_frames=1, height=64, width=64, **extra):
    return {"path": path, "num_frames": num_frames, "height": height, "width": width, **extra}


@pytest.mark.parametrize("fmt", ["jsonl", "csv", "parquet"])
def test_latents_in_all_formats(tmp_path, fmt):
    a = save_latents(tmp_path / "a.safetensors", (16, 5, 8, 12))
    b = torch.randn(16, 1, 8, 8)
    torch.save(b, tmp_path / "b.pt")
    c = torch.randn(16, 21, 60, 104)
    torch.save({"latents": c}, tmp_path / "c.pt")
    rows = [row("a.safetensors", 17, 64, 96), row("b.pt"), row("c.pt", 81, 480, 832)]
    ds = ManifestDataset(write_manifest(tmp_path, rows, fmt), **TEXT)
    assert ds.token_grids().tolist() == [[5, 4, 6], [1, 4, 4], [21, 30, 52]]
    for i, expected in enumerate((a, b, c)):
        item = ds[i]
        torch.testing.assert_close(item["latents"], expected, rtol=0, atol=0)
        assert item["context"].shape == (6, 8)
        assert item["index"] == i
    grids, report = read_manifest_shapes(write_manifest(tmp_path, rows, fmt, name="again"))
    assert grids.tolist() == ds.token_grids().tolist()
    assert (report.num_rows, report.num_valid, report.skipped) == (3, 3, {})


def test_read_manifest_shapes_needs_no_files_and_is_vectorised(tmp_path):
    rng = np.random.default_rng(0)
    n = 100_000
    frames = rng.choice([1, 17, 33, 81], n)
    heights = rng.choice([480, 720, 500], n)
    widths = rng.choice([832, 1280, 100], n)
    table = pa.table(
        {
            "path": [f"clip_{i}.mp4" for i in range(n)],
            "num_frames": frames,
            "height": heights,
            "width": widths,
        }
    )
    pq.write_table(table, tmp_path / "big.parquet")
    grids, report = read_manifest_shapes(tmp_path / "big.parquet")
    np.testing.assert_array_equal(grids, pixel_token_grids(frames, heights, widths))
    assert report.num_valid == n


BAD_ROWS = [
    (row(None), "manifest row 2 (no path): path is missing; expected a file path", "missing path"),
    (row("clip_0042.mp4", height=-1), "manifest row 2 (clip_0042.mp4): height=-1; expected a positive integer", "bad height"),
    (row("clip.mp4", num_frames=0), "manifest row 2 (clip.mp4): num_frames=0; expected a positive integer", "bad num_frames"),
    (row("clip.mp4", width=64.5), "manifest row 2 (clip.mp4): width=64.5; expected a positive integer", "bad width"),
    (row("clip.mp4", height="abc"), "manifest row 2 (clip.mp4): height='abc'; expected a positive integer", "bad height"),
    ({"path": "clip.mp4", "num_frames": 5, "width": 64}, "manifest row 2 (clip.mp4): height is missing; expected a positive integer", "bad height"),
    (row("anim.gif"), "manifest row 2 (anim.gif): unknown extension '.gif'; expected .safetensors, .pt (latents)", "unknown extension"),
    (row("noext"), "manifest row 2 (noext): unknown extension '(none)'", "unknown extension"),
    (row("img.png", num_frames=17), "manifest row 2 (img.png): num_frames=17 but the file is an image; expected num_frames=1", "image with num_frames > 1"),
    (row("tiny.mp4", height=8), "manifest row 2 (tiny.mp4): height=8 is smaller than one token (vae_stride x patch_size); expected at least 16", "smaller than one token"),
    (row("gone.mp4"), "manifest row 2 (gone.mp4): file not found at ", "missing file"),
    (row("ok.safetensors", text_embedding="t.txt"), "manifest row 2 (ok.safetensors): text_embedding='t.txt' has an unknown extension; expected .safetensors or .pt", "bad text_embedding"),
    (row("ok.safetensors", text_embedding="t_missing.pt"), "manifest row 2 (ok.safetensors): text_embedding file not found at ", "missing text_embedding file"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("bad", "message", "reason"), BAD_ROWS, ids=[r[2] + "-" + str(i) for i, r in enumerate(BAD_ROWS)]
)
def test_bad_row_errors_and_skips(tmp_path, bad, message, reason):
    save_latents(tmp_path / "ok.safetensors", (16, 1, 8, 8))
    rows = [row("ok.safetensors"), bad, row("ok.safetensors")]
    path = write_manifest(tmp_path, rows)
    with pytest.raises(ValueError) as err:
        ManifestDataset(path, **TEXT)
    assert message in str(err.value)
    assert "on_bad_row='skip'" in str(err.value)

    with pytest.warns(UserWarning, match=rf"Skipped 1 of 3 rows of manifest .*{reason}: 1"):
        ds = ManifestDataset(path, on_bad_row="skip", **TEXT)
    assert len(ds) == 2
    assert ds.report.skipped == {reason: 1}
    assert ds.report.num_valid == 2 and ds.report.num_skipped == 1
    assert message in ds.report.examples[0]
    assert ds[1]["index"] == 1


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_bad_rows_in_csv_and_parquet(tmp_path, fmt):
    save_latents(tmp_path / "ok.safetensors", (16, 1, 8, 8))
    rows = [row("ok.safetensors"), row("clip_0042.mp4", height=-1), row("x.gif"), row("gone.mp4")]
    path = write_manifest(tmp_path, rows, fmt)
    with pytest.raises(
        ValueError, match=r"manifest row 2 \(clip_0042.mp4\): height=-1; expected a positive integer"
    ):
        ManifestDataset(path, **TEXT)
    with pytest.warns(UserWarning, match="Skipped 3 of 4"):
        ds = ManifestDataset(path, on_bad_row="skip", **TEXT)
    assert ds.report.skipped == {"bad height": 1, "unknown extension": 1, "missing file": 1}


def test_mixed_type_and_broken_jsonl_rows_are_named(tmp_path):
    save_latents(tmp_path / "ok.safetensors", (16, 1, 8, 8))
    lines = [
        json.dumps(row("ok.safetensors")),
        "{not json",
        json.dumps(row("ok.safetensors", height="64")),
        "[1, 2]",
        "",
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"manifest row 2: not valid JSON"):
        ManifestDataset(path, **TEXT)
    with pytest.warns(UserWarning):
        ds = ManifestDataset(path, on_bad_row="skip", **TEXT)
    # A numeric string is accepted as a size; blank lines are not rows.
    assert ds.report.skipped == {"malformed row": 2}
    assert ds.report.examples[1] == "manifest row 4: not a JSON object (list)"
    assert ds.token_grids().tolist() == [[1, 4, 4], [1, 4, 4]]


def test_skip_counts_several_reasons_once_per_row(tmp_path):
    rows = [row("a.pt", height=-1, width="x"), row("b.gif", num_frames=0), row("c.safetensors")]
    with pytest.warns(UserWarning, match="Skipped 2 of 3 rows"):
        grids, report = read_manifest_shapes(write_manifest(tmp_path, rows), on_bad_row="skip")
    assert grids.tolist() == [[1, 4, 4]]
    assert report.skipped == {"bad num_frames": 1, "bad height": 1}
    assert report.examples == [
        "manifest row 1 (a.pt): height=-1; expected a positive integer",
        "manifest row 2 (b.gif): num_frames=0; expected a positive integer",
    ]


def test_manifest_level_errors(tmp_path):
    with pytest.raises(ValueError, match=r"has no column\(s\) \['height'\]"):
        read_manifest_shapes(write_manifest(tmp_path, [{"path": "a.pt", "num_frames": 1, "width": 64}]))
    with pytest.raises(ValueError, match="unknown extension"):
        read_manifest_shapes(tmp_path / "m.txt")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_manifest_shapes(tmp_path / "nope.csv")
    (tmp_path / "empty.csv").write_text("path,num_frames,height,width\n")
    with pytest.raises(ValueError, match="has no rows"):
        read_manifest_shapes(tmp_path / "empty.csv")
    (tmp_path / "broken.csv").write_text("path,num_frames,height,width\na.pt,1,64\n")
    with pytest.raises(ValueError, match="Cannot parse manifest"):
        read_manifest_shapes(tmp_path / "broken.csv")
    with pytest.raises(ValueError, match="Every row of manifest"):
        read_manifest_shapes(write_manifest(tmp_path, [row("a.gif")], name="allbad"), on_bad_row="skip")
    with pytest.raises(ValueError, match=r"on_bad_row='ignore'"):
        read_manifest_shapes(tmp_path / "empty.csv", on_bad_row="ignore")


def test_root_and_absolute_paths(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    a = save_latents(data / "a.safetensors", (16, 1, 8, 8))
    b = save_latents(tmp_path / "b.safetensors", (16, 1, 8, 8), seed=1)
    path = write_manifest(tmp_path, [row("a.safetensors"), row(str(tmp_path / "b.safetensors"))])
    ds = ManifestDataset(path, root=data, **TEXT)
    torch.testing.assert_close(ds[0]["latents"], a)
    torch.testing.assert_close(ds[1]["latents"], b)


def test_latent_shape_fitting(tmp_path):
    # 72x72 pixels: VAE latent 9x9, token grid 4x4, so latents are trimmed to 8x8.
    vae = save_latents(tmp_path / "vae.safetensors", (16, 1, 9, 9))
    save_file({"latents": torch.randn(1, 16, 1, 8, 8)}, str(tmp_path / "batched.safetensors"))
    save_latents(tmp_path / "wrong.safetensors", (16, 2, 8, 8))
    save_file({"lat": torch.randn(16, 1, 8, 8)}, str(tmp_path / "nokey.safetensors"))
    rows = [
        row("vae.safetensors", 1, 72, 72),
        row("batched.safetensors"),
        row("wrong.safetensors"),
        row("nokey.safetensors"),
    ]
    ds = ManifestDataset(write_manifest(tmp_path, rows), **TEXT)
    torch.testing.assert_close(ds[0]["latents"], vae[:, :, :8, :8])
    assert ds[1]["latents"].shape == (16, 1, 8, 8)
    with pytest.raises(
        CorruptSampleError,
        match=r"manifest row 3 \(wrong.safetensors\): latents in .* have shape \[16, 2, 8, 8\]",
    ):
        ds[2]
    with pytest.raises(CorruptSampleError, match=r"has no 'latents' tensor \(keys: \['lat'\]\)"):
        ds[3]


def test_text_context_sources(tmp_path):
    save_latents(tmp_path / "ctx.safetensors", (16, 1, 8, 8), context=torch.ones(3, 8))
    save_latents(tmp_path / "plain.safetensors", (16, 1, 8, 8))
    save_file({"emb": torch.full((6, 8), 2.0)}, str(tmp_path / "emb.safetensors"))
    torch.save(torch.full((1, 2, 8), 3.0), tmp_path / "emb.pt")
    torch.save(torch.zeros(7, 8), tmp_path / "long.pt")
    rows = [
        row("ctx.safetensors"),
        row("plain.safetensors", text_embedding="emb.safetensors"),
        row("ctx.safetensors", text_embedding="emb.pt"),
        row("plain.safetensors", caption="a cat"),
        row("plain.safetensors"),
        row("plain.safetensors", text_embedding="long.pt"),
    ]
    calls = []

    def text_encoder(caption):
        calls.append(caption)
        return torch.full((4, 8), 5.0)

    ds = ManifestDataset(write_manifest(tmp_path, rows), text_encoder=text_encoder, **TEXT)
    ctx = ds[0]["context"]
    assert ctx.shape == (6, 8) and ctx[:3].eq(1).all() and ctx[3:].eq(0).all()  # zero-padded
    assert ds[1]["context"].eq(2).all()
    ctx = ds[2]["context"]  # the text_embedding column wins over the latent file's context
    assert ctx[:2].eq(3).all() and ctx[2:].eq(0).all()
    assert ds[3]["context"][:4].eq(5).all() and calls == ["a cat"]
    with pytest.warns(UserWarning, match=r"manifest row 5 \(plain.safetensors\) has no text embedding"):
        assert ds[4]["context"].eq(0).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds[4]  # warned once only
    with pytest.raises(
        CorruptSampleError,
        match=r"text context from .*long.pt has shape \[7, 8\]; expected \[L, 8\] with L <= text_len=6",
    ):
        ds[5]


def test_context_of_another_text_encoder_names_the_model_override_not_on_corrupt(tmp_path):
    # A Wan manifest (umT5 contexts, width 4096) read with the tiny model's text_dim: every sample would be
    # "corrupt", so skipping is no fix; the error names the row and the model / experiment override.
    save_latents(tmp_path / "wan.safetensors", (16, 1, 8, 8), context=torch.ones(5, 64))
    for on_corrupt in ("error", "skip"):
        ds = ManifestDataset(write_manifest(tmp_path, [row("wan.safetensors")]), on_corrupt=on_corrupt, **TEXT)
        with pytest.raises(ContextMismatchError) as err:
            ds[0]
        message = str(err.value)
        assert message.startswith("manifest row 1 (wan.safetensors): text context from ") and "\n" not in message
        assert "[5, 64], but the model takes [L <= text_len=6, text_dim=8]" in message
        assert "experiment=wan2_1_1_3b_480p" in message and "on_corrupt" not in message


def test_corrupt_latents_error_and_skip(tmp_path):
    good = [save_latents(tmp_path / f"g{i}.safetensors", (16, 1, 8, 8), seed=i) for i in range(2)]
    (tmp_path / "bad.safetensors").write_bytes(b"\x00garbage")
    (tmp_path / "bad.pt").write_bytes(b"not a pickle")
    save_latents(tmp_path / "other.safetensors", (16, 5, 8, 8))
    rows = [
        row("g0.safetensors"),
        row("bad.safetensors"),
        row("other.safetensors", 17),
        row("bad.pt"),
        row("g1.safetensors"),
    ]
    path = write_manifest(tmp_path, rows)
    ds = ManifestDataset(path, **TEXT)
    with pytest.raises(
        CorruptSampleError,
        match=r"manifest row 2 \(bad.safetensors\): cannot read latents file .*on_corrupt='skip'",
    ):
        ds[1]
    with pytest.raises(CorruptSampleError, match=r"manifest row 4 \(bad.pt\): cannot read latents file"):
        ds[3]

    ds = ManifestDataset(path, on_corrupt="skip", **TEXT)
    item = ds[1]  # replaced by the next loadable sample of the same grid: row 5 (bad.pt is skipped)
    assert item["index"] == 1
    torch.testing.assert_close(item["latents"], good[1], rtol=0, atol=0)
    assert ds.report.corrupt == 2
    assert "bad.safetensors" in ds.report.corrupt_examples[0] and "bad.pt" in ds.report.corrupt_examples[1]
    torch.testing.assert_close(ds[3]["latents"], good[1], rtol=0, atol=0)  # wraps around, counted once
    assert ds.report.corrupt == 2
    batch = collate_batch([ds[0], ds[1], ds[3], ds[4]])
    assert batch["latents"].shape == (4, 16, 1, 8, 8)


def _bad_value_corpus(tmp_path):
    """Row 1 good; rows 2-4 latents holding NaN, Inf, 1e30; rows 5-6 a NaN context (embedding file, latent file)."""
    good = save_latents(tmp_path / "good.safetensors", (16, 1, 8, 8))
    for name, value in (("nan", float("nan")), ("inf", float("inf")), ("huge", 1e30)):
        latents = good.clone()
        latents[3, 0, 2, 5] = value
        save_file({"latents": latents}, str(tmp_path / f"{name}.safetensors"))
    context = torch.zeros(4, 8)
    context[1, 7] = float("nan")
    save_file({"context": context}, str(tmp_path / "nan_emb.safetensors"))
    save_file({"latents": good, "context": context}, str(tmp_path / "nan_ctx.safetensors"))
    rows = [row("good.safetensors"), row("nan.safetensors"), row("inf.safetensors"), row("huge.safetensors"),
            row("good.safetensors", text_embedding="nan_emb.safetensors"), row("nan_ctx.safetensors")]
    return write_manifest(tmp_path, rows), good


@pytest.mark.parametrize("index, message", [
    (1, r"manifest row 2 \(nan.safetensors\): latents \[16, 1, 8, 8\] hold 1 NaN value\(s\), the first at \[3, 0, 2, 5\]"),
    (2, r"manifest row 3 \(inf.safetensors\): latents \[16, 1, 8, 8\] hold 1 Inf value\(s\), the first at \[3, 0, 2, 5\]"),
    (3, r"manifest row 4 \(huge.safetensors\): latents \[16, 1, 8, 8\] hold 1 value\(s\) with \|x\| > 10000 "
        r"\(max \|x\| = 1e\+30\)"),
    (4, r"manifest row 5 \(good.safetensors\): context \[4, 8\] hold 1 NaN value\(s\), the first at \[1, 7\] "
        r"\(from .*nan_emb.safetensors\)"),
    (5, r"manifest row 6 \(nan_ctx.safetensors\): context \[4, 8\] hold 1 NaN value\(s\), the first at \[1, 7\]\. "),
])
def test_nonfinite_or_absurd_values_raise_one_line_naming_row_and_file(tmp_path, index, message):
    path, _ = _bad_value_corpus(tmp_path)
    ds = ManifestDataset(path, **TEXT)
    with pytest.raises(BadSampleError, match=message) as err:
        ds[index]
    text = str(err.value)
    assert "\n" not in text and text.endswith("or pass `on_bad_sample='skip'` to train without such samples (each "
                                                "is counted and named once).")
    assert isinstance(err.value, CorruptSampleError)  # callers catching corrupt samples catch these too
    assert ds[0]["latents"].isfinite().all()  # the good row still loads


def test_bad_values_with_skip_come_back_as_zeros_marked_bad_and_are_counted(tmp_path):
    path, good = _bad_value_corpus(tmp_path)
    ds = ManifestDataset(path, on_bad_sample="skip", **TEXT)
    items = [ds[i] for i in range(len(ds))]
    assert "bad" not in items[0] and torch.equal(items[0]["latents"], good)
    for i, item in enumerate(items[1:], start=1):
        assert item["index"] == i and f"manifest row {i + 1} (" in item["bad"]
        assert item["latents"].shape == (16, 1, 8, 8) and not item["latents"].any()
        assert item["context"].shape == (6, 8) and not item["context"].any()
    assert ds.report.bad_samples == 5 and len(ds.report.bad_sample_examples) == 5
    assert "bad samples skipped (weight 0): 5" in str(ds.report) and "bad_samples=5" in repr(ds)

    batch = collate_batch(items[:3])
    assert batch["sample_weight"].tolist() == [1.0, 0.0, 0.0]
    assert batch["bad_samples"] == [items[1]["bad"], items[2]["bad"]]
    assert set(collate_batch([items[0], items[0]])) == {"latents", "context", "index"}  # no skips: no extra keys


def test_max_abs_value_is_the_bound_and_none_refuses_only_nan_and_inf(tmp_path):
    path, _ = _bad_value_corpus(tmp_path)
    assert ManifestDataset(path, max_abs_value=None, **TEXT)[3]["latents"].max() == 1e30
    with pytest.raises(BadSampleError, match="NaN"):
        ManifestDataset(path, max_abs_value=None, **TEXT)[1]
    big = save_latents(tmp_path / "big.safetensors", (16, 1, 8, 8)) * 1e4  # |x| up to ~4e4
    save_file({"latents": big}, str(tmp_path / "big.safetensors"))
    ds = ManifestDataset(write_manifest(tmp_path, [row("big.safetensors")], name="big"), max_abs_value=1e6, **TEXT)
    torch.testing.assert_close(ds[0]["latents"], big)
    with pytest.raises(BadSampleError, match=r"with \|x\| > 1000 "):
        ManifestDataset(ds.path, max_abs_value=1e3, **TEXT)[0]
    for bad in (0, -1.0, float("nan"), "1e4"):
        with pytest.raises(ValueError, match=rf"`ManifestDataset\(max_abs_value={bad!r}\)` is not valid"):
            ManifestDataset(ds.path, max_abs_value=bad, **TEXT)
    with pytest.raises(ValueError, match=r"`ManifestDataset\(on_bad_sample='drop'\)` is not valid"):
        ManifestDataset(ds.path, on_bad_sample="drop", **TEXT)


def test_corrupt_grid_with_no_replacement(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png")
    (tmp_path / "bad.mp4").write_bytes(b"not an mp4")
    save_latents(tmp_path / "ok.safetensors", (16, 1, 8, 8))
    rows = [row("bad.png", 1, 64, 96), row("bad.mp4", 17), row("ok.safetensors")]
    with pytest.warns(UserWarning, match="PatchPoolEncoder"):
        ds = ManifestDataset(write_manifest(tmp_path, rows), on_corrupt="skip", **TEXT)
    with pytest.raises(
        CorruptSampleError, match=r"cannot decode image .*every other sample with token grid \(1, 4, 6\)"
    ):
        ds[0]
    with pytest.raises(CorruptSampleError, match=r"cannot decode video .*bad.mp4"):
        ds[1]


def _write_video(path, frames, height, width, rate=8):
    import av

    with av.open(str(path), "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            image = np.full((height, width, 3), i * 12, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def test_image_and_video_through_stand_in_encoder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (70, 100, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(tmp_path / "img.png")
    _write_video(tmp_path / "clip.mp4", frames=20, height=64, width=96)
    rows = [row("img.png", 1, 70, 100), row("clip.mp4", 20, 64, 96)]
    with pytest.warns(UserWarning, match="NOT a VAE"):
        ds = ManifestDataset(write_manifest(tmp_path, rows), **TEXT)
    assert ds.token_grids().tolist() == [[1, 4, 6], [5, 4, 6]]

    image = ds[0]["latents"]
    assert image.shape == (16, 1, 8, 12)
    # 70x100 covers 64x96 after scaling by 0.96 (→ 67x96), then the center 64 rows are kept.
    expected = PatchPoolEncoder(16)(resize_center_crop(torch.from_numpy(pixels)[None], 64, 96))
    torch.testing.assert_close(image, expected)

    video = ds[1]["latents"]
    assert video.shape == (16, 5, 8, 12)
    assert pixel_shape_of_grid((5, 4, 6)) == (17, 64, 96)
    frames = load_video(tmp_path / "clip.mp4", 17)
    assert frames.shape == (17, 64, 96, 3)
    # Frame i was painted i*12: the 17 chosen frames are spread evenly over all 20.
    chosen = sample_frame_indices(20, 17)
    assert np.abs(frames[:, 32, 48].float().mean(-1).numpy() - chosen * 12).max() < 8
    torch.testing.assert_close(video, PatchPoolEncoder(16)(resize_center_crop(frames, 64, 96)))


def test_encoder_with_wrong_output_shape_is_an_error(tmp_path):
    from PIL import Image

    Image.fromarray(np.zeros((64, 64, 3), dtype=np.uint8)).save(tmp_path / "img.png")
    ds = ManifestDataset(
        write_manifest(tmp_path, [row("img.png")]),
        encoder=lambda px: torch.zeros(4, 1, 8, 8),
        on_corrupt="skip",
        **TEXT,
    )
    with pytest.raises(ValueError, match=r"latents of shape \[4, 1, 8, 8\]; expected \[16, 1, 8, 8\]"):
        ds[0]


def test_patch_pool_encoder_formula():
    torch.manual_seed(0)
    pixels = torch.rand(3, 9, 16, 24, dtype=torch.float64) * 2 - 1
    enc = PatchPoolEncoder(latent_channels=5, vae_stride=(4, 8, 8), seed=3)
    out = enc(pixels.float())
    assert out.shape == (5, 3, 2, 3)
    # fp64 reference: frame 0 alone, then frames 1-4 and 5-8 averaged; 8x8 spatial means; projection.
    groups = [pixels[:, :1], pixels[:, 1:5], pixels[:, 5:9]]
    t = torch.stack([g.mean(dim=1) for g in groups], dim=1)
    pooled = t.reshape(3, 3, 2, 8, 3, 8).mean(dim=(3, 5))
    ref = torch.einsum("oc,cfhw->ofhw", enc.weight.double(), pooled)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(PatchPoolEncoder(5, seed=3).weight, enc.weight, rtol=0, atol=0)
    assert enc(pixels.float()[None]).shape == (1, 5, 3, 2, 3)


def test_resize_center_crop_exact():
    frames = torch.arange(2 * 4 * 3, dtype=torch.uint8).reshape(1, 2, 4, 3)
    out = resize_center_crop(frames, 2, 2)  # already covers: crop columns 1..2, no resampling
    assert out.shape == (3, 1, 2, 2)
    torch.testing.assert_close(out, frames[:, :, 1:3].permute(3, 0, 1, 2).float() / 127.5 - 1)


def test_sample_frame_indices():
    assert sample_frame_indices(81, 81).tolist() == list(range(81))
    assert sample_frame_indices(5, 3).tolist() == [0, 2, 4]
    assert sample_frame_indices(2, 4).tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError):
        sample_frame_indices(0, 3)


def test_constructor_argument_errors(tmp_path):
    path = write_manifest(tmp_path, [row("a.pt")])
    for kwargs, match in (
        ({"on_bad_row": "drop"}, r"on_bad_row='drop'"),
        ({"on_corrupt": "x"}, r"on_corrupt='x'"),
        ({"text_len": 0}, r"text_len=0"),
        ({"patch_size": (1, 2)}, r"patch_size=\(1, 2\)"),
    ):
        with pytest.raises(ValueError, match=match):
            ManifestDataset(path, check_files=False, **kwargs)
    ds = ManifestDataset(path, check_files=False)
    with pytest.raises(IndexError):
        ds[1]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_make_latent_manifest_script_round_trip(tmp_path, fmt):
    import importlib.util
    from pathlib import Path

    from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset

    script = Path(__file__).parents[2] / "examples" / "make_latent_manifest.py"
    spec = importlib.util.spec_from_file_location("make_latent_manifest", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = tmp_path / "out"
    manifest = module.main(["--out", str(out), "--num-samples", "12", "--seed", "5", "--format", fmt])
    assert manifest == out / f"manifest.{fmt}"
    ds = ManifestDataset(manifest, text_len=16, text_dim=32)
    ref = SyntheticMixedDataset(12, "tiny", text_len=16, text_dim=32, seed=5)
    np.testing.assert_array_equal(ds.token_grids(), ref.token_grids())
    for i in (0, 7, 11):
        item, expected = ds[i], ref[i]
        torch.testing.assert_close(item["latents"], expected["latents"], rtol=0, atol=0)
        length = int((item["context"].abs().sum(dim=1) > 0).sum())
        torch.testing.assert_close(item["context"][:length], expected["context"][:length], rtol=0, atol=0)
        assert item["context"][length:].eq(0).all()
    with pytest.raises(SystemExit, match="--overwrite"):
        module.main(["--out", str(out), "--format", fmt])


def test_dataset_pickles_for_dataloader_workers(tmp_path):
    import pickle

    from PIL import Image

    save_latents(tmp_path / "a.safetensors", (16, 1, 8, 8))
    Image.fromarray(np.full((64, 64, 3), 100, dtype=np.uint8)).save(tmp_path / "b.png")
    with pytest.warns(UserWarning, match="PatchPoolEncoder"):
        ds = ManifestDataset(write_manifest(tmp_path, [row("a.safetensors"), row("b.png")]), **TEXT)
    clone = pickle.loads(pickle.dumps(ds))
    for i in range(2):
        torch.testing.assert_close(clone[i]["latents"], ds[i]["latents"], rtol=0, atol=0)
    loader = torch.utils.data.DataLoader(ds, batch_size=1, num_workers=1, collate_fn=collate_batch)
    assert [b["index"].tolist() for b in loader] == [[0], [1]]


def test_latent_shape_columns_and_tensor_keys(tmp_path):
    rows = []
    for i, (f, h, w) in enumerate([(1, 4, 6), (3, 8, 8)]):
        save_file({"z": torch.full((16, f, h, w), float(i)), "txt": torch.ones(3, 8)}, tmp_path / f"s{i}.safetensors")
        rows.append({"path": f"s{i}.safetensors", "latent_frames": f, "latent_height": h, "latent_width": w})
    manifest = tmp_path / "latents.jsonl"
    manifest.write_text("\n".join(json.dumps(r) for r in rows))
    ds = ManifestDataset(manifest, text_len=4, text_dim=8, latents_key="z", context_key="txt")
    assert ds.token_grids().tolist() == [[1, 2, 3], [3, 4, 4]]  # latent shape / patch (1, 2, 2)
    item = ds[1]
    assert item["latents"].shape == (16, 3, 8, 8) and float(item["latents"][0, 0, 0, 0]) == 1.0
    assert item["context"].shape == (4, 8) and float(item["context"][:3].sum()) == 24.0
    grids, _ = read_manifest_shapes(manifest)
    assert grids.tolist() == [[1, 2, 3], [3, 4, 4]]
    with pytest.raises(Exception, match=r"has no 'latents' tensor.*latents_key"):
        ManifestDataset(manifest, text_len=4, text_dim=8)[0]

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({**rows[0], "latent_height": 0}))
    with pytest.raises(ValueError, match=r"manifest row 1 \(s0.safetensors\): latent_height=0; expected a positive"):
        read_manifest_shapes(bad)
    media = tmp_path / "media.jsonl"
    media.write_text(json.dumps({"path": "clip.mp4", "latent_frames": 1, "latent_height": 2, "latent_width": 2}))
    with pytest.raises(ValueError, match=r"manifest row 1 \(clip.mp4\): a raw image/video needs num_frames"):
        read_manifest_shapes(media)


def test_hydra_manifest_config_passes_on_bad_sample_and_max_abs_value(tmp_path):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    path, _ = _bad_value_corpus(tmp_path)
    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_adaptiveload.conf", version_base="1.3"):
        default = compose(config_name="train", overrides=["data=manifest", f"data.dataset.path={path}"])
        skipping = compose(config_name="train", overrides=["data=manifest", f"data.dataset.path={path}",
                                                           "data.dataset.on_bad_sample=skip",
                                                           "data.dataset.max_abs_value=1e31"])
    model = {"vae_stride": (4, 8, 8), "patch_size": (1, 2, 2), **TEXT}  # what adaptiveload-train takes from the model
    ds = instantiate(default.data.dataset, **model)
    assert (ds.on_bad_sample, ds.max_abs_value) == ("error", 1e4)
    with pytest.raises(BadSampleError, match="manifest row 4"):
        ds[3]
    ds = instantiate(skipping.data.dataset, **model)
    assert "bad" not in ds[3] and "bad" in ds[1]  # 1e30 is within 1e31; NaN never is


def test_make_latent_manifest_prints_the_command_of_the_model_it_was_written_for(tmp_path, capsys):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).parents[2] / "examples" / "make_latent_manifest.py"
    spec = importlib.util.spec_from_file_location("make_latent_manifest", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    for text, expected in ((["--text-len", "512", "--text-dim", "4096"], "experiment=wan2_1_1_3b_480p data=manifest"),
                           ([], "adaptiveload-train data=manifest")):
        manifest = module.main(["--out", str(tmp_path / str(len(text))), "--num-samples", "2", *text])
        assert f"Train on it: {'adaptiveload-train ' if text else ''}{expected} data.dataset.path={manifest.resolve()}" \
            in capsys.readouterr().out.replace("\n", "")
