"""Number-level NTL (ntloss 0.3.2's ``NumberLevelLoss``) as a numeric loss of the plugin: the digits
of one number are joined and the number's value is compared, on a digit vocabulary.

A *number* is a run of consecutive positions (along the sequence dim) whose targets are digit
tokens; with ``float_level=True`` a dot token between two digits joins the runs on either side
(``12.34`` is one number, read as the integer ``1234``, as ntloss does; the dot adds no digit).
For a number with digit targets ``d_1 .. d_n`` at positions ``1 .. n`` and ``q_i = softmax`` over
the numeric tokens at position i:

    y    = sum_i d_i 10^(n - i)                      (the target number)
    yhat = sum_i E_{q_i}[value] 10^(n - i)           (the expected number)
    loss = |yhat - y| / (|yhat| + |y| + eps)         (symmetric MAPE, in [0, 1]; eps = float32's)

and with ``reweigh=True`` (ntloss's default) ``loss * mass + 1.01 * (1 - mass)``, ``mass`` being the
full softmax's probability on the numeric tokens at the number's first digit. Exponents are capped
at ``max_number_length - 1`` (ntloss: 20 digits). The value lives at the number's first digit
position (ntloss's ``reduction="none"`` layout), so a call's numeric statistic and the CE ops'
numeric term are sums over numbers divided by the *digit* positions, like every numeric loss's;
the standalone call ``loss(logits, targets)`` takes ntloss's mean over numbers.

It reads only the numeric slice at the digit positions (the exchange's), plus the call's targets
(which positions are consecutive, where the dots are): full logits, vocabulary-parallel shards
(still one collective) and the fused linear head alike. On a sequence shard
(``smmd_scale.sequence_shard``) the numbers are found in the whole sequence's targets, and the
expected values (and first-digit masses) of the numbers that cross a shard boundary are summed
over the group in one small all-reduce; the value sits on the rank of the number's first digit,
and every rank holding one of its digits gets that digit's gradient.
"""

from __future__ import annotations

import weakref
from typing import NamedTuple, Optional, Sequence

import torch

from .numeric_loss import IGNORE_INDEX, NumericLoss, NumericTerms, terms_from_q
from .parallel import sum_across
from .refusal import Refusal, digits_vocabulary, literal
from .sequence_shard import marked_cells, run_context
from .vocab import NumericVocab

# ntloss computes the target numbers in float32 and takes float32's epsilon in the denominator.
EPS = float(torch.finfo(torch.float32).eps)
REWEIGH_MARGIN = 1.01


class DigitSpans(NamedTuple):
    """The numbers of one call, over its P digit (numeric-target) positions in ``plan.positions`` order.

    number:   ``[P]`` which number (0..S-1) each digit position belongs to
    exponent: ``[P]`` the power of ten of the digit in its number
    first:    ``[S]`` the digit position (index into the P) of each number's first digit
    """

    number: torch.Tensor
    exponent: torch.Tensor
    first: torch.Tensor


def digit_spans(targets: torch.Tensor, positions: torch.Tensor, sequence_dim: int = -1,
                dot_ids: Optional[torch.Tensor] = None, max_number_length: int = 20,
                live: Optional[torch.Tensor] = None) -> DigitSpans:
    """The numbers formed by the digit positions ``positions`` (sorted flat indices into
    ``targets [...]``): runs along ``sequence_dim``; with ``dot_ids``, a dot target between two
    digits joins their runs (float level).

    ``live``: ``[P]`` bool on a fixed-capacity plan (``CallPlan.live``; the spare rows repeat position
    0 after the live ones). Then nothing is read back to the host: the numbers are held at a capacity
    of P + 1, the last a bin that takes the spare rows (``number`` P there) and is no number's (its
    ``first`` and that of every unused slot is -1). Without it, S is the numbers' exact count."""
    device = positions.device
    shape = tuple(targets.shape) or (1, )
    flat_targets = targets.reshape(-1)
    tokens = flat_targets.numel()
    # the flat indices laid out as [rows, sequence]
    order = torch.arange(tokens, device=device).view(shape).movedim(sequence_dim, -1)
    order = order.reshape(-1, order.shape[-1]) if order.dim() else order.view(1, 1)
    is_digit = marked_cells(tokens, positions, live)
    digit = is_digit[order]
    previous = torch.zeros_like(digit)
    previous[:, 1:] = digit[:, :-1]
    continues = previous
    if dot_ids is not None:
        dot = torch.isin(flat_targets[order], dot_ids.to(device))
        following, two_back, dot_before = torch.zeros_like(digit), torch.zeros_like(digit), torch.zeros_like(digit)
        following[:, :-1] = digit[:, 1:]
        two_back[:, 2:] = digit[:, :-2]
        dot_before[:, 1:] = (dot & previous & following)[:, :-1]
        continues = previous | (dot_before & two_back)
    first_digit = (digit & ~continues).reshape(-1)
    # back to the positions' order (flat index order): the cell of each digit position
    cell_of = torch.empty(tokens, dtype=torch.int64, device=device)
    cell_of[order.reshape(-1)] = torch.arange(tokens, device=device)
    cells = cell_of[positions]
    number = (torch.cumsum(first_digit.to(torch.int64), 0) - 1)[cells]  # numbers counted in [rows, sequence] order
    count = torch.cumsum(digit.reshape(-1).to(torch.int64), 0)[cells]  # digits so far, 1-based
    if live is None:
        numbers, digits = int(first_digit.sum()), torch.ones_like(number)
    else:  # the spare rows go to the bin, slot P
        numbers, digits = positions.numel() + 1, live.to(torch.int64)
        number = torch.where(live, number, numbers - 1)
    digits_in = torch.zeros(numbers, dtype=torch.int64, device=device).index_add_(0, number, digits)
    count_before = torch.zeros(numbers, dtype=torch.int64, device=device).scatter_reduce_(
        0, number, count - 1, reduce="amin", include_self=False)
    exponent = digits_in[number] - (count - count_before[number])
    # each number's first digit: the position with no digit of its number before it (a bin past the
    # slots takes every other row)
    is_first = count - 1 == count_before[number]
    if live is not None:
        is_first = is_first & live
    first = torch.full((numbers + 1, ), -1, dtype=torch.int64, device=device).index_put_(
        (torch.where(is_first, number, numbers), ), torch.arange(positions.numel(), device=device))[:numbers]
    return DigitSpans(number=number, exponent=exponent.clamp(0, max_number_length - 1), first=first)


class CallNumbers(NamedTuple):
    """The numbers one call's P digit positions belong to, M numbers in all (on a sequence shard:
    every number of the whole sequence, also those with no digit in the call).

    number:   ``[P]`` which number (0..M-1) each digit position belongs to
    exponent: ``[P]`` the power of ten of the digit in its number
    first:    ``[M]`` the digit position (index into the P) of each number's first digit; -1 where
              it lies on another shard
    target:   ``[M]`` the number's value (float64), from the targets
    crossing: ``[M]`` bool, the number has digits on more than one shard; None without a shard
    """

    number: torch.Tensor
    exponent: torch.Tensor
    first: torch.Tensor
    target: torch.Tensor
    crossing: Optional[torch.Tensor]


class Runs(NamedTuple):
    """Runs of consecutive member cells along the sequence dim, per cell of ``targets`` (flat order).

    run:    which run (0..R-1) each cell belongs to (meaningless outside the members)
    index:  the cell's place in its run, 0-based from the run's start
    length: its run's number of cells
    """

    run: torch.Tensor
    index: torch.Tensor
    length: torch.Tensor


def runs_along(member: torch.Tensor, sequence_dim: int = -1) -> Runs:
    """The runs of ``member`` (bool ``[...]``, e.g. "the target is a digit") along ``sequence_dim``:
    a run never crosses a sequence's end (the next row starts a new one)."""
    shape = tuple(member.shape) or (1, )
    cells = member.numel()
    device = member.device
    order = torch.arange(cells, device=device).view(shape).movedim(sequence_dim if member.dim() else -1, -1)
    order = order.reshape(-1, order.shape[-1])
    inside = member.reshape(-1)[order]
    previous = torch.zeros_like(inside)
    previous[:, 1:] = inside[:, :-1]
    starts = (inside & ~previous).reshape(-1)
    run = (torch.cumsum(starts.to(torch.int64), 0) - 1).clamp(min=0)
    places = torch.arange(cells, device=device)
    # Sized by the cells (a bound on the runs), not by the runs' count: nothing here reads a value back
    # to the host. Each run's first place; a cell that starts no run writes to a bin past the end.
    start_place = torch.zeros(cells + 1, dtype=torch.int64, device=device).index_put_(
        (torch.where(starts, run, cells), ), places)
    index = places - start_place[run]
    inside = inside.reshape(-1)
    length = torch.zeros(cells, dtype=torch.int64, device=device).index_add_(0, run, inside.to(torch.int64))
    flat = order.reshape(-1)
    found = [torch.empty_like(places) for _ in range(3)]
    for tensor, value in zip(found, (run, index, length[run])):
        tensor[flat] = value
    return Runs(*found)


class NumberLevelNTLoss(NumericLoss):
    """Number-level NTL (ntloss's ``NumberLevelLoss``) over a digit vocabulary.

    ``NumberLevelNTLoss(NumericVocab.from_tokenizer(tokenizer, policy="digits"))``; options as
    ntloss: ``reweigh=True``, ``float_level=False`` (with ``dot_token_ids``: the id(s) of ``"."``),
    ``max_number_length=20``. ``sequence_dim``: the targets' sequence dim (-1: ``[batch, seq]``;
    0 for Megatron's ``[s, b]``).
    """

    gradient = "hand-written"  # terms_for_call, over a call's numbers
    gradient_reference = "a float64 autograd reference and ntloss's NumberLevelLoss (tests/loss/test_ntl_number.py)"

    def __init__(self, vocab: NumericVocab, reweigh: bool = True, float_level: bool = False,
                 dot_token_ids: Optional[Sequence[int]] = None, max_number_length: int = 20,
                 sequence_dim: int = -1, ignore_index: int = IGNORE_INDEX):
        super().__init__(vocab, ignore_index)
        values = vocab.values.tolist()
        others = sorted({value for value in values if value not in range(10)})
        found = sorted({int(value) for value in values if value in range(10)})
        if others or len(found) != 10:
            raise Refusal(literal(f"number-level NTL joins digits into numbers, so it needs a vocabulary of the "
                                  f"ten digits 0..9; this one has the digits {found}"
                                  + (f" and the values {others[:5]}" if others else ""))
                          + "; build it with {digits} from a tokenizer that spells numbers digit by digit",
                          digits=digits_vocabulary())
        if not isinstance(reweigh, bool) or not isinstance(float_level, bool):
            raise TypeError(f"reweigh={reweigh!r} and float_level={float_level!r} must be True or False")
        if float_level and not dot_token_ids:
            raise ValueError("float_level=True joins numbers across a dot: pass dot_token_ids, the id(s) of the '.' "
                             "token (tokenizer.convert_tokens_to_ids('.'))")
        dots = sorted({int(token_id) for token_id in (dot_token_ids or ())})
        if set(dots) & set(vocab.token_id_list):
            raise ValueError(f"dot_token_ids {dots} include numeric tokens")
        if isinstance(max_number_length, bool) or not isinstance(max_number_length, int) or max_number_length < 1:
            raise ValueError(f"max_number_length={max_number_length!r} must be a positive int (digits per number)")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"sequence_dim={sequence_dim!r} must be an int")
        self.reweigh, self.float_level = reweigh, float_level
        self.dot_token_ids = tuple(dots) if float_level else ()
        self.max_number_length, self.sequence_dim = max_number_length, sequence_dim
        self._dots = torch.tensor(self.dot_token_ids, dtype=torch.int64)
        self._last_numbers = None

    name = "ntl_number"

    @property
    def needs_mass(self) -> bool:
        return self.reweigh

    def __repr__(self):
        return (f"NumberLevelNTLoss(reweigh={self.reweigh}, float_level={self.float_level}, "
                f"dot_token_ids={list(self.dot_token_ids)}, max_number_length={self.max_number_length}, "
                f"sequence_dim={self.sequence_dim}, ignore_index={self.ignore_index}, vocab={self.vocab!r})")

    def options(self) -> tuple:
        return self.reweigh, self.float_level, self.dot_token_ids, self.max_number_length, self.sequence_dim

    def numbers(self, plan) -> CallNumbers:
        """The numbers of the call ``plan`` (``smmd_scale.call_plan.CallPlan``); the last call's are
        kept (weakly) for the next question about the same plan."""
        if torch.compiler.is_compiling():  # no state kept from inside a graph (the ops ask once per call)
            return self._numbers(plan)
        last = self._last_numbers
        if last is not None and last[0]() is plan:
            return last[1]
        numbers = self._numbers(plan)
        self._last_numbers = (weakref.ref(plan), numbers)
        return numbers

    def _numbers(self, plan) -> CallNumbers:
        shape = plan.spec.shape[:-1]
        if len(shape) and not -len(shape) <= self.sequence_dim < len(shape):
            raise ValueError(f"sequence_dim={self.sequence_dim} is not a dim of targets of shape {tuple(shape)}")
        sequence_dim = self.sequence_dim if len(shape) else -1
        context = run_context(plan, sequence_dim)
        spans = digit_spans(context.targets, context.positions, sequence_dim,
                            self._dots if self.float_level else None, self.max_number_length, context.live)
        count = spans.first.numel()
        values = self.vocab.on(plan.positions.device, torch.float64)[1]
        target = torch.zeros(count, dtype=torch.float64, device=values.device).index_add_(
            0, spans.number, values[context.numeric_targets] * torch.pow(10.0, spans.exponent.to(torch.float64)))
        number, exponent = spans.number[context.of_call], spans.exponent[context.of_call]
        # the call's row of each number's first digit (-1: not in this call); the others write to a bin
        is_first = spans.first[number] == context.of_call
        first = torch.full((count + 1, ), -1, dtype=torch.int64, device=number.device).index_put_(
            (torch.where(is_first, number, count), ), torch.arange(number.numel(), device=number.device))[:count]
        crossing = None
        if context.shard is not None:
            shard_of_digit = context.shard.shard_of_cells(context.positions)
            lowest, highest = (torch.zeros(count, dtype=torch.int64, device=number.device).scatter_reduce_(
                0, spans.number, shard_of_digit, reduce=reduce, include_self=False) for reduce in ("amin", "amax"))
            crossing = lowest != highest
        return CallNumbers(number, exponent, first, target, crossing)

    def value_owners(self, plan) -> torch.Tensor:
        numbers = self.numbers(plan)
        return numbers.first[numbers.number]

    def mass_rows(self, plan) -> Optional[torch.Tensor]:
        # the mass reweighs a number at its first digit only
        return self.numbers(plan).first if self.reweigh else None

    def numeric_terms(self, q, numeric_targets, mass, compute_dtype) -> NumericTerms:
        raise NotImplementedError("number-level NTL needs the call's positions: the ops call terms_for_call")

    def terms_for_call(self, plan, numeric) -> NumericTerms:
        # O(P N) and O(P): float64 throughout.
        q, mass = numeric.q, numeric.mass
        numbers = self.numbers(plan)
        values = self.vocab.on(q.device, torch.float64)[1]
        scale = torch.pow(10.0, numbers.exponent.to(torch.float64))
        # Each number's first digit (and value) row in this call: indices over every number, not a
        # selection of them (no host sync); a number whose first digit is elsewhere points at a bin row
        # past the call's P (its mass there is 0, and what it writes there is dropped).
        rows = q.shape[0]
        owners = torch.where(numbers.first >= 0, numbers.first, rows)
        expected = torch.zeros_like(numbers.target).index_add_(0, numbers.number, (q @ values) * scale)
        first_mass = None
        if self.reweigh:
            first_mass = torch.cat([mass, mass.new_zeros(1)])[owners]
        comm_calls = comm_bytes = 0
        crossing = None if numbers.crossing is None else numbers.crossing.nonzero().squeeze(1)
        if crossing is not None and crossing.numel():  # the same numbers on every rank of the group
            partial = torch.stack([expected[crossing]] + ([] if first_mass is None else [first_mass[crossing]]))
            comm_bytes, comm_calls = sum_across(partial, plan.sequence_shard.group), 1
            expected[crossing] = partial[0]
            if first_mass is not None:
                first_mass[crossing] = partial[1]
        error = expected - numbers.target
        denominator = expected.abs() + numbers.target.abs() + EPS
        loss = error.abs() / denominator
        grad_expected = error.sign() / denominator - error.abs() * expected.sign() / denominator.square()
        row_factor = grad_expected[numbers.number] * scale
        grad_mass = None
        if first_mass is not None:
            row_factor = row_factor * first_mass[numbers.number]
            grad_mass = mass.new_zeros(rows + 1).index_put_((owners, ), loss - REWEIGH_MARGIN)[:rows]
            loss = loss * first_mass + REWEIGH_MARGIN * (1.0 - first_mass)
        value = torch.zeros(rows + 1, dtype=torch.float64, device=q.device).index_put_((owners, ), loss)[:rows]
        return terms_from_q(q, value, row_factor[:, None] * values[None, :], {self.name: value}, grad_mass, mass,
                            comm_calls=comm_calls, comm_bytes=comm_bytes)
