"""The numeric losses by name: one table that the command line, the training monitor and the
TensorBoard layout read, so adding a loss touches its own module and one entry here.

    entry = NUMERIC_LOSSES["ntl-was"]          # name on the command line
    entry.stat_name, entry.parts               # "ntl_was", (): what the loss logs (loss/<stat_name>)
    terms = parse_terms(["smmd:1", "ntl-was:0.3"])                  # [("smmd", 1.0), ("ntl-was", 0.3)]
    loss = build_numeric_loss(vocab, terms, {"smmd": {...}, "ntl": {...}})   # one loss or a weighted sum
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .ntl import NTLoss
from .number_level import NumberLevelNTLoss
from .numeric_loss import NumericLoss, WeightedNumericLosses
from .smmd import SMMDLoss
from .vocab import NumericVocab


@dataclass(frozen=True)
class NumericLossEntry:
    """One numeric loss as the tools see it.

    name:          its name on the command line (``--numeric_loss NAME[:WEIGHT]``)
    stat_name:     its value's key in ``NumericOutput.stats`` and its TensorBoard tag ``loss/<stat_name>``
    parts:         further per-position statistics it reports (SMMD: its two terms)
    option_group:  which keyword-option group builds it (``build_numeric_loss``'s ``options[group]``)
    build:         ``(vocab, **options) -> NumericLoss``
    summary:       one line for ``--help``
    study_setting: the setting the numeracy study (benchmarks/numeracy) trained it with, for a loss
                   whose size follows the values (``NumericLoss.value_scale``): what a warning suggests
    """

    name: str
    stat_name: str
    parts: tuple
    option_group: str
    build: Callable[..., NumericLoss]
    summary: str
    study_setting: str = ""


def _ntl(kind: str) -> Callable[..., NumericLoss]:
    def build(vocab: NumericVocab, **options) -> NumericLoss:
        return NTLoss(vocab, kind=kind, **options)

    return build


def _number_level(vocab: NumericVocab, reweigh: bool = True, squash_factor=None, **options) -> NumericLoss:
    # the "ntl" option group's squash_factor shapes NTL-WAS's distances; number-level NTL has none
    return NumberLevelNTLoss(vocab, reweigh=reweigh, **options)


NUMERIC_LOSSES = {entry.name: entry for entry in (
    NumericLossEntry("smmd", "smmd", ("mmd", "smooth"), "smmd", SMMDLoss,
                     "Smooth MMD: value-distance kernel MMD + graph-Laplacian smoothness"),
    NumericLossEntry("ntl-was", "ntl_was", (), "ntl", _ntl("was"),
                     "Number Token Loss, Wasserstein-1 to the target value",
                     "ntl-was:0.3 with --ntl_squash_factor 9 (distances mapped onto [1, 9], so at most 9.09 per "
                     "position)"),
    NumericLossEntry("ntl-mse", "ntl_mse", (), "ntl", _ntl("mse"),
                     "Number Token Loss, squared error of the expected value",
                     "ntl-mse:0.0001 on the values 0..999, chosen on validation"),
    NumericLossEntry("ntl-number", "ntl_number", (), "ntl", _number_level,
                     "Number-level NTL: the digits of a number joined, symmetric relative error of its expected value "
                     "(needs a digit vocabulary: --numeric_policy digits)"),
)}


def statistic_names() -> tuple:
    """Every per-position statistic any registered loss reports (``loss/<name>`` in TensorBoard)."""
    names = []
    for entry in NUMERIC_LOSSES.values():
        for name in (entry.stat_name, *entry.parts):
            if name not in names:
                names.append(name)
    return tuple(names)


def entry_of(loss: NumericLoss) -> NumericLossEntry:
    """The registry entry of a built loss (one term of a weighted sum), by its statistic's name."""
    return next(entry for entry in NUMERIC_LOSSES.values() if entry.stat_name == loss.name)


def parse_terms(entries: Sequence[str], flag: str = "--numeric_loss") -> list:
    """``["smmd", "ntl-was:0.3"]`` (or one string ``"smmd:1 ntl-was:0.3"``) -> ``[("smmd", 1.0),
    ("ntl-was", 0.3)]``; the weight defaults to 1. Raises ValueError naming the bad entry."""
    if isinstance(entries, str):
        entries = entries.split()
    terms = []
    for entry in entries:
        name, _, weight = entry.partition(":")
        if name not in NUMERIC_LOSSES:
            raise ValueError(f"{flag} {entry!r}: {name!r} is not one of {', '.join(NUMERIC_LOSSES)}")
        try:
            value = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"{flag} {entry!r}: the weight after ':' must be a number") from None
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag} {entry!r}: the weight must be a finite number >= 0")
        terms.append((name, value))
    names = [name for name, _ in terms]
    if len(set(names)) != len(names):
        raise ValueError(f"{flag} names each loss once; got {names}")
    if not terms:
        raise ValueError(f"{flag} needs at least one loss name ({', '.join(NUMERIC_LOSSES)})")
    return terms


def build_numeric_loss(vocab: NumericVocab, terms: Sequence[tuple], options: Optional[dict] = None) -> NumericLoss:
    """The loss of ``terms`` (``[(name, weight)]``, see :func:`parse_terms`) on ``vocab``: the loss
    itself for one term of weight 1, else their weighted sum. ``options``: keyword options per
    option group (``{"smmd": {"sigmas": (2.0,)}, "ntl": {"reweigh": True}}``)."""
    options = options or {}
    built = [(NUMERIC_LOSSES[name].build(vocab, **options.get(NUMERIC_LOSSES[name].option_group, {})), weight)
             for name, weight in terms]
    if len(built) == 1 and built[0][1] == 1.0:
        return built[0][0]
    return WeightedNumericLosses(built)
