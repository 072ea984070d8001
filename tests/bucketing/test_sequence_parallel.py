"""Per-bucket sequence-parallel planning: degree checks, the layout rule and the sampler's invariants with SP groups."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_adaptiveload.bucketing.policy import DualConstraintPolicy, EqualTokenPolicy
from lightning_adaptiveload.bucketing.sampler import AdaptiveBucketBatchSampler, OversizeSampleError
from lightning_adaptiveload.bucketing.sequence_parallel import (
    SequenceParallelConfig,
    allowed_sp_degrees,
    check_sp_degree,
    plan_bucket_layout,
    sp_cost_function,
)

# S = 4, 16, 12, 120, 18, 144 fit m_mem=256; S = 320 and 640 do not (640 needs a group of 4 or more).
GRIDS = np.array([(1, 2, 2), (1, 4, 4), (3, 2, 2), (5, 4, 6), (2, 3, 3), (9, 4, 4), (20, 4, 4), (40, 4, 4)])
POLICY = DualConstraintPolicy(m_mem=256, m_comp=4096 * 9, p=2, oversize="error")
SP = SequenceParallelConfig((2, 4), num_heads=12, ranks_per_node=4)


def _shapes(seed, n, grids=GRIDS):
    return grids[np.random.default_rng(seed).integers(0, len(grids), n)]


def _sampler(shapes, world, rank=0, sp=SP, policy=POLICY, **kw):
    return AdaptiveBucketBatchSampler(shapes, policy, num_replicas=world, rank=rank, sequence_parallel=sp, **kw)


def _check_groups(plan, world, ranks_per_node):
    """Every SP batch of degree k fills the k ranks [g*k, (g+1)*k) of its step, inside one node."""
    deg = plan.batch_degree
    for row in plan.steps:
        r = 0
        while r < world:
            b = int(row[r])
            k = int(deg[b])
            assert r % k == 0 and r // ranks_per_node == (r + k - 1) // ranks_per_node
            assert (row[r:r + k] == b).all()
            r += k


def test_allowed_degrees_and_check_errors():
    assert allowed_sp_degrees(12, 8) == [2, 4]
    assert allowed_sp_degrees(40, 8) == [2, 4, 8]
    assert allowed_sp_degrees(12, 12) == [2, 3, 4, 6, 12]
    assert check_sp_degree(4, 40, 8, 64) == 4 and check_sp_degree(1, 12, 8) == 1
    with pytest.raises(ValueError, match=r"degree=5.*does not divide the heads.*Expected one of \[2, 4\]"):
        check_sp_degree(5, 12, 8)
    with pytest.raises(ValueError, match=r"degree=3.*does not divide the ranks of a node.*Expected one of \[2, 4\]"):
        check_sp_degree(3, 12, 8)
    with pytest.raises(ValueError, match=r"world_size=6.*groups of 4"):
        check_sp_degree(4, 12, 8, 6)
    with pytest.raises(ValueError, match=r"world_size=12.*not whole nodes of ranks_per_node=8"):
        check_sp_degree(2, 12, 8, 12)
    with pytest.raises(ValueError, match=r"num_heads=0"):
        check_sp_degree(2, 0, 8)


def test_config_validates_degrees():
    assert SequenceParallelConfig([4, 2, 2], num_heads=40, ranks_per_node=8).degrees == (2, 4)
    with pytest.raises(ValueError, match=r"3 does not divide 4"):
        SequenceParallelConfig((3, 4), num_heads=12, ranks_per_node=12)
    with pytest.raises(ValueError, match=r"degree=5.*Expected one of \[2, 4\]"):
        SequenceParallelConfig((5,), num_heads=12, ranks_per_node=8)
    with pytest.raises(ValueError, match="no degree above 1"):
        SequenceParallelConfig((1,), num_heads=12, ranks_per_node=8)
    with pytest.raises(ValueError, match="tolerance"):
        SequenceParallelConfig((2,), num_heads=12, ranks_per_node=8, tolerance=-1)
    assert SP.usable_degrees(2) == [2] and SP.usable_degrees(1) == [] and SP.usable_degrees(8) == [2, 4]


def test_layout_rule_on_a_hand_checked_example():
    """Unit-cost model t(B, S) = B*S^2 and t_sp = t/k; m_mem = 50, S=80 above it."""
    s = np.array([10, 20, 40, 80])
    dp = np.array([8, 2, 1, 0])
    cost, sp_cost = sp_cost_function(None, 2.0)

    def layout(world, **cfg):
        bs, deg = plan_bucket_layout(s, dp, m_mem=50, config=SequenceParallelConfig((2, 4), 12, 4, **cfg),
                                     world_size=world, cost=cost, sp_cost=sp_cost)
        return bs.tolist(), deg.tolist()

    # Explicit target 800. S=40: 1600 > 800 -> k=2 (cap 2*50//40 = 2; 2*1600/2 > 800 so B=1): 800 <= 800.
    # S=80 needs k >= 2 for memory: k=2 (cap 1): 3200 > 800; k=4 (cap 2, B=1): 1600 > 800 -> the fastest, k=4.
    assert layout(8, target_step_time=800.0, tolerance=0.0) == ([8, 2, 1, 1], [1, 1, 2, 4])
    # Derived target: the policy's 800 (slowest B >= 2 batch: 8*100, 2*400) is below the floor, S=80's fastest
    # unit 6400/4 = 1600, so target 1600: S=40 (1600) stays data parallel, S=80 takes k=4 (1600 <= 1600).
    assert layout(8, tolerance=0.0) == ([8, 2, 1, 1], [1, 1, 1, 4])
    # A generous tolerance (limit 6400): the smallest degree within it, k=2 (3200), wins.
    assert layout(8, tolerance=3.0) == ([8, 2, 1, 1], [1, 1, 1, 2])
    # On 2 ranks only k=2 is usable; on 1 rank S=80 cannot be planned (0, 0).
    assert layout(2, target_step_time=800.0, tolerance=0.0) == ([8, 2, 1, 1], [1, 1, 2, 2])
    assert layout(1) == ([8, 2, 1, 0], [1, 1, 1, 0])


def test_sp_batches_respect_memory_per_rank():
    s = _sampler(_shapes(0, 500), 8)
    seq, bs, deg = s.bucket_seq_lens, s.bucket_batch_sizes, s.bucket_degrees
    assert (bs * seq <= POLICY.m_mem * deg).all()
    assert deg[seq > POLICY.m_mem].min() >= 2 and deg[seq == 640].min() == 4
    assert s.skipped_oversize == 0


def _golden_digest():
    import hashlib

    grids = np.array([(1, 2, 2), (1, 4, 4), (3, 2, 2), (5, 4, 6), (2, 3, 3), (9, 4, 4), (20, 4, 4)])
    shapes = grids[np.random.default_rng(7).integers(0, len(grids), 2000)]
    h = hashlib.sha256()
    for pol in (DualConstraintPolicy(m_mem=512, m_comp=4096 * 9, p=2), EqualTokenPolicy(512)):
        for balance in ("cost", "none"):
            for drop_last in (False, True):
                for world in (1, 3, 8):
                    s = AdaptiveBucketBatchSampler(shapes, pol, num_replicas=world, seed=5, balance=balance,
                                                   drop_last=drop_last)
                    for epoch in (0, 1):
                        s.set_epoch(epoch)
                        p = s.plan()
                        for a in (p.order, p.batch_start, p.batch_len, p.steps, p.batch_cost):
                            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:32]


def test_sp_disabled_plan_is_bit_identical_to_the_previous_release():
    # Digest of 48 plans computed with the sampler as released before sequence parallelism (commit 17f24dd).
    assert _golden_digest() == "4422ceb49813e3e8ccdb119b90c90a4e"


def test_sp_enabled_without_sp_buckets_plans_as_data_parallel():
    shapes = _shapes(3, 400, GRIDS[:6])  # every bucket fits; a huge tolerance keeps all of them DP
    sp = SequenceParallelConfig((2, 4), 12, 4, tolerance=1e9)
    for world in (1, 4, 8):
        a, b = AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=world, seed=2).plan(), _sampler(
            shapes, world, sp=sp, seed=2).plan()
        assert (a.steps == b.steps).all() and (a.order == b.order).all()


def _all_ranks(shapes, world, **kw):
    out = []
    for r in range(world):
        s = _sampler(shapes, world, rank=r, **kw)
        out.append(list(s))
    return out


def _distinct_batches(per_rank, plan):
    """Batches of an epoch with each SP batch once: (step, first rank of its group) -> indices."""
    deg = plan.batch_degree if plan.batch_degree is not None else np.ones(int(plan.steps.max(initial=0)) + 1, int)
    out = []
    for step in range(plan.num_steps):
        r = 0
        while r < len(per_rank):
            out.append(per_rank[r][step])
            r += int(deg[plan.steps[step, r]])
    return out


# With this target S=320 trains on pairs (51,200 <= 60,000) and S=640 on groups of 4: two degrees in one plan.
MIXED_SP = SequenceParallelConfig((2, 4), num_heads=12, ranks_per_node=4, target_step_time=60_000, tolerance=0.0)


def test_mixed_degrees_layout():
    s = _sampler(_shapes(0, 300), 8, sp=MIXED_SP)
    assert {int(q): int(k) for q, k in zip(s.bucket_seq_lens, s.bucket_degrees, strict=True)} == {
        4: 1, 12: 1, 16: 1, 18: 1, 120: 1, 144: 1, 320: 2, 640: 4}


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 300), st.sampled_from([2, 4, 8, 12]),
       st.sampled_from(["cost", "none"]), st.booleans(), st.booleans())
def test_plan_invariants_with_sp_groups(seed, n, world, balance, drop_last, mixed):
    # S=640 needs k=4: with `mixed` it is in the data (two degrees per plan) and the world has 4+ ranks.
    shapes = _shapes(seed, n, GRIDS if mixed else GRIDS[:7])
    world = max(world, 4) if mixed else world
    kw = dict(seed=seed, balance=balance, drop_last=drop_last, sp=MIXED_SP if mixed else SP)
    per_rank = _all_ranks(shapes, world, **kw)
    ref = _sampler(shapes, world, **kw)
    plan = ref.plan()
    assert {len(b) for b in per_rank} == {plan.num_steps}  # equal counts on every rank
    for r in range(1, world):  # a pure function: every rank builds the same plan
        assert (_sampler(shapes, world, rank=r, **kw).plan().steps == plan.steps).all()
    if plan.batch_degree is not None:
        _check_groups(plan, world, SP.ranks_per_node)
        for step in range(plan.num_steps):  # ranks of one group yield the same index list
            for r in range(world):
                k = int(plan.batch_degree[plan.steps[step, r]])
                assert per_rank[r][step] == per_rank[r - r % k][step]
    seen = Counter(i for batch in _distinct_batches(per_rank, plan) for i in batch)
    stats = ref.plan_stats
    if drop_last:
        assert max(seen.values(), default=1) == 1 and n - len(seen) == stats["dropped_samples"]
    else:
        assert len(seen) == n  # every sample, SP batches counted once
        assert sum(seen.values()) - n == stats["padded_samples"]


@pytest.mark.parametrize("worlds", [(8, 8, 8), (8, 4, 2), (4, 12, 8)])
def test_two_resumes_in_a_row_yield_exactly_the_remaining_samples(worlds):
    shapes = _shapes(11, 600, GRIDS[:7])
    seen: Counter = Counter()
    state = None
    for i, world in enumerate(worlds):
        samplers = [_sampler(shapes, world, rank=r, seed=4) for r in range(world)]
        for s in samplers:
            s.set_epoch(1)
            if state is not None:
                s.load_state_dict(state)
        plan = samplers[0].plan()
        assert plan.batch_degree is not None and plan.batch_degree.max() >= 2  # S=320 trains on SP groups
        iters = [iter(s) for s in samplers]
        steps_before = samplers[0].steps_taken
        offset = steps_before - (len(samplers[0]) - plan.num_steps)  # steps of the current plan already taken
        remaining = plan.num_steps - offset
        total = remaining if i == len(worlds) - 1 else remaining // 3
        per_rank = [[next(it) for _ in range(total)] for it in iters]
        plan_rows = plan.steps[offset:offset + total]

        class _P:
            num_steps, steps, batch_degree = total, plan_rows, plan.batch_degree

        seen.update(i for b in _distinct_batches(per_rank, _P) for i in b)
        state = samplers[0].state_dict(steps_taken=steps_before + total)
        assert all(s.state_dict(steps_taken=steps_before + total) == state for s in samplers)
    assert set(seen) == set(range(len(shapes)))
    # Only padding repeats samples (each segment pads at most world - 1 slots).
    assert sum(seen.values()) - len(shapes) <= sum(worlds)


def test_oversize_with_sp_trains_or_names_the_degrees():
    shapes = _shapes(5, 200)
    assert _sampler(shapes, 8).skipped_oversize == 0  # S=320 and 640 train on groups of 2 and 4
    with pytest.raises(OversizeSampleError, match=r"S=320.*usable on 1 ranks \(none; configured \[2, 4\]\)"):
        _sampler(shapes, 1)
    with pytest.raises(OversizeSampleError, match=r"S=640.*usable on 2 ranks \(\[2\]"):
        _sampler(shapes, 2)
    skip = DualConstraintPolicy(m_mem=256, m_comp=4096 * 9, p=2, oversize="skip")
    s = _sampler(shapes, 2, policy=skip)
    assert s.skipped_oversize == int((shapes.prod(axis=1) == 640).sum()) > 0
    # Without SP the same data is refused as before.
    with pytest.raises(OversizeSampleError):
        AdaptiveBucketBatchSampler(shapes, POLICY, num_replicas=8)


def test_resume_on_a_world_that_cannot_hold_the_remaining_samples_is_refused():
    shapes = _shapes(5, 200)
    s = _sampler(shapes, 8)
    state = s.state_dict(steps_taken=1)
    with pytest.raises(OversizeSampleError, match="S=640"):
        _sampler(shapes, 2).load_state_dict(state)


def test_state_records_sp_settings():
    shapes = _shapes(1, 100, GRIDS[:7])
    state = _sampler(shapes, 4).state_dict(steps_taken=2)
    assert state["settings"]["sequence_parallel"]["degrees"] == [2, 4]
    with pytest.raises(ValueError, match="sequence_parallel"):
        _sampler(shapes, 4, sp=SequenceParallelConfig((2,), 12, 4)).load_state_dict(state)
    no_sp = AdaptiveBucketBatchSampler(shapes[shapes.prod(axis=1) <= 256], POLICY, num_replicas=4)
    assert "sequence_parallel" not in no_sp.state_dict()["settings"]


def test_bucket_table_and_degree_by_grid():
    s = _sampler(_shapes(0, 300), 8)
    rows = s.bucket_table()
    assert {r["seq_len"]: r["sp_degree"] for r in rows}[640] == 4
    assert s.degree_by_grid()[(40, 4, 4)] == 4 and s.degree_by_grid()[(1, 2, 2)] == 1
    with pytest.raises(ValueError, match="SequenceParallelConfig"):
        AdaptiveBucketBatchSampler(_shapes(0, 10), POLICY, sequence_parallel={"degrees": [2]})


def test_bucket_plan_table_shows_sp_ranks_and_sp_cost():
    from lightning_adaptiveload.reporting import bucket_plan_table

    s = _sampler(_shapes(0, 300), 8, sp=MIXED_SP)
    table, _ = bucket_plan_table(s)
    cols = {c.header: list(c._cells) for c in table.columns}
    assert cols["SP ranks"] == [str(r["sp_degree"]) for r in s.bucket_table()]
    # cost/batch relative to the costliest: S=640 on 4 ranks (640^2/4) is the top, S=320 on 2 is half of it.
    by_s = dict(zip(cols["S"], cols["cost/batch"], strict=True))
    assert by_s["640"] == "1.00" and by_s["320"] == "0.50"
    assert "SP ranks" not in {c.header for c in bucket_plan_table(_sampler(_shapes(0, 50, GRIDS[:6]), 8, sp=None))[0].columns}


def test_layout_takes_a_memory_budget_per_bucket():
    # The same example with target 6400: S=80 (k=4) is capped by memory, 4*m_mem // 80 per group.
    s, dp = np.array([10, 20, 40, 80]), np.array([8, 2, 1, 0])
    cost, sp_cost = sp_cost_function(None, 2.0)
    config = SequenceParallelConfig((2, 4), 12, 4, target_step_time=12800.0, tolerance=0.0)

    def layout(m_mem):
        return plan_bucket_layout(s, dp, m_mem=m_mem, config=config, world_size=4, cost=cost, sp_cost=sp_cost)

    bs, deg = layout(100)
    assert deg[3] == 2 and bs[3] == 2 * 100 // 80  # 2 x 6400 / 2 <= 12,800: the cap binds
    bs, deg = layout(np.array([100, 100, 100, 50]))  # S=80 in a mode that holds 50 tokens a rank
    # k=2 now holds one sample (2*50 // 80) at 3,200, within the target: the smallest degree wins.
    assert deg[3] == 2 and bs[3] == 1 and (bs * s <= deg * np.array([100, 100, 100, 50])).all()


def test_tiered_policy_sp_groups_hold_what_each_buckets_mode_allows_per_rank():
    from lightning_adaptiveload.bucketing.policy import TieredPolicy

    # 'none' holds 200 tokens a rank up to S=144; 'full' 600 up to S=256; S=320 and 640 need SP groups.
    tiered = TieredPolicy([("none", 144, EqualTokenPolicy(200)), ("full", 256, EqualTokenPolicy(600))])
    assert tiered.memory_budgets(np.array([4, 144, 145, 256, 640])).tolist() == [200, 200, 600, 600, 600]
    s = _sampler(_shapes(0, 500), 8, sp=MIXED_SP, policy=tiered)
    seq, bs, deg = s.bucket_seq_lens, s.bucket_batch_sizes, s.bucket_degrees
    assert (bs * seq <= deg * tiered.memory_budgets(seq)).all()
    assert (deg[seq > 256] >= 2).all() and (bs[seq <= 144] * seq[seq <= 144] <= 200 * deg[seq <= 144]).all()
