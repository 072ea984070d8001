import math
from fractions import Fraction

import numpy as np
import pytest

from lightning_adaptiveload.bucketing.policy import CostModelPolicy, DualConstraintPolicy, EqualTokenPolicy

SEQ_LENS = [1, 2, 3, 7, 16, 100, 1560, 3600, 7800, 14040, 20280, 32760, 65519, 65520]


def _exact_dual(m_mem, m_comp, p, s):
    comp = math.floor(Fraction(m_comp) / Fraction(s) ** p)
    return max(1, min(m_mem // s, comp))


@pytest.mark.parametrize("m_comp", [65520 * 1560, 32760**2, 10**9 + 7, 12345.678])
def test_dual_constraint_exact_formula(m_comp):
    policy = DualConstraintPolicy(65520, m_comp, 2)
    expected = [_exact_dual(65520, m_comp, 2, s) for s in SEQ_LENS]
    assert [policy.batch_size(s) for s in SEQ_LENS] == expected
    assert policy.batch_sizes(np.array(SEQ_LENS)).tolist() == expected


def test_dual_constraint_float_floor_edge():
    # m_comp = k * S**p exactly: the float quotient can round to k - 1e-16 and floor to k - 1.
    for s in [3, 7, 1560, 32760, 49999]:
        for k in [1, 3, 5, 29]:
            assert DualConstraintPolicy(10**12, k * s**2, 2).batch_size(s) == min(10**12 // s, k)
            # Non-integral p: 10 * S**1.5 must give 10, not 9.
            assert DualConstraintPolicy(10**12, k * float(s) ** 1.5, 1.5).batch_size(s) == min(10**12 // s, k)
    # 0.1 + 0.2 style rounding: m_comp=0.3 * S^2 / S^2 -> 0 -> max(1, .) = 1
    assert DualConstraintPolicy(100, 0.3, 1).batch_size(1) == 1
    # p = 3 with S**3 beyond int64 stays exact
    assert DualConstraintPolicy(10**18, 2**64 * 3, 3).batch_size(2**21) == 3 * 2**64 // 2**63


def test_equal_token_formula():
    policy = EqualTokenPolicy(65520)
    assert policy.batch_sizes(np.array(SEQ_LENS)).tolist() == [max(1, 65520 // s) for s in SEQ_LENS]
    assert policy.batch_size(10**6) == 1


class _Quadratic:
    def predict(self, b, s):
        b, s = np.asarray(b, float), np.asarray(s, float)
        return 0.01 + b * (1e-5 * s + 1e-9 * s * s)


def test_cost_model_policy_is_largest_admissible_batch():
    cm = _Quadratic()
    policy = CostModelPolicy(cm, m_mem=65520, step_budget=0.8)
    got = policy.batch_sizes(np.array(SEQ_LENS))
    for s, b in zip(SEQ_LENS, got.tolist(), strict=True):
        brute = [x for x in range(1, 65520 // s + 1) if cm.predict(x, s) <= 0.8]
        assert b == (max(brute) if brute else 1)


@pytest.mark.parametrize(
    "make, arg",
    [
        (lambda: DualConstraintPolicy(100, 10, 0), "p=0"),
        (lambda: DualConstraintPolicy(100, 10, -1.0), "p=-1.0"),
        (lambda: DualConstraintPolicy(100, float("nan"), 2), "m_comp=nan"),
        (lambda: DualConstraintPolicy(0, 10, 2), "m_mem=0"),
        (lambda: DualConstraintPolicy(100, float("inf"), 2), "m_comp=inf"),
        (lambda: DualConstraintPolicy(100, 10, 2, oversize="ignore"), "oversize='ignore'"),
        (lambda: EqualTokenPolicy(-5), "max_tokens=-5"),
        (lambda: CostModelPolicy(_Quadratic(), 100, 0.0), "step_budget=0.0"),
        (lambda: CostModelPolicy(object(), 100, 1.0), "cost_model="),
    ],
)
def test_invalid_arguments_name_the_argument(make, arg):
    with pytest.raises(ValueError, match=arg.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_oversize_error_and_skip():
    with pytest.raises(ValueError, match="S=200 tokens exceeds the memory budget 100.*oversize='skip'"):
        DualConstraintPolicy(100, 1e6, 2).batch_size(200)
    assert DualConstraintPolicy(100, 1e6, 2, oversize="skip").batch_sizes(np.array([50, 200])).tolist() == [2, 0]


def test_repr_and_to_dict():
    p = DualConstraintPolicy(65520, 1e9, 2)
    assert repr(p) == "DualConstraintPolicy(m_mem=65520, m_comp=1000000000, p=2.0, oversize='error')"
    assert p.to_dict()["type"] == "dual_constraint"
    assert EqualTokenPolicy(8).to_dict() == {"type": "equal_token", "max_tokens": 8}


def test_fixed_batch_policy():
    from lightning_adaptiveload.bucketing.policy import FixedBatchPolicy

    policy = FixedBatchPolicy({32760: 1, "7800": 4, 1560: 16})
    assert policy.batch_sizes(np.array([1560, 32760, 7800, 1560])).tolist() == [16, 1, 4, 16]
    assert policy.to_dict() == {"type": "fixed", "batch_sizes": {1560: 16, 7800: 4, 32760: 1}, "default": None}
    with pytest.raises(ValueError, match=r"no batch size for S=100 \(unlisted sequence lengths of the data: "
                                         r"\[100, 200\]; listed: \[1560, 7800, 32760\]\).*default=<B>"):
        policy.batch_sizes(np.array([200, 100, 1560, 100]))
    assert FixedBatchPolicy({10: 2}, default=3).batch_sizes(np.array([10, 11])).tolist() == [2, 3]
    assert FixedBatchPolicy(None, default=2).batch_size(5) == 2
    for bad, match in (({}, "non-empty unless"), ({10: 0}, r"batch_sizes\[10\]=0"), ({"x": 1}, "key 'x'"),
                       ({10: 1.5}, r"batch_sizes\[10\]=1.5")):
        with pytest.raises(ValueError, match=match):
            FixedBatchPolicy(bad)
