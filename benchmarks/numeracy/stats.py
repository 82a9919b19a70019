"""The numeracy study's statistics, one module for every tier: pure functions of numbers (tested on
synthetic values in tests/numeracy/test_stats.py and test_tier_a.py).

Across seeds a cell is described by its mean, sample std and 95% t-interval (``describe``). An arm is
compared with ``ce`` on the per-seed differences of the seeds both finished (``paired_test``: the paired
t-test; ``t_interval``: the paired Student-t 95% interval, the primary one; ``bootstrap_interval``: the
percentile bootstrap beside it, too narrow with fewer than 10 seeds), Holm's step-down correction within
a metric and study-wide (``holm``, ``study_holm``), the minimal detectable effect at 80% power
(``minimal_detectable_effect``, from ``paired_power``) and the pre-registered decision rule of
``preregistration.json`` (``load_rule``, ``decide``). ``compare`` runs all of it for one metric.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
from pathlib import Path

import numpy as np
from scipy import integrate, optimize, stats

HERE = Path(__file__).resolve().parent
BASELINE = "ce"
ALPHA = 0.05
POWER = 0.8
BOOTSTRAP_RESAMPLES = 10_000
PREREGISTRATION = HERE / "preregistration.json"


def describe(values) -> dict:
    """Mean, sample std and 95% t-interval of the finite ``values`` (NaN/None are left out).

    ``n`` < 2 gives a NaN std and interval; ``n`` = 0 also a NaN mean.
    """
    finite = [float(value) for value in values if value is not None and math.isfinite(value)]
    n = len(finite)
    mean = statistics.fmean(finite) if finite else math.nan
    std = statistics.stdev(finite) if n > 1 else math.nan
    half_width = stats.t.ppf(0.975, n - 1) * std / math.sqrt(n) if n > 1 else math.nan
    return {"n": n, "mean": mean, "std": std, "ci95_low": mean - half_width, "ci95_high": mean + half_width}


def paired_test(values, baseline_values) -> dict:
    """Paired t-test of ``values`` against ``baseline_values`` (same seeds, same order).

    Pairs where either side is missing (None/NaN) are dropped. Returns ``n`` (pairs),
    ``mean_difference`` (values - baseline), ``t``, the two-sided ``p_value`` and ``constant``. Fewer
    than 2 pairs: t and p are NaN. Differences without spread have no t statistic: identical methods
    (every difference 0) get p = 1; the same non-zero difference on every seed gets t = +-inf, p NaN
    and ``constant`` True. Such a test is left out of Holm and reported as untestable rather than as
    p = 0: it arises when both sides are constant across seeds (e.g. a model that collapsed to one
    answer), where a t-test says nothing about a difference.
    """
    if len(values) != len(baseline_values):
        raise ValueError(f"paired values need one baseline value per seed; got {len(values)} and "
                         f"{len(baseline_values)}")
    pairs = [(float(a), float(b)) for a, b in zip(values, baseline_values)
             if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
    n = len(pairs)
    differences = np.array([a - b for a, b in pairs])
    mean_difference = float(differences.mean()) if n else math.nan
    if n < 2:
        return {"n": n, "mean_difference": mean_difference, "t": math.nan, "p_value": math.nan, "constant": False}
    if np.all(differences == differences[0]):
        if differences[0] == 0:
            return {"n": n, "mean_difference": 0.0, "t": 0.0, "p_value": 1.0, "constant": False}
        return {"n": n, "mean_difference": mean_difference, "t": math.copysign(math.inf, differences[0]),
                "p_value": math.nan, "constant": True}
    result = stats.ttest_rel([a for a, _ in pairs], [b for _, b in pairs])
    return {"n": n, "mean_difference": mean_difference, "t": float(result.statistic),
            "p_value": float(result.pvalue), "constant": False}


def holm(p_values) -> list:
    """Holm's step-down adjusted p-values, in input order; NaN stays NaN and is not counted.

    The i-th smallest of m p-values becomes max over j <= i of min(1, (m - j + 1) * p_(j)).
    """
    finite = sorted((p, index) for index, p in enumerate(p_values) if math.isfinite(p))
    adjusted = [math.nan] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(finite):
        running = max(running, min(1.0, (len(finite) - rank) * p))
        adjusted[index] = running
    return adjusted


def paired_power(n: int, effect_size: float, alpha: float = ALPHA) -> float:
    """Power of a two-sided paired t-test with ``n`` pairs against a true mean difference of
    ``effect_size`` standard deviations of the differences.

    The statistic is (Z + delta) / S with Z standard normal, delta = effect_size * sqrt(n) and S =
    chi(n - 1) / sqrt(n - 1); the power P(|T| > t_crit) is integrated over S (scipy's noncentral t
    returns NaN for some large noncentralities with few degrees of freedom).
    """
    df, noncentrality = n - 1, effect_size * math.sqrt(n)
    critical = stats.t.ppf(1 - alpha / 2, df)

    def rejection_given_chi(chi: float) -> float:
        threshold = critical * chi / math.sqrt(df)
        return stats.chi.pdf(chi, df) * (stats.norm.sf(threshold - noncentrality)
                                         + stats.norm.cdf(-threshold - noncentrality))

    return float(integrate.quad(rejection_given_chi, 0, math.inf)[0])


def bootstrap_interval(differences, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                       level: float = 0.95) -> tuple:
    """Percentile bootstrap interval of the mean of ``differences`` (resampling them with
    replacement). Fewer than 2 values: (nan, nan). With few seeds the percentile interval is
    narrower than it should be (it ignores the t correction); the report says so."""
    values = np.asarray([value for value in differences if value is not None and math.isfinite(value)], dtype=float)
    if len(values) < 2:
        return math.nan, math.nan
    generator = np.random.default_rng(seed)
    means = values[generator.integers(0, len(values), size=(resamples, len(values)))].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def t_interval(differences, level: float = 0.95) -> tuple:
    """The paired Student-t interval of the mean of ``differences``: mean +- t(1 - (1 - level) / 2, n - 1)
    x sd / sqrt(n). Fewer than 2 values: (nan, nan); no spread: (mean, mean)."""
    values = np.asarray([value for value in differences if value is not None and math.isfinite(value)], dtype=float)
    if len(values) < 2:
        return math.nan, math.nan
    half = float(stats.t.ppf(1 - (1 - level) / 2, len(values) - 1) * values.std(ddof=1) / math.sqrt(len(values)))
    return float(values.mean()) - half, float(values.mean()) + half


@functools.lru_cache(maxsize=None)
def minimal_detectable_effect(n: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """The true mean difference, in SDs of the per-seed differences, that a two-sided paired t-test
    with ``n`` pairs detects with probability ``power`` at level ``alpha`` (a root search over the
    noncentral t, about a second: remembered per ``n``, since a report asks it for every metric)."""
    if n < 2:
        return math.nan
    return float(optimize.brentq(lambda effect: paired_power(n, effect, alpha) - power, 1e-3, 100.0))


def compare(values: dict, seeds: list) -> dict:
    """Tests of every arm against ``ce`` for one metric: ``values`` is {column: {arm: [value per seed]}}
    (None where missing). Returns {"rows": [...], "mde_sd": ..., "mde_holm_sd": ...}; each row has
    arm, column, n, mean_difference, t95_low/high (paired Student t: the primary interval), ci95_low/high
    (percentile bootstrap), sd_difference, p_value, p_holm (within this metric), mde (in the metric's
    units, from the observed SD). ``analyze`` adds p_holm_study (over every pre-registered test)."""
    rows = []
    for column, by_arm in values.items():
        baseline = by_arm[BASELINE]
        for arm, arm_values in by_arm.items():
            if arm == BASELINE:
                continue
            test = paired_test(arm_values, baseline)
            differences = [a - b for a, b in zip(arm_values, baseline)
                           if a is not None and b is not None and math.isfinite(a) and math.isfinite(b)]
            low, high = bootstrap_interval(differences)
            t_low, t_high = t_interval(differences)
            rows.append({"arm": arm, "column": column, **test, "t95_low": t_low, "t95_high": t_high,
                         "ci95_low": low, "ci95_high": high,
                         "sd_difference": float(np.std(differences, ddof=1)) if len(differences) > 1 else math.nan,
                         "differences": differences})
    for row, adjusted in zip(rows, holm([row["p_value"] for row in rows])):
        row["p_holm"] = adjusted
    pairs = max((row["n"] for row in rows), default=0)  # the complete comparisons; a short one has its own MDE
    tests = sum(math.isfinite(row["p_value"]) for row in rows)
    mde_sd = minimal_detectable_effect(pairs)
    mde_holm_sd = minimal_detectable_effect(pairs, ALPHA / max(tests, 1))
    for row in rows:  # a row with fewer pairs (a grid cut short) has its own, larger MDE
        row["mde"] = minimal_detectable_effect(row["n"]) * row["sd_difference"]
    return {"rows": rows, "pairs": pairs, "tests": tests, "mde_sd": mde_sd, "mde_holm_sd": mde_holm_sd}


def study_holm(tests: dict, family: list) -> None:
    """Holm's correction over every test of the metrics in ``family`` at once (the study-wide family, beside
    the within-metric one): sets each row's ``p_holm_study`` (NaN for rows outside the family)."""
    rows = [row for metric in family for row in tests[metric]["rows"]]
    for row, adjusted in zip(rows, holm([row["p_value"] for row in rows])):
        row["p_holm_study"] = adjusted
    for metric, result in tests.items():
        if metric not in family:
            for row in result["rows"]:
                row["p_holm_study"] = math.nan
    for result in tests.values():
        result["tests_study"] = sum(math.isfinite(row["p_value"]) for row in rows)


def load_rule(tier: str, path: Path = PREREGISTRATION) -> dict:
    """The pre-registered decision rule of ``tier`` (``preregistration.json``: the primary metric and
    split, the interval, the MDE, the words of each outcome), committed before the tier's grid ran."""
    rules = json.loads(Path(path).read_text())
    if tier not in rules["tiers"]:
        raise KeyError(f"{path} has no pre-registered rule for tier {tier!r}; it has {sorted(rules['tiers'])}")
    return {**rules["rule"], **rules["tiers"][tier]}


def decide(row: dict, higher_is_better: bool, rule: dict) -> str:
    """The pre-registered outcome of one comparison (``row`` from ``compare``): its t-interval, turned so
    that positive is better, above 0 -> ``rule["above"]`` (recommend); below 0 -> ``rule["below"]``
    (warn); inside +-MDE (the row's minimal detectable effect in the metric's units) ->
    ``rule["within_mde"]``; otherwise (it straddles 0 and reaches past the MDE) ``rule["otherwise"]``."""
    low, high, mde = row["t95_low"], row["t95_high"], row["mde"]
    if not (math.isfinite(low) and math.isfinite(high)):
        return rule["untestable"]
    if not higher_is_better:
        low, high = -high, -low
    if low > 0:
        return rule["above"]
    if high < 0:
        return rule["below"]
    if math.isfinite(mde) and -mde <= low and high <= mde:
        return rule["within_mde"]
    return rule["otherwise"]


def strict_json(value):
    """``value`` with NaN and infinities as ``null`` (strict JSON has neither) and numpy scalars as Python ones."""
    if isinstance(value, dict):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
