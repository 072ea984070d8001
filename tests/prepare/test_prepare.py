"""adaptiveload-prepare end to end on generated media with a tiny random Wan VAE and umT5 (nothing downloaded)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from prepare_media import caption, write_image, write_video, write_zero_frame_video

from lightning_adaptiveload.cli.prepare import load_rules, main
from lightning_adaptiveload.data.media import load_pixels
from lightning_adaptiveload.data.shards import ShardedLatentDataset
from lightning_adaptiveload.prepare import PrepareError, Preparer, UMT5TextEncoder, WanVaeEncoder, read_inputs

TEXT_LEN = 16
EXPECTED_SKIPS = {"missing caption": 1, "missing file": 1, "no frames": 1, "too large": 1, "too short": 1,
                  "unreadable": 1}  # fmt: skip


@pytest.fixture(scope="module")
def corpus(good_corpus, tmp_path_factory) -> Path:
    """The good corpus plus one input of every bad kind, and one image larger than every bucket."""
    root = tmp_path_factory.mktemp("mixed")
    for p in good_corpus.iterdir():
        shutil.copy(p, root / p.name)
    rows = [json.loads(line) for line in (good_corpus / "manifest.jsonl").read_text().splitlines()]
    (root / "garbage.mp4").write_bytes(b"not a video" * 50)
    write_zero_frame_video(root / "empty.mp4")
    write_video(root / "short.mp4", frames=3)
    from PIL import Image

    Image.new("RGB", (2100, 2100), (200, 10, 10)).save(root / "huge.png")
    write_image(root / "big.png", 256, 256, seed=99)
    rows += [
        {"path": "garbage.mp4", "caption": "a clip"},
        {"path": "empty.mp4", "caption": "a clip"},
        {"path": "short.mp4", "caption": "a clip"},
        {"path": "huge.png", "caption": "a red image"},
        {"path": "big.png", "caption": caption(99)},
        {"path": "clip0.mp4", "caption": "   "},
        {"path": "gone.mp4", "caption": "a clip"},
    ]
    (root / "manifest.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def _cli(corpus: Path, out: Path, encoders: dict[str, str], *extra: str) -> int:
    return main([str(corpus / "manifest.jsonl"), str(out), "--vae", encoders["vae"], "--text-encoder",
                 encoders["text_encoder"], "--tokenizer", encoders["tokenizer"], "--buckets", "tiny", "--text-len",
                 str(TEXT_LEN), "--num-workers", "0", "--samples-per-shard", "4", "--batch-size", "2",
                 "--no-progress", *extra])  # fmt: skip


@pytest.fixture(scope="module")
def prepared(corpus, encoders, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("out")
    assert _cli(corpus, out, encoders) == 0
    return out


@pytest.fixture(scope="module")
def loaded(encoders) -> tuple[WanVaeEncoder, UMT5TextEncoder, dict[str, str]]:
    vae = WanVaeEncoder.load(encoders["vae"])
    text = UMT5TextEncoder.load(encoders["text_encoder"], encoders["tokenizer"], text_len=TEXT_LEN)
    return vae, text, {**encoders, "compute_dtype": "float32"}  # what the CLI records in every meta.json


def _preparer(out: Path, loaded, **kw) -> Preparer:
    vae, text, names = loaded
    return Preparer(out, load_rules("tiny"), kw.pop("vae", vae), text, samples_per_shard=4, batch_size=2,
                    progress=False, encoder_names=names, **kw)  # fmt: skip


def test_every_input_is_a_sample_or_a_counted_skip_with_its_reason(prepared, capsys):
    summary = json.loads((prepared / "summary.json").read_text())
    assert summary["inputs"] == 17 and summary["samples"] == 11 and summary["skipped"] == 6
    assert summary["skipped_by_reason"] == EXPECTED_SKIPS
    skipped = [json.loads(line) for line in (prepared / "skipped.jsonl").read_text().splitlines()]
    assert {s["source"]: s["reason"] for s in skipped} == {
        "garbage.mp4": "unreadable", "empty.mp4": "no frames", "short.mp4": "too short", "huge.png": "too large",
        "clip0.mp4": "missing caption", "gone.mp4": "missing file"}  # fmt: skip
    index = pq.read_table(prepared / "index.parquet")
    assert sorted(index.column("source").to_pylist()) == sorted(
        [f"clip{i}.mp4" for i in range(6)] + [f"img{i}.png" for i in range(4)] + ["big.png"]
    )
    assert sum(b["samples"] for b in summary["buckets"]) == 11
    assert summary["tokens"] == sum(b["tokens"] for b in summary["buckets"]) == sum(index.column("seq_len").to_pylist())


def test_large_sources_are_resized_to_the_largest_bucket(prepared):
    index = pq.read_table(prepared / "index.parquet").to_pylist()
    big = next(r for r in index if r["source"] == "big.png")
    assert (big["latent_f"], big["latent_h"], big["latent_w"]) == (1, 8, 8)  # 256x256 → 64x64 bucket


def test_index_offsets_are_the_tar_members(prepared):
    rows = pq.read_table(prepared / "index.parquet").to_pylist()
    for shard in {r["shard"] for r in rows}:
        with tarfile.open(prepared / shard) as tar:
            members = {m.name: m for m in tar.getmembers()}
        for r in (r for r in rows if r["shard"] == shard):
            for member, suffix in (("latents", "npy"), ("context", "npy"), ("meta", "json")):
                info = members[f"{r['key']}.{member}.{suffix}"]
                assert (info.offset_data, info.size) == (r[f"{member}_offset"], r[f"{member}_size"])
        assert len(members) == 3 * sum(r["shard"] == shard for r in rows)


def test_encoder_outputs_match_diffusers_and_transformers_called_directly(prepared, corpus, encoders):
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    vae = AutoencoderKLWan.from_pretrained(encoders["vae"]).eval()
    model = UMT5EncoderModel.from_pretrained(encoders["text_encoder"]).eval()
    tokenizer = AutoTokenizer.from_pretrained(encoders["tokenizer"])
    ds = ShardedLatentDataset(prepared / "index.parquet")
    rows = pq.read_table(prepared / "index.parquet").to_pylist()
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    # clip0 and clip1 share a bucket and a VAE/text batch (their captions differ in length, so the batch
    # is padded); clip3 and img1 are alone in theirs.
    assert len(tokenizer(caption(0)).input_ids) != len(tokenizer(caption(1)).input_ids)
    for source in ("clip0.mp4", "clip1.mp4", "clip3.mp4", "img1.png"):
        i = next(k for k, r in enumerate(rows) if r["source"] == source)
        meta = json.loads(_member(prepared, rows[i], "meta"))
        pixels = load_pixels(corpus / source, *meta["bucket"])
        with torch.no_grad():
            mu = vae.encode(pixels[None]).latent_dist.mode()
            tokens = tokenizer(meta["caption"], padding="max_length", max_length=TEXT_LEN, truncation=True,
                               return_tensors="pt")  # fmt: skip
            hidden = model(tokens.input_ids, tokens.attention_mask).last_hidden_state[0]
        n = int(tokens.attention_mask.sum())
        item = ds[i]
        torch.testing.assert_close(item["latents"], ((mu - mean) / std)[0], atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(item["context"][:n], hidden[:n], atol=2e-3, rtol=2e-3)
        assert not item["context"][n:].any() and rows[i]["context_len"] == n


def _member(out: Path, row: dict, member: str) -> bytes:
    with open(out / row["shard"], "rb") as fh:
        fh.seek(row[f"{member}_offset"])
        return fh.read(row[f"{member}_size"])


class _CrashingVae:
    def __init__(self, vae, after: int) -> None:
        self.vae, self.calls, self.after = vae, 0, after

    def __call__(self, pixels):
        self.calls += 1
        if self.calls > self.after:
            raise RuntimeError("simulated crash")
        return self.vae(pixels)


def test_a_rerun_after_a_crash_keeps_finished_shards_and_encodes_the_rest(prepared, corpus, loaded, tmp_path):
    items = read_inputs(corpus / "manifest.jsonl")[:8]  # shards 0 and 1; shard 0 takes 3 VAE calls
    with pytest.raises(RuntimeError, match="simulated crash"):
        _preparer(tmp_path, loaded, vae=_CrashingVae(loaded[0], after=4)).run(items)
    assert sorted(p.name for p in (tmp_path / "parts").glob("*.done.json")) == ["shard-000000.done.json"]
    assert not list((tmp_path / "shards").glob(".*.tmp"))  # the interrupted shard's temp file is gone
    assert not (tmp_path / "shards" / "shard-000001.tar").exists()
    with pytest.raises(PrepareError, match=r"1 of 2 shard\(s\) are not finished \(shard-000001\)"):
        _preparer(tmp_path, loaded).merge(len(items))
    again = _preparer(tmp_path, loaded)
    result = again.run(items)
    assert (result.chunks_skipped, result.chunks_done) == (1, 1)
    again.merge(len(items))
    fresh = [r for r in pq.read_table(prepared / "index.parquet").to_pylist() if r["shard_id"] < 2]
    assert pq.read_table(tmp_path / "index.parquet").to_pylist() == fresh
    assert (tmp_path / "shards" / "shard-000001.tar").read_bytes() == (prepared / "shards" / "shard-000001.tar").read_bytes()
    # A finished shard truncated afterwards (a bad copy) no longer matches its done marker: a rerun rebuilds it.
    tar = tmp_path / "shards" / "shard-000000.tar"
    os.truncate(tar, tar.stat().st_size - 1024)
    result = again.run(items)
    assert (result.chunks_skipped, result.chunks_done) == (1, 1)
    assert tar.read_bytes() == (prepared / "shards" / "shard-000000.tar").read_bytes()


def test_two_ranks_split_the_shards_and_merge_one_index(prepared, corpus, loaded, tmp_path):
    items = read_inputs(corpus / "manifest.jsonl")
    results = [_preparer(tmp_path, loaded, rank=r, world_size=2).run(items) for r in (0, 1)]
    assert [r.chunks_done for r in results] == [3, 2]  # shards 0, 2, 4 and 1, 3
    assert sum(r.samples for r in results) == 11
    assert sum(sum(r.skipped.values()) for r in results) == 6
    _preparer(tmp_path, loaded, rank=0, world_size=2).merge(len(items))
    assert pq.read_table(tmp_path / "index.parquet").to_pylist() == pq.read_table(prepared / "index.parquet").to_pylist()


def test_missing_captions_can_be_encoded_empty(corpus, loaded, tmp_path):
    items = [i for i in read_inputs(corpus / "manifest.jsonl") if i.source == "clip0.mp4"]
    prep = _preparer(tmp_path, loaded, missing_caption="empty")
    assert prep.run(items).samples == 2
    ds = ShardedLatentDataset(tmp_path / "index.parquet") if prep.merge(len(items)) else None
    assert len(ds) == 2


def test_folder_input_reads_sidecar_captions(tmp_path, encoders):
    folder = tmp_path / "media"
    folder.mkdir()
    write_image(folder / "a.png")
    (folder / "a.txt").write_text("a red cat")
    write_image(folder / "b.png", seed=1)  # no caption → skipped
    items = read_inputs(folder)
    assert [(i.source, i.caption) for i in items] == [("a.png", "a red cat"), ("b.png", None)]


def test_cli_errors_are_one_line(tmp_path, encoders, capsys):
    assert main([str(tmp_path / "nope.jsonl"), str(tmp_path / "out"), "--vae", encoders["vae"], "--text-encoder",
                 encoders["text_encoder"], "--tokenizer", encoders["tokenizer"], "--buckets", "tiny"]) == 1  # fmt: skip
    assert capsys.readouterr().err.strip().startswith("adaptiveload-prepare: Input")


def test_store_dtype_float32_round_trips(corpus, loaded, tmp_path):
    items = [i for i in read_inputs(corpus / "manifest.jsonl") if i.source == "img0.png"]
    prep = _preparer(tmp_path, loaded, store_dtype="float32")
    prep.run(items)
    prep.merge(len(items))
    ds = ShardedLatentDataset(tmp_path / "index.parquet")
    vae = loaded[0]
    pixels = load_pixels(corpus / "img0.png", 1, 64, 64).half()  # decoding workers hand over float16 pixels
    np.testing.assert_allclose(ds[0]["latents"].numpy(), vae(pixels[None])[0].numpy(), rtol=1e-5, atol=1e-5)


def _train(index: Path, out: Path, record: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE", "NODE_RANK")}  # fmt: skip
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    script = Path(__file__).parents[1] / "helpers" / "train_from_shards.py"
    return subprocess.run([sys.executable, str(script), str(index), str(out), str(record), *extra], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # ~39 s on a 2-core CPU
def test_training_from_shards_on_two_ranks_killed_and_resumed_sees_every_sample_once(prepared, tmp_path):
    from train_from_shards import POLICY

    from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
    from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler

    index = prepared / "index.parquet"
    crashed = _train(index, tmp_path, tmp_path / "first", "--kill-at", "2")
    assert crashed.returncode == 3, crashed.stderr[-3000:]
    resumed = _train(index, tmp_path, tmp_path / "second", "--ckpt", str(tmp_path / "ckpt" / "step=2.ckpt"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def seen(name: str, rank: int) -> list[list[int]]:
        path = tmp_path / f"{name}.rank{rank}"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []

    grids = ShardedLatentDataset(index).token_grids()
    everything = []
    for rank in (0, 1):
        plan = list(AdaptiveBucketBatchSampler(grids, DualConstraintPolicy(**POLICY), num_replicas=2, rank=rank, seed=1))
        assert len(seen("first", rank)) == 2 and len(plan) > 2
        assert seen("first", rank) + seen("second", rank) == plan  # the resumed run continues the same plan
        everything += [i for batch in plan for i in batch]
    assert sorted(set(everything)) == list(range(11))


@pytest.mark.slow  # ~18-26 s on a 2-core CPU
def test_torchrun_two_ranks_write_the_same_index_as_one_process(good_corpus, encoders, tmp_path):
    # Images first: rank 0's shard is 4 images + 1 clip, rank 1's is 5 clips, so rank 1 finishes last and
    # rank 0 must wait for it before merging.
    lines = (good_corpus / "manifest.jsonl").read_text().splitlines()
    manifest = tmp_path / "images_first.jsonl"
    manifest.write_text("\n".join(lines[6:] + lines[:6]) + "\n")
    args = [str(manifest), "--root", str(good_corpus), "--vae", encoders["vae"], "--text-encoder", encoders["text_encoder"],
            "--tokenizer", encoders["tokenizer"], "--buckets", "tiny", "--text-len", str(TEXT_LEN), "--num-workers",
            "0", "--samples-per-shard", "5", "--no-progress"]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
                                                            "WORLD_SIZE", "NODE_RANK")}  # fmt: skip
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                           "lightning_adaptiveload.cli.prepare", args[0], str(tmp_path / "ddp"), *args[1:]], env=env,
                          capture_output=True, text=True, timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rank 0/2: 1 shard(s) encoded" in proc.stderr and "rank 1/2: 1 shard(s) encoded" in proc.stderr
    assert main([args[0], str(tmp_path / "one"), *args[1:]]) == 0
    assert pq.read_table(tmp_path / "ddp" / "index.parquet").to_pylist() == pq.read_table(
        tmp_path / "one" / "index.parquet"
    ).to_pylist()
