"""Tier A' of the numeracy study: Tier A's task and model with SMMD on raw value distances.

    python -m benchmarks.numeracy.run_study --tier aprime            # the grid -> results/tier_aprime_*
    python -m benchmarks.numeracy.run_study --tier aprime --quick    # one candidate, 2 seeds: checks its pipeline

Tier A's SMMD (the paper's defaults: value distances squashed onto [1, 9], sigma 2) is nearly flat over
0..999, where exact match is decided; Tier A' separates "SMMD cannot help from scratch" from "that
kernel is flat". Arms (``tier_a.PRIME_ARMS``):

``ce``               CE alone;
``smmd_raw``         CE + SMMD with ``--smmd_squash_factor 0`` (raw value distances), sigma in
                     {3, 10, 30} value units x weight in {0.1, 0.3, 1} chosen on validation;
``shuffled_kernel``  the control: the chosen kernel and weight with the values shuffled across the
                     tokens (``--smmd_kernel shuffled``: a gaussian Gram matrix of permuted points,
                     positive semi-definite, value-agnostic), instead of Tier A's random kernel, whose
                     objective is indefinite.

1. Data as Tier A, but every validation and test pair is scored (2,505 each); out of range 600.
2. The selection (``study_a.select_on_validation``): one run per (sigma, weight) on seed 1000, which
   no arm uses, and a CE run on that seed (the weight 0); validation exact match, then capped MAE.
3. The runs, seed by seed, ``ce`` and ``smmd_raw`` first (``study_a.run_order``), then the report
   (``analyze_a.write_report(..., tier="aprime")``) with the pre-registered decision rule.
"""

from __future__ import annotations

import functools
import time

from benchmarks.numeracy import analyze_a, study_a
from smmd_numeracy import tier_a

ARMS = tier_a.PRIME_ARMS
SETTINGS = tier_a.PRIME_SETTINGS
SELECTION_SEED = study_a.SELECTION_SEED
FULL_SEEDS, QUICK_SEEDS = (0, 1, 2, 3, 4), (0, 1)
# --quick checks the pipeline within 20 minutes on 2 cores: a quarter of the steps, one candidate.
QUICK_SETTINGS = dict(SETTINGS, steps=SETTINGS["steps"] // 4, warmup_steps=SETTINGS["warmup_steps"] // 4,
                      eval_every=SETTINGS["eval_every"] // 4, nice=0)
QUICK_CANDIDATES = ((10.0, ), (1.0, ))


def parse_args(argv=None):
    return study_a.parse_tier_options("aprime", argv, __doc__, ARMS, ARMS, QUICK_SEEDS, FULL_SEEDS,
                                      f"{len(QUICK_SEEDS)} seeds x every arm, one (sigma, weight) candidate, a "
                                      "quarter of the steps", reserved_seeds={SELECTION_SEED: "the selection seed"})


def candidates(quick: bool) -> dict:
    """{"sigma3-w0.1": flags, ...}: the (sigma, weight) grid of the selection."""
    sigmas, weights = QUICK_CANDIDATES if quick else (tier_a.PRIME_SIGMAS, tier_a.PRIME_WEIGHTS)
    return {f"sigma{sigma:g}-w{weight:g}": tier_a.raw_smmd_flags(sigma, weight) for sigma in sigmas
            for weight in weights}


def flags_for(arm: str, grid: dict, quick: bool = False) -> dict:
    """``ce``'s options, or the chosen raw-distance SMMD (plain or on shuffled values); the selection runs
    before the first run that needs it."""
    if arm == "ce":
        return tier_a.ARMS["ce"]
    if "smmd_raw" not in grid:
        selection = study_a.select_on_validation("smmd_raw", candidates(quick), tier_a.ARMS["ce"], grid,
                                                 SELECTION_SEED, study_a.evaluate_a)
        grid["smmd_raw"] = grid["study"]["smmd_raw"] = selection["flags"]
        print(f"[tier aprime] SMMD on raw distances chosen on validation: {selection['chosen']}", flush=True)
    flags = grid["smmd_raw"]
    return {**flags, "smmd_kernel": "shuffled"} if arm == "shuffled_kernel" else flags


def main(argv=None) -> None:
    options = parse_args(argv)
    settings = QUICK_SETTINGS if options.quick else SETTINGS
    began = time.monotonic()
    study_a.run_grid("aprime", options, settings, study_a.prepare,
                     lambda arm, grid: flags_for(arm, grid, options.quick), study_a.evaluate_a, "test")
    study_a.report_and_check("aprime", options, began, functools.partial(analyze_a.write_report, tier="aprime"),
                             functools.partial(study_a.check_pipeline, report="tier_aprime"))
