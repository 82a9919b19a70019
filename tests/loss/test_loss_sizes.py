"""docs/objective.md's "size at a uniform prediction" column is what the registered losses compute:
each loss's numeric term per numeric position, with its defaults, on ``a+b=c`` rows at uniform logits."""

import math
import re

import pytest
import torch
from helpers.launching import REPO

from smmd_scale import NumericVocab, numeric_cross_entropy
from smmd_scale.registry import build_numeric_loss, options_from

DEFAULTS = options_from(lambda option: option.default)
# The table's options where its line sets some (``--smmd_squash_factor 0 --smmd_sigmas 10``, ...).
TABLE_OPTIONS = {("0..999", "smmd"): {"smmd": {**DEFAULTS["smmd"], "squash_factor": 0.0, "sigmas": (10.0, )}},
                 ("0..999", "ntl-was"): {"ntl": {**DEFAULTS["ntl"], "squash_factor": 9.0}}}


def arithmetic_rows(digits: bool, rows: int = 200) -> torch.Tensor:
    """Targets of ``a+b=c`` rows (2-digit operands; each number a digit run or one token, followed by a
    non-numeric token). A fixed seed: the documented figures are a measurement on these rows."""
    generator, targets = torch.Generator().manual_seed(0), []
    separator = 1005
    for _ in range(rows):
        a, b = torch.randint(10, 100, (2, ), generator=generator).tolist()
        for number in (a, b, a + b):
            targets += ([int(digit) for digit in str(number)] if digits else [number]) + [separator]
    return torch.tensor([targets])


def uniform_size(name: str, digits: bool, vocab_size: int, options=None) -> tuple:
    """(the numeric term, CE) at uniform logits, with the losses' defaults updated by ``options``."""
    numeric_size = 10 if digits else 1000
    vocab = NumericVocab(list(range(numeric_size)), [float(value) for value in range(numeric_size)], vocab_size)
    targets = arithmetic_rows(digits)
    output = numeric_cross_entropy(torch.zeros(1, targets.shape[1], vocab_size), targets,
                                   build_numeric_loss(vocab, [(name, 1.0)], {**DEFAULTS, **(options or {})}))
    return float(output.numeric), float(output.ce)


def documented_sizes() -> dict:
    """(style, loss name) -> the number the docs table gives (its first number in the size column)."""
    docs = (REPO / "docs" / "objective.md").read_text()
    section = docs[docs.index("### Which loss, at which weight"):docs.index("## The numeric vocabulary")]
    sizes = {}
    for line in section.splitlines():
        cells = [cell.strip() for cell in line.split("|")[1:-1]]
        if len(cells) != 5 or not cells[1].startswith("`"):
            continue
        style = "digits" if cells[0].startswith("digits") else "0..999"
        name = re.match(r"`(?:--numeric_loss )?([a-z0-9-]+)", cells[1]).group(1)
        number = re.search(r"\d+(?:\.\d+)?(?:e\d+)?", cells[3].replace("*", ""))
        sizes[(style, name)] = float(number.group(0))
    return sizes


def test_the_documented_sizes_are_measured():
    sizes = documented_sizes()
    assert len(sizes) >= 10, sizes  # every studied (style, loss) line
    for (style, name), documented in sizes.items():
        digits = style == "digits"
        size, ce = uniform_size(name, digits, 49_152 if digits else 128_256, TABLE_OPTIONS.get((style, name)))
        assert ce == pytest.approx(math.log(49_152 if digits else 128_256), rel=1e-6)
        # The docs give 2 significant digits: within half a unit of the last one.
        assert size == pytest.approx(documented, rel=0.05), (style, name, size, documented)


def test_dels_size_is_a_few_ten_thousandths_of_ce():
    size, ce = uniform_size("del", True, 49_152)
    assert size / ce < 5e-4  # the docs' "about 0.02% of CE"
