"""The numeracy study: one command for every tier (``tiers.TIERS``), each a pre-registered grid of arms
x seeds through ``launch/train.py``, evaluated on held-out items, with paired statistics against CE.

    python -m benchmarks.numeracy.run_study --tier a [--quick]       # Tier A, one-token arithmetic (study_a.py)
    python -m benchmarks.numeracy.run_study --tier aprime [--quick]  # Tier A', raw-distance SMMD (study_aprime.py)
    python -m benchmarks.numeracy.run_study --tier b [--quick]       # Tier B, NTL's add_sub_multiple (study_b.py)
    python -m benchmarks.numeracy.run_study --tier c [--quick]       # Tier C, fine-tuning SmolLM2 (study_c.py)

Every other option belongs to the tier's own command line (``--tier a --help``). Every tier is
resumable: the same command continues a work dir, and its ``study.json`` refuses other settings.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from smmd_cli.options import option, parse_options

from benchmarks.numeracy.tiers import RETIRED, TIERS


@dataclass(frozen=True)
class TierChoice:
    """The tier, read first: every other option belongs to the tier's own command line."""

    tier: str = option("--tier", choices=[*TIERS, *RETIRED], required=True,
                       help="; ".join(f"{name}: {tier.what}" for name, tier in TIERS.items()))


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    known, rest, parser = parse_options(TierChoice, argv, known_only=True, add_help=False)
    if known.tier in RETIRED:
        parser.error(f"--tier {known.tier}: {RETIRED[known.tier]}; choose one of {', '.join(TIERS)}")
    TIERS[known.tier].run(rest)


if __name__ == "__main__":
    main()
