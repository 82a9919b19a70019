"""Whether the run's numeric loss will see a target, decided before the model is built: the plan checks
the tokenizer's number style against the losses that read numbers digit by digit, the data stage counts
the numeric-target positions of the run's first optimizer steps on its packed data.

    style = number_style(tokenizer)         # "writes numbers as multi-digit tokens (12345 -> '123' '45')"
    warnings = check_digit_losses(terms, tokenizer, "digits")   # raises for a loss it cannot feed
    counts = step_numeric_targets(blocks, numeric_token_ids, micro_batch_size=2, dp_size=4, accumulation=1,
                                  seed=0)   # per optimizer step, as the train step will count them
    warnings += check_numeric_targets(blocks, plan, seed=0, max_steps=1000, resumed=False)  # raises for none

Every rank holds the same packed blocks (rank 0 packs them, the others read its cache) and the same plan,
so every rank reaches the same verdict without a collective: a refusal is raised on all of them at once.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Iterator

import torch

from ..distributed.sequence_parallel import local_target_counts, micro_batch_inputs, step_targets
from .batches import PackedBatches

# The optimizer steps whose numeric targets the data stage counts before the model is built: a run
# whose first steps hold none is warned about (its numeric term is 0 there), one whose data hold none
# is refused.
CHECKED_STEPS = 10
# Numbers the number style is probed with, bare and after a space (GPT-2's learned "Ġ2024").
_PROBE_NUMBERS = ("12345", " 12345", "2024", " 2024")
_DIGITS = frozenset("0123456789")
_ROWS_PER_READ = 1024
_LISTED_NUMBERS = 3


@dataclass(frozen=True)
class NumberStyle:
    """How a tokenizer writes numbers. ``kind``: ``"digit by digit"`` (every digit a token of its own),
    ``"multi-digit"`` (a token can hold several digits) or ``"no digits"`` (no token for a digit);
    ``example``: a probe number and its pieces, ``12345 -> '123' '45'``."""

    kind: str
    example: str

    @property
    def digit_by_digit(self) -> bool:
        return self.kind == "digit by digit"

    def __str__(self) -> str:
        says = {"digit by digit": "spells numbers digit by digit", "multi-digit": "writes numbers as multi-digit "
                "tokens", "no digits": "has no token for a digit"}[self.kind]
        return f"{says} ({self.example})"


def number_style(tokenizer) -> NumberStyle:
    """The :class:`NumberStyle` of a Hugging Face ``tokenizer``, from how it splits a few probe numbers."""
    examples = []
    for number in _PROBE_NUMBERS:
        ids = tokenizer(number, add_special_tokens=False)["input_ids"]
        pieces = [piece for piece in (tokenizer.decode([token_id]).strip() for token_id in ids) if piece]
        example = f"{number.strip()} -> {' '.join(map(repr, pieces))}"
        if any(sum(character in _DIGITS for character in piece) > 1 for piece in pieces):
            return NumberStyle("multi-digit", example)
        if not all(len(piece) == 1 and piece in _DIGITS for piece in pieces):
            return NumberStyle("no digits", example)
        examples.append(example)
    return NumberStyle("digit by digit", examples[0])


def whole_number_losses() -> str:
    """The registered losses that read any numeric vocabulary (whole-number tokens too), as a flag's values."""
    from smmd_scale.registry import NUMERIC_LOSSES

    names = [name for name, entry in NUMERIC_LOSSES.items() if not entry.digits_reason]
    return f"{', '.join(names[:-1])} or {names[-1]}"


def check_digit_losses(terms, tokenizer, policy: str) -> list:
    """For the losses of ``terms`` (``[(name, weight)]``) that read numbers digit by digit (their registry
    entry's ``digits_reason``) on a ``tokenizer`` that writes numbers as multi-digit tokens: raises
    ValueError (one line per loss) under a ``policy`` other than ``"digits"``, whose vocabulary is not the
    ten digits; returns one warning per loss under ``"digits"``, where such a loss sees only the digits that
    are tokens of their own. [] for any other tokenizer."""
    from smmd_scale.registry import NUMERIC_LOSSES

    readers = [NUMERIC_LOSSES[name] for name, _ in terms if NUMERIC_LOSSES[name].digits_reason]
    style = number_style(tokenizer) if readers else None
    if style is None or style.kind != "multi-digit":
        return []
    sees = ("would see only the digits that are tokens of their own (a number 0..9 written alone, a digit left "
            "over from a longer number), each read as a number of its own")
    if policy != "digits":
        raise ValueError("\n".join(
            f"{entry.digits_reason}, so it needs a vocabulary of the ten digits 0..9, but this tokenizer {style}: "
            f"under --numeric_policy digits --numeric_loss {entry.name} {sees}. On this tokenizer train a loss "
            f"that reads whole-number tokens (--numeric_loss {whole_number_losses()}) with --numeric_policy "
            f"{policy}, or keep {entry.name}; build it with --numeric_policy digits from a tokenizer that spells "
            "numbers digit by digit" for entry in readers))
    return [f"--numeric_loss {entry.name} reads numbers digit by digit, but this tokenizer {style}: it {sees}; "
            f"train a loss that reads whole-number tokens (--numeric_loss {whole_number_losses()}) with "
            f"--numeric_policy integers, or {entry.name} on a tokenizer that spells numbers digit by digit"
            for entry in readers]


def numeric_targets(batch: dict, numeric_token_ids: torch.Tensor) -> int:
    """The numeric-target positions of one micro-batch of ``smmd_train.data`` (``input_ids``, and
    ``labels`` for prompt/completion rows), counted as the train step counts them
    (``smmd_train.run.step_counts``): targets among ``numeric_token_ids``, ignored ones left out."""
    return int(local_target_counts(step_targets(micro_batch_inputs(batch, "cpu")), numeric_token_ids)[1])


def step_numeric_targets(blocks, numeric_token_ids: torch.Tensor, *, micro_batch_size: int, dp_size: int,
                         accumulation: int, seed: int) -> Iterator[int]:
    """The numeric-target positions of each optimizer step of a run from step 1 (``smmd_train.data.
    PackedBatches`` on ``blocks`` in the run's layout), over all its data-parallel ranks' micro-batches,
    in step order, without end. A step holds the same blocks however it is split (``PackedBatches``),
    so each step is read as one batch: one data order drawn, not one per rank."""
    # the run's own iterator refuses data shorter than one step, in the words of the run's layout
    PackedBatches(blocks, micro_batch_size, 0, dp_size, seed, accumulation=accumulation)
    steps = PackedBatches(blocks, micro_batch_size * dp_size * accumulation, 0, 1, seed)
    while True:
        yield numeric_targets(next(steps), numeric_token_ids)


def check_numeric_targets(blocks, plan, seed: int, max_steps: int, resumed: bool) -> list:
    """Check that the run of ``plan`` (``smmd_train.plan.RunPlan``) trains its numeric loss on some target
    of ``blocks`` (its packed training data; ``seed``: the data order's): raises ValueError when no target
    in the data is numeric; returns the plan's warnings: one when none of the first :data:`CHECKED_STEPS`
    steps (at most ``max_steps``) holds one, else none. A ``resumed`` run continues elsewhere in the data:
    its whole data are checked, not its first steps. Nothing to check for a run without a numeric loss, or
    whose numeric losses all weigh 0."""
    loss, vocab = plan.loss, plan.numeric_vocab
    numeric_token_ids = loss.numeric_token_ids(vocab)
    terms = [(name, weight) for name, weight in loss.terms() if weight > 0]
    if numeric_token_ids is None or not terms:
        return []
    checked = 0 if resumed else min(CHECKED_STEPS, max_steps)
    if checked:
        counts = step_numeric_targets(blocks, numeric_token_ids,
                                      micro_batch_size=plan.ds_config["train_micro_batch_size_per_gpu"],
                                      dp_size=plan.topology.dp_size,
                                      accumulation=plan.ds_config["gradient_accumulation_steps"], seed=seed)
        if any(count > 0 for count in itertools.islice(counts, checked)):
            return []
    names = " ".join(name for name, _ in terms)
    numeric_tokens = f"{len(vocab)} numeric tokens (--numeric_policy {vocab.policy}: {_values(vocab)})"
    number_values = _number_values(plan)
    found, targets, other_numbers = _scan_targets(blocks, numeric_token_ids, number_values)
    if found:
        return [] if resumed else [
            f"the first {checked} optimizer steps hold no target among the {numeric_tokens} of --numeric_loss "
            f"{names}; later steps of --data do: until then the numeric loss trains nothing, CE alone"]
    style = number_style(plan.tokenizer)
    never = (f"--numeric_loss {names} would never see a target: this tokenizer {style}, and none of the "
             f"{targets:,} targets of --data is")
    if not other_numbers:
        raise ValueError(f"{never} a number token; train on data with numbers (prompt/completion records: in the "
                         "completions), or without a numeric loss (--framework_loss)")
    listed = ", ".join(repr(plan.tokenizer.decode([token_id]).strip())
                       for token_id, _ in other_numbers.most_common(_LISTED_NUMBERS))
    raise ValueError(f"{never} one of its {numeric_tokens}: the data's numbers are tokens such as {listed}; "
                     f"{_what_works(plan, terms, style, [number_values[token] for token in other_numbers])}")


def _values(vocab) -> str:
    low, high = float(vocab.values.min()), float(vocab.values.max())
    return f"the values {low:g}..{high:g}" if len(vocab) > 1 else f"the value {low:g}"


def _number_values(plan) -> dict:
    """Token id -> value of every token of the plan's tokenizer that is a number: a digit, an integer or
    a decimal (``NumericVocab.from_tokenizer``'s digits and unbounded floats policies)."""
    from smmd_scale import NumericVocab

    numbers = {}
    for policy in ("digits", "floats"):
        try:
            vocab = NumericVocab.from_tokenizer(plan.tokenizer, policy=policy, max_value=None,
                                                vocab_size=plan.numeric_vocab.vocab_size)
        except ValueError:  # no token of this kind
            continue
        numbers.update(zip(vocab.token_id_list, vocab.values.tolist()))
    return numbers


def _scan_targets(blocks, numeric_token_ids: torch.Tensor, number_values: dict) -> tuple:
    """``(found, targets, other_numbers)`` over every target of ``blocks`` in row order: whether one is
    among ``numeric_token_ids`` (the scan stops there), how many targets were read, and a Counter of the
    targets that are number tokens (``number_values``' ids) outside ``numeric_token_ids``."""
    other_ids = torch.tensor(sorted(set(number_values) - set(numeric_token_ids.tolist())), dtype=torch.int64)
    columns = [name for name in ("input_ids", "labels") if name in blocks.column_names]
    rows = blocks.with_format("torch", columns=columns)
    targets, other_numbers = 0, Counter()
    for start in range(0, len(blocks), _ROWS_PER_READ):
        batch_targets = step_targets(micro_batch_inputs(rows[start:start + _ROWS_PER_READ], "cpu"))
        valid, numeric = local_target_counts(batch_targets, numeric_token_ids).tolist()
        targets += valid
        if numeric:
            return True, targets, other_numbers
        other_numbers.update(batch_targets[torch.isin(batch_targets, other_ids)].tolist())
    return False, targets, other_numbers


def _what_works(plan, terms, style: NumberStyle, values: list) -> str:
    """The flags under which the run's numeric loss reads the data's numbers (their ``values``: numbers
    outside its vocabulary), or the losses that read them where a loss of ``terms`` needs single digits."""
    from smmd_scale.registry import NUMERIC_LOSSES

    policy = "integers" if all(float(value).is_integer() for value in values) else "floats"
    max_value = plan.loss.settings.numeric_max_value
    bound = [f"--numeric_max_value {max(values):g}"] if max_value is not None and max(values) > max_value else []
    readers = [name for name, _ in terms if NUMERIC_LOSSES[name].digits_reason]
    if readers and not style.digit_by_digit:
        return (f"train a loss that reads whole-number tokens (--numeric_loss {whole_number_losses()}) with "
                f"{' '.join([f'--numeric_policy {policy}', *bound])}, or {' '.join(readers)} on a tokenizer that "
                "spells numbers digit by digit")
    flags = ([] if policy == plan.numeric_vocab.policy else [f"--numeric_policy {policy}"]) + bound
    return f"use {' '.join(flags)}"
