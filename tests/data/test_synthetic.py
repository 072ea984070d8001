import numpy as np
import pytest
import torch

from lightning_adaptiveload.data.collate import collate_batch
from lightning_adaptiveload.data.mixtures import MIXTURES, get_mixture
from lightning_adaptiveload.data.synthetic import SyntheticMixedDataset
from lightning_adaptiveload.geometry import pixel_token_grid, pixel_token_grids

SMALL = {"latent_channels": 16, "text_len": 4, "text_dim": 8}


def test_wan_81_frames_480p_token_grid_and_latents():
    ds = SyntheticMixedDataset(3, [{"num_frames": 81, "height": 480, "width": 832, "weight": 1}], **SMALL)
    assert ds.token_grids().tolist() == [[21, 30, 52]] * 3
    item = ds[1]
    assert item["latents"].shape == (16, 21, 60, 104)
    assert item["latents"].dtype == torch.float32
    assert item["context"].shape == (4, 8)
    assert item["index"] == 1


def test_named_mixture_token_counts():
    rows = SyntheticMixedDataset(2000, "wan_mixed_480p_720p", seed=1).describe()
    by_shape = {(r["num_frames"], r["height"], r["width"]): r for r in rows}
    assert by_shape[(81, 480, 832)]["seq_len"] == 32_760
    assert by_shape[(81, 720, 1280)]["seq_len"] == 75_600
    assert by_shape[(81, 720, 1280)]["token_grid"] == (21, 45, 80)
    assert by_shape[(1, 480, 832)]["seq_len"] == 1_560
    assert sum(r["count"] for r in rows) == 2000


@pytest.mark.parametrize("name", sorted(MIXTURES))
def test_every_named_mixture_is_valid(name):
    ds = SyntheticMixedDataset(50, name)
    grids = ds.token_grids()
    assert grids.dtype == np.int64 and grids.shape == (50, 3)
    assert abs(sum(e["weight"] for e in MIXTURES[name]) - 1.0) < 1e-9


def test_tiny_items_match_token_grids_and_patch():
    ds = SyntheticMixedDataset(40, "tiny", patch_size=(1, 2, 2), **SMALL)
    grids = ds.token_grids()
    assert len(np.unique(grids, axis=0)) > 1
    for i in range(len(ds)):
        f, h, w = grids[i]
        assert ds[i]["latents"].shape == (16, f, 2 * h, 2 * w)


def test_items_are_deterministic_by_seed_and_index():
    a = SyntheticMixedDataset(20, "tiny", seed=3, **SMALL)
    b = SyntheticMixedDataset(20, "tiny", seed=3, **SMALL)
    for i in (5, 0, 19, 5):  # any access order
        torch.testing.assert_close(a[i]["latents"], b[i]["latents"], rtol=0, atol=0)
        torch.testing.assert_close(a[i]["context"], b[i]["context"], rtol=0, atol=0)
    assert not torch.equal(a[0]["context"], a[1]["context"])
    c = SyntheticMixedDataset(20, "tiny", seed=4, **SMALL)
    assert not torch.equal(a[0]["context"], c[0]["context"])


def test_shape_draw_is_seeded_and_a_prefix():
    small = SyntheticMixedDataset(100, "wan_mixed_480p_720p", seed=7).token_grids()
    big = SyntheticMixedDataset(10_000, "wan_mixed_480p_720p", seed=7).token_grids()
    np.testing.assert_array_equal(small, big[:100])
    other = SyntheticMixedDataset(100, "wan_mixed_480p_720p", seed=8).token_grids()
    assert not np.array_equal(small, other)


def test_draw_follows_weights_and_never_picks_zero_weight():
    mixture = [
        {"num_frames": 1, "height": 64, "width": 64, "weight": 3},
        {"num_frames": 1, "height": 128, "width": 128, "weight": 0},
        {"num_frames": 17, "height": 64, "width": 64, "weight": 1},
    ]
    n = 200_000
    ds = SyntheticMixedDataset(n, mixture)
    rows = ds.describe()
    assert rows[1]["count"] == 0
    for row, p in ((rows[0], 0.75), (rows[2], 0.25)):
        sigma = (p * (1 - p) / n) ** 0.5
        assert abs(row["fraction"] - p) < 5 * sigma
    grids = ds.token_grids()
    np.testing.assert_array_equal(
        grids, pixel_token_grids(*ds.pixel_shapes().T, vae_stride=ds.vae_stride, patch_size=ds.patch_size)
    )
    assert (grids == (1, 4, 4)).all(axis=1).sum() == rows[0]["count"]
    assert (grids == (5, 4, 4)).all(axis=1).sum() == rows[2]["count"]


def test_token_grids_large_vectorised():
    ds = SyntheticMixedDataset(1_000_000, "wan_mixed_480p_720p")
    grids = ds.token_grids()
    assert grids.shape == (1_000_000, 3) and grids.dtype == np.int64
    expected = {
        pixel_token_grid(e["num_frames"], e["height"], e["width"]) for e in MIXTURES["wan_mixed_480p_720p"]
    }
    keys = np.unique(grids @ np.array([1_000_000, 1_000, 1]))  # 1-D unique is much faster than axis=0
    assert {(k // 1_000_000, k // 1_000 % 1_000, k % 1_000) for k in keys.tolist()} == expected


def test_collate_synthetic_same_grid():
    ds = SyntheticMixedDataset(30, "tiny", **SMALL)
    grids = ds.token_grids()
    same = np.flatnonzero((grids == grids[0]).all(axis=1))[:3]
    batch = collate_batch([ds[int(i)] for i in same])
    assert batch["latents"].shape[0] == len(same)
    assert batch["index"].tolist() == same.tolist()


@pytest.mark.parametrize(
    ("mixture", "match"),
    [
        ([], "non-empty list"),
        ("nope", r"unknown mixture. Expected one of \["),
        ([{"num_frames": 1, "height": 64}], r"mixture entry 0 .* has no 'width'"),
        ([{"num_frames": 1, "height": 64, "width": 64, "wieght": 1}], r"unknown keys \['wieght'\]"),
        (
            [{"num_frames": 0, "height": 64, "width": 64}],
            r"mixture entry 0 .*num_frames=0; expected a positive integer",
        ),
        ([{"num_frames": 1, "height": 64.5, "width": 64}], r"height=64.5; expected a positive integer"),
        (
            [
                {"num_frames": 1, "height": 64, "width": 64},
                {"num_frames": 1, "height": 64, "width": 64, "weight": -1},
            ],
            r"mixture entry 1 .*weight=-1; expected a finite number >= 0",
        ),
        ([{"num_frames": 1, "height": 64, "width": 64, "weight": float("nan")}], "weight=nan"),
        ([{"num_frames": 1, "height": 64, "width": 64, "weight": 0}], "All mixture weights are zero"),
        ([{"num_frames": 1, "height": 8, "width": 64}], r"mixture entry 0 .*smaller than patch"),
        (["x"], r"mixture entry 0 \('x'\) is not a dict"),
    ],
)
def test_mixture_validation_errors(mixture, match):
    with pytest.raises(ValueError, match=match):
        SyntheticMixedDataset(10, mixture)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_samples": 0}, r"num_samples=0"),
        ({"text_len": -1}, r"text_len=-1"),
        ({"seed": -2}, r"seed=-2"),
        ({"patch_size": (1, 2)}, r"patch_size=\(1, 2\)"),
        ({"vae_stride": (4, 8.5, 8)}, r"vae_stride=\(4, 8.5, 8\)"),
    ],
)
def test_argument_errors(kwargs, match):
    args = {"num_samples": 10, "mixture": "tiny", **kwargs}
    with pytest.raises(ValueError, match=match):
        SyntheticMixedDataset(**args)


def test_get_mixture_returns_a_copy():
    mix = get_mixture("tiny")
    mix[0]["weight"] = 123
    assert MIXTURES["tiny"][0]["weight"] != 123


def test_index_out_of_range():
    ds = SyntheticMixedDataset(5, "tiny", **SMALL)
    with pytest.raises(IndexError, match="out of range"):
        ds[5]
