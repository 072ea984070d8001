"""Mid-epoch re-planning: a new policy takes over at an agreed step, every sample still once per epoch."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler

GRIDS = np.array([(1, 2, 2), (1, 4, 4), (3, 2, 2), (5, 4, 6), (2, 3, 3), (9, 4, 4)])
OLD = DualConstraintPolicy(m_mem=256, m_comp=4096, p=2)
NEW = DualConstraintPolicy(m_mem=256, m_comp=40_000, p=2)  # larger batches for the short buckets


def _shapes(seed: int, n: int) -> np.ndarray:
    return GRIDS[np.random.default_rng(seed).integers(0, len(GRIDS), n)]


def _samplers(shapes, world, policy=OLD, **kw):
    return [AdaptiveBucketBatchSampler(shapes, policy, num_replicas=world, rank=r, seed=5, **kw) for r in range(world)]


def _take(iterators, steps):
    return [[next(it) for _ in range(steps)] for it in iterators]


def _replanned_epoch(shapes, world, drawn, at):
    """Every rank draws ``drawn[r]`` steps, all re-plan at ``at``, then draw the rest."""
    samplers = _samplers(shapes, world)
    iters = [iter(s) for s in samplers]
    out = [[next(it) for _ in range(d)] for it, d in zip(iters, drawn, strict=True)]
    for s in samplers:
        s.replan(NEW, None, at)
    for rank, it in enumerate(iters):
        out[rank] += list(it)
    return samplers, out


def _assert_once(shapes, per_rank, padding):
    seen = Counter(i for rank in per_rank for batch in rank for i in batch)
    assert set(seen) == set(range(len(shapes)))
    assert sum(seen.values()) - len(shapes) <= padding


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(20, 300), st.integers(1, 4), st.data())
def test_a_replan_keeps_every_sample_once_and_ranks_even(seed, n, world, data):
    shapes = _shapes(seed, n)
    steps = len(_samplers(shapes, world)[0])
    at = data.draw(st.integers(0, steps))
    drawn = [data.draw(st.integers(0, at)) for _ in range(world)]  # ranks prefetched different amounts
    samplers, per_rank = _replanned_epoch(shapes, world, drawn, at)
    assert len({len(r) for r in per_rank}) == 1 and len(per_rank[0]) == len(samplers[0])
    # Padding repeats whole batches: at most world - 1 batches in each of the two segments.
    seq = shapes.prod(axis=1)
    largest = int(max(OLD.batch_sizes(seq).max(), NEW.batch_sizes(seq).max()))
    _assert_once(shapes, per_rank, padding=2 * (world - 1) * largest)
    # After the switch, batches follow the new policy (bucket batch sizes of NEW), before it the old one.
    new_sizes = NEW.batch_sizes(shapes.prod(axis=1))
    for rank in per_rank:
        for batch in rank[at:]:
            assert len(batch) <= new_sizes[batch[0]]


def test_a_replan_changes_the_batches_after_it_and_is_reported():
    shapes = _shapes(1, 200)
    samplers, per_rank = _replanned_epoch(shapes, 2, [3, 4], 4)
    plain = [list(s) for s in _samplers(shapes, 2)]
    assert [r[:4] for r in per_rank] == [r[:4] for r in plain]  # the old plan up to the agreed step
    assert per_rank != plain
    step, changed = samplers[0].replans[0]
    seq = shapes.prod(axis=1)
    assert step == 4 and changed and all(OLD.batch_sizes(np.array([s]))[0] == old and
                                         NEW.batch_sizes(np.array([s]))[0] == new for s, (old, new) in changed.items())
    assert set(changed) <= set(seq.tolist())


def test_replan_before_the_drawn_steps_is_refused():
    s = _samplers(_shapes(0, 50), 1)[0]
    it = iter(s)
    _take([it], 3)
    with pytest.raises(ValueError, match=r"replan\(at_step=2\)` is not valid: this rank has drawn 3 steps"):
        s.replan(NEW, None, 2)


def test_next_epoch_is_planned_with_the_new_policy():
    shapes = _shapes(2, 120)
    s = _samplers(shapes, 1)[0]
    s.replan(NEW, None, 0)
    s.set_epoch(1)
    fresh = AdaptiveBucketBatchSampler(shapes, NEW, seed=5)
    fresh.set_epoch(1)
    assert list(s) == list(fresh) and s.replans == []


@pytest.mark.parametrize("stop_offset", [-2, 0, 3], ids=["before-switch", "at-switch", "after-switch"])
@pytest.mark.parametrize("world_after", [2, 1, 3])
def test_resume_after_a_replan_is_exact_on_the_same_world_and_once_on_another(stop_offset, world_after):
    shapes = _shapes(3, 160)
    world, at = 2, 6
    samplers, uninterrupted = _replanned_epoch(shapes, world, [4, 5], at)
    stop = at + stop_offset  # steps trained when the checkpoint is written (prefetch ran ahead to `at`)
    state = samplers[0].state_dict(steps_taken=stop)
    if stop < at:
        assert state["position"] == stop
    resumed = _samplers(shapes, world_after, policy=NEW)
    for s in resumed:
        s.load_state_dict(state)
    rest = [list(s) for s in resumed]
    assert len({len(r) for r in rest}) == 1 and len(resumed[0]) == stop + len(rest[0])
    if world_after == world:
        assert rest == [r[stop:] for r in uninterrupted]
    _assert_once(shapes, [r[:stop] for r in uninterrupted] + rest, padding=3 * (max(world, world_after) - 1))


def test_state_after_a_replan_survives_json_and_a_second_resume():
    import json

    shapes = _shapes(4, 150)
    samplers, uninterrupted = _replanned_epoch(shapes, 1, [5], 5)
    state = json.loads(json.dumps(samplers[0].state_dict(steps_taken=8)))
    first = _samplers(shapes, 1, policy=NEW)[0]
    first.load_state_dict(state)
    it = iter(first)
    _take([it], 2)
    second = _samplers(shapes, 1, policy=NEW)[0]
    second.load_state_dict(json.loads(json.dumps(first.state_dict(steps_taken=10))))
    assert list(second) == uninterrupted[0][10:]


def test_a_state_whose_spec_does_not_fit_the_dataset_is_refused():
    shapes = _shapes(5, 80)
    samplers, _ = _replanned_epoch(shapes, 1, [2], 2)
    state = samplers[0].state_dict(steps_taken=3)
    state["segments"][0][2]["batch_sizes"] = [1]
    s = _samplers(shapes, 1, policy=NEW)[0]
    with pytest.raises(ValueError, match=r"segments\[0\]=.*expected \[ranks, steps\] or \[ranks, steps, spec\]"):
        s.load_state_dict(state)
