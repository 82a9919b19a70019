"""The one collective of the vocab-parallel loss (docs/vocab_parallel.md). The only module that talks to
``torch.distributed`` for the loss (also for the sum a number-level loss runs over a sequence-parallel
group, :func:`sum_across`).

Tensor-parallel rank k holds ``logits[..., s_k:e_k]``; targets are replicated in the group. Per
forward, every rank packs what the others need into **one SUM all-reduce**:

    header          int64    [TP, HEADER_FIELDS]  verdict of its input checks, its shard layout, a
                                                  fingerprint of its vocabulary/options and of its
                                                  targets, its count of numeric positions P
    lse slots       float    [tokens, TP, 2]      its local log-sum-exp per token as (max, log of the sum of
                                                  exp(logit - max)), so no rounding at the logits'
                                                  magnitude enters CE (CE only); with label smoothing
                                                  [tokens, TP, 3]: one more per-token scalar, the sum
                                                  of its shard's logits
    target logits   logits'  [tokens]             logits[t, y_t] for the targets it owns (CE only)
    numeric logits  logits'  [capacity, N]        its numeric columns at the P numeric positions

Every element has exactly one writer (the others write zeros), so the SUM is a gather by
disjoint writes. It runs on the buffer's **integer** bit patterns: the sum of one bit pattern
and zeros is that bit pattern, so every value arrives bit-exact and bf16 logits travel as bf16.
Backward needs no communication: each rank already holds everything for its own columns.

Why the header rides in the same collective: a bad input on one rank (an out-of-range target,
targets that differ across the group, a shard that does not tile the vocabulary) must make all
ranks raise together, not leave the healthy ranks waiting. Each rank writes its verdict; after
the all-reduce every rank reads every verdict and raises the same error.

Why the buffer length never depends on target values: ranks that disagree on the length of an
all-reduce do not get an error, they abort or hang (gloo: SIGABRT, "Received data size doesn't
match expected size"). The length depends only on the logits' leading shape and dtype (which
the model's own tensor-parallel all-reduces already force to agree), on TP, N, and on
``capacity``. ``capacity`` (rows reserved for numeric positions) is state derived only from
earlier all-reduced headers, so it is identical on every rank. When this call has more numeric
positions than that, every rank learns it from the header and a second all-reduce carries the
numeric rows at a grown capacity (it starts at 0; the first call of a group pays the second
round once, and the capacity keeps the high-water mark after that).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from . import compat
from .checks import FailedCheck

# Header fields, one int64 row per rank.
CODE, ARG0, ARG1, ARG2, ARG3, VOCAB_START, WIDTH, VOCAB_SIZE, NUMERIC_SIZE, LOSS_FINGERPRINT, \
    TARGETS_FINGERPRINT, NUMERIC_POSITIONS = range(12)
HEADER_FIELDS = 12
WORD_BYTES = 4  # the packed buffer is int32
_PRIME = 2**31 - 1  # fingerprints are sums mod this prime, exact in int64

CAPACITY_ROUNDING = 8
CAPACITY_HEADROOM = 1.125


def group_size_and_rank(tp_group) -> tuple:
    """(world size, rank) of ``tp_group``; (1, 0) without a group or distributed init."""
    if tp_group is None or not dist.is_available() or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(tp_group), dist.get_rank(tp_group)


def sum_across(tensor: torch.Tensor, group) -> int:
    """Sum ``tensor`` over the ranks of ``group`` in place (one all-reduce) and return its payload
    bytes: the exchange of a number-level loss's partial sums over a sequence-parallel group
    (``smmd_scale.sequence_shard``), which the vocab-parallel exchange does not carry."""
    dist.all_reduce(tensor, group=group)
    return tensor.numel() * tensor.element_size()


def targets_fingerprint(targets: torch.Tensor) -> torch.Tensor:
    """A 62-bit fingerprint of ``targets [tokens]`` as an int64 device tensor (no host sync).

    Two position-weighted sums mod 2^31-1: a difference at one position changes both unless
    it is a multiple of the prime, which token ids and ignore_index never are.
    """
    positions = torch.arange(targets.numel(), device=targets.device, dtype=torch.int64)
    values = torch.remainder(targets.reshape(-1).to(torch.int64), _PRIME)
    first = torch.remainder(values * torch.remainder((positions + 1) * 48271, _PRIME), _PRIME).sum()
    second = torch.remainder(values * torch.remainder((positions + 7) * 69621, _PRIME), _PRIME).sum()
    return torch.remainder(first, _PRIME) * _PRIME + torch.remainder(second, _PRIME)


@dataclass
class ExchangeState:
    """Per (loss, TP group) state. Derived only from all-reduced data, so equal on every rank."""

    capacity: int = 0


@dataclass
class RankContribution:
    """What one rank contributes to the exchange.

    tokens:            number of positions in the call (the logits' leading numel)
    numeric_logits:    ``[P, hi - lo]`` this rank's numeric columns at the numeric positions
    numeric_columns:   (lo, hi) — indices into the numeric vocabulary owned by this shard
    local_lse:         ``ShiftedLogSumExp`` of ``[tokens]`` in the compute dtype, or None (numeric-only calls
                       carry no CE contribution)
    target_logits:     ``[tokens]`` logits' dtype, logits[t, y_t] where this rank owns y_t else 0
    local_logit_sum:   ``[tokens]`` compute dtype, the sum of this shard's logits per token (label
                       smoothing only), or None
    logit_sum_slot:    whether the lse slots have the third (logit sum) element: the call's label
                       smoothing is on. It sets the buffer's length, so a rank whose input failed a
                       check still sets it from its options (like N, it must agree across the group)
    numeric_capacity:  on a fixed-capacity plan, the numeric rows the exchange carries whatever the count
                       (the call's bound, at most ``tokens``), checked on the device: the exchange then
                       reads nothing back (:func:`exchange`); None: the group's grown capacity, read back
    """

    failed_check: Optional[FailedCheck]
    tokens: int
    numeric_size: int
    vocab_start: int
    width: int
    vocab_size: int
    loss_fingerprint: int
    targets: torch.Tensor
    numeric_positions: int = 0
    numeric_logits: Optional[torch.Tensor] = None
    numeric_columns: tuple = (0, 0)
    local_lse: Optional[tuple] = None
    target_logits: Optional[torch.Tensor] = None
    local_logit_sum: Optional[torch.Tensor] = None
    logit_sum_slot: bool = False
    compute_dtype: torch.dtype = torch.float32
    logits_dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    with_ce: bool = True
    numeric_capacity: Optional[int] = None


@dataclass
class ExchangeResult:
    """What every rank holds after the exchange (identical on every rank of the group).

    lse_slots: ``[tokens, TP, 2]`` every rank's local log-sum-exp as (max, log-sum) (None without CE);
        ``[tokens, TP, 3]`` with every rank's logit sum third (label smoothing)
    target_logits: ``[tokens]`` logits[t, y_t] (zero where y_t is ignored; None without CE)
    numeric_logits: ``[P, N]`` the full numeric slice at the numeric positions
    """

    lse_slots: Optional[torch.Tensor]
    target_logits: Optional[torch.Tensor]
    numeric_logits: torch.Tensor
    comm_calls: int
    comm_bytes: int


class _PackedBuffer:
    """An int32 buffer carved into typed sections, each starting on an 8-byte boundary."""

    def __init__(self):
        self._sections = []
        self.words = 0

    def reserve(self, name: str, shape: tuple, dtype: torch.dtype) -> None:
        numel = math.prod(shape)
        words = -(-numel * dtype.itemsize // WORD_BYTES)
        words += words % 2
        self._sections.append((name, self.words, words, shape, dtype))
        self.words += words

    def allocate(self, device) -> tuple:
        buffer = torch.zeros(self.words, dtype=torch.int32, device=device)
        views = {}
        for name, offset, words, shape, dtype in self._sections:
            numel = math.prod(shape)
            views[name] = buffer[offset:offset + words].view(dtype)[:numel].view(shape)
        return buffer, views


def _all_reduce(buffer: torch.Tensor, tp_group) -> None:
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=tp_group)


def reduce_input_gradient(grad_hidden: torch.Tensor, tp_group) -> None:
    """The fused linear head's backward: the sum over the group of every rank's ``d loss / d hidden``
    ``[tokens, H]`` (each rank's covers its own vocabulary rows). It is the all-reduce a
    column-parallel head runs in its own backward anyway (hidden is replicated across the group),
    which the fused path, bypassing the head's forward, runs itself; the loss adds no other
    collective to backward."""
    _all_reduce(grad_hidden, tp_group)


def _grown_capacity(needed: int) -> int:
    rows = math.ceil(needed * CAPACITY_HEADROOM)
    return -(-rows // CAPACITY_ROUNDING) * CAPACITY_ROUNDING


def _raise_on_disagreement(header: list) -> None:
    """Raise the same error on every rank if any rank's verdict or view of the call differs."""
    for rank, row in enumerate(header):
        if row[CODE] != 0:
            failed_check = FailedCheck(int(row[CODE]), tuple(int(a) for a in row[ARG0:ARG3 + 1]))
            raise failed_check.error(prefix=f"tensor-parallel rank {rank} of the group: ")
    described = [f"rank {rank}: N={row[NUMERIC_SIZE]}, vocab_size={row[VOCAB_SIZE]}, "
                 f"fingerprint={row[LOSS_FINGERPRINT]}" for rank, row in enumerate(header)]
    if len({(row[NUMERIC_SIZE], row[VOCAB_SIZE], row[LOSS_FINGERPRINT]) for row in header}) > 1:
        raise ValueError("the tensor-parallel ranks of the group hold different numeric vocabularies or numeric-loss "
                         "options (" + "; ".join(described) + "); build them identically on every rank")
    vocab_size = header[0][VOCAB_SIZE]
    shards = sorted((row[VOCAB_START], row[VOCAB_START] + row[WIDTH], rank) for rank, row in enumerate(header))
    expected_start = 0
    for start, end, _ in shards:
        if start != expected_start or end <= start:
            break
        expected_start = end
    if expected_start != vocab_size or any(end <= start for start, end, _ in shards):
        layout = ", ".join(f"rank {rank}: [{start}, {end})" for start, end, rank in sorted(shards, key=lambda s: s[2]))
        raise ValueError(f"the logits shards do not tile the vocabulary [0, {vocab_size}) exactly once ({layout}); "
                         "each rank must pass its own contiguous shard and its vocab_start_index")
    fingerprints = [(row[TARGETS_FINGERPRINT], row[NUMERIC_POSITIONS]) for row in header]
    if len(set(fingerprints)) > 1:
        described = "; ".join(f"rank {rank}: fingerprint {fp}, {count} numeric positions"
                              for rank, (fp, count) in enumerate(fingerprints))
        raise ValueError("targets differ across the tensor-parallel ranks of the group (" + described + "); every "
                         "rank of a tensor-parallel group must receive the same batch")


# The header fields every rank of a group must hold alike once its input passed its checks.
AGREEING_FIELDS = [NUMERIC_SIZE, VOCAB_SIZE, LOSS_FINGERPRINT, TARGETS_FINGERPRINT, NUMERIC_POSITIONS]


def _checked_on_device(views: dict, contribution: RankContribution, tp_rank: int, capacity: int) -> torch.Tensor:
    """:func:`_raise_on_disagreement`'s checks without reading the header back, for an exchange at a fixed
    ``numeric_capacity``: a rank whose own input failed a check raises its own error (it knows it without
    a read); every rank asserts on the device that no rank failed, that the ranks agree (vocabulary, loss
    options, targets, their count) and tile the vocabulary, and that the count fits the capacity (on a
    GPU the assert stops the process at its next sync; on the CPU it raises at once). Returns the received
    numeric rows at the plan's capacity, the rows past the count zeros (as the read-back exchange gives)."""
    if contribution.failed_check is not None:
        raise contribution.failed_check.error(prefix=f"tensor-parallel rank {tp_rank} of the group: ")
    header = views["header"]
    compat.device_assert((header[:, CODE] == 0).all(), "a tensor-parallel rank of the group failed an input check "
                         "(that rank raised the error that names it)")
    agreeing = header[:, AGREEING_FIELDS]
    compat.device_assert((agreeing == agreeing[:1]).all(), "the tensor-parallel ranks of the group hold different "
                         "numeric vocabularies, numeric-loss options or targets (checked on the device, which cannot "
                         "say which: run one call with numeric_capacity=None to have them named); build them "
                         "identically on every rank and give every rank the same batch")
    starts = header[:, VOCAB_START]
    order = starts.argsort()
    starts, ends = starts[order], (header[:, VOCAB_START] + header[:, WIDTH])[order]
    tiles = ((starts[0] == 0) & (ends[-1] == header[0, VOCAB_SIZE]) & (starts[1:] == ends[:-1]).all()
             & (header[:, WIDTH] > 0).all())
    compat.device_assert(tiles, "the logits shards do not tile the vocabulary exactly once; each rank must pass its "
                         "own contiguous shard and its vocab_start_index")
    count = header[tp_rank, NUMERIC_POSITIONS]
    compat.device_assert(count <= capacity, f"the call holds more numeric-target positions than its "
                         f"numeric_capacity={capacity}: raise it (at most the call's tokens), or pass None")
    rows = torch.arange(capacity, device=count.device)[:, None] < count
    numeric = torch.where(rows, views["numeric"], 0.0)
    spare = contribution.numeric_logits.shape[0] - capacity
    return numeric if spare == 0 else torch.cat([numeric, numeric.new_zeros((spare, numeric.shape[1]))])


def exchange(contribution: RankContribution, tp_group, state: ExchangeState) -> ExchangeResult:
    """Run the packed all-reduce for one call; raise on every rank if any rank's input is bad."""
    tp_size, tp_rank = group_size_and_rank(tp_group)
    tokens, numeric_size = contribution.tokens, contribution.numeric_size
    layout = _PackedBuffer()
    layout.reserve("header", (tp_size, HEADER_FIELDS), torch.int64)
    if contribution.with_ce:
        slots = 3 if contribution.logit_sum_slot else 2
        layout.reserve("lse", (tokens, tp_size, slots), contribution.compute_dtype)
        layout.reserve("target", (tokens, ), contribution.logits_dtype)
    counted_on_device = isinstance(contribution.numeric_positions, torch.Tensor)  # a fixed-capacity plan
    on_device = contribution.numeric_capacity is not None  # nothing read back (set on fixed-capacity plans only)
    capacity = min(contribution.numeric_capacity, tokens) if on_device else state.capacity
    layout.reserve("numeric", (capacity, numeric_size), contribution.logits_dtype)
    buffer, views = layout.allocate(contribution.device)

    row = [0] * HEADER_FIELDS
    if contribution.failed_check is not None:
        row[CODE] = contribution.failed_check.code
        row[ARG0:ARG0 + len(contribution.failed_check.args)] = contribution.failed_check.args
    row[VOCAB_START], row[WIDTH] = contribution.vocab_start, contribution.width
    row[VOCAB_SIZE] = contribution.vocab_size
    row[NUMERIC_SIZE], row[LOSS_FINGERPRINT] = numeric_size, contribution.loss_fingerprint
    row[NUMERIC_POSITIONS] = 0 if counted_on_device else contribution.numeric_positions
    own_header = views["header"][tp_rank]
    own_header.copy_(torch.tensor(row, dtype=torch.int64))
    healthy = contribution.failed_check is None
    lo, hi = contribution.numeric_columns
    if healthy:
        own_header[TARGETS_FINGERPRINT] = targets_fingerprint(contribution.targets)
        if counted_on_device:
            own_header[NUMERIC_POSITIONS] = contribution.numeric_positions
        if contribution.with_ce:
            views["lse"][:, tp_rank, 0], views["lse"][:, tp_rank, 1] = contribution.local_lse
            if contribution.local_logit_sum is not None:
                views["lse"][:, tp_rank, 2] = contribution.local_logit_sum
            views["target"].copy_(contribution.target_logits)
        if counted_on_device:  # the numeric positions come first: the capacity's rows hold them when they fit
            rows = min(capacity, contribution.numeric_logits.shape[0])
            views["numeric"][:rows, lo:hi] = contribution.numeric_logits[:rows]
        elif contribution.numeric_positions <= capacity:
            views["numeric"][:contribution.numeric_positions, lo:hi] = contribution.numeric_logits

    _all_reduce(buffer, tp_group)
    comm_calls, comm_bytes = 1, buffer.numel() * WORD_BYTES
    if on_device:
        return ExchangeResult(lse_slots=views.get("lse"), target_logits=views.get("target"),
                              numeric_logits=_checked_on_device(views, contribution, tp_rank, capacity),
                              comm_calls=comm_calls, comm_bytes=comm_bytes)
    header = views["header"].tolist()  # the call's one host read: every rank's verdict and counts
    _raise_on_disagreement(header)

    count = header[tp_rank][NUMERIC_POSITIONS]
    numeric = views["numeric"]
    if count > state.capacity:
        # All ranks agree on the count (checked above), so all of them take this branch.
        state.capacity = _grown_capacity(count)
        again = _PackedBuffer()
        again.reserve("numeric", (state.capacity, numeric_size), contribution.logits_dtype)
        second, second_views = again.allocate(contribution.device)
        second_views["numeric"][:count, lo:hi] = contribution.numeric_logits[:count]
        _all_reduce(second, tp_group)
        comm_calls, comm_bytes = 2, comm_bytes + second.numel() * WORD_BYTES
        numeric = second_views["numeric"]
    numeric = numeric[:count]
    if counted_on_device:  # back to the plan's capacity: its spare rows after the count, as zeros
        numeric = torch.cat([numeric, numeric.new_zeros((contribution.numeric_logits.shape[0] - count,
                                                          numeric_size))])
    return ExchangeResult(lse_slots=views.get("lse"), target_logits=views.get("target"), numeric_logits=numeric,
                          comm_calls=comm_calls, comm_bytes=comm_bytes)
