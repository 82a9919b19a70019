"""A call's slice of the whole sequence under sequence parallelism, for the losses that read whole
numbers (DEL's place weights, DIST2's place weights, number-level NTL).

Under sequence parallelism (``train.py --sp N``, ``smmd_train.distributed.sequence_parallel``) each rank of a
group holds a slice of every sequence, so a number's digits can lie on two or more ranks. Every rank
of the group has the whole micro-batch's targets (only the activations are sliced), so a call may
pass them along with its slice as a :class:`SequenceShard`; the losses then find each number in the
whole sequence and keep what lies in the call's slice (:func:`run_context`):

* a place weight (DEL, DIST2) depends only on the targets: exact with no collective;
* number-level NTL compares a number's expected value, a sum over its digits' distributions, with
  its value: the digits on other ranks enter through one small all-reduce over the group
  (:func:`smmd_scale.parallel.sum_across`) of two float64 numbers per number that crosses a
  shard boundary; which numbers cross, every rank finds alike from the whole targets, and a call
  where none does runs no collective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

from .parallel import group_size_and_rank


@dataclass(frozen=True, eq=False)
class SequenceShard:
    """The whole sequence's targets and where the call's slice lies in it.

    targets: the whole micro-batch's targets (the call's shape, longer along ``dim``)
    bounds:  ``(0, b_1, ..., S)``: shard r holds ``[bounds[r], bounds[r + 1])`` along ``dim``
             (uneven shards allowed), S = ``targets.shape[dim]``
    rank:    which shard the call holds
    group:   the process group of the shards' ranks, in shard order (None: the default group);
             a number-level loss sums over it when a number crosses a boundary
    dim:     the sequence dim of the targets (-1: ``[batch, seq]``)
    """

    targets: torch.Tensor
    bounds: tuple
    rank: int
    group: object = None
    dim: int = -1

    @classmethod
    def even(cls, targets: torch.Tensor, rank: int, size: int, group=None, dim: int = -1) -> "SequenceShard":
        """Shard ``rank`` of ``size`` equal shards (``targets.shape[dim]`` a multiple of ``size``)."""
        length = targets.shape[dim]
        if length % size:
            raise ValueError(f"sequence length {length} is not a multiple of {size} shards")
        return cls(targets, tuple(range(0, length + 1, length // size)), rank, group, dim)

    def __post_init__(self):
        if not isinstance(self.targets, torch.Tensor) or not self.targets.dim():
            raise TypeError(f"SequenceShard.targets must be the whole sequence's targets as a torch.Tensor with a "
                            f"sequence dim, got {type(self.targets).__name__}")
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or \
                not -self.targets.dim() <= self.dim < self.targets.dim():
            raise ValueError(f"SequenceShard.dim={self.dim!r} is not a dim of targets of shape "
                             f"{tuple(self.targets.shape)}")
        bounds = tuple(self.bounds)
        length = self.targets.shape[self.dim]
        if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != length or \
                any(not isinstance(b, int) or isinstance(b, bool) for b in bounds) or \
                any(lo > hi for lo, hi in zip(bounds, bounds[1:])):
            raise ValueError(f"SequenceShard.bounds={self.bounds!r} must be ints rising from 0 to the sequence "
                             f"length {length}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or not 0 <= self.rank < len(bounds) - 1:
            raise ValueError(f"SequenceShard.rank={self.rank!r} must name one of the {len(bounds) - 1} shards")
        group_size, group_rank = group_size_and_rank(self.group)
        if group_size > 1 and (group_size, group_rank) != (len(bounds) - 1, self.rank):
            raise ValueError(f"SequenceShard: {len(bounds) - 1} shards, this one number {self.rank}, but its group "
                             f"has {group_size} ranks and this is rank {group_rank}; the group's ranks hold the "
                             "shards in order")
        object.__setattr__(self, "bounds", bounds)

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1

    def check_call(self, targets: torch.Tensor) -> None:
        """Raise unless ``targets`` are this shard's slice of the whole targets."""
        start, end = self.bounds[self.rank], self.bounds[self.rank + 1]
        whole = self.targets
        expected = tuple(whole.shape[:self.dim % whole.dim()]) + (end - start, ) + \
            tuple(whole.shape[self.dim % whole.dim() + 1:])
        if tuple(targets.shape) != expected:
            raise ValueError(f"targets of shape {tuple(targets.shape)} are not shard {self.rank} of the whole "
                             f"sequence's targets {tuple(whole.shape)} (bounds {self.bounds}, dim {self.dim}): "
                             f"expected {expected}")
        if not torch.equal(whole.to(targets.device).narrow(self.dim, start, end - start), targets):
            raise ValueError(f"targets differ from shard {self.rank} (positions {start}..{end - 1} along dim "
                             f"{self.dim}) of SequenceShard.targets; pass the same labels, shifted over the whole "
                             "sequence before slicing")

    def call_cells(self, device) -> torch.Tensor:
        """``[T]``: the flat index into the whole targets of each of the call's targets (flat order)."""
        whole = self.targets
        start, end = self.bounds[self.rank], self.bounds[self.rank + 1]
        return torch.arange(whole.numel(), device=device).view(whole.shape).narrow(self.dim, start, end - start) \
            .reshape(-1)

    def shard_of_cells(self, cells: torch.Tensor) -> torch.Tensor:
        """Which shard each flat index ``cells`` into the whole targets lies in."""
        whole = self.targets
        dim = self.dim % whole.dim()
        stride = 1
        for size in whole.shape[dim + 1:]:
            stride *= size
        along = (cells // stride) % whole.shape[dim]
        inner = torch.tensor(self.bounds[1:-1], dtype=along.dtype, device=along.device)
        return torch.bucketize(along, inner, right=True)


class RunContext(NamedTuple):
    """The targets in which a call's numbers are found: its own, or the whole sequence's.

    targets:   the targets, shaped (``[batch, seq]``, ...)
    positions: ``[P']`` sorted flat indices of their numeric targets
    numeric_targets: ``[P']`` each one's index in the numeric vocabulary
    of_call:   ``[P]`` for each of the call's P numeric positions, its index into ``positions``
    shard:     the call's :class:`SequenceShard`, or None (the call holds whole sequences)
    live:      ``[P']`` bool on a fixed-capacity plan (``CallPlan.live``: its spare rows repeat
               position 0), else None
    """

    targets: torch.Tensor
    positions: torch.Tensor
    numeric_targets: torch.Tensor
    of_call: torch.Tensor
    shard: Optional[SequenceShard]
    live: Optional[torch.Tensor] = None

    def marked(self) -> torch.Tensor:
        """bool ``[cells]`` of the targets: True at the numeric positions (:func:`marked_cells`)."""
        return marked_cells(self.targets.numel(), self.positions, self.live)


def marked_cells(cells: int, positions: torch.Tensor, live: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bool ``[cells]``: True at ``positions`` (flat indices); with ``live`` (a fixed-capacity plan's), a
    spare row marks nothing: it writes to a bin cell past the end (an index, not a mask: no host sync)."""
    if live is None:
        marked = torch.zeros(cells, dtype=torch.bool, device=positions.device)
        marked[positions] = True
        return marked
    marked = torch.zeros(cells + 1, dtype=torch.bool, device=positions.device)
    marked[torch.where(live, positions, cells)] = True
    return marked[:cells]


def numeric_positions(targets: torch.Tensor, token_ids: torch.Tensor, ignore_index: int) -> tuple:
    """(positions, index): the sorted flat indices of ``targets`` whose target is one of ``token_ids``
    (sorted) and not ``ignore_index``, and each one's index in ``token_ids``."""
    flat = targets.reshape(-1).to(torch.long).contiguous()
    index = torch.searchsorted(token_ids, flat).clamp(max=token_ids.numel() - 1)
    positions = ((token_ids[index] == flat) & (flat != ignore_index)).nonzero().squeeze(1)
    return positions, index[positions]


def run_context(plan, sequence_dim: int) -> RunContext:
    """The :class:`RunContext` of ``plan`` (``call_plan.CallPlan``) for a loss whose runs go along
    ``sequence_dim``: under a :class:`SequenceShard` the whole sequence's, else the call's own."""
    shard = plan.sequence_shard
    if shard is None:
        return RunContext(plan.targets.view(plan.spec.shape[:-1]), plan.positions, plan.numeric_targets,
                          torch.arange(plan.positions.numel(), device=plan.positions.device), None, plan.live)
    dims = shard.targets.dim()
    if not -dims <= sequence_dim < dims or sequence_dim % dims != shard.dim % dims:
        raise ValueError(f"{type(plan.loss).__name__} finds numbers along sequence_dim={sequence_dim}, but the "
                         f"call's SequenceShard slices dim {shard.dim} of targets {tuple(shard.targets.shape)}; "
                         "build the loss with the shard's sequence dim")
    device = plan.positions.device
    whole = shard.targets.to(device)
    positions, numeric_targets = numeric_positions(whole, plan.token_ids, plan.loss.ignore_index)
    of_call = torch.searchsorted(positions, shard.call_cells(device)[plan.positions])
    return RunContext(whole, positions, numeric_targets, of_call, shard)
