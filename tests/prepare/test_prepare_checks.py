"""adaptiveload-prepare writes a checksum per sample and skips inputs that encode to non-finite values; a shard whose
checksum fails is rebuilt by deleting it and running the same command again, as the reader's error says."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from lightning_adaptiveload.cli.prepare import load_rules
from lightning_adaptiveload.data.bad_samples import BadSampleError
from lightning_adaptiveload.data.shards import ShardedLatentDataset, sample_checksum
from lightning_adaptiveload.prepare import Preparer, UMT5TextEncoder, WanVaeEncoder, read_inputs

TEXT_LEN = 16


class _PoisonedVae:
    """The VAE, with NaN in the latents of the first sample of its ``call``-th call."""

    def __init__(self, vae, call: int) -> None:
        self.vae, self.calls, self.call = vae, 0, call

    def __call__(self, pixels):
        latents = self.vae(pixels)
        self.calls += 1
        if self.calls == self.call:
            latents[0, 0, 0, 0, 0] = float("nan")
        return latents


@pytest.fixture(scope="module")
def encoders_loaded(encoders):
    return WanVaeEncoder.load(encoders["vae"]), UMT5TextEncoder.load(encoders["text_encoder"], encoders["tokenizer"],
                                                                     text_len=TEXT_LEN)  # fmt: skip


def _preparer(out: Path, vae, text) -> Preparer:
    return Preparer(out, load_rules("tiny"), vae, text, samples_per_shard=4, batch_size=2, progress=False)


def _read_all(index: Path) -> list[dict]:
    ds = ShardedLatentDataset(index)
    return [ds[i] for i in range(len(ds))]


def test_checksums_non_finite_skips_and_rebuilding_a_flipped_shard(good_corpus, encoders_loaded, tmp_path):
    vae, text = encoders_loaded
    items = read_inputs(good_corpus / "manifest.jsonl")
    prep = _preparer(tmp_path, _PoisonedVae(vae, call=1), text)
    result = prep.run(items)
    summary = prep.merge(len(items))
    reason = "non-finite or out-of-range values"
    assert result.skipped == {reason: 1} and summary["skipped_by_reason"] == {reason: 1}
    assert summary["samples"] + summary["skipped"] == summary["inputs"] == len(items)
    (skip,) = [json.loads(line) for line in (tmp_path / "skipped.jsonl").read_text().splitlines()]
    assert skip["reason"] == reason and "hold 1 NaN value(s), the first at [0, 0, 0, 0]" in skip["detail"]
    assert skip["detail"].startswith(f"{skip['source']}: latents [") and "after encoding (float16)" in skip["detail"]

    # Every row carries the CRC-32 of its two members, and every sample reads back verified and finite.
    rows = pq.read_table(tmp_path / "index.parquet").to_pylist()
    for r in rows:
        data = (tmp_path / r["shard"]).read_bytes()
        members = [data[r[f"{m}_offset"] : r[f"{m}_offset"] + r[f"{m}_size"]] for m in ("latents", "context")]
        assert r["checksum"] == sample_checksum(*members)
    clean = _read_all(tmp_path / "index.parquet")
    assert all(torch.isfinite(s["latents"]).all() and "bad" not in s for s in clean)

    # A flipped bit in shard 1: the read names the shard; deleting it and running again rebuilds it.
    row = next(i for i, r in enumerate(rows) if r["shard"] == "shards/shard-000001.tar")
    tar = tmp_path / rows[row]["shard"]
    data = bytearray(tar.read_bytes())
    data[rows[row]["latents_offset"] + rows[row]["latents_size"] - 1] ^= 4
    tar.write_bytes(bytes(data))
    with pytest.raises(BadSampleError, match=rf"shard {tar}, sample '{rows[row]['key']}' .*Delete {tar} and re-run"):
        ShardedLatentDataset(tmp_path / "index.parquet")[row]
    tar.unlink()
    again = _preparer(tmp_path, vae, text)
    assert (again.run(items).chunks_done, again.merge(len(items))["samples"]) == (1, summary["samples"])
    for got, want in zip(_read_all(tmp_path / "index.parquet"), clean, strict=True):
        assert torch.equal(got["latents"], want["latents"]) and torch.equal(got["context"], want["context"])


def test_parts_written_before_checksums_merge_into_unverified_rows(good_corpus, encoders_loaded, tmp_path):
    vae, text = encoders_loaded
    items = read_inputs(good_corpus / "manifest.jsonl")[:8]
    prep = _preparer(tmp_path, vae, text)
    prep.run(items)
    part = tmp_path / "parts" / "shard-000000.parquet"
    old = pq.read_table(part).drop_columns(["checksum"])  # as an older release wrote it
    pq.write_table(old, part)
    prep.merge(len(items))
    checksums = pq.read_table(tmp_path / "index.parquet").column("checksum")
    assert checksums.null_count == old.num_rows and len(checksums) > old.num_rows
    with pytest.warns(UserWarning, match=rf"{old.num_rows} of {len(checksums)} samples have no checksum"):
        ds = ShardedLatentDataset(tmp_path / "index.parquet")
    assert ds.report.unverified_rows == old.num_rows
    assert np.isfinite(ds[len(ds) - 1]["latents"].numpy()).all()
