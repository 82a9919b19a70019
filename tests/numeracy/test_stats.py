"""The numeracy study's statistics (``benchmarks.numeracy.stats``) on synthetic numbers with known
answers: describe, the paired t-test, Holm's correction and the paired test's power."""

import math

import numpy as np
import pytest

from benchmarks.numeracy import stats  # scipy comes with the test extras


@pytest.fixture
def rng(generator):
    return np.random.default_rng(int(generator.initial_seed()))


def test_describe_matches_the_closed_form(rng):
    values = rng.normal(10.0, 3.0, size=5)
    described = stats.describe(list(values) + [None, math.nan])  # undefined values are left out
    mean, std = values.mean(), values.std(ddof=1)
    half_width = 2.7764451051977987 * std / math.sqrt(5)  # t(0.975, 4)
    assert described["n"] == 5
    assert described["mean"] == pytest.approx(mean) and described["std"] == pytest.approx(std)
    assert described["ci95_low"] == pytest.approx(mean - half_width)
    assert described["ci95_high"] == pytest.approx(mean + half_width)


def test_describe_with_one_or_no_value():
    one = stats.describe([0.25])
    assert one["n"] == 1 and one["mean"] == 0.25 and math.isnan(one["std"]) and math.isnan(one["ci95_low"])
    none = stats.describe([None, math.nan])
    assert none["n"] == 0 and math.isnan(none["mean"])


def test_a_method_better_on_every_seed_by_a_constant(rng):
    baseline = rng.uniform(0.1, 0.5, size=5)
    noise = rng.normal(0.0, 1e-4, size=5)
    result = stats.paired_test(list(baseline + 0.1 + noise), list(baseline))
    assert result["n"] == 5
    assert result["mean_difference"] == pytest.approx(0.1 + noise.mean())
    assert result["p_value"] < 1e-6 and result["t"] > 0


def test_a_constant_difference_without_spread_is_untestable_not_p_zero():
    # both sides constant across seeds (a collapsed model): no spread, so no evidence either way
    result = stats.paired_test([3.5, 3.5, 3.5], [0.5, 0.5, 0.5])
    assert result["mean_difference"] == pytest.approx(3.0)
    assert result["constant"] and result["t"] == math.inf and math.isnan(result["p_value"])
    assert math.isnan(stats.holm([result["p_value"], 0.01])[0])


def test_identical_methods_give_p_one(rng):
    values = list(rng.uniform(size=3))
    result = stats.paired_test(values, values)
    assert result == {"n": 3, "mean_difference": 0.0, "t": 0.0, "p_value": 1.0, "constant": False}


def test_pairs_with_a_missing_side_are_dropped():
    result = stats.paired_test([1.0, None, 3.0, 4.5], [0.0, 2.0, math.nan, 1.0])
    assert result["n"] == 2 and result["mean_difference"] == pytest.approx((1.0 + 3.5) / 2)
    too_few = stats.paired_test([1.0, None], [0.5, 2.0])
    assert too_few["n"] == 1 and math.isnan(too_few["p_value"])
    with pytest.raises(ValueError, match="one baseline value per seed"):
        stats.paired_test([1.0, 2.0], [1.0])


def test_paired_test_matches_scipy(rng):
    from scipy import stats as scipy_stats

    a, b = rng.normal(size=4), rng.normal(size=4)
    result = stats.paired_test(list(a), list(b))
    reference = scipy_stats.ttest_rel(a, b)
    assert result["t"] == pytest.approx(reference.statistic) and result["p_value"] == pytest.approx(reference.pvalue)


def test_holm_by_hand():
    # sorted: 0.01 (x3), 0.03 (x2 -> 0.06), 0.04 (x1 -> 0.04, but never below the previous 0.06)
    assert stats.holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    adjusted = stats.holm([0.5, math.nan, 0.02])  # NaN is neither adjusted nor counted
    assert adjusted[0] == pytest.approx(0.5) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.04)
    assert stats.holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1


def test_power_of_three_seeds():
    # (what 3 seeds can show was the retired suite's power note; the tiers read the same power as their MDE)
    effect = stats.minimal_detectable_effect(3)
    assert stats.paired_power(3, effect) == pytest.approx(0.8, abs=1e-6)
    assert 0.1 < stats.paired_power(3, 1.0) < 0.25  # a 1-SD effect is usually missed with 3 seeds
    assert stats.paired_power(3, 0.0) == pytest.approx(0.05, abs=1e-6)  # no effect: the test's size
