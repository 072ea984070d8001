"""The tokens attention sees (an MMDiT's video + joint text tokens): the cost and memory models fit and predict
in them while buckets, policies and the sampler stay keyed by video tokens S."""

import time
import warnings

import numpy as np
import pytest
from lightning.fabric.utilities.exceptions import MisconfigurationException

from lightning_adaptiveload.bucketing.policy import CostModelPolicy, DualConstraintPolicy
from lightning_adaptiveload.calibration import derive, record
from lightning_adaptiveload.calibration.calibrate import ProfileSettings, Trainee, calibrate
from lightning_adaptiveload.calibration.costmodel import CostModel, MemoryModel, map_tokens, token_table
from lightning_adaptiveload.models.protocol import attention_tokens_of

L = 128  # joint text tokens
GRIDS = np.array([(1, 4, 4), (1, 8, 8), (1, 16, 16), (3, 16, 16), (5, 16, 32)])  # S = 16 .. 2560
COUNTS = np.array([100, 100, 50, 20, 10])
SEQ = GRIDS.prod(axis=1)


def _true_time(b, s):
    """A joint-attention step: fixed 5 ms + linear and attention work over the S + L tokens of every sample."""
    s_attn = np.asarray(s, dtype=np.float64) + L
    return 5e-3 + np.asarray(b) * (2e-6 * s_attn + 1e-9 * s_attn**2)


def _shapes():
    return [(b, int(s)) for s in SEQ for b in (1, 2, 4, 8)]


def test_the_table_is_the_identity_or_checked():
    assert token_table(None, SEQ) == {} and token_table(lambda s: s, SEQ) == {}
    table = token_table(lambda s: s + L, SEQ)
    assert table == {int(s): int(s) + L for s in SEQ}
    # Exact at the table's lengths, and an affine map stays exact between and beyond them.
    assert map_tokens(table, [16, 100, 5000, 1]).tolist() == [16 + L, 100 + L, 5000 + L, 1 + L]
    assert map_tokens({}, [7]).tolist() == [7]
    with pytest.raises(ValueError, match=r"attention_tokens\(16\)` returned 8. Expected an integer >= 16"):
        token_table(lambda s: s // 2, SEQ)


def test_the_cost_model_fits_in_attention_tokens_and_is_asked_in_video_tokens():
    b, s = np.array(_shapes()).T
    t = _true_time(b, s)
    joint = CostModel.fit(b, s, t, form="quadratic", attention_tokens=lambda v: v + L)
    video = CostModel.fit(b, s, t, form="quadratic")
    assert joint.attention_tokens == {int(v): int(v) + L for v in SEQ}
    assert joint.quality["heldout_median_rel_error"] < 1e-6
    assert video.quality["heldout_median_rel_error"] > 0.02  # the text tokens are invisible to it
    # predict takes video tokens: the sampler, policies and BalanceMonitor call it unchanged.
    np.testing.assert_allclose(joint.predict(b, s), t, rtol=1e-6)
    # JSON, scaling (activation-checkpointing tiers) and the string keep the map.
    assert CostModel.from_json(joint.to_json()) == joint
    assert joint.scaled(1.5).attention_tokens == joint.attention_tokens
    assert "S = attention tokens (16 -> 144" in str(joint)
    assert "attention_tokens" not in video.to_dict()  # older records read back as the identity


def test_the_memory_budget_stays_in_video_tokens_and_prices_the_text():
    b, s = np.array(_shapes()).T
    m0, m1 = 1e9, 1e5
    peaks = m0 + m1 * b * (s + L)
    mm = MemoryModel.fit(b, s, peaks, token_table(lambda v: v + L, SEQ))
    assert mm.m1 == pytest.approx(m1, rel=1e-6) and mm.m2 == pytest.approx(0.0, abs=1.0)
    assert MemoryModel.from_dict(mm.to_dict()) == mm
    device = 4e9
    budget = mm.max_tokens(device, margin=0.0, min_seq_len=16)
    # B·S <= M_mem at the shortest length must fit with its text tokens: B·(16 + L)·m1 <= free.
    b_max = budget // 16
    assert m0 + m1 * b_max * (16 + L) <= device < m0 + m1 * (b_max + 1) * (16 + L) + m1 * 16 * (16 + L)
    assert mm.max_batch_size(16, device, margin=0.0) == int((device - m0) // (m1 * (16 + L)))


def test_the_policy_is_derived_in_attention_tokens():
    b, s = np.array(_shapes()).T
    joint = CostModel.fit(b, s, _true_time(b, s), form="power", attention_tokens=lambda v: v + L)
    # B·S^p <= M_comp is in video tokens: with joint tokens the one rule gives the cost-model policy.
    assert isinstance(derive.policy_for_budget(joint, 10_000, 0.05), CostModelPolicy)
    plain = CostModel.fit(b, s, _true_time(b, s), form="power")
    assert isinstance(derive.policy_for_budget(plain, 10_000, 0.05), DualConstraintPolicy)
    exact = CostModel.fit(b, s, _true_time(b, s), form="quadratic", attention_tokens=lambda v: v + L)
    sizes = derive.derive_policy(exact, GRIDS, 10_000, counts=COUNTS, step_budget_s=0.02).policy.batch_sizes(SEQ)
    # Every bucket gets the largest batch whose true (joint) step meets the budget (or its memory cap).
    want = [max(1, min(10_000 // int(sl), max(bb for bb in range(1, 10_001) if _true_time(bb, sl) <= 0.02)))
            for sl in SEQ]
    assert sizes.tolist() == want
    # Without the text tokens the image buckets are planned about 2x too large.
    blind = CostModel.fit(b, s, _true_time(b, s), form="quadratic")
    assert derive.derive_policy(blind, GRIDS, 10_000, counts=COUNTS, step_budget_s=0.02).policy.batch_sizes(
        SEQ)[0] > 1.3 * want[0]


def test_the_conductor_fits_in_attention_tokens(monkeypatch):
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def make_step(b, grid):
        def step():
            clock[0] += float(_true_time(b, int(np.prod(grid))))

        return step

    settings = ProfileSettings(repeats=2, warmup=0, converge_rel=0.0, max_shapes=5, form="quadratic")
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, fn in (("joint", lambda v: v + L), ("video", None)):
            results[name] = calibrate(GRIDS, COUNTS, settings, Trainee(make_step, attention_tokens=fn),
                                      key={"model": name})
    cal = results["joint"].calibration
    assert cal.cost_model.attention_tokens == {int(v): int(v) + L for v in SEQ}
    assert cal.cost_model.quality["heldout_median_rel_error"] < 1e-6
    assert results["video"].calibration.cost_model.quality["heldout_median_rel_error"] > 0.02
    again = record.Calibration.from_json(cal.to_json())
    assert again.cost_model == cal.cost_model


def test_attention_tokens_of_defaults_to_the_video_tokens_and_checks_the_module():
    class CrossAttention:
        pass

    class Joint:
        def attention_tokens(self, seq_len):
            return seq_len + 32

    class Broken:
        def attention_tokens(self, seq_len):
            return seq_len / 2

    assert attention_tokens_of(CrossAttention())(1560) == 1560
    assert attention_tokens_of(Joint())(1560) == 1592
    with pytest.raises(MisconfigurationException, match=r"`Broken.attention_tokens\(10\)` returned 5.0; expected an "
                       r"integer >= 10"):
        attention_tokens_of(Broken())(10)
