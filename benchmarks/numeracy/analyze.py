"""Statistics, table and plot of a numeracy study: every method against CE, paired by seed.

    python benchmarks/numeracy/analyze.py                          # runs/quick -> results/
    python benchmarks/numeracy/analyze.py --work_dir DIR --results_dir OUT

Reads the finished runs of a work dir written by ``run_study.py`` (``study.json`` and one folder per
(method, seed) with ``run.json``, ``numeric_eval.json``, ``metrics.jsonl``, ``run_config.json``) and
writes, all generated, never hand-edited:

``results.json``  every run's metrics, the per-cell statistics and the tests;
``summary.md``    the run settings, mean ± std (95% t-interval) tables of exact match and MAE per task
                  and method, paired t-tests of each method against ``ce`` (raw and Holm-corrected p),
                  what 3 seeds can and cannot show, and the findings in words;
``study.png``     one panel per task (and all tasks), exact match on top and MAE below: bars are the
                  mean over seeds, error bars the std, dots the seeds.

Statistics. A *cell* is (metric, column, method); columns are the tasks and "all" (every held-out
problem). Across seeds: mean, sample std (ddof 1) and the 95% t-interval mean ± t(0.975, n-1) * std
/ sqrt(n). Against ``ce``: ``scipy.stats.ttest_rel`` on the per-seed values of the seeds both
methods finished, difference = method - ce. A metric that is undefined for a run (MAE when no
answer parses) leaves that seed out of its cells and pairs. Holm's step-down correction runs over
all the tests of one metric (every method x every column).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy import integrate, optimize, stats
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from smmd_train.monitor.metrics_file import read_metrics

HERE = Path(__file__).resolve().parent

BASELINE = "ce"
ALPHA = 0.05
# name in numeric_eval.json -> (header, higher is better, scale for display, unit shown)
METRICS = {"exact_match": ("exact match", True, 100.0, "%"), "mae": ("MAE", False, 1.0, "")}
# Reported per cell without tests: how often no number came out (MAE covers the rest only), and the
# teacher-forced error of the expected numeric value (what SMMD's loss acts on).
DESCRIPTIVE = {"unparseable": ("unparseable answers", 100.0, "%"),
               "numeric_token_mae": ("teacher-forced numeric-token MAE", 1.0, "")}
ALL = "all"


def difference_unit(unit: str) -> str:
    """Differences of percentages are percentage points."""
    return " pp" if unit == "%" else unit


# ----------------------------------------------------------------------------------------------
# Statistics (pure functions of numbers; tested on synthetic values)
# ----------------------------------------------------------------------------------------------

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


def power_note(n: int, tests_per_metric: int, alpha: float = ALPHA) -> dict:
    """What ``n`` seeds can show: the observed effect (in SDs of the differences) that just reaches
    p < alpha, the power against a 1-SD effect, the effect needing 80% power, and how many raw
    p < alpha to expect by chance among ``tests_per_metric`` tests when no method differs."""
    critical = stats.t.ppf(1 - alpha / 2, n - 1)
    return {"seeds": n, "degrees_of_freedom": n - 1, "t_critical": float(critical),
            "effect_for_significance_sd": float(critical / math.sqrt(n)),
            "power_at_1_sd": paired_power(n, 1.0, alpha),
            "effect_for_80_percent_power_sd": float(optimize.brentq(lambda d: paired_power(n, d, alpha) - 0.8,
                                                                    1e-3, 100.0)),
            "tests_per_metric": tests_per_metric, "expected_false_positives": tests_per_metric * alpha}


# ----------------------------------------------------------------------------------------------
# Collecting the runs of a work dir
# ----------------------------------------------------------------------------------------------

def load_study(work_dir) -> dict:
    """``study.json`` and every finished run of ``work_dir`` (a run whose ``run.json`` records its
    evaluation), in the study's method order then seed order."""
    work_dir = Path(work_dir)
    study_path = work_dir / "study.json"
    if not study_path.is_file():
        raise FileNotFoundError(f"{study_path} does not exist: {work_dir} is not a run_study.py work dir")
    study = json.loads(study_path.read_text())
    runs = []
    for run_file in sorted(work_dir.glob("*/run.json")):
        record = json.loads(run_file.read_text())
        if "eval_seconds" in record:
            runs.append(collect_run(run_file.parent, record))
    if not runs:
        raise ValueError(f"{work_dir} holds no finished run yet (no run.json with an evaluation)")
    order = {method: index for index, method in enumerate(study["methods"])}
    runs.sort(key=lambda run: (order.get(run["method"], len(order)), run["method"], run["seed"]))
    return {"study": study, "runs": runs}


def collect_run(run_dir: Path, record: dict) -> dict:
    """One run's evaluation per column, its training summary and its timings."""
    report = json.loads((run_dir / "numeric_eval.json").read_text())
    keys = ("count", *METRICS, *DESCRIPTIVE)
    metrics = {ALL: {key: report[key] for key in keys}}
    metrics.update({task: {key: values[key] for key in keys} for task, values in report["per_task"].items()})
    records = read_metrics(run_dir)
    steps = [entry for entry in records if "loss/total" in entry]
    evals = [entry for entry in records if "eval/ce" in entry]
    config = json.loads((run_dir / "run_config.json").read_text())
    global_batch, args = config["deepspeed_config"]["train_batch_size"], config["args"]
    train = {"steps": len(steps), "global_batch": global_batch, "world_size": config["world_size"],
             "tokens_seen": global_batch * args["seq_len"] * args["max_steps"],
             "vocab_size": config["model_config"]["vocab_size"],
             "final_loss_ce": steps[-1]["loss/ce"], "final_loss_aux": steps[-1].get("loss/numeric"),
             "eval_ce": evals[-1]["eval/ce"] if evals else None,
             "tokens_per_second": statistics.median(entry["perf/tokens_per_second"] for entry in steps
                                                    if "perf/tokens_per_second" in entry)}  # after warm-up
    return {"method": record["method"], "seed": record["seed"], "run_dir": run_dir.name, "flags": record["flags"],
            "metrics": metrics, "train": train, "train_seconds": record["train_seconds"],
            "eval_seconds": record["eval_seconds"]}


# ----------------------------------------------------------------------------------------------
# Tables of statistics
# ----------------------------------------------------------------------------------------------

def analyze(runs: list, seeds: list) -> dict:
    """Per-cell statistics and the tests against ``BASELINE`` (see the module docstring).

    ``seeds`` fixes the order of the per-seed values (None where a run is missing or its metric is
    undefined).
    """
    methods = list(dict.fromkeys(run["method"] for run in runs))
    columns = list(dict.fromkeys(column for run in runs for column in run["metrics"] if column != ALL)) + [ALL]
    metrics_by_run = {(run["method"], run["seed"]): run["metrics"] for run in runs}
    cells = {}
    for metric in (*METRICS, *DESCRIPTIVE):
        cells[metric] = {column: {} for column in columns}
        for column in columns:
            for method in methods:
                values = [metrics_by_run.get((method, seed), {}).get(column, {}).get(metric) for seed in seeds]
                cells[metric][column][method] = {"values": values, **describe(values)}
    tests = {}
    if BASELINE in methods:
        for metric in METRICS:
            rows = [{"method": method, "column": column,
                     **paired_test(cells[metric][column][method]["values"], cells[metric][column][BASELINE]["values"])}
                    for method in methods if method != BASELINE for column in columns]
            for row, adjusted in zip(rows, holm([row["p_value"] for row in rows])):
                row["p_holm"] = adjusted
            tests[metric] = rows
    pair_counts = [row["n"] for rows in tests.values() for row in rows if row["n"] > 1]
    typical_pairs = statistics.median_low(pair_counts) if pair_counts else 0
    tests_per_metric = max((sum(math.isfinite(row["p_value"]) for row in rows) for rows in tests.values()), default=0)
    return {"methods": methods, "columns": columns, "seeds": seeds, "cells": cells, "tests": tests,
            "power": power_note(typical_pairs, tests_per_metric) if typical_pairs > 1 else None}


def _number(value: float, scale: float, digits: int = 1) -> str:
    return "n/a" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f}"


def _p(value: float) -> str:
    if not math.isfinite(value):
        return "n/a"
    return f"{value:.3f}" if value >= 0.001 else f"{value:.0e}"


def cell_text(cell: dict, scale: float) -> str:
    """``mean ± std (low–high)``; ``n/a`` without any value, the mean alone with one seed."""
    if cell["n"] == 0:
        return "n/a"
    if cell["n"] == 1:
        return f"{_number(cell['mean'], scale)} (1 seed)"
    text = f"{_number(cell['mean'], scale)} ± {_number(cell['std'], scale)}"
    if math.isfinite(cell["ci95_low"]):
        text += f" ({_number(cell['ci95_low'], scale)}–{_number(cell['ci95_high'], scale)})"
    return text


def cells_table(analysis: dict, metric: str, scale: float) -> str:
    columns = analysis["columns"]
    rows = [{"method": method, **{column: cell_text(analysis["cells"][metric][column][method], scale)
                                  for column in columns}} for method in analysis["methods"]]
    return markdown_table(rows, [("method", "method", "s")] + [(column, column, "s") for column in columns])


def direction(difference: float, higher_is_better: bool) -> str:
    """How a method compares with the baseline given the mean difference (method - baseline)."""
    if not math.isfinite(difference):
        return "n/a"
    if difference == 0:
        return "same"
    return "better" if (difference > 0) == higher_is_better else "worse"


def tests_table(analysis: dict, metric: str) -> str:
    _, higher_is_better, scale, unit = METRICS[metric]
    rows = []
    for row in analysis["tests"][metric]:
        difference = row["mean_difference"]
        rows.append({"method": row["method"], "column": row["column"], "n": str(row["n"]),
                     "difference": f"{difference * scale:+.2f}{difference_unit(unit)}" if math.isfinite(difference)
                     else "n/a",
                     "direction": direction(difference, higher_is_better),
                     "p": "n/a: same diff. every seed" if row["constant"] else _p(row["p_value"]),
                     "p_holm": _p(row["p_holm"]),
                     "mark": "*" if math.isfinite(row["p_holm"]) and row["p_holm"] < ALPHA
                     else "(raw)" if math.isfinite(row["p_value"]) and row["p_value"] < ALPHA else ""})
    return markdown_table(rows, [("method", "method", "s"), ("column", "task", "s"), ("n", "seeds", "s"),
                                 ("difference", f"mean diff. vs {BASELINE}", "s"), ("direction", "than ce", "s"),
                                 ("p", "p (paired t)", "s"), ("p_holm", "p (Holm)", "s"),
                                 ("mark", "p < 0.05", "s")])


# ----------------------------------------------------------------------------------------------
# Findings in words (generated, so the text always matches the numbers)
# ----------------------------------------------------------------------------------------------

def findings(analysis: dict) -> list:
    """One line per method compared with ``BASELINE``: where its mean is better / not better on each
    metric and which differences are significant; then, for ``smmd``, where it does not help."""
    if not analysis["tests"]:
        return [f"No `{BASELINE}` runs: nothing to compare against."]
    lines, smmd_not_better = [], []
    for method in analysis["methods"]:
        if method == BASELINE:
            continue
        parts = []
        for metric, (header, higher_is_better, scale, unit) in METRICS.items():
            rows = [row for row in analysis["tests"][metric] if row["method"] == method]
            outcome = {row["column"]: direction(row["mean_difference"], higher_is_better) for row in rows}
            better = [row for row in rows if outcome[row["column"]] == "better"]
            not_better = [row for row in rows if outcome[row["column"]] in ("same", "worse")]
            undefined = [row["column"] for row in rows if outcome[row["column"]] == "n/a"]
            significant = [row for row in rows if math.isfinite(row["p_holm"]) and row["p_holm"] < ALPHA]
            raw = [row for row in rows if math.isfinite(row["p_value"]) and row["p_value"] < ALPHA
                   and row not in significant]
            text = (f"{header}: better than {BASELINE} in {_differences(better, scale, unit)}; not better in "
                    f"{_differences(not_better, scale, unit)}")
            if significant:
                text += "; significant after Holm: " + _columns(significant, outcome)
            elif any(math.isfinite(row["p_holm"]) for row in rows):
                smallest = min(row["p_holm"] for row in rows if math.isfinite(row["p_holm"]))
                text += f"; no difference survives Holm (smallest Holm p = {_p(smallest)})"
            else:
                text += "; no test (fewer than 2 paired seeds)"
            if raw:
                text += "; raw p < 0.05 only in " + _columns(raw, outcome)
            constant = [row["column"] for row in rows if row["constant"]]
            if constant:
                text += "; untestable (the same difference on every seed) in " + ", ".join(constant)
            if undefined:
                text += "; undefined (no parseable answers) in " + ", ".join(undefined)
            parts.append(text)
            if method == "smmd":
                smmd_not_better.append(f"{header} in {', '.join(row['column'] for row in not_better) or 'no column'}")
        lines.append(f"**{method}** — " + ". ".join(parts) + ".")
    if smmd_not_better:
        lines.append("**Where `smmd` does not help** (mean not better than `ce`): " + "; ".join(smmd_not_better) + ".")
    return lines


def _columns(rows: list, outcome: dict) -> str:
    """``clock (better), all (worse)``."""
    return ", ".join(f"{row['column']} ({outcome[row['column']]})" for row in rows)


def _differences(rows: list, scale: float, unit: str) -> str:
    """``clock (+1.2 pp), all (-0.3 pp)`` (finite differences), or ``none``."""
    return ", ".join(f"{row['column']} ({row['mean_difference'] * scale:+.1f}{difference_unit(unit)})"
                     for row in rows) or "none"


def power_text(power: dict) -> str:
    if power is None:
        return "Fewer than 2 paired seeds per comparison: no test is possible."
    n = power["seeds"]
    return (f"With {n} seeds ({power['degrees_of_freedom']} degrees of freedom) a paired t-test reaches p < 0.05 "
            f"only when the observed mean difference exceeds {power['effect_for_significance_sd']:.2f} standard "
            f"deviations of the per-seed differences (t > {power['t_critical']:.2f}). Its power against a true "
            f"difference of 1 such standard deviation is {power['power_at_1_sd']:.0%}; 80% power needs a true "
            f"difference of {power['effect_for_80_percent_power_sd']:.1f} standard deviations. A non-significant "
            f"result here is therefore weak evidence of no effect. Each metric has {power['tests_per_metric']} "
            f"tests, so about {power['expected_false_positives']:.1f} raw p < 0.05 are expected by chance even if "
            f"no method differed from {BASELINE}; Holm's correction (per metric, over all of them) controls that "
            f"family-wise error at 5% and is shown next to the raw p.")


# ----------------------------------------------------------------------------------------------
# The report: results.json, summary.md, study.png
# ----------------------------------------------------------------------------------------------

def _options_text(options: dict) -> str:
    """train.py options as the flags they become: ``{"smmd_mode": "mmd"}`` -> ``--smmd_mode mmd``."""
    return " ".join(f"--{name} {value}" for name, value in options.items())


def settings_rows(study: dict, runs: list) -> list:
    settings = study["settings"]
    first = runs[0]["train"]
    train_seconds = [run["train_seconds"] for run in runs]
    eval_seconds = [run["eval_seconds"] for run in runs]
    machines = list(dict.fromkeys(_machine_text(entry["machine"]) for entry in study["invocations"]))
    study_seconds = sum(entry["wall_seconds"] for entry in study["invocations"])
    return [
        ("model", f"`{settings['model']}` Llama, {study['parameters']:,} parameters, vocabulary {first['vocab_size']} "
                  f"(0..999 are single tokens)"),
        ("training", f"{settings['steps']} steps x global batch {first['global_batch']} x seq_len "
                     f"{settings['seq_len']} = {first['tokens_seen']:,} tokens per run; lr {settings['lr']:g}, "
                     f"warmup {settings['warmup_steps']} steps, cosine to 10%"),
        ("data", f"tasks {', '.join(settings['tasks'])}: {settings['train_per_task']:,} training and "
                 f"{settings['test_per_task']:,} held-out problems per task (held-out operands never trained), "
                 f"{settings['plain_text_share']:.0%} plain-text documents"),
        ("methods", ", ".join(f"`{method}` ({_options_text(study['method_flags'][method])})"
                              for method in dict.fromkeys(run["method"] for run in runs))),
        ("seeds", ", ".join(str(seed) for seed in sorted({run["seed"] for run in runs}))
         + f" ({len(runs)} runs; a seed fixes the initialisation and data order of every method)"),
        ("launch", f"`{settings['launcher']} launch/train.py --deepspeed_config {settings['deepspeed_config']}`, "
                   f"world size {first['world_size']}, {study.get('parallel', 1)} run(s) at a time"),
        ("wall time", f"per run: training {statistics.median(train_seconds):.0f} s, evaluation "
                      f"{statistics.median(eval_seconds):.0f} s (medians); whole study {study_seconds / 60:.1f} min "
                      f"over {len(study['invocations'])} invocation(s)"),
        ("machine", "; ".join(machines)),
    ]


def _machine_text(machine: dict) -> str:
    device = machine.get("gpu") or f"{machine['cpu']} ({machine['cpu_cores']} cores)"
    return f"{device}, torch {machine['torch']}, {machine['date']}"


def summary_markdown(study: dict, runs: list, analysis: dict) -> str:
    lines = ["# Numeracy study: CE vs CE + SMMD, its ablations and CE + NTL", "",
             "Generated by `benchmarks/numeracy/analyze.py` from the runs of `benchmarks/numeracy/run_study.py` "
             f"(`--{study['settings']['preset']}`); do not edit by hand. Held-out problems: operand tuples never "
             "seen in training; answers by greedy generation.", "", "## Settings", "",
             markdown_table([{"what": what, "value": value} for what, value in settings_rows(study, runs)],
                            [("what", "setting", "s"), ("value", "value", "s")]), ""]
    for metric, (header, higher_is_better, scale, unit) in METRICS.items():
        direction = "higher is better" if higher_is_better else "lower is better"
        note = " MAE is over the answers that parse as a number (see the unparseable share below)." \
            if metric == "mae" else ""
        lines += [f"## {header} ({unit or 'absolute error'}; {direction})", "",
                  f"Mean ± std over seeds (95% t-interval).{note}", "", cells_table(analysis, metric, scale), ""]
    lines += ["## Paired tests against `ce`", "",
              "`scipy.stats.ttest_rel` on the per-seed values, difference = method − ce; Holm's correction over "
              "all the tests of one metric. `*`: Holm p < 0.05; `(raw)`: only the uncorrected p < 0.05.", "",
              power_text(analysis["power"]), ""]
    for metric, (header, *_) in METRICS.items():
        if metric in analysis["tests"]:
            lines += [f"### {header}", "", tests_table(analysis, metric), ""]
    lines += ["## What it shows", "", *[f"* {line}" for line in findings(analysis)], ""]
    lines += ["## Other numbers (descriptive, no tests)", ""]
    for metric, (header, scale, unit) in DESCRIPTIVE.items():
        lines += [f"### {header}{f' ({unit})' if unit else ''}", "", cells_table(analysis, metric, scale), ""]
    return "\n".join(lines)


def plot(analysis: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods, columns = analysis["methods"], analysis["columns"]
    colors = {method: plt.get_cmap("tab10")(index % 10) for index, method in enumerate(methods)}
    figure, axes = plt.subplots(len(METRICS), len(columns), figsize=(3.2 * len(columns), 3.4 * len(METRICS)),
                                squeeze=False, sharex=True)
    offsets = np.linspace(-0.2, 0.2, max(len(analysis["seeds"]), 1)) if len(analysis["seeds"]) > 1 else [0.0]
    for row, (metric, (header, higher_is_better, scale, unit)) in enumerate(METRICS.items()):
        for column_index, column in enumerate(columns):
            axis = axes[row][column_index]
            for x, method in enumerate(methods):
                cell = analysis["cells"][metric][column][method]
                if cell["n"] == 0:
                    continue
                std = cell["std"] * scale if math.isfinite(cell["std"]) else 0.0
                axis.bar(x, cell["mean"] * scale, yerr=std, color=colors[method], alpha=0.6, capsize=3)
                for offset, value in zip(offsets, cell["values"]):
                    if value is not None and math.isfinite(value):
                        axis.plot(x + offset, value * scale, "o", color="black", markersize=2.5)
            axis.set_xticks(range(len(methods)), methods, rotation=60, ha="right", fontsize=8)
            if row == 0:
                axis.set_title(column)
            if column_index == 0:
                axis.set_ylabel(f"{header}{f' ({unit})' if unit else ''}, "
                                f"{'higher' if higher_is_better else 'lower'} is better")
            axis.grid(axis="y", alpha=0.3)
    figure.suptitle("held-out problems: mean over seeds (bars), std (error bars), seeds (dots)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def write_report(work_dir, results_dir) -> dict:
    """Analyze the finished runs of ``work_dir``; write results.json, summary.md and study.png to
    ``results_dir``. Returns the analysis."""
    loaded = load_study(work_dir)
    study, runs = loaded["study"], loaded["runs"]
    seeds = sorted({run["seed"] for run in runs})
    analysis = analyze(runs, seeds)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    results = {"study": study, "runs": runs,
               "statistics": {key: analysis[key] for key in ("cells", "tests", "power")}}
    (results_dir / "results.json").write_text(json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n")
    (results_dir / "summary.md").write_text(summary_markdown(study, runs, analysis))
    plot(analysis, results_dir / "study.png")
    return analysis


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


@dataclass(frozen=True)
class AnalyzeOptions:
    work_dir: str = option("--work_dir", default=str(HERE / "runs" / "quick"), help="a run_study.py work dir")
    results_dir: str = option("--results_dir", default=str(HERE / "results"), help="where the report is written")


def main(argv=None) -> None:
    options, _ = parse_options(AnalyzeOptions, argv, description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
    analysis = write_report(options.work_dir, options.results_dir)
    print(f"exact match (%), mean ± std over seeds {analysis['seeds']}:")
    print(cells_table(analysis, "exact_match", 100.0))
    print(f"\nreport: {Path(options.results_dir) / 'summary.md'}, results.json, study.png")


if __name__ == "__main__":
    main()
