"""ShardedLatentDataset over shards written with ShardWriter: random access, bad shards, fsspec, DataModule resume."""

from __future__ import annotations

import json
import os
import pickle
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.data.bad_samples import BadSampleError
from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.datamodule import AdaptiveLoadDataModule
from lightning_adaptiveload.data.media import CorruptSampleError
from lightning_adaptiveload.data.shards import (
    ShardedLatentDataset,
    ShardWriter,
    index_rows_to_table,
    read_index_metadata,
    write_index,
)

GRIDS = [(1, 2, 2), (3, 2, 3), (2, 3, 3)]
TEXT_LEN, TEXT_DIM = 6, 8


def _sample(i: int) -> tuple[tuple[int, int, int], np.ndarray, np.ndarray]:
    grid = GRIDS[i % len(GRIDS)]
    latents = np.full((4, grid[0], 2 * grid[1], 2 * grid[2]), i, dtype=np.float16)
    context = np.full((1 + i % TEXT_LEN, TEXT_DIM), -i, dtype=np.float16)
    return grid, latents, context


def write_corpus(root: Path, n: int = 24, per_shard: int = 10) -> Path:
    """n samples in ceil(n / per_shard) shards + index.parquet, as adaptiveload-prepare lays them out."""
    rows, shards = [], []
    for start in range(0, n, per_shard):
        name = f"shards/shard-{start // per_shard:06d}.tar"
        shards.append(name)
        with ShardWriter(root / name) as writer:
            for i in range(start, min(n, start + per_shard)):
                grid, latents, context = _sample(i)
                where = writer.add(f"{i:09d}", latents, context, {"i": i})
                rows.append({"shard": name, "shard_id": len(shards) - 1, "key": f"{i:09d}", **where,
                             "channels": 4, "latent_f": latents.shape[1], "latent_h": latents.shape[2],
                             "latent_w": latents.shape[3], "grid_f": grid[0], "grid_h": grid[1], "grid_w": grid[2],
                             "seq_len": int(np.prod(grid)), "context_len": context.shape[0], "caption_hash": "0",
                             "source": f"src{i}"})  # fmt: skip
    meta = {"shards": shards, "text_len": TEXT_LEN, "text_dim": TEXT_DIM, "dtype": "float16"}
    write_index(root / "index.parquet", index_rows_to_table(rows), meta)
    return root / "index.parquet"


@pytest.fixture
def corpus(tmp_path) -> Path:
    return write_corpus(tmp_path)


def test_random_access_returns_what_was_written(corpus):
    ds = ShardedLatentDataset(corpus)
    assert len(ds) == 24 and ds.text_len == TEXT_LEN and ds.text_dim == TEXT_DIM
    for i in [17, 0, 23, 5, 10]:
        grid, latents, context = _sample(i)
        item = ds[i]
        assert item["index"] == i
        assert item["latents"].dtype == torch.float32
        torch.testing.assert_close(item["latents"], torch.from_numpy(latents).float())
        assert item["context"].shape == (TEXT_LEN, TEXT_DIM)
        torch.testing.assert_close(item["context"][: context.shape[0]], torch.from_numpy(context).float())
        assert not item["context"][context.shape[0] :].any()  # zero-padded to text_len
        assert tuple(ds.token_grids()[i]) == grid


def test_token_grids_come_from_the_index_alone(corpus):
    for tar in (corpus.parent / "shards").glob("*.tar"):
        tar.unlink()
    ds = ShardedLatentDataset(corpus, check_shards=False)
    grids = ds.token_grids()
    assert grids.dtype == np.int16 and not grids.flags.writeable  # a view of the kept array, not a copy
    assert [tuple(g) for g in ds.token_grids()] == [_sample(i)[0] for i in range(24)]


def test_shards_are_webdataset_readable(corpus):
    import webdataset as wds

    tar = str(corpus.parent / "shards" / "shard-000001.tar")
    got = list(wds.WebDataset(tar, shardshuffle=False).decode())
    assert [x["__key__"] for x in got] == [f"{i:09d}" for i in range(10, 20)]
    np.testing.assert_array_equal(got[3]["latents.npy"], _sample(13)[1])
    assert got[3]["meta.json"] == {"i": 13}


def test_truncated_shard_is_named_at_construction(corpus):
    tar = corpus.parent / "shards" / "shard-000001.tar"
    os.truncate(tar, tar.stat().st_size // 2)
    with pytest.raises(ValueError, match=r"shard-000001\.tar is truncated"):
        ShardedLatentDataset(corpus)
    ds = ShardedLatentDataset(corpus, on_bad_shard="skip")
    assert len(ds) == 14 and ds.report.skipped_rows == 10
    assert list(ds.report.bad_shards) == [str(tar)]
    torch.testing.assert_close(ds[10]["latents"], torch.from_numpy(_sample(20)[1]).float())  # rows renumbered
    # Without the up-front check the read itself names the shard and the sample.
    ds = ShardedLatentDataset(corpus, check_shards=False)
    with pytest.raises(CorruptSampleError, match=r"shard-000001\.tar, sample '000000019'.*truncated"):
        ds[19]


def test_missing_shard_is_named(corpus):
    (corpus.parent / "shards" / "shard-000002.tar").unlink()
    with pytest.raises(ValueError, match=r"shard-000002\.tar is missing"):
        ShardedLatentDataset(corpus)


def test_index_row_past_the_shard_end_is_named(corpus):
    table = pq.read_table(corpus)
    offsets = table.column("meta_offset").to_numpy().copy()
    offsets[3] += 10_000_000
    table = table.set_column(table.schema.get_field_index("meta_offset"), "meta_offset", [offsets])
    write_index(corpus, table, read_index_metadata(corpus))
    with pytest.raises(ValueError, match=r"shard-000000\.tar is truncated.*index row 3"):
        ShardedLatentDataset(corpus)


def test_text_dim_mismatch_and_long_context_raise(corpus):
    with pytest.raises(ValueError, match="text_dim=16"):
        ShardedLatentDataset(corpus, text_dim=16)
    ds = ShardedLatentDataset(corpus, text_len=2)
    with pytest.raises(CorruptSampleError, match=r"context of shape \[3, 8\]"):
        ds[2]


def test_not_an_index_is_refused(tmp_path):
    import pyarrow as pa

    pq.write_table(pa.table({"a": [1]}), tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="without `adaptiveload` metadata"):
        ShardedLatentDataset(tmp_path / "x.parquet")


@pytest.mark.parametrize("cached", [False, True])
def test_fsspec_url_with_and_without_a_local_cache(tmp_path, cached):
    fsspec = pytest.importorskip("fsspec")
    index = write_corpus(tmp_path / "src", n=12, per_shard=5)
    fs = fsspec.filesystem("memory")
    for path in [index, *sorted((index.parent / "shards").glob("*.tar"))]:
        fs.pipe(f"/corpus/{path.relative_to(index.parent)}", path.read_bytes())
    cache = tmp_path / "cache" if cached else None
    ds = ShardedLatentDataset("memory://corpus/index.parquet", cache_dir=cache)
    if cached:  # reads now come from the local copies alone
        fs.rm("/corpus/shards", recursive=True)
    for i in (11, 0, 7):
        torch.testing.assert_close(ds[i]["latents"], torch.from_numpy(_sample(i)[1]).float())
    assert (cache is not None) == (tmp_path / "cache" / "corpus" / "shards" / "shard-000002.tar").is_file()


class _Recorder(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx):
        self.seen.append(batch["index"].tolist())
        # A sample's latents hold its index: the loader returned the sample the sampler asked for.
        assert torch.equal(batch["latents"][:, 0, 0, 0, 0], batch["index"].float())
        return self.layer(batch["latents"].mean(dim=(2, 3, 4))).pow(2).mean() + batch["context"].sum() * 0

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit(root, model, ckpt_path=None, callbacks=()):
    dm = AdaptiveLoadDataModule(ShardedLatentDataset(root / "index.parquet"), DualConstraintPolicy(36, 36 * 18, 2),
                                seed=3, num_workers=2)  # fmt: skip
    trainer = Trainer(default_root_dir=root, accelerator="cpu", devices=1, max_epochs=1, logger=False,
                      enable_progress_bar=False, enable_model_summary=False, callbacks=list(callbacks),
                      enable_checkpointing=bool(callbacks))  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)


def test_datamodule_with_workers_resumes_mid_epoch_exactly(corpus):
    root = corpus.parent
    ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=3, save_top_k=-1, filename="{step}")
    full = _Recorder()
    _fit(root, full, callbacks=[ckpt])
    assert sorted(i for b in full.seen for i in b) == list(range(24))
    resumed = _Recorder()
    _fit(root, resumed, ckpt_path=str(root / "ckpt" / "step=3.ckpt"))
    assert resumed.seen == full.seen[3:]
    assert Counter(i for b in full.seen[:3] + resumed.seen for i in b) == Counter(range(24))


def test_hydra_config_composes_and_instantiates(corpus):
    from hydra import compose, initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from hydra.utils import instantiate

    GlobalHydra.instance().clear()
    with initialize_config_module(config_module="lightning_adaptiveload.conf", version_base="1.3"):
        cfg = compose(config_name="train", overrides=["data=shards", f"data.dataset.path={corpus}"])
        skipping = compose(config_name="train", overrides=["data=shards", f"data.dataset.path={corpus}",
                                                           "data.dataset.on_bad_sample=skip",
                                                           "data.dataset.max_abs_value=null"])
    assert cfg.data.datamodule.num_workers == 2 and cfg.data.datamodule.pin_memory is False
    ds = instantiate(cfg.data.dataset, text_len=TEXT_LEN, text_dim=TEXT_DIM)
    assert isinstance(ds, ShardedLatentDataset) and len(ds) == 24
    assert (ds.on_bad_sample, ds.max_abs_value) == ("error", 1e4)
    ds = instantiate(skipping.data.dataset, text_len=TEXT_LEN, text_dim=TEXT_DIM)
    assert (ds.on_bad_sample, ds.max_abs_value) == ("skip", None)
    assert json.loads(json.dumps(ds.metadata))["shards"][0] == "shards/shard-000000.tar"


def test_file_handles_are_per_process(corpus):
    ds = ShardedLatentDataset(corpus)
    ds[0]
    handle = ds._files[0]
    assert pickle.loads(pickle.dumps(ds))._files == {}  # spawned workers start without handles
    ds._pid = -1  # as in a forked worker: the parent's handles are dropped, not shared
    ds[1]
    assert ds._files[0] is not handle


def _rewrite_index(index: Path, edit, row_group_size: int = 7) -> None:
    """Apply ``edit(table) -> table`` to the index, keeping its metadata, in small row groups (so a
    value that needs a wider column arrives mid-stream)."""
    table = pq.read_table(index)
    meta = table.schema.metadata
    pq.write_table(edit(table).replace_schema_metadata(meta), index, row_group_size=row_group_size)


def test_compact_columns_and_widening_on_the_row_that_needs_it(tmp_path):
    import pyarrow as pa
    import pyarrow.compute as pc

    index = write_corpus(tmp_path)
    ds = ShardedLatentDataset(index)
    kept = [v for k, v in vars(ds).items() if k.startswith("_") and isinstance(v, np.ndarray)]
    assert sum(a.nbytes for a in kept) == 30 * len(ds)  # block starts (uint32), int16 grids, uint32 checksums
    assert ds._start.dtype == np.uint32 and ds._start_unit == 512 and ds.token_grids().dtype == np.int16

    # Shard 2 (samples 20-23) moved 7 bytes into its file: not a tar's block offsets any more.
    tar = tmp_path / "shards" / "shard-000002.tar"
    tar.write_bytes(b"\0" * 7 + tar.read_bytes())

    def shift(table):
        moved = pc.equal(table["shard_id"], 2)
        for col in ("latents_offset", "context_offset", "meta_offset"):
            table = table.set_column(table.schema.get_field_index(col), col,
                                     pc.if_else(moved, pc.add(table[col], 7), table[col]))
        big = pa.array([40_000 if i == 23 else g for i, g in enumerate(table["grid_w"].to_pylist())], pa.int32())
        return table.set_column(table.schema.get_field_index("grid_w"), "grid_w", big)

    _rewrite_index(index, shift)
    ds = ShardedLatentDataset(index)
    assert ds._start.dtype == np.int64 and ds._start_unit == 1
    grids = ds.token_grids()
    assert grids.dtype == np.int32 and tuple(grids[23]) == (2, 3, 40_000)
    assert [tuple(g) for g in grids[:23]] == [_sample(i)[0] for i in range(23)]  # rows before the widening kept
    for i in range(24):  # every sample still reads back, the moved ones at their new offsets
        torch.testing.assert_close(ds[i]["latents"], torch.from_numpy(_sample(i)[1]).float())


# ------------------------------------------------------------------ checksums and bad values
def _flip_bit(index: Path, i: int, member: str, at: int) -> Path:
    """Flip the lowest bit of byte ``at`` of sample ``i``'s ``member`` (negative: from its end) in its shard."""
    row = pq.read_table(index).to_pylist()[i]
    tar = index.parent / row["shard"]
    pos = row[f"{member}_offset"] + (at if at >= 0 else row[f"{member}_size"] + at)
    data = bytearray(tar.read_bytes())
    data[pos] ^= 1
    tar.write_bytes(bytes(data))
    return tar


@pytest.mark.parametrize("member, at", [("latents", -1), ("context", -1), ("latents", 20)],
                         ids=["latents payload", "context payload", "npy header"])
def test_a_flipped_bit_fails_the_checksum_naming_shard_and_sample(corpus, member, at):
    tar = _flip_bit(corpus, 13, member, at)
    ds = ShardedLatentDataset(corpus)
    assert ds.report.unverified_rows == 0
    with pytest.raises(BadSampleError) as err:
        ds[13]
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith(f"shard {tar}, sample '000000013' (dataset index 13): bytes ")
    assert "the shard changed after it was written (a flipped bit or an overwritten file)" in text
    assert f"Delete {tar} and re-run `adaptiveload-prepare` with the same inputs and output folder" in text
    assert "`on_bad_sample='skip'`" in text
    for i in (12, 14, 3, 23):  # every other sample still reads back exactly
        torch.testing.assert_close(ds[i]["latents"], torch.from_numpy(_sample(i)[1]).float(), rtol=0, atol=0)


def test_a_flipped_bit_with_skip_comes_back_as_zeros_marked_bad(corpus):
    _flip_bit(corpus, 13, "latents", 20)  # a header flip: the bytes cannot be parsed, the shape comes from the index
    ds = ShardedLatentDataset(corpus, on_bad_sample="skip", dtype="bfloat16")
    item = ds[13]
    assert item["index"] == 13 and "sample '000000013'" in item["bad"] and "CRC-32" in item["bad"]
    assert item["latents"].shape == _sample(13)[1].shape and not item["latents"].any()
    assert item["latents"].dtype == torch.bfloat16 and item["context"].shape == (TEXT_LEN, TEXT_DIM)
    assert ds.report.bad_samples == 1 and "bad samples skipped (weight 0): 1" in str(ds.report)
    assert "bad" not in ds[16]  # same token grid, unharmed


def _without_checksums(index: Path, rows=None) -> None:
    """The index as written before checksums: no column (``rows`` None), or nulls in those rows (merged parts)."""
    import pyarrow as pa

    def edit(table):
        if rows is None:
            return table.drop_columns(["checksum"])
        values = [None if i in rows else v for i, v in enumerate(table["checksum"].to_pylist())]
        return table.set_column(table.schema.get_field_index("checksum"), "checksum", pa.array(values, pa.uint32()))

    _rewrite_index(index, edit)


def test_an_index_without_checksums_loads_unverified_with_a_note(corpus):
    _without_checksums(corpus)
    with pytest.warns(UserWarning, match=r"24 of 24 samples have no checksum in the index .* reads are unverified"):
        ds = ShardedLatentDataset(corpus)
    assert ds.report.unverified_rows == 24 and "24 samples without a checksum" in str(ds.report)
    for i in (0, 13, 23):
        torch.testing.assert_close(ds[i]["latents"], torch.from_numpy(_sample(i)[1]).float(), rtol=0, atol=0)
    _flip_bit(corpus, 13, "latents", -1)
    assert "bad" not in ShardedLatentDataset(corpus)[13]  # what "unverified" means: the flip goes unseen


def test_rows_without_a_checksum_are_unverified_and_the_rest_verified(corpus):
    _without_checksums(corpus, rows=set(range(10)))  # shard 0's part was written before checksums
    with pytest.warns(UserWarning, match="10 of 24 samples have no checksum"):
        ds = ShardedLatentDataset(corpus)
    assert ds.report.unverified_rows == 10
    _flip_bit(corpus, 3, "latents", -1)
    _flip_bit(corpus, 13, "latents", -1)
    ds[3]
    with pytest.raises(BadSampleError, match="sample '000000013'"):
        ds[13]


@pytest.mark.parametrize("what, where, value, message", [
    ("latents", (1, 0, 2, 3), np.nan, r"latents \[4, 1, 4, 4\] hold 1 NaN value\(s\), the first at \[1, 0, 2, 3\]"),
    ("latents", (0, 0, 0, 0), np.inf, r"latents \[4, 1, 4, 4\] hold 1 Inf value\(s\), the first at \[0, 0, 0, 0\]"),
    ("latents", (2, 0, 1, 1), 3e4, r"latents \[4, 1, 4, 4\] hold 1 value\(s\) with \|x\| > 10000 \(max \|x\| = 3e\+04\), the first at \[2, 0, 1, 1\]"),
    ("context", (0, 5), np.nan, r"context \[1, 8\] hold 1 NaN value\(s\), the first at \[0, 5\]"),
])
def test_bad_values_in_a_shard_name_shard_and_sample_or_train_with_weight_zero(tmp_path, monkeypatch, what, where,
                                                                              value, message):
    import test_shards as this

    original = this._sample

    def poisoned(i):
        grid, latents, context = original(i)
        if i == 12:  # grid (1, 2, 2), context of 1 token
            (latents if what == "latents" else context)[where] = value
        return grid, latents, context

    monkeypatch.setattr(this, "_sample", poisoned)
    index = write_corpus(tmp_path)
    with pytest.raises(BadSampleError, match=rf"shard-000001\.tar, sample '000000012' \(dataset index 12\): {message}\. "
                                             r"Delete .*`on_bad_sample='skip'`"):
        ShardedLatentDataset(index)[12]
    ds = ShardedLatentDataset(index, on_bad_sample="skip")
    item = ds[12]
    assert re.search(message, item["bad"]) and not item["latents"].any() and not item["context"].any()
    assert item["latents"].shape == (4, 1, 4, 4) and item["context"].shape == (TEXT_LEN, TEXT_DIM)
    assert ds.report.bad_samples == 1
    batch = collate_batch([ds[15], item, ds[18]])
    assert batch["sample_weight"].tolist() == [1.0, 0.0, 1.0] and batch["bad_samples"] == [item["bad"]]
