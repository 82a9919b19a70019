"""The numeracy study (benchmarks/numeracy): its statistics on synthetic numbers with known answers,
and a --smoke run end to end (data, ZeRO-3 training of CE / SMMD / NTL on 2 seeds, evaluation, report)."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO

from benchmarks.numeracy import analyze, run_study  # scipy and matplotlib come with the test extras

STUDY = [sys.executable, "-m", "benchmarks.numeracy.run_study"]


@pytest.fixture
def rng(generator):
    return np.random.default_rng(int(generator.initial_seed()))


def test_describe_matches_the_closed_form(rng):
    values = rng.normal(10.0, 3.0, size=5)
    described = analyze.describe(list(values) + [None, math.nan])  # undefined values are left out
    mean, std = values.mean(), values.std(ddof=1)
    half_width = 2.7764451051977987 * std / math.sqrt(5)  # t(0.975, 4)
    assert described["n"] == 5
    assert described["mean"] == pytest.approx(mean) and described["std"] == pytest.approx(std)
    assert described["ci95_low"] == pytest.approx(mean - half_width)
    assert described["ci95_high"] == pytest.approx(mean + half_width)


def test_describe_with_one_or_no_value():
    one = analyze.describe([0.25])
    assert one["n"] == 1 and one["mean"] == 0.25 and math.isnan(one["std"]) and math.isnan(one["ci95_low"])
    none = analyze.describe([None, math.nan])
    assert none["n"] == 0 and math.isnan(none["mean"])


def test_a_method_better_on_every_seed_by_a_constant(rng):
    baseline = rng.uniform(0.1, 0.5, size=5)
    noise = rng.normal(0.0, 1e-4, size=5)
    result = analyze.paired_test(list(baseline + 0.1 + noise), list(baseline))
    assert result["n"] == 5
    assert result["mean_difference"] == pytest.approx(0.1 + noise.mean())
    assert result["p_value"] < 1e-6 and result["t"] > 0


def test_a_constant_difference_without_spread_is_untestable_not_p_zero():
    # both sides constant across seeds (a collapsed model): no spread, so no evidence either way
    result = analyze.paired_test([3.5, 3.5, 3.5], [0.5, 0.5, 0.5])
    assert result["mean_difference"] == pytest.approx(3.0)
    assert result["constant"] and result["t"] == math.inf and math.isnan(result["p_value"])
    assert math.isnan(analyze.holm([result["p_value"], 0.01])[0])


def test_identical_methods_give_p_one(rng):
    values = list(rng.uniform(size=3))
    result = analyze.paired_test(values, values)
    assert result == {"n": 3, "mean_difference": 0.0, "t": 0.0, "p_value": 1.0, "constant": False}


def test_pairs_with_a_missing_side_are_dropped():
    result = analyze.paired_test([1.0, None, 3.0, 4.5], [0.0, 2.0, math.nan, 1.0])
    assert result["n"] == 2 and result["mean_difference"] == pytest.approx((1.0 + 3.5) / 2)
    too_few = analyze.paired_test([1.0, None], [0.5, 2.0])
    assert too_few["n"] == 1 and math.isnan(too_few["p_value"])
    with pytest.raises(ValueError, match="one baseline value per seed"):
        analyze.paired_test([1.0, 2.0], [1.0])


def test_paired_test_matches_scipy(rng):
    from scipy import stats

    a, b = rng.normal(size=4), rng.normal(size=4)
    result = analyze.paired_test(list(a), list(b))
    reference = stats.ttest_rel(a, b)
    assert result["t"] == pytest.approx(reference.statistic) and result["p_value"] == pytest.approx(reference.pvalue)


def test_holm_by_hand():
    # sorted: 0.01 (x3), 0.03 (x2 -> 0.06), 0.04 (x1 -> 0.04, but never below the previous 0.06)
    assert analyze.holm([0.04, 0.01, 0.03]) == pytest.approx([0.06, 0.03, 0.06])
    adjusted = analyze.holm([0.5, math.nan, 0.02])  # NaN is neither adjusted nor counted
    assert adjusted[0] == pytest.approx(0.5) and math.isnan(adjusted[1]) and adjusted[2] == pytest.approx(0.04)
    assert analyze.holm([0.9, 0.8]) == [1.0, 1.0]  # capped at 1


def test_power_of_three_seeds():
    note = analyze.power_note(3, tests_per_metric=24)
    assert note["t_critical"] == pytest.approx(4.302652729749464)
    assert note["effect_for_significance_sd"] == pytest.approx(4.302652729749464 / math.sqrt(3))
    assert 0.1 < note["power_at_1_sd"] < 0.25  # a 1-SD effect is usually missed with 3 seeds
    assert analyze.paired_power(3, note["effect_for_80_percent_power_sd"]) == pytest.approx(0.8, abs=1e-6)
    assert analyze.paired_power(3, 0.0) == pytest.approx(0.05, abs=1e-6)  # no effect: the test's size
    assert note["expected_false_positives"] == pytest.approx(1.2)


def _run(method, seed, exact_match, mae):
    column = {"count": 10, "exact_match": exact_match, "mae": mae, "unparseable": 0.0, "numeric_token_mae": 5.0}
    return {"method": method, "seed": seed, "metrics": {"arithmetic": dict(column), "all": dict(column)}}


def test_analyze_tables_tests_and_findings(rng):
    seeds = [0, 1, 2]
    baseline = rng.uniform(0.2, 0.4, size=3)
    runs = ([_run("ce", seed, float(value), 50.0 + seed) for seed, value in zip(seeds, baseline)]
            + [_run("smmd", seed, float(value) + 0.1 + 1e-4 * seed, 50.0 + seed)
               for seed, value in zip(seeds, baseline)])
    analysis = analyze.analyze(runs, seeds)
    assert analysis["methods"] == ["ce", "smmd"] and analysis["columns"] == ["arithmetic", "all"]
    assert analysis["cells"]["exact_match"]["all"]["smmd"]["mean"] == pytest.approx(baseline.mean() + 0.1001)
    exact = {row["column"]: row for row in analysis["tests"]["exact_match"]}
    assert exact["all"]["mean_difference"] == pytest.approx(0.1001) and exact["all"]["p_value"] < 1e-3
    assert exact["all"]["p_holm"] == pytest.approx(min(1.0, 2 * max(row["p_value"] for row in exact.values())))
    mae = {row["column"]: row for row in analysis["tests"]["mae"]}
    assert mae["all"]["p_value"] == 1.0 and mae["all"]["p_holm"] == 1.0  # identical MAE on every seed
    text = "\n".join(analyze.findings(analysis))
    assert "significant after Holm: arithmetic (better), all (better)" in text
    assert "**Where `smmd` does not help** (mean not better than `ce`): exact match in no column; MAE in " \
           "arithmetic, all." in text
    table = analyze.cells_table(analysis, "exact_match", 100.0)
    assert table.splitlines()[0] == "| method | arithmetic | all |" and "±" in table


@pytest.mark.slow
def test_smoke_study_end_to_end(tmp_path):
    work_dir, results_dir = tmp_path / "work", tmp_path / "results"
    completed = subprocess.run([*STUDY, "--smoke", "--work_dir", str(work_dir), "--results_dir", str(results_dir)],
                               capture_output=True, text=True, timeout=hang_guard(400), cwd=REPO)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-5000:]
    preset = run_study.PRESETS["smoke"]

    results = json.loads((results_dir / "results.json").read_text())
    assert {(run["method"], run["seed"]) for run in results["runs"]} == \
        {(method, seed) for method in preset.methods for seed in preset.seeds}
    for run in results["runs"]:
        assert set(run["metrics"]) == {*run_study.TASKS, "all"}, run["metrics"].keys()
        for column, metrics in run["metrics"].items():
            for key in ("exact_match", "unparseable", "numeric_token_mae"):
                assert math.isfinite(metrics[key]), (run["method"], run["seed"], column, key, metrics[key])
            # MAE is over parseable answers: undefined exactly when nothing parsed.
            assert (metrics["mae"] is None) == (metrics["unparseable"] == 1.0), metrics
            assert metrics["mae"] is None or math.isfinite(metrics["mae"])
        assert run["train"]["steps"] == preset.steps and run["train"]["tokens_seen"] == \
            preset.steps * preset.micro_batch_size * preset.seq_len
        assert math.isfinite(run["train"]["final_loss_ce"]) and run["train_seconds"] > 0
    # Paired by seed: every non-baseline method is tested against ce in every column.
    tests = results["statistics"]["tests"]["exact_match"]
    assert {(row["method"], row["column"]) for row in tests} == \
        {(method, column) for method in preset.methods if method != "ce" for column in (*run_study.TASKS, "all")}
    assert all(row["n"] == len(preset.seeds) for row in tests)

    summary = (results_dir / "summary.md").read_text()
    for heading in ("## Settings", "## exact match", "## MAE", "## Paired tests against `ce`", "## What it shows"):
        assert heading in summary
    assert "| method | arithmetic | clock | word_problems | all |" in summary
    assert "Where `smmd` does not help" in summary
    assert (results_dir / "study.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # Resumable: a second invocation finds every run finished and only re-analyzes.
    again = subprocess.run([*STUDY, "--smoke", "--work_dir", str(work_dir), "--results_dir", str(results_dir)],
                           capture_output=True, text=True, timeout=hang_guard(120), cwd=REPO)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(preset.methods) * len(preset.seeds)} run(s) already finished" in again.stdout
    assert "trained" not in again.stdout
    # Other settings in the same work dir are refused instead of mixed into its results.
    refused = subprocess.run([*STUDY, "--smoke", "--steps", "3", "--work_dir", str(work_dir), "--results_dir",
                              str(results_dir)], capture_output=True, text=True, timeout=hang_guard(120), cwd=REPO)
    assert refused.returncode != 0 and "steps: 12 -> 3" in refused.stderr
