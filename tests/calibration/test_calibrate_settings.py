"""ProfileSettings: the conductor's settings check and normalise themselves, for callers of
`calibrate()` as much as for ShapeBenchmarkCallback."""

import dataclasses

import pytest

from lightning_adaptiveload.calibration.calibrate import ProfileSettings


def test_settings_are_normalised_and_owner_is_not_a_field():
    s = ProfileSettings(batch_sizes=[4, 1, 4.0], max_shapes=6.0, shape_time_s=3, m_mem=1000.0)
    assert s.batch_sizes == [1, 4] and s.max_shapes == 6 and isinstance(s.max_shapes, int)
    assert s.shape_time_s == 3.0 and isinstance(s.shape_time_s, float) and s.m_mem == 1000
    assert "owner" not in {f.name for f in dataclasses.fields(s)}
    assert ProfileSettings() == ProfileSettings(owner="ShapeBenchmarkCallback")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_sizes": []}, r"`ProfileSettings\(batch_sizes=\[\]\)` is not valid. Expected positive integers"),
        ({"batch_sizes": [1, 0]}, r"`ProfileSettings\(batch_sizes=0\)` is not valid. Expected a positive integer"),
        ({"warmup": True}, r"`ProfileSettings\(warmup=True\)` is not valid. Expected a non-negative integer"),
        ({"max_shapes": 2.5}, r"`ProfileSettings\(max_shapes=2.5\)` is not valid. Expected a positive integer"),
        ({"stable_rel": 1.0}, r"`ProfileSettings\(stable_rel=1.0\)` is not valid. Expected a fraction in \[0, 1\)"),
        ({"converge_rel": -0.1}, r"converge_rel=-0.1.*Expected a non-negative finite number"),
        ({"time_budget_s": float("nan")}, r"time_budget_s=nan.*Expected a positive finite number"),
        ({"step_budget_s": float("inf")}, r"step_budget_s=inf.*Expected a positive finite number"),
        ({"m_mem": 0}, r"m_mem=0.*Expected a positive integer"),
        ({"form": "linear"}, r"form='linear'.*one of \('power', 'quadratic', 'saturating', 'auto'\)"),
    ],
)
def test_bad_settings_are_refused_naming_the_setting(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ProfileSettings(**kwargs)
    with pytest.raises(ValueError, match=r"`MyCallback\("):
        ProfileSettings(owner="MyCallback", **kwargs)
