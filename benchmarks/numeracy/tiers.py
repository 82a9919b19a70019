"""The numeracy study's tiers as data: one :class:`Tier` record each, what ``run_study --tier`` runs
and what the report writers title their reports with.

A tier is its task module under ``smmd_numeracy`` (data, arms, settings, scoring), the module that runs
it through the one run loop (``study_a.run_grid``: train.py per arm and seed, evaluation, resume) and
the module that writes its report with the one statistics module (``stats``) and the shared tables
and sections (``analyze_a``). Adding a tier is a record here plus its task module and a test.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Tier:
    """``name``: the ``--tier`` value and the results' file stem (``results/tier_<name>.json``);
    ``title``: the report's heading; ``task``: its module under ``smmd_numeracy`` (``ARMS``, ``SETTINGS``,
    data and scoring); ``study``: the module that runs it (``main(argv)``); ``report``: the module that
    writes its report (``METRICS``, ``write_report``); ``what``: one line for ``--tier``'s help."""

    name: str
    title: str
    task: str
    study: str
    report: str
    what: str

    def module(self, role: str):
        """The tier's ``task``, ``study`` or ``report`` module (imported when first asked for: the study's
        modules pull in torch, scipy and DeepSpeed)."""
        return importlib.import_module(getattr(self, role))

    @property
    def arms(self) -> tuple:
        arms = getattr(self.module("task"), "PRIME_ARMS" if self.name == "aprime" else "ARMS")
        return tuple(arms)

    @property
    def metrics(self) -> dict:
        """name -> (header, higher is better, display scale, unit, columns tested): the pre-registered metrics."""
        return self.module("report").METRICS

    def run(self, argv: list) -> None:
        self.module("study").main(argv)


TIERS = {tier.name: tier for tier in (
    Tier("a", "Tier A: one-token arithmetic", "smmd_numeracy.tier_a", "benchmarks.numeracy.study_a",
         "benchmarks.numeracy.analyze_a", "one-token arithmetic from scratch (study_a.py)"),
    Tier("aprime", "Tier A': SMMD on raw value distances, one-token arithmetic", "smmd_numeracy.tier_a",
         "benchmarks.numeracy.study_aprime", "benchmarks.numeracy.analyze_a",
         "Tier A's task with SMMD on raw value distances (study_aprime.py)"),
    Tier("b", "Tier B: DeepMind arithmetic__add_sub_multiple, digit tokens", "smmd_numeracy.tier_b",
         "benchmarks.numeracy.study_b", "benchmarks.numeracy.analyze_b",
         "the NTL paper's task, DeepMind add_sub_multiple with digit tokens (study_b.py)"),
    Tier("c", "Tier C: fine-tuning pretrained SmolLM2-135M-Instruct on arithmetic in digits", "smmd_numeracy.tier_c",
         "benchmarks.numeracy.study_c", "benchmarks.numeracy.analyze_c",
         "fine-tuning pretrained SmolLM2-135M-Instruct (study_c.py)"),
)}
# What ``--tier`` refuses by name: a design that ran and was retired, and where its last report is.
RETIRED = {"suite": "the task suite (arithmetic, clock, word problems on a tiny model from scratch) was retired in "
                    "0.3.0: its tasks were not learnable at its budget, so it could separate no method; its last "
                    "report is in git history (git show cd281b2:benchmarks/numeracy/results/summary.md)"}
