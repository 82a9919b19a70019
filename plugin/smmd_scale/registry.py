"""The numeric losses by name: one table that the command line, the training monitor, the
TensorBoard layout, the HParams columns and the resume record read, so adding a loss touches its
own module and one entry here.

    entry = NUMERIC_LOSSES["ntl-was"]          # name on the command line
    entry.stat_name, entry.parts               # "ntl_was", (): what the loss logs (loss/<stat_name>)
    entry.options                              # its LossOptions: keyword, train.py flag, default, check, help
    terms = parse_terms(["smmd:1", "ntl-was:0.3"])                  # [("smmd", 1.0), ("ntl-was", 0.3)]
    loss = build_numeric_loss(vocab, terms, {"smmd": {...}, "ntl": {...}})   # one loss or a weighted sum

This module imports only the losses (torch and numpy): the trainer builds its flags from
:func:`all_options` and reads them back with :func:`options_from`.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from .digit_entropy import DigitEntropyLoss
from .dist2 import DIST2Loss
from .gauss_ls import GaussianLabelSmoothingLoss
from .ntl import NTLoss
from .number_level import NumberLevelNTLoss
from .numeric_loss import NumericLoss, WeightedNumericLosses
from .refusal import Refusal
from .smmd import SMMDLoss
from .vocab import NumericVocab


@dataclass(frozen=True)
class LossOption:
    """One option of a numeric loss: the keyword its class takes and the train.py flag that sets it.

    keyword:  the loss class's keyword argument (``sigmas``)
    flag:     train.py's flag (``--smmd_sigmas``); without the dashes (:attr:`column`) it names the
              option's HParams column and its key in a checkpoint's resume record
    kind:     ``float``, ``int``, ``str`` or ``bool`` (a bool is a ``--flag`` / ``--no-flag`` pair)
    default:  the flag's default (None: the keyword's None, e.g. "no squashing")
    help:     one line for ``--help`` and the docs
    choices:  the values a ``str`` option takes
    several:  the flag takes one or more values (the keyword gets a tuple)
    check:    ``value -> None`` or what is wrong with it, a phrase read after ``<flag> <value>``
              (checked when the command line is read; the loss's own checks run when it is built)
    """

    keyword: str
    flag: str
    kind: type
    default: object
    help: str
    choices: tuple = ()
    several: bool = False
    check: Optional[Callable[[object], Optional[str]]] = None

    @property
    def column(self) -> str:
        return self.flag.lstrip("-")

    def keyword_value(self, value):
        """The flag's parsed value as the loss's keyword takes it."""
        return tuple(value) if self.several and value is not None else value

    def problem(self, value) -> Optional[str]:
        """``"<flag> <value> <what is wrong>"``, or None when ``value`` passes :attr:`check`."""
        found = self.check(value) if self.check is not None and value is not None else None
        return None if found is None else f"{self.flag} {value} {found}"


@dataclass(frozen=True)
class NumericLossEntry:
    """One numeric loss as the tools see it.

    name:          its name on the command line (``--numeric_loss NAME[:WEIGHT]``)
    stat_name:     its value's key in ``NumericOutput.stats`` and its TensorBoard tag ``loss/<stat_name>``
    parts:         further per-position statistics it reports (SMMD: its two terms)
    option_group:  which keyword-option group builds it (``build_numeric_loss``'s ``options[group]``)
    build:         ``(vocab, **options) -> NumericLoss``
    summary:       one line for ``--help``
    options:       the :class:`LossOption` s its build reads from its group (an option may serve
                   several entries of one group: NTL's ``--ntl_reweigh``)
    reads_dots:    its build takes ``dot_token_ids``, the ids of ``"."`` (a loss that reads decimals)
    digits_reason: for a loss that reads numbers digit by digit (its vocabulary is the ten digits, from a
                   tokenizer that spells numbers digit by digit), why, as its refusal says it (``"DEL
                   weighs each digit by its place in its number"``); "" for a loss of any numeric
                   vocabulary
    """

    name: str
    stat_name: str
    parts: tuple
    option_group: str
    build: Callable[..., NumericLoss]
    summary: str
    options: tuple = ()
    reads_dots: bool = False
    digits_reason: str = ""


def _finite_at_least_zero(value) -> Optional[str]:
    if not (math.isfinite(value) and value >= 0):
        return ("must be a finite number >= 0 (0 or 1: raw value distances; above 1: non-zero distances mapped onto "
                "[1, it])")
    return None


def _finite_positive(value) -> Optional[str]:
    return None if math.isfinite(value) and value > 0 else "must be a finite number > 0"


SMMD_OPTIONS = (
    LossOption("mode", "--smmd_mode", str, "smmd", "SMMD: both terms, or the MMD or the smoothness term alone "
               "(ablations)", choices=("smmd", "mmd", "smooth")),
    LossOption("kernel", "--smmd_kernel", str, "gaussian", "SMMD's value kernel (random and shuffled: ablations "
               "without value structure)", choices=("gaussian", "laplace", "random", "shuffled")),
    LossOption("sigmas", "--smmd_sigmas", float, (2.0, ), "SMMD kernel bandwidths (averaged), in the units of the "
               "value distances the kernel sees: after --smmd_squash_factor, or raw value differences with it at 0 or "
               "1", several=True),
    LossOption("squash_factor", "--smmd_squash_factor", float, 9.0, "SMMD: map the non-zero value distances "
               "affinely onto [1, this] before the kernel (the paper's 9; the identity on the values 0..9); 0 or 1: "
               "raw value differences", check=_finite_at_least_zero),
)
NTL_REWEIGH = LossOption("reweigh", "--ntl_reweigh", bool, True,
                         "NTL: scale by the probability mass on number tokens (ntloss's default)")
NTL_SQUASH = LossOption("squash_factor", "--ntl_squash_factor", float, None,
                        "NTL-WAS: map value distances onto [1, this] (default: raw distances, as ntloss)")
DIST2_OPTIONS = (
    LossOption("tau", "--dist2_tau", float, 1.0, "DIST2: the soft targets' temperature, q_j ~ exp(-(v_j - "
               "v_target)^2 / tau) over the numeric tokens", check=_finite_positive),
    LossOption("place_weighted", "--dist2_place_weighted", bool, False, "DIST2: weigh each digit by its place in "
               "its number (1 for units, 2 for tens, ...), as the DEL authors' re-implementation does"),
)
GAUSS_LS_OPTIONS = (
    LossOption("sigma", "--gauss_ls_sigma", float, 1.0, "Gaussian label smoothing: the soft targets' standard "
               "deviation in value units, q_j ~ exp(-(v_j - v_target)^2 / (2 sigma^2))", check=_finite_positive),
)
DEL_OPTIONS = (
    LossOption("place_base", "--del_place_base", float, 1.02, "DEL: decimal digits weigh base^-(k+1) at the k-th "
               "place after the dot (the paper's 1.02)", check=lambda value: None if math.isfinite(value)
               and value > 1 else "must be a finite number > 1"),
    LossOption("scale", "--del_scale", float, 0.01, "DEL: the loss's scale (the paper's 0.01)",
               check=_finite_positive),
)


def _ntl(kind: str) -> Callable[..., NumericLoss]:
    def build(vocab: NumericVocab, **options) -> NumericLoss:
        return NTLoss(vocab, kind=kind, **options)

    return build


NUMERIC_LOSSES = {entry.name: entry for entry in (
    NumericLossEntry("smmd", "smmd", ("mmd", "smooth"), "smmd", SMMDLoss,
                     "Smooth MMD: value-distance kernel MMD + graph-Laplacian smoothness", options=SMMD_OPTIONS),
    NumericLossEntry("ntl-was", "ntl_was", (), "ntl", _ntl("was"),
                     "Number Token Loss, Wasserstein-1 to the target value", options=(NTL_REWEIGH, NTL_SQUASH)),
    NumericLossEntry("ntl-mse", "ntl_mse", (), "ntl", _ntl("mse"),
                     "Number Token Loss, squared error of the expected value", options=(NTL_REWEIGH, )),
    NumericLossEntry("ntl-number", "ntl_number", (), "ntl", NumberLevelNTLoss,
                     "Number-level NTL: the digits of a number joined, symmetric relative error of its expected value "
                     "(needs a digit vocabulary: --numeric_policy digits, on a tokenizer that spells numbers digit by "
                     "digit)", options=(NTL_REWEIGH, ),
                     digits_reason="number-level NTL joins digits into numbers"),
    NumericLossEntry("dist2", "dist2", (), "dist2", DIST2Loss,
                     "DIST2: KL from soft targets exp(-(value distance)^2 / tau) over the numeric tokens to the "
                     "numeric softmax", options=DIST2_OPTIONS),
    NumericLossEntry("gauss-ls", "gauss_ls", (), "gauss_ls", GaussianLabelSmoothingLoss,
                     "Gaussian label smoothing on number tokens: CE against a Gaussian over the values, "
                     "full-vocabulary softmax", options=GAUSS_LS_OPTIONS),
    NumericLossEntry("del", "del", (), "del", DigitEntropyLoss,
                     "Digit Entropy Loss: per-digit BCE on the digit logits, weighted by the digit softmax and the "
                     "digit's place (needs a digit vocabulary: --numeric_policy digits, on a tokenizer that spells "
                     "numbers digit by digit)", options=DEL_OPTIONS,
                     reads_dots=True, digits_reason="DEL weighs each digit by its place in its number"),
)}


# The modules that took a copy of the table when they were imported (their TensorBoard tags, HParams
# columns, resume-record flags): a loss registered after one of them would be missing there.
_READERS = []


def note_reader(module: str) -> None:
    """Record that ``module`` (its ``__name__``) copied the table at import: from then on
    :func:`register_numeric_loss` refuses, naming it, rather than leave a loss half registered."""
    if module not in _READERS:
        _READERS.append(module)


def register_numeric_loss(entry: NumericLossEntry) -> NumericLossEntry:
    """Add a loss of one's own to the table, as the built-in ones are (its module calls this when
    imported; train.py imports it with ``--loss_module MODULE`` before it reads the table): its name on
    ``--numeric_loss``, its statistic (``loss/<stat_name>``), its options as train.py flags, HParams
    columns and resume-record keys. Returns ``entry``.

    Raises:
        TypeError: ``entry`` is not a :class:`NumericLossEntry`, or an option not a :class:`LossOption`.
        ValueError: its name, statistic, option group or a flag is another loss's, or a name is not
            a plain word.
        RuntimeError: a module has already copied the table (:func:`note_reader`), so the loss would
            be missing there; the message names the modules and what to import first.
    """
    if not isinstance(entry, NumericLossEntry):
        raise TypeError(f"register_numeric_loss takes a smmd_scale.registry.NumericLossEntry, got "
                        f"{type(entry).__name__}")
    if _READERS:
        raise RuntimeError(f"numeric loss {entry.name!r} registered after {', '.join(_READERS)} copied the registry, "
                           "so its flags, tags and resume record would be missing there: import the module that "
                           "registers it first (train.py: --loss_module MODULE)")
    if not entry.name or not all(part.isalnum() for part in entry.name.split("-")):
        raise ValueError(f"loss name {entry.name!r} must be words of letters and digits joined by '-' (as "
                         "--numeric_loss NAME:WEIGHT reads it)")
    if not entry.stat_name.isidentifier():
        raise ValueError(f"stat_name {entry.stat_name!r} of loss {entry.name!r} must be an identifier (a TensorBoard "
                         "tag loss/<stat_name> and a statistics key)")
    taken = {(other.name, other.stat_name, *other.parts): other.name for other in NUMERIC_LOSSES.values()}
    for names, owner in taken.items():
        clash = {entry.name, entry.stat_name, *entry.parts} & set(names)
        if clash:
            raise ValueError(f"loss {entry.name!r}: {', '.join(sorted(clash))} is taken by loss {owner!r}")
    groups = {other.option_group for other in NUMERIC_LOSSES.values()}
    if entry.option_group in groups:
        raise ValueError(f"loss {entry.name!r}: option group {entry.option_group!r} is another loss's")
    flags = {option.flag: option for option in all_options()}
    for option in entry.options:
        if not isinstance(option, LossOption):
            raise TypeError(f"loss {entry.name!r}: its options must be smmd_scale.registry.LossOption, got "
                            f"{type(option).__name__}")
        if option.flag in flags:
            raise ValueError(f"loss {entry.name!r}: flag {option.flag} is another loss's option")
    NUMERIC_LOSSES[entry.name] = entry
    return entry


def all_options() -> tuple:
    """Every registered :class:`LossOption` once (an option several entries share appears once), in
    registry order: what train.py makes its loss flags from."""
    found = []
    for entry in NUMERIC_LOSSES.values():
        found += [option for option in entry.options if option not in found]
    return tuple(found)


def options_from(read: Callable[[LossOption], object]) -> dict:
    """The keyword options of every group (``build_numeric_loss``'s ``options``) from ``read(option)``,
    the option's value as the command line gave it (train.py: ``getattr(args, option.column)``)."""
    groups = {}
    for entry in NUMERIC_LOSSES.values():
        group = groups.setdefault(entry.option_group, {})
        for option in entry.options:
            group[option.keyword] = option.keyword_value(read(option))
    return groups


def options_in_use(terms: Sequence[tuple]) -> tuple:
    """The :class:`LossOption` s that shape the losses of ``terms`` (``[(name, weight)]``), each once."""
    found = []
    for name, _ in terms:
        found += [option for option in NUMERIC_LOSSES[name].options if option not in found]
    return tuple(found)


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
            close = difflib.get_close_matches(name.replace("_", "-").lower(), NUMERIC_LOSSES, n=2, cutoff=0.5)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ValueError(f"{flag} {entry!r}: {name!r} is not one of {', '.join(NUMERIC_LOSSES)}{hint}")
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


class LossOptionError(ValueError):
    """A loss refused its options while :func:`build_numeric_loss` built it; ``entry`` says which loss
    and ``refusal`` (a :class:`~smmd_scale.refusal.Refusal`, or None) what it refused, as data, so that a
    tool names the options in its own words (train.py: its flags, ``refusal.worded``)."""

    def __init__(self, entry: NumericLossEntry, error: ValueError):
        super().__init__(str(error))
        self.entry = entry
        self.refusal = error if isinstance(error, Refusal) else None

    def worded(self, names: dict) -> str:
        """The message with the options in a tool's words (``names``: keyword -> how the tool spells it)."""
        return str(self) if self.refusal is None else self.refusal.worded(names)


def build_numeric_loss(vocab: NumericVocab, terms: Sequence[tuple], options: Optional[dict] = None,
                       dot_token_ids: Sequence[int] = ()) -> NumericLoss:
    """The loss of ``terms`` (``[(name, weight)]``, see :func:`parse_terms`) on ``vocab``: the loss
    itself for one term of weight 1, else their weighted sum. ``options``: keyword options per
    option group (``{"smmd": {"sigmas": (2.0,)}, "ntl": {"reweigh": True}}``); each loss gets those
    of its group that it declares. ``dot_token_ids``: the ids of ``"."``, for a loss that reads
    decimals (DEL). A loss that refuses its options raises :class:`LossOptionError`."""
    options = options or {}
    built = []
    for name, weight in terms:
        entry = NUMERIC_LOSSES[name]
        group = options.get(entry.option_group, {})
        keywords = {option.keyword: group[option.keyword] for option in entry.options if option.keyword in group}
        if entry.reads_dots:
            keywords["dot_token_ids"] = tuple(dot_token_ids)
        try:
            built.append((entry.build(vocab, **keywords), weight))
        except ValueError as error:
            raise LossOptionError(entry, error) from None
    if len(built) == 1 and built[0][1] == 1.0:
        return built[0][0]
    return WeightedNumericLosses(built)
