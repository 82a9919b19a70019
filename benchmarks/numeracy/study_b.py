"""Tier B of the numeracy study: the NTL paper's task, DeepMind ``arithmetic__add_sub_multiple`` with
digit tokens (``smmd_numeracy.tier_b``), three pre-registered arms x seeds.

    python -m benchmarks.numeracy.run_study --tier b            # the grid -> results/tier_b_*
    python -m benchmarks.numeracy.run_study --tier b --quick    # tiny settings: checks its own pipeline
    python -m benchmarks.numeracy.run_study --tier b --seeds 0 1 2   # more seeds in the same work dir

1. Data (once per work dir): ``tier_b.build_data`` (train-easy/medium/hard, interpolate, extrapolate,
   generated offline with a fixed seed), a digit-level tokenizer trained on the training text,
   tokenized once.
2. Runs, arm by arm in ``study_a.run_order`` (``ce`` and ``smmd`` over every seed first): every arm
   through ``launch/train.py`` (ZeRO-3, the installed loss, one process, one thread, ``nice``), a
   periodic held-out evaluation for the learning curve, then greedy answers on interpolate and
   extrapolate.
3. ``analyze_b.write_report`` (``stats``): ``results/tier_b.json`` and ``results/tier_b_summary.md``.

Resumable like Tier A: a run whose ``run.json`` records its evaluation is kept, and ``study.json``
refuses other settings.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path

from benchmarks.numeracy import analyze_b, study_a
from smmd_numeracy import tier_b

ARMS = tier_b.ARMS
SETTINGS = tier_b.SETTINGS
FULL_SEEDS, QUICK_SEEDS = (0, 1), (0, 1)
# --quick checks the pipeline in about a minute on 2 cores: the tiny model, little data, 30 steps (3 periodic
# evaluations; the check needs 2).
# --quick runs at the caller's priority (nice 0): it is a pipeline check, often inside a test suite whose
# other processes would otherwise starve its niced runs
QUICK_SETTINGS = dict(SETTINGS, train_per_level=1000, eval_per_split=40, model="tiny", steps=30, warmup_steps=3,
                      eval_every=10, eval_batches=2, nice=0)


def parse_args(argv=None):
    return study_a.parse_tier_options("b", argv, __doc__, ARMS, tuple(ARMS), QUICK_SEEDS, FULL_SEEDS,
                                      f"every arm x {len(QUICK_SEEDS)} seeds at tiny settings")


def build_data(data_dir: Path, settings: dict) -> dict:
    return tier_b.build_data(data_dir, train_per_level=settings["train_per_level"],
                             eval_per_split=settings["eval_per_split"], seed=settings["data_seed"])


def prepare(work_dir: Path, settings: dict) -> dict:
    return study_a.prepare(work_dir, settings, build_data)


def flags_for(arm: str, grid: dict) -> dict:
    return ARMS[arm]


def main(argv=None) -> None:
    options = parse_args(argv)
    settings = QUICK_SETTINGS if options.quick else SETTINGS
    began = time.monotonic()
    study_a.run_grid("b", options, settings, prepare, flags_for, tier_b.evaluate_model, "interpolate")
    study_a.report_and_check("b", options, began, analyze_b.write_report, functools.partial(
        study_a.check_pipeline, report="tier_b", splits=tuple(tier_b.TEST_SPLITS), tested_metrics=analyze_b.METRICS))
