"""BucketRules: 4k+1 frame buckets, aspect-ratio resolution buckets, skips with reasons."""

from __future__ import annotations

import pytest

from lightning_adaptiveload.cli.prepare import load_rules
from lightning_adaptiveload.prepare.buckets import BucketRules, SkipSample


def test_wan_480p_clip_lands_in_the_32760_token_bucket():
    rules = load_rules("wan2_1_480p")
    bucket = rules.choose(num_frames=120, height=1080, width=1920)
    assert (bucket.frames, bucket.height, bucket.width) == (81, 480, 832)
    assert bucket.grid == (21, 30, 52) and bucket.seq_len == 32_760


def test_longest_frame_bucket_that_fits_and_images_are_one_frame():
    rules = BucketRules(resolutions=[(480, 832)], frame_buckets=[17, 33, 81])
    assert rules.choose(80, 480, 832).frames == 33
    assert rules.choose(33, 480, 832).frames == 33
    image = rules.choose(1, 600, 900, is_image=True)
    assert image.frames == 1 and image.grid == (1, 30, 52)


@pytest.mark.parametrize(
    ("size", "expected"),
    [((1080, 1920), (480, 832)), ((1920, 1080), (832, 480)), ((1000, 1000), (624, 624)), ((768, 1024), (544, 720))],
)
def test_closest_aspect_ratio(size, expected):
    bucket = load_rules("wan2_1_480p").choose(81, *size)
    assert (bucket.height, bucket.width) == expected


def test_no_upscaling_by_default_and_a_smaller_bucket_is_taken():
    rules = BucketRules(resolutions=[(480, 832), (240, 416)], frame_buckets=[17])
    assert (rules.choose(17, 300, 500).height, rules.choose(17, 300, 500).width) == (240, 416)
    assert BucketRules(resolutions=[(480, 832), (240, 416)], frame_buckets=[17], max_upscale=2.0).choose(
        17, 300, 500
    ).height == 480


@pytest.mark.parametrize(
    ("args", "reason"),
    [((4, 480, 832), "too short"), ((17, 100, 100), "too small"), ((17, 9000, 9000), "too large")],
)
def test_skips_have_reasons(args, reason):
    rules = BucketRules(resolutions=[(480, 832)], frame_buckets=[5, 17])
    with pytest.raises(SkipSample) as err:
        rules.choose(*args)
    assert err.value.reason == reason


@pytest.mark.parametrize(
    "kwargs",
    [{"resolutions": [(480, 830)]}, {"frame_buckets": [16]}, {"resolutions": []}, {"max_upscale": 0.5}],
)
def test_buckets_off_the_token_grid_are_refused(kwargs):
    with pytest.raises(ValueError, match="BucketRules"):
        BucketRules(**kwargs)


def test_unknown_preset_lists_the_known_ones():
    with pytest.raises(FileNotFoundError, match="tiny"):
        load_rules("nope")
