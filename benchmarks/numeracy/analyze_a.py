"""The report of Tier A (``study_a``) and Tier A': every arm against ``ce``, paired by seed.

    python -m benchmarks.numeracy.analyze_a [--work_dir runs/tier_a] [--results_dir results]
    python -m benchmarks.numeracy.analyze_a --from_results results/tier_a.json   # the work dir is gone

Pre-registered metrics (``METRICS``), each on the test split (held-out in-range pairs) and the
out-of-range split, all operations pooled: greedy exact match, MAE (over parseable answers) and the
share of answers within +-1; sample efficiency is the mean held-out teacher-forced numeric-token
accuracy over train.py's periodic evaluations (the area under the learning curve; higher = learns
sooner), on the test pairs' documents.

For each arm, metric and column, ``stats.compare``: the paired differences against ce with their t-interval
(primary) and bootstrap, Holm within the metric and study-wide, the MDE, and the pre-registered rule's
decision (``stats``' docstring says each). This module holds the tables and sections every tier's report
shares (``tables``, ``decisions_section``, ``selections_section``, ``write_files``).

MAE appears twice: over the answers that parse (``mae``, with the unparseable share beside it) and
capped (``mae_capped``, ``tier_a.score``): every item counts, an unparseable answer and any error
larger than the split's cap count as the cap, the span of the split's answers (largest - smallest),
so an arm that answers less often cannot look better for it.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
from smmd_cli.options import option, parse_options
from smmd_cli.tables import markdown_table

from benchmarks.numeracy.stats import (
    BASELINE,
    PREREGISTRATION,
    compare,
    decide,
    describe,
    load_rule,
    strict_json,
    study_holm,
)
from benchmarks.numeracy.tiers import TIERS
from smmd_train.monitor.metrics_file import read_metrics

HERE = Path(__file__).resolve().parent
# name -> (header, higher is better, display scale, unit, columns tested)
METRICS = {
    "exact_match": ("exact match", True, 100.0, "%", ("test", "oor")),
    "mae": ("MAE", False, 1.0, "", ("test", "oor")),
    "mae_capped": ("MAE, unparseable and larger errors capped at the split's answer span", False, 1.0, "",
                   ("test", "oor")),
    "within_1": ("within +-1", True, 100.0, "%", ("test", "oor")),
    "curve_auc": ("learning-curve area (held-out numeric-token accuracy)", True, 100.0, "%", ("test",)),
}
# Post hoc, added after the first results were seen: the same three answer metrics with each answer
# scored as the first generated token alone (``tier_a.evaluate_model``), because the pre-registered
# scorer can read two number tokens run together as one number. Reported in their own section,
# Holm within each; the pre-registered metrics above are unchanged.
POST_HOC_METRICS = {f"{metric}_first_token": (f"{METRICS[metric][0]}, first generated token (post hoc)",
                                              *METRICS[metric][1:])
                    for metric in ("exact_match", "mae", "mae_capped", "within_1")}
TIER_A_METRICS = {**METRICS, **POST_HOC_METRICS}  # what Tier A's analysis tests; tables print each set apart


def curve_auc(curve: list) -> float:
    """Mean of the periodic held-out accuracies (``[(step, accuracy), ...]``) before the end: the
    area under the learning curve divided by its length, evaluations equally spaced."""
    if not curve:
        return math.nan
    return float(np.mean([accuracy for _, accuracy in curve]))


# ----------------------------------------------------------------------------------------------
# Runs -> statistics -> report
# ----------------------------------------------------------------------------------------------

def qa_items(work_dir: Path):
    """The work dir's evaluation items (``data/data.json``'s ``qa_eval``), or None where it has none."""
    record = work_dir / "data" / "data.json"
    if not record.is_file():
        return None
    from smmd_numeracy import load_qa

    return load_qa(json.loads(record.read_text())["qa_eval"])


def with_capped_mae(evaluation: dict, answers, items) -> dict:
    """``evaluation`` (a run's scores) with ``mae_capped`` and ``mae_cap`` added from its per-item
    ``answers`` where it was scored before the capped MAE existed; unchanged without answers or items."""
    if not evaluation or all("mae_capped" in scores for scores in evaluation.values()):
        return evaluation
    if answers is None or items is None or len(answers) != len(items):
        return evaluation
    from smmd_numeracy import tier_a

    rescored = tier_a.score(items, answers)
    return {key: {**scores, **{name: rescored[key][name] for name in ("mae_capped", "mae_cap") if key in rescored}}
            for key, scores in evaluation.items()}


def run_entry(record: dict, curve: list) -> dict:
    """One run as the reports read it and tier_<tier>.json keeps it: ``record`` (a run.json, or a run of a
    results JSON) with ``curve``, its periodic held-out accuracies ``[(step, accuracy), ...]``."""
    return {"arm": record["arm"], "seed": record["seed"], "flags": record["flags"], "eval": record["eval"],
            **{key: record[key] for key in ("eval_first_token", "eval_reproduced") if key in record},
            "curve": curve, "train_seconds": record["train_seconds"],
            "train_cpu_seconds": record.get("train_cpu_seconds"), "eval_seconds": record["eval_seconds"],
            "eval_cpu_seconds": record.get("eval_cpu_seconds")}


def load_runs(work_dir: Path, tier: str) -> tuple:
    """(study.json, the finished runs as ``run_entry`` makes them); ``ValueError`` when there is none."""
    study = json.loads((work_dir / "study.json").read_text())
    runs = []
    items = qa_items(work_dir)
    for path in sorted(work_dir.glob("*-seed*/run.json")):
        record = json.loads(path.read_text())
        if "eval" not in record:
            continue
        answers_path = path.parent / "answers.json"
        answers = json.loads(answers_path.read_text()) if answers_path.is_file() else {}
        record["eval"] = with_capped_mae(record["eval"], answers.get("answers"), items)
        if "eval_first_token" in record:
            record["eval_first_token"] = with_capped_mae(record["eval_first_token"],
                                                         answers.get("answers_first_token"), items)
        metrics = read_metrics(path.parent)
        curve = [(entry["step"], entry["eval/numeric_accuracy"]) for entry in metrics
                 if "eval/numeric_accuracy" in entry]
        runs.append(run_entry(record, curve))
    if not runs:
        raise ValueError(f"{work_dir} holds no finished {TIERS[tier].title.split(':')[0]} run")
    return study, runs


def load_results(path) -> dict:
    """A results JSON a report wrote (tier_<tier>.json), its runs as ``run_entry`` makes them: what a
    report is regenerated from when the runs' work dir is gone. Each run keeps its recorded scores; what
    only the work dir had (the per-item answers) stays missing."""
    recorded = json.loads(Path(path).read_text())
    return {**recorded, "runs": [{**run_entry(run, run["curve"]), **run} for run in recorded["runs"]]}


def metric_values(runs: list, arms: list, seeds: list, metrics: dict = TIER_A_METRICS) -> dict:
    """{metric: {column: {arm: [value per seed]}}} for ``metrics`` (a tier's table like ``METRICS``)."""
    by_key = {(run["arm"], run["seed"]): run for run in runs}
    values = {}
    for metric, (_, _, _, _, columns) in metrics.items():
        values[metric] = {}
        for column in columns:
            values[metric][column] = {}
            for arm in arms:
                per_seed = []
                for seed in seeds:
                    run = by_key.get((arm, seed))
                    if run is None:
                        per_seed.append(None)
                    elif metric == "curve_auc":
                        per_seed.append(curve_auc(run["curve"]))
                    elif metric in POST_HOC_METRICS:  # None for a run scored before the check existed
                        scores = run.get("eval_first_token")
                        per_seed.append(scores[column].get(metric.removesuffix("_first_token")) if scores else None)
                    else:  # None for a metric added after the run was scored, without its answers to rescore
                        per_seed.append(run["eval"][column].get(metric))
                values[metric][column][arm] = per_seed
    return values


def analyze(runs: list, metrics: dict = TIER_A_METRICS) -> dict:
    arms = list(dict.fromkeys(run["arm"] for run in runs))
    if BASELINE in arms:
        arms.remove(BASELINE)
        arms.insert(0, BASELINE)
    # Every seed some run finished; a comparison pairs the seeds both arms finished (n in its row),
    # so a grid cut short still compares what it has, and the table says how many seeds each arm has.
    seeds = sorted({run["seed"] for run in runs})
    values = metric_values(runs, arms, seeds, metrics)
    cells = {metric: {column: {arm: describe(per_arm[arm]) for arm in arms} for column, per_arm in columns.items()}
             for metric, columns in values.items()}
    tests = {metric: compare(columns, seeds) for metric, columns in values.items()} if BASELINE in arms else {}
    study_holm(tests, [metric for metric in tests if metric not in POST_HOC_METRICS])
    return {"arms": arms, "seeds": seeds, "values": values, "cells": cells, "tests": tests}


def decisions(analysis: dict, metrics: dict, rule: dict) -> list:
    """The pre-registered outcome of every arm on the rule's primary metric and split (rows: arm,
    difference, t-interval, MDE, decision)."""
    metric, column = rule["metric"], rule["split"]
    higher_is_better = metrics[metric][1]
    return [{"arm": row["arm"], "row": row, "decision": decide(row, higher_is_better, rule)}
            for row in analysis["tests"].get(metric, {"rows": []})["rows"] if row["column"] == column]


def decisions_section(analysis: dict, metrics: dict, rule: dict) -> list:
    """The summary's lines for ``decisions``: the rule in words, a table, and a plain sentence when no
    numeric loss beat ce."""
    header, _, scale, unit, _ = metrics[rule["metric"]]
    unit = " pp" if unit == "%" else unit
    made = decisions(analysis, metrics, rule)
    rows = [{"arm": item["arm"], "arm - ce": f"{scaled(item['row']['mean_difference'], scale, 2)}{unit}",
             "95% t-interval":
                 f"[{scaled(item['row']['t95_low'], scale, 2)}, {scaled(item['row']['t95_high'], scale, 2)}]",
             "MDE (80%)": f"{scaled(item['row']['mde'], scale, 2)}{unit}", "decision": item["decision"]}
            for item in made]
    lines = ["## Pre-registered decision", "",
             f"Rule ({PREREGISTRATION.name}, written {rule['written']}), on {header} of the {rule['split']} split, "
             f"per arm against ce: the paired 95% t-interval of the difference above 0 -> \"{rule['above']}\"; below "
             f"0 -> \"{rule['below']}\"; inside +-MDE -> \"{rule['within_mde']}\"; otherwise \"{rule['otherwise']}\".",
             ""]
    if rows:
        lines += [markdown_table(rows, [(key, key, "s") for key in rows[0]]), ""]
    ablations = set(rule.get("ablations", ()))
    if not any(item["decision"] == rule["above"] for item in made if item["arm"] not in ablations):
        lines += [f"No numeric loss beat ce on {header} ({rule['split']}): none is recommended.", ""]
    return lines


def scaled(value, scale: float, digits: int = 1) -> str:
    """``value * scale`` with ``digits`` decimals (``scale`` 100 shows a fraction in percent), or ``n/a``
    for a missing or non-finite value; the reports of every tier format their cells with it."""
    return "n/a" if value is None or not math.isfinite(value) else f"{value * scale:.{digits}f}"


def _p(value: float) -> str:
    return "n/a" if not math.isfinite(value) else f"{value:.3f}" if value >= 0.001 else f"{value:.0e}"


def tables(analysis: dict, metrics: dict = METRICS) -> str:
    parts = []
    for metric, (header, higher, scale, unit, columns) in metrics.items():
        if not any(cell["n"] for cells in analysis["cells"][metric].values() for cell in cells.values()):
            continue  # no run has it (scored before the metric existed): ``scoring_note`` says so
        unit_text = f" ({unit})" if unit else ""
        rows = [{"arm": arm, **{column: f"{scaled(cell['mean'], scale)} ± {scaled(cell['std'], scale)}"
                                for column, cell in ((c, analysis["cells"][metric][c][arm]) for c in columns)}}
                for arm in analysis["arms"]]
        parts.append(f"**{header}**{unit_text}, {'higher' if higher else 'lower'} is better: mean ± std over "
                     f"{len(analysis['seeds'])} seeds\n\n"
                     + markdown_table(rows, [("arm", "arm", "s")] + [(c, c, "s") for c in columns]))
        if metric in analysis["tests"]:
            result = analysis["tests"][metric]
            difference_unit = " pp" if unit == "%" else unit
            test_rows = [{"arm": row["arm"], "split": row["column"], "n": str(row["n"]),
                          "arm - ce": f"{scaled(row['mean_difference'], scale, 2)}{difference_unit}",
                          "95% t-interval":
                              f"[{scaled(row['t95_low'], scale, 2)}, {scaled(row['t95_high'], scale, 2)}]",
                          "95% bootstrap":
                              f"[{scaled(row['ci95_low'], scale, 2)}, {scaled(row['ci95_high'], scale, 2)}]",
                          "p": _p(row["p_value"]), "p (Holm, metric)": _p(row["p_holm"]),
                          "p (Holm, study)": _p(row.get("p_holm_study", math.nan)),
                          "MDE (80%)": f"{scaled(row['mde'], scale, 2)}{difference_unit}"}
                         for row in result["rows"]]
            columns_spec = [(key, key, "s") for key in test_rows[0]] if test_rows else []
            parts.append(f"Paired differences against ce (the t-interval is primary; {result['tests']} tests, Holm "
                         f"within this metric, and over all {result.get('tests_study', 0)} pre-registered tests of "
                         f"the report; MDE = {result['mde_sd']:.2f} SD of the differences at alpha 0.05, "
                         f"{result['mde_holm_sd']:.2f} SD at Holm's strictest level):\n\n"
                         + markdown_table(test_rows, columns_spec))
    return "\n\n".join(parts)


INTERVALS_NOTE = ("The paired Student-t interval is the primary one; the percentile bootstrap beside it resamples the "
                  "seeds and is too narrow with fewer than 10 of them. Holm (metric) corrects within one metric, Holm "
                  "(study) over every pre-registered test of this report. A cell with n/a p had the same difference "
                  "on every seed or too few seeds.")


def load_selections(work_dir: Path) -> list:
    """The validation selections of a work dir (``study_a.select_on_validation``'s selection-*.json)."""
    return [json.loads(path.read_text()) for path in sorted(Path(work_dir).glob("selection-*.json"))]


def selections_section(selections: list, scale: float = 100.0) -> list:
    """The summary's lines for the validation selections: every candidate's validation exact match and
    capped MAE, the chosen one, the CE reference on the same seed (weight 0) and whether it was beaten."""
    if not selections:
        return []
    rows = []
    for selection in selections:
        for row in [*selection["candidates"], selection["reference"]]:
            rows.append({"arm": selection["arm"], "candidate": row["candidate"],
                         "val exact match (%)": scaled(row["val_exact_match"], scale),
                         "val capped MAE": scaled(row["val_mae_capped"], 1.0, 2),
                         "chosen": "yes" if row["candidate"] == selection["chosen"] else "",
                         "CPU-h": f"{(row['train_cpu_seconds'] + row['eval_cpu_seconds']) / 3600:.2f}"})
    beaten = "; ".join(f"{selection['arm']}: {selection['chosen']} "
                       f"{'beats' if selection['beats_reference'] else 'does not beat'} CE (weight 0)"
                       for selection in selections)
    return ["## Selection on validation", "",
            f"Seed {selections[0]['seed']} (no arm uses it); criterion: {selections[0]['criterion']}. {beaten}.", "",
            markdown_table(rows, [(key, key, "s") for key in rows[0]]), ""]


# What a tier's report points to where its own scoring falls short (``scoring_note``).
RESCORED_BY = {"a": "Tier A' (study_aprime) trains this setting again with every validation and test pair scored "
                    "and capped MAE"}


def regenerated_note(regenerated_from: str = None) -> list:
    """The summary's lines saying it was regenerated from a results JSON (``regenerated_from``), or none."""
    if not regenerated_from:
        return []
    return [f"Regenerated from {regenerated_from} (the runs' work directory is gone): the statistics are "
            "recomputed from what it recorded of each run (scores, learning curve, timings).", ""]


def scoring_note(study: dict, runs: list, tier: str, regenerated_from: str = None) -> list:
    """The summary's lines on what its numbers cannot show: where it was regenerated from a results JSON
    (``regenerated_from``), and in one sentence the runs scored before the capped MAE existed whose per-item
    answers are gone (it cannot be recomputed for them: ``tables`` leaves a metric no run has out) and the
    share of the pre-registered split each run scored where it is a sample; nothing when neither holds."""
    lines = regenerated_note(regenerated_from)
    limits = []
    uncapped = sum(any("mae" in scores and "mae_capped" not in scores
                       for key, scores in run["eval"].items() if "/" not in key) for run in runs)
    if uncapped:
        limits.append(f"Scored before the capped MAE existed ({uncapped} of {len(runs)} runs), without the per-item "
                      "answers it needs: MAE over the parseable answers, not capped ("
                      + ("the capped MAE is left out of the tables)" if uncapped == len(runs)
                         else "the capped rows leave those runs out)"))
    split = load_rule(tier)["split"]
    data = study.get("data", {})
    noun = next((noun for noun in ("pairs", "problems", "items") if f"{split}_{noun}" in data), None)
    count = runs[0]["eval"].get(split, {}).get("count")
    if noun is not None and count is not None and count < data[f"{split}_{noun}"]:
        limits.append(f"each run scored {count:,} of the {data[f'{split}_{noun}']:,} {split} {noun}")
    if limits and tier in RESCORED_BY:
        limits.append(RESCORED_BY[tier])
    return lines + (["; ".join(limits) + ".", ""] if limits else [])


def scored_counts(runs: list) -> str:
    """``val 2505, test 2505, oor 600``: how many items each split of the first run scored."""
    evaluation = runs[0]["eval"]
    return ", ".join(f"{split} {evaluation[split]['count']}" for split in ("val", "test", "oor")
                     if "count" in evaluation.get(split, {})) or "n/a"


def summary_markdown(study: dict, runs: list, analysis: dict, selection: dict = None, tier: str = "a",
                     selections: tuple = (), regenerated_from: str = None) -> str:
    settings = study["settings"]
    train_seconds = sum(run["train_seconds"] for run in runs)
    cpu_seconds = sum(run["train_cpu_seconds"] or 0 for run in runs)
    by_op = []
    for arm in analysis["arms"]:
        row = {"arm": arm}
        for split in ("test", "oor"):
            for op in ("add", "sub", "dist"):
                values = [run["eval"][f"{split}/{op}"]["exact_match"] for run in runs
                          if run["arm"] == arm and run["seed"] in analysis["seeds"]]
                row[f"{split}/{op}"] = scaled(float(np.mean(values)) if values else math.nan, 100.0)
        by_op.append(row)
    lines = [
        f"# {TIERS[tier].title} (generated by analyze_a.py; do not edit)", "",
        f"Arms {', '.join(analysis['arms'])}; seeds {analysis['seeds']}; finished runs per arm: "
        + ", ".join(f"{arm} {sum(run['arm'] == arm for run in runs)}" for arm in analysis["arms"]) + "; "
        f"{len(runs)} runs reported. Model `{settings['model']}` ({study.get('parameters', 0) / 1e6:.2f}M "
        f"parameters), {settings['steps']} steps x {settings['micro_batch_size']} x {settings['seq_len']} tokens, "
        f"lr {settings['lr']}, operands 0..{settings['operand_range'] - 1} (out of range: up to "
        f"{settings['operand_range'] + settings['oor_band'] - 1}). "
        + (f"NTL-MSE weight {study['ntl_mse_weight']} (chosen on validation). " if "ntl_mse_weight" in study else "")
        + f"Items scored per run: {scored_counts(runs)}. "
        f"Training time {train_seconds / 60:.1f} min wall, {cpu_seconds / 3600:.2f} CPU-hours (train.py processes)"
        + (f"; the NTL-MSE weight selection's {len(selection['candidates'])} runs "
           f"{sum(row['train_cpu_seconds'] for row in selection['candidates']) / 3600:.2f} CPU-hours more"
           if selection else "") + ".",
        "", *scoring_note(study, runs, tier, regenerated_from), tables(analysis), "",
        "**exact match per operation** (%, mean over the seeds above)", "",
        markdown_table(by_op, [(key, key, "s") for key in by_op[0]]) if by_op else "", "",
        *post_hoc_section(runs, analysis),
        *selections_section(list(selections)),
        *decisions_section(analysis, METRICS, load_rule(tier)),
        INTERVALS_NOTE,
    ]
    return "\n".join(lines) + "\n"


def post_hoc_section(runs: list, analysis: dict) -> list:
    """The post-hoc first-token scoring's section of the summary (lines), or nothing when no run has it."""
    scored = [run for run in runs if run.get("eval_first_token")]
    if not scored:
        return []
    changed = sum(run["eval_first_token"][split]["mae"] != run["eval"][split]["mae"]
                  for run in scored for split in ("test", "oor"))
    reproduced = [run["eval_reproduced"] for run in scored if run.get("eval_reproduced") is not None]
    return [
        "## Post hoc: each answer scored as the first generated token", "",
        "Added after the first results were seen (not pre-registered): the pre-registered scorer reads the first "
        "number of a 3-token greedy continuation, so two number tokens run together read as one number no "
        "one-token answer can be. Here each answer is the first generated token alone. "
        f"{len(scored)} of {len(runs)} runs scored; MAE differs from the pre-registered scoring in {changed} of "
        f"{2 * len(scored)} (run, split) cells"
        + (f"; runs evaluated before this check existed were generated again and reproduced their recorded "
           f"pre-registered metrics and answers in {sum(reproduced)} of {len(reproduced)}" if reproduced else "")
        + ".", "", tables(analysis, POST_HOC_METRICS), ""]


def statistics_record(analysis: dict) -> dict:
    """The part of a tier's results JSON that ``analyze`` computed: seeds, cells, tests, power."""
    return {"seeds": analysis["seeds"], "cells": analysis["cells"],
            "tests": {metric: result["rows"] for metric, result in analysis["tests"].items()},
            "power": {metric: {key: result[key] for key in ("pairs", "tests", "mde_sd", "mde_holm_sd")}
                      for metric, result in analysis["tests"].items()}}


def write_report(work_dir, results_dir, tier: str = "a") -> dict:
    """``results_dir``/tier_<tier>.json and tier_<tier>_summary.md from the runs of ``work_dir`` (Tier A,
    or Tier A' with ``tier="aprime"``)."""
    work_dir = Path(work_dir)
    study, runs = load_runs(work_dir, tier)
    selection_path = work_dir / "selection.json"
    selection = json.loads(selection_path.read_text()) if selection_path.is_file() else None
    return report(study, runs, selection, load_selections(work_dir), results_dir, tier)


def rewrite_report(results_path, results_dir, tier: str = "a") -> dict:
    """``write_report``'s files again from ``results_path``, a tier_<tier>.json it wrote (``load_results``),
    when the runs' work dir is gone: the statistics are recomputed from each run's recorded scores."""
    recorded = load_results(results_path)
    return report(recorded["study"], recorded["runs"], recorded.get("selection"), recorded.get("selections", []),
                  results_dir, tier, regenerated_from=Path(results_path).name)


def report(study: dict, runs: list, selection, selections: list, results_dir, tier: str,
           regenerated_from: str = None) -> dict:
    """``analyze`` the runs and write ``results_dir``/tier_<tier>.json and tier_<tier>_summary.md."""
    analysis = analyze(runs)
    summary = summary_markdown(study, runs, analysis, selection, tier, selections, regenerated_from)
    return write_files(tier, {"study": study, "selection": selection, "selections": selections, "runs": runs},
                       analysis, summary, results_dir)


def write_files(tier: str, results: dict, analysis: dict, summary: str, results_dir) -> dict:
    """Every tier's report files: ``results_dir``/tier_<tier>.json (``results``, then ``analysis``'s
    statistics) and tier_<tier>_summary.md (``summary``); returns ``analysis`` with the summary as ``text``."""
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    (results_dir / f"tier_{tier}.json").write_text(
        json.dumps(strict_json({**results, **statistics_record(analysis)}), indent=1, allow_nan=False) + "\n")
    (results_dir / f"tier_{tier}_summary.md").write_text(summary)
    analysis["text"] = summary
    return analysis


@dataclass(frozen=True)
class ReportOptions:
    work_dir: Optional[str] = option("--work_dir", at_most_one_of="source")  # default: the tier's runs/tier_<tier>
    results_dir: str = option("--results_dir", default=str(HERE / "results"))
    from_results: Optional[str] = option("--from_results", default=None, at_most_one_of="source",
                                         help="regenerate the report from this results JSON (tier_<tier>.json) "
                                              "instead of the runs' work dir, e.g. once the work dir is gone")


def report_cli(write, tier: str, doc: str, argv=None, rewrite=None) -> None:
    """``python -m benchmarks.numeracy.analyze_<tier>``: ``write(work_dir, results_dir)``'s report again, or
    with ``--from_results``, ``rewrite(results_json, results_dir)``'s."""
    options, parser = parse_options(ReportOptions, argv, description=doc,
                                    formatter_class=argparse.RawDescriptionHelpFormatter)
    if options.from_results:
        if not Path(options.from_results).is_file():
            parser.error(f"--from_results {options.from_results}: no such file; give the tier_{tier}.json a report "
                         "wrote")
        print(rewrite(options.from_results, options.results_dir)["text"])
    else:
        print(write(options.work_dir or str(HERE / "runs" / f"tier_{tier}"), options.results_dir)["text"])


def main(argv=None) -> None:
    report_cli(write_report, "a", __doc__, argv, rewrite=rewrite_report)


if __name__ == "__main__":
    main()
