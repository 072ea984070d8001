from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy, EqualTokenPolicy
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler

GRIDS = np.array([(1, 2, 2), (1, 4, 4), (3, 2, 2), (5, 4, 6), (2, 3, 3), (9, 4, 4)])
POLICY = DualConstraintPolicy(m_mem=256, m_comp=4096, p=2)


def _shapes(seed, n):
    rng = np.random.default_rng(seed)
    return GRIDS[rng.integers(0, len(GRIDS), n)]


def _epoch(shapes, world, epoch=0, **kw):
    """All ranks' batches of one epoch: list over ranks of list of batches."""
    out = []
    for r in range(world):
        s = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, rank=r, **kw)
        s.set_epoch(epoch)
        out.append(list(s))
    return out


def _stats(shapes, world, **kw):
    return AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, **kw).plan_stats


dataset = st.tuples(st.integers(0, 10_000), st.integers(1, 300), st.integers(1, 64))


@settings(max_examples=25, deadline=None)
@given(dataset, st.sampled_from(["cost", "none"]), st.booleans())
def test_plan_invariants(args, balance, drop_last):
    seed, n, world = args
    shapes = _shapes(seed, n)
    per_rank = _epoch(shapes, world, seed=seed, balance=balance, drop_last=drop_last)
    stats = _stats(shapes, world, seed=seed, balance=balance, drop_last=drop_last)
    # equal batch counts on every rank, and len() agrees
    counts = {len(b) for b in per_rank}
    assert len(counts) == 1
    assert counts.pop() == len(AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, balance=balance,
                                                          drop_last=drop_last, seed=seed)) == stats["num_steps"]
    seen = Counter(i for rank in per_rank for batch in rank for i in batch)
    seq = shapes.prod(axis=1)
    bs = POLICY.batch_sizes(seq)
    for rank in per_rank:
        for batch in rank:
            # no batch mixes grids, none exceeds the policy's batch size
            assert len({tuple(shapes[i]) for i in batch}) == 1
            assert 1 <= len(batch) <= bs[batch[0]]
    if drop_last:
        assert max(seen.values(), default=1) == 1
        assert stats["padded_samples"] == 0
        assert n - len(seen) == stats["dropped_samples"]
    else:
        assert set(seen) == set(range(n))
        assert sum(seen.values()) - n == stats["padded_samples"]
        assert stats["dropped_samples"] == 0


@settings(max_examples=10, deadline=None)
@given(dataset, st.sampled_from(["cost", "none"]))
def test_plan_is_deterministic_and_epoch_dependent(args, balance):
    seed, n, world = args
    shapes = _shapes(seed, n)
    a = _epoch(shapes, world, seed=seed, balance=balance)
    assert a == _epoch(shapes, world, seed=seed, balance=balance)
    # Another epoch is another plan (over all ranks; with 20+ samples a coincidence is ~impossible),
    # and coming back to epoch 0 gives the first plan again.
    b = _epoch(shapes, world, epoch=1, seed=seed, balance=balance)
    if n > 20:
        assert b != a
    s = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, seed=seed, balance=balance)
    s.set_epoch(1)
    s.set_epoch(0)
    assert list(s) == a[0]


def _resume_run(shapes, worlds_and_stops, balance, drop_last=False):
    """Run an epoch in segments: (world, steps to take) pairs, the last with None = to the end.

    Returns the multiset of samples trained and the samples the uninterrupted plan would train."""
    state = None
    trained = Counter()
    for world, stop in worlds_and_stops:
        samplers = [AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, rank=r, seed=3, balance=balance,
                                               drop_last=drop_last) for r in range(world)]
        for s in samplers:
            if state is not None:
                s.load_state_dict(state)
        taken_before = sum(k for _, k in state["segments"]) if state else 0
        total = len(samplers[0])
        assert all(len(s) == total for s in samplers)
        iters = [iter(s) for s in samplers]
        end = total if stop is None else min(total, taken_before + stop)
        for _ in range(taken_before, end):
            for it in iters:
                trained.update(next(it))
        if stop is None:
            for it in iters:
                assert next(it, None) is None
        # prefetch: the sampler ran ahead, but the state uses the steps actually taken
        for it in iters:
            next(it, None)
        state = samplers[0].state_dict(steps_taken=end)
    return trained


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 1000), st.integers(1, 200), st.integers(1, 16), st.integers(1, 16), st.integers(1, 16),
       st.data(), st.sampled_from(["cost", "none"]))
def test_resume_yields_exactly_the_remaining_samples(seed, n, w1, w2, w3, data, balance):
    shapes = _shapes(seed, n)
    full = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=w1, seed=3, balance=balance)
    k1 = data.draw(st.integers(0, len(full)))
    k2 = data.draw(st.integers(0, 5))
    trained = _resume_run(shapes, [(w1, k1), (w2, k2), (w3, None)], balance)
    assert set(trained) == set(range(n))
    stats_repeats = sum(trained.values()) - n
    # repeats only come from the (counted) padding of each segment's plan: at most world-1 batches each
    assert stats_repeats <= (w1 + w2 + w3) * int(POLICY.batch_sizes(shapes.prod(1)).max())


def test_resume_at_every_step_same_world_reproduces_the_uninterrupted_epoch():
    shapes = _shapes(7, 120)
    for world in (1, 3):
        ref = [list(AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, rank=r, seed=5)) for r in range(world)]
        for k in range(len(ref[0]) + 1):
            state = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, seed=5).state_dict(steps_taken=k)
            for r in range(world):
                s = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, rank=r, seed=5)
                s.load_state_dict(state)
                assert list(s) == ref[r][k:]
                assert len(s) == len(ref[r])


def test_resume_at_every_step_other_world_size():
    shapes = _shapes(11, 90)
    ref = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=2, seed=1)
    ref_batches = [list(AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=2, rank=r, seed=1)) for r in range(2)]
    for k in range(len(ref) + 1):
        seen = Counter(i for r in range(2) for b in ref_batches[r][:k] for i in b)
        state = ref.state_dict(steps_taken=k)
        rest = Counter()
        lens = set()
        for r in range(5):
            s = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=5, rank=r, seed=1)
            s.load_state_dict(state)
            batches = list(s)
            lens.add(len(batches))
            rest.update(i for b in batches for i in b)
            assert len(s) == k + len(batches)
        assert len(lens) == 1
        assert set(rest) == set(range(90)) - set(seen)


def test_state_dict_without_steps_counts_yielded_batches_and_epoch_end():
    shapes = _shapes(0, 50)
    s = AdaptiveBucketBatchSampler(shapes, POLICY, seed=0)
    it = iter(s)
    next(it), next(it)
    assert s.state_dict()["segments"] == [[1, 2]]
    list(it)
    assert s.state_dict()["segments"] == [[1, len(s)]]
    # a finished epoch iterates in full again
    assert len(list(s)) == len(s)
    s.set_epoch(1)
    assert s.state_dict()["segments"] == [[1, 0]]


def test_load_state_rejects_changed_dataset_or_policy():
    shapes = _shapes(0, 50)
    state = AdaptiveBucketBatchSampler(shapes, POLICY).state_dict(steps_taken=1)
    with pytest.raises(ValueError, match="num_samples=50 but the dataset has 49"):
        AdaptiveBucketBatchSampler(shapes[:49], POLICY).load_state_dict(state)
    with pytest.raises(ValueError, match=r"different policy \(policy: saved .*dual_constraint.*now .*equal_token"):
        AdaptiveBucketBatchSampler(shapes, EqualTokenPolicy(256)).load_state_dict(state)


def test_load_state_rejects_changed_shapes_with_the_same_size():
    shapes = _shapes(0, 263)
    state = AdaptiveBucketBatchSampler(shapes, POLICY).state_dict(steps_taken=3)
    changed = shapes.copy()
    changed[:10] = (1, 8, 8)
    now = AdaptiveBucketBatchSampler(changed, POLICY).shapes_fingerprint()
    with pytest.raises(ValueError, match=rf"has shapes='{state['shapes']}' but the dataset has shapes='{now}'"):
        AdaptiveBucketBatchSampler(changed, POLICY).load_state_dict(state)
    # The same shapes load.
    AdaptiveBucketBatchSampler(shapes, POLICY).load_state_dict(state)


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("segments", [[1, 500]], "says 500 steps were taken.*its plan has"),
        ("segments", [[1, -3]], r"segments\[0\]\[1\] \(steps\)=-3"),
        ("segments", [[0, 2]], r"segments\[0\]\[0\] \(ranks\)=0"),
        ("segments", [[4, 500], [1, 0]], "segment 0 of epoch 0 under 4 ranks"),
        ("segments", "x", "segments='x'"),
        ("version", 99, "version=99"),
        ("seed", 7, r"seed=7 but this run has seed=0.*`seed=7`"),
        ("epoch", -1, "epoch=-1"),
        ("num_samples", "50", "num_samples='50'"),
    ],
)
def test_load_state_checks_every_field(field, value, match):
    shapes = _shapes(0, 50)
    state = AdaptiveBucketBatchSampler(shapes, POLICY).state_dict(steps_taken=1)
    state[field] = value
    s = AdaptiveBucketBatchSampler(shapes, POLICY)
    with pytest.raises(ValueError, match=match):
        s.load_state_dict(state)


@pytest.mark.parametrize("missing", [("shapes", "settings"), ("fingerprint",)])
def test_unverifiable_states_load_only_when_allowed(missing):
    shapes = _shapes(0, 50)
    state = AdaptiveBucketBatchSampler(shapes, POLICY).state_dict(steps_taken=2)
    state = {k: v for k, v in state.items() if k not in missing}
    state["version"] = 1
    s = AdaptiveBucketBatchSampler(shapes, POLICY)
    with pytest.raises(ValueError, match=rf"has no `{missing[0]}` \(written by an older release\).*"
                                         "allow_unverified_resume=True"):
        s.load_state_dict(state)
    assert s.steps_taken == 0  # nothing changed
    s.load_state_dict(state, allow_unverified=True)
    assert s.steps_taken == 2 and len(list(s)) == len(s) - 2


def test_an_epoch_is_planned_once():
    shapes = _shapes(0, 500)
    s = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=4)
    assert s.plans_built == 0
    n = len(s)
    s.plan_stats, s.bucket_table()
    assert len(list(s)) == n
    assert s.plans_built == 1
    s.set_epoch(1)
    list(s)
    assert s.plans_built == 2


def test_cost_balance_beats_none_on_predicted_cv():
    shapes = _shapes(2, 3000)
    cost = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=8, balance="cost").plan_stats
    none = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=8, balance="none").plan_stats
    assert cost["compute_cv"] < 0.05 < none["compute_cv"]


def test_oversize_error_names_sample_and_skip_counts():
    shapes = np.array([(1, 2, 2), (9, 9, 9), (1, 2, 2)])
    with pytest.raises(ValueError, match=r"^sample 1: S=729 tokens \(token grid \(9, 9, 9\)\).*oversize='skip'"):
        AdaptiveBucketBatchSampler(shapes, DualConstraintPolicy(64, 1e4, 2))
    s = AdaptiveBucketBatchSampler(shapes, DualConstraintPolicy(64, 1e4, 2, oversize="skip"))
    assert sorted(i for b in s for i in b) == [0, 2]
    assert s.plan_stats["skipped_oversize"] == 1


def test_bad_arguments():
    shapes = _shapes(0, 10)
    with pytest.raises(ValueError, match="rank=4"):
        AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=4, rank=4)
    with pytest.raises(ValueError, match="balance='greedy'"):
        AdaptiveBucketBatchSampler(shapes, POLICY, balance="greedy")
    with pytest.raises(ValueError, match="empty"):
        AdaptiveBucketBatchSampler(np.zeros((0, 3), dtype=np.int64), POLICY)
    with pytest.raises(ValueError, match=r"Sample 1 has token grid \(0, 2, 2\)"):
        AdaptiveBucketBatchSampler(np.array([(1, 2, 2), (0, 2, 2)]), POLICY)


def test_tiny_dataset_pads_instead_of_zero_batches():
    shapes = np.array([(1, 2, 2)])
    per_rank = _epoch(shapes, 4)
    assert per_rank == [[[0]]] * 4
    with pytest.warns(UserWarning, match="0 steps"):
        assert list(AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=4, drop_last=True)) == []


def test_bucket_table():
    shapes = np.array([(1, 2, 2)] * 5 + [(5, 4, 6)] * 3)
    table = AdaptiveBucketBatchSampler(shapes, POLICY).bucket_table()
    assert table == [
        {"grid": (1, 2, 2), "seq_len": 4, "samples": 5, "batch_size": 64, "batches": 1},
        {"grid": (5, 4, 6), "seq_len": 120, "samples": 3, "batch_size": 1, "batches": 3},
    ]


def test_compact_dtypes_same_plan():
    shapes = _shapes(4, 5000)
    a = AdaptiveBucketBatchSampler(shapes.astype(np.int64), POLICY, num_replicas=3, rank=2, seed=1)
    b = AdaptiveBucketBatchSampler(shapes.astype(np.int32), POLICY, num_replicas=3, rank=2, seed=1)
    assert list(a) == list(b)
    assert b.plan().order.dtype == np.int32 and b._bucket_of.dtype == np.uint16
    assert b.shapes_fingerprint() == a.shapes_fingerprint()


def _small_chunks(monkeypatch, rows: int) -> None:
    """Plan in chunks of ``rows`` (many chunks, an uneven last one) in every module that chunks."""
    from lightning_adaptiveload.bucketing import buckets, sampler, steps

    for module, name in ((buckets, "CHUNK"), (sampler, "_CHUNK"), (steps, "_CHUNK")):
        monkeypatch.setattr(module, name, rows)


def test_chunked_indexing_and_bucket_sort_match_the_whole_array_versions(monkeypatch):
    from lightning_adaptiveload.bucketing import steps

    shapes = _shapes(7, 3001)
    whole = [list(AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=5, rank=r, seed=2)) for r in range(5)]
    _small_chunks(monkeypatch, 7)
    chunked = [list(AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=5, rank=r, seed=2)) for r in range(5)]
    assert chunked == whole
    rng = np.random.default_rng(0)
    idx = rng.permutation(1000).astype(np.int32)
    bucket_of = rng.integers(0, 9, 1000).astype(np.uint16)
    out, counts = steps._stable_sort_by_bucket(idx, bucket_of, 9)
    assert np.array_equal(out, idx[np.argsort(bucket_of[idx], kind="stable")])
    assert counts.tolist() == np.bincount(bucket_of, minlength=9).tolist()


def test_count_buckets_matches_a_row_wise_unique(monkeypatch):
    from lightning_adaptiveload.bucketing.buckets import count_buckets

    shapes = _shapes(9, 2000).astype(np.int32)
    want_grids, want_counts = np.unique(shapes, axis=0, return_counts=True)
    _small_chunks(monkeypatch, 13)
    grids, counts = count_buckets(shapes)
    assert grids.dtype == np.int64 and grids.tolist() == want_grids.tolist()
    assert counts.tolist() == want_counts.tolist()
    with pytest.raises(ValueError, match=r"Sample 1 has token grid \(0, 2, 2\)"):
        count_buckets(np.array([(1, 2, 2), (0, 2, 2)]))


def _reference_plan(s, base, num_replicas, segment):
    """The epoch plan computed on whole arrays (argsort / lexsort of every batch): the chunked,
    counting-sort planner must give exactly this."""
    from lightning_adaptiveload.bucketing.buckets import batch_costs
    from lightning_adaptiveload.bucketing.sampler import EpochPlan

    rng = np.random.default_rng([s.seed, s.epoch, segment])
    bs_of_bucket = s.bucket_batch_sizes
    if base is None:
        base = np.arange(s.num_samples, dtype=s._index_dtype)
        if s.skipped_oversize:
            base = base[bs_of_bucket[s._bucket_of] > 0]
    idx = rng.permutation(base) if s.shuffle else base
    idx = idx[np.argsort(s._bucket_of[idx], kind="stable")]
    counts = np.bincount(s._bucket_of[idx], minlength=len(bs_of_bucket))
    bsz = np.maximum(bs_of_bucket, 1)
    nb = -(-counts // bsz)
    total = int(nb.sum())
    batch_bucket = np.repeat(np.arange(len(bs_of_bucket), dtype=np.int32), nb)
    within = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(nb) - nb, nb)
    first = np.cumsum(counts) - counts
    batch_start = (first[batch_bucket] + within * bsz[batch_bucket]).astype(s._index_dtype)
    batch_len = np.minimum(bsz[batch_bucket], counts[batch_bucket] - within * bsz[batch_bucket]).astype(np.int32)
    cost = batch_costs(batch_len, s.bucket_seq_lens[batch_bucket], s.cost_model, s._cost_exponent())
    ids = np.arange(total, dtype=s._index_dtype)
    if s.shuffle:
        ids = rng.permutation(ids)
    rem = total % num_replicas
    dropped = (0, 0)
    if s.drop_last and rem:
        drop = ids[np.argsort(batch_len[ids], kind="stable")[:rem]]
        keep = np.ones(total, dtype=bool)
        keep[drop] = False
        ids = ids[keep[ids]]
        dropped, rem = (rem, int(batch_len[drop].sum())), 0
    if s.balance == "cost":
        ids = ids[np.argsort(-cost[ids], kind="stable")]
    padded = (0, 0)
    if rem:
        fewest = np.lexsort((cost[ids], batch_len[ids]))
        pad = ids[fewest[np.arange(num_replicas - rem) % len(ids)]]
        ids = np.concatenate([ids, pad])
        padded = (len(pad), int(batch_len[pad].sum()))
    steps = ids.reshape(-1, num_replicas)
    if s.balance == "cost" and s.shuffle:
        steps = steps[rng.permutation(steps.shape[0])]
    return EpochPlan(idx, batch_start, batch_len, batch_bucket, cost, steps, *padded, *dropped)


class _Affine:
    def predict(self, b, s):
        return 0.25 + 1e-3 * np.asarray(b, dtype=np.float64) * np.asarray(s, dtype=np.float64) ** 1.5


@pytest.mark.parametrize("chunk", [5, 1 << 22])
@pytest.mark.parametrize("world, balance, drop_last, shuffle, cost_model", [
    (7, "cost", False, True, None), (7, "cost", False, True, _Affine()), (64, "cost", False, True, None),
    (5, "none", False, True, None), (5, "cost", True, True, None), (3, "cost", False, False, None),
    (600, "cost", False, True, None),  # fewer batches than ranks: every batch padded, some twice
])  # fmt: skip
def test_plans_equal_the_whole_array_planner_bit_for_bit(monkeypatch, chunk, world, balance, drop_last, shuffle,
                                                         cost_model):
    _small_chunks(monkeypatch, chunk)
    rng = np.random.default_rng(3)
    shapes = np.concatenate([_shapes(11, 2500), rng.integers(1, 6, (500, 3))])  # 6 common grids + a tail
    s = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, seed=5, balance=balance, drop_last=drop_last,
                                   shuffle=shuffle, cost_model=cost_model)  # fmt: skip
    for epoch, base in ((0, None), (1, np.sort(rng.choice(3000, 1700, replace=False)).astype(np.int32))):
        s.set_epoch(epoch)
        got, want = s._build_plan(base, world, 0), _reference_plan(s, base, world, 0)
        for name in ("order", "batch_start", "batch_len", "batch_bucket", "batch_cost", "steps"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and np.array_equal(a, b), name
        assert (got.padded_batches, got.padded_samples, got.dropped_batches, got.dropped_samples) == (
            want.padded_batches, want.padded_samples, want.dropped_batches, want.dropped_samples)
        assert got.padded_batches == (-len(got.batch_len) % world if not drop_last else 0)


def test_partial_sorts_equal_full_sorts(monkeypatch):
    from lightning_adaptiveload.bucketing import steps

    rng = np.random.default_rng(1)
    first = rng.integers(0, 4, 5000).astype(np.int32)
    second = rng.integers(0, 3, 5000).astype(np.float64)  # many exact ties in both keys
    for k in (1, 2, 37, 4999, 5000, 6000):
        assert np.array_equal(steps._lex_first(first, second, k), np.lexsort((second, first))[:k])
    second[::7] = np.nan
    assert np.array_equal(steps._lex_first(first, second, 40), np.lexsort((second, first))[:40])
    _small_chunks(monkeypatch, 333)
    ids = rng.permutation(5000).astype(np.int32)
    cost = rng.integers(0, 50, 5000).astype(np.float64)
    want = np.lexsort((cost[ids], first[ids]))[:63]
    assert np.array_equal(steps._fewest_samples(ids, first, cost, 63), want)
    assert np.array_equal(steps._by_descending_cost(ids, cost), ids[np.argsort(-cost[ids], kind="stable")])
    many = np.repeat(rng.random(35_000), 2)  # more distinct costs than 16-bit ranks hold: the float sort
    ids = rng.permutation(70_000).astype(np.int32)
    assert np.array_equal(steps._by_descending_cost(ids, many), ids[np.argsort(-many[ids], kind="stable")])


def test_oversize_error_names_the_first_long_sample_by_its_label():
    from lightning_adaptiveload.bucketing.sampler import OversizeSampleError, oversize_error

    shapes = np.array([(1, 2, 2), (4, 4, 4), (9, 9, 9), (4, 4, 4)])
    with pytest.raises(OversizeSampleError) as info:
        AdaptiveBucketBatchSampler(shapes, DualConstraintPolicy(32, 1e4, 2),
                                   sample_label=lambda i: f"manifest row {i + 2} (clip_{i}.mp4)")
    assert info.value.index == 1  # the first in dataset order, not the first bucket
    message = str(info.value)
    assert message.startswith("manifest row 3 (clip_1.mp4): S=64 tokens (token grid (4, 4, 4)) is above the memory "
                              "budget of 32 tokens of DualConstraintPolicy(")
    assert "(3 samples in all are that long)" in message and "\n" not in message
    # The function others call: nothing to say when all fit, when skipping, or without a limit.
    seq = np.array([4, 64, 729])
    assert oversize_error(seq, 729, "error") is None
    assert oversize_error(seq, 32, "skip") is None and oversize_error(seq, None, "error") is None
    err = oversize_error(seq, 32, "error", lambda i: f"row {i}")
    assert err.index == 1 and str(err).startswith("row 1: S=64 tokens is above the memory budget of 32 tokens;")
    # A label that fails still gives the error, with the index.
    assert str(oversize_error(seq, 32, "error", lambda i: 1 / 0)).startswith("sample 1: S=64")
