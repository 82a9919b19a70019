"""What every numeric loss shares: its numeric vocabulary, input validation, and the plan of one
call (which positions are numeric, which columns this shard owns) built before any collective.

A numeric loss is a function of the model's distribution over the numeric tokens at the positions
whose target is numeric: ``q = softmax(numeric logits)`` ``[P, N]`` and, for losses that weigh by it,
the probability ``mass`` the full softmax puts on the numeric tokens ``[P]``. Subclasses
(:class:`smmd_scale.SMMDLoss`) implement :meth:`NumericLoss.numeric_terms`; the fused ops in
``loss.py`` and ``fused_linear.py`` chain its gradient through the softmax, so every numeric loss
runs on full logits, vocabulary-parallel shards and the fused linear head with the same one exchange.
"""

from __future__ import annotations

import bisect
import functools
import math
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch

from . import checks
from .parallel import ExchangeState, RankContribution, exchange, group_size_and_rank, options_fingerprint
from .vocab import NumericVocab


def compute_dtype_for(logits_dtype: torch.dtype) -> torch.dtype:
    """Losses are computed in at least float32; float64 logits stay float64."""
    return torch.float64 if logits_dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class LogitsSpec:
    """The logits a call scores, described without the tensor (the fused linear path never makes it):
    ``shape`` ``[..., V_local]``, ``dtype`` and ``device``."""

    shape: tuple
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, logits: torch.Tensor) -> "LogitsSpec":
        return cls(tuple(logits.shape), logits.dtype, logits.device)

    @property
    def width(self) -> int:
        return self.shape[-1]

    @property
    def tokens(self) -> int:
        count = 1
        for size in self.shape[:-1]:
            count *= size
        return count


@dataclass
class NumericTerms:
    """What a numeric loss returns for the P numeric-target positions of a call.

    value:      ``[P]`` the loss at each position (>= 0)
    grad_q:     ``[P, N]`` d value / d q, q = softmax over the numeric tokens
    grad_mass:  ``[P]`` d value / d mass (the full softmax's mass on the numeric tokens), or None
                when the loss does not depend on it
    parts:      named ``[P]`` components logged as statistics (e.g. ``mmd`` and ``smooth``)
    """

    value: torch.Tensor
    grad_q: torch.Tensor
    grad_mass: Optional[torch.Tensor]
    parts: dict = field(default_factory=dict)


@dataclass
class VocabTensors:
    """The numeric vocabulary on one device: ids ``[N]`` (sorted) and values ``[N]`` in the compute dtype."""

    token_ids: torch.Tensor
    values: torch.Tensor


@dataclass
class ForwardPlan:
    """Everything one forward needs besides the logits; built before any collective."""

    loss: "NumericLoss"
    spec: LogitsSpec
    tensors: VocabTensors
    targets: torch.Tensor  # [T] int64
    valid: torch.Tensor  # [T] bool, target != ignore_index
    owned: torch.Tensor  # [T] bool, target id inside this shard
    local_targets: torch.Tensor  # [T] target id - vocab_start_index, clamped into the shard
    positions: torch.Tensor  # [P] numeric-target positions
    numeric_targets: torch.Tensor  # [P] index of the target in the numeric vocabulary
    numeric_columns: tuple  # (lo, hi): numeric-vocabulary indices owned by this shard
    local_numeric_columns: torch.Tensor  # [hi - lo] their column in the shard
    vocab_start_index: int
    tp_group: object
    tp_state: Optional[ExchangeState]
    compute_dtype: torch.dtype
    with_ce: bool
    stats: object = None  # the call's StatSums, set by the forward


class NumericLoss:
    """Base of the numeric losses: a :class:`NumericVocab`, ``ignore_index``, and the per-call plan.

    ``loss(logits, targets)`` is the loss alone (mean over numeric-target positions; an exact 0 that
    still back-propagates when there are none); pass ``tp_group`` and ``vocab_start_index`` for a
    vocabulary-parallel shard. For CE + the numeric loss in one pass use
    :func:`smmd_scale.smmd_cross_entropy` or :func:`smmd_scale.linear_smmd_cross_entropy`.
    """

    #: True when :meth:`numeric_terms` needs the full softmax's mass on the numeric tokens.
    needs_mass = False

    def __init__(self, vocab: NumericVocab, ignore_index: int = -100):
        if not isinstance(vocab, NumericVocab):
            raise TypeError(f"vocab must be a smmd_scale.NumericVocab, got {type(vocab).__name__}; build one with "
                            "NumericVocab(token_ids, values, vocab_size) or NumericVocab.from_tokenizer(tokenizer)")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index={ignore_index!r} must be an int")
        self.vocab = vocab
        self.ignore_index = ignore_index
        self.token_id_list = vocab.token_ids.tolist()  # sorted ascending, on the host
        self._vocab_tensors_cache = {}
        # Exchange state per tensor-parallel group; weak keys so a destroyed group is not kept alive.
        self._tp_states = weakref.WeakKeyDictionary()

    # -- what subclasses provide --------------------------------------------------------------

    @property
    def name(self) -> str:
        """The loss's name in statistics and TensorBoard (``smmd``, ``ntl_was``, ...)."""
        raise NotImplementedError

    def options(self) -> tuple:
        """The options that change the loss (they enter the fingerprint ranks compare)."""
        raise NotImplementedError

    def numeric_terms(self, q: torch.Tensor, numeric_targets: torch.Tensor, mass: Optional[torch.Tensor],
                      compute_dtype: torch.dtype) -> NumericTerms:
        """The loss at P positions from ``q [P, N]`` and (if :attr:`needs_mass`) ``mass [P]``, both
        float64, and ``numeric_targets [P]``; work that is O(P N) can stay in float64, heavier work
        runs in ``compute_dtype`` (the logits' precision, at least float32)."""
        raise NotImplementedError

    # -- shared machinery ---------------------------------------------------------------------

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 62-bit id of (loss type, vocabulary, options) that tensor-parallel ranks compare."""
        return options_fingerprint(type(self).__name__, self.vocab.fingerprint, self.ignore_index, *self.options())

    def vocab_tensors(self, device: torch.device, compute_dtype: torch.dtype) -> VocabTensors:
        key = (device, compute_dtype)
        if key not in self._vocab_tensors_cache:
            self._vocab_tensors_cache[key] = VocabTensors(
                token_ids=self.vocab.token_ids.to(device), values=self.vocab.values.to(device=device,
                                                                                     dtype=compute_dtype))
        return self._vocab_tensors_cache[key]

    def numeric_mask(self, targets: torch.Tensor) -> torch.Tensor:
        """``targets [...]`` -> bool ``[...]``: where the target is a numeric token (where the loss applies)."""
        return torch.isin(targets, self.vocab_tensors(targets.device, torch.float32).token_ids)

    def _tp_state(self, tp_group) -> ExchangeState:
        if tp_group not in self._tp_states:
            self._tp_states[tp_group] = ExchangeState()
        return self._tp_states[tp_group]

    def rank_contribution(self, spec: LogitsSpec, targets: torch.Tensor, vocab_start_index: int, with_ce: bool,
                          failed_check=None) -> RankContribution:
        """This rank's header for the exchange; the caller adds the data pieces when healthy."""
        return RankContribution(failed_check=failed_check, tokens=spec.tokens, numeric_size=len(self.vocab),
                                vocab_start=vocab_start_index, width=spec.width, vocab_size=self.vocab.vocab_size,
                                loss_fingerprint=self.fingerprint, targets=targets,
                                compute_dtype=compute_dtype_for(spec.dtype),
                                logits_dtype=spec.dtype if spec.dtype.is_floating_point else torch.float32,
                                device=spec.device, with_ce=with_ce)

    def prepare(self, spec: LogitsSpec, targets, tp_group, vocab_start_index, with_ce: bool,
                num_items_in_batch=None, weight: Optional[float] = None,
                failed_check: Optional[checks.FailedCheck] = None) -> ForwardPlan:
        """Validate (all ranks reach the same verdict) and build the forward plan; no collective runs
        unless the input is bad under tensor parallelism, where the verdict is shared. ``failed_check``:
        a verdict the caller already reached (the fused linear path checks its own inputs first)."""
        if not isinstance(targets, torch.Tensor):
            raise TypeError(f"targets must be a torch.Tensor, got {type(targets).__name__}")
        if len(spec.shape) < 1:
            raise ValueError(f"logits must have a last (vocabulary) dim, got shape {spec.shape}")
        tp_size, tp_rank = group_size_and_rank(tp_group)
        tensor_parallel = tp_size > 1
        if vocab_start_index is None:
            # Megatron-style equal shards.
            vocab_start_index = tp_rank * spec.width
        if isinstance(vocab_start_index, bool) or not isinstance(vocab_start_index, int):
            raise TypeError(f"vocab_start_index={vocab_start_index!r} must be an int")
        if failed_check is None:
            failed_check = checks.check_inputs(spec, targets, vocab_size=self.vocab.vocab_size,
                                               vocab_start_index=vocab_start_index, tensor_parallel=tensor_parallel,
                                               ignore_index=self.ignore_index, num_items_in_batch=num_items_in_batch,
                                               weight=weight)
        if failed_check is not None:
            if not tensor_parallel:
                raise failed_check.error()
            # Take part in the collective with the verdict so every rank raises it together.
            exchange(self.rank_contribution(spec, targets, vocab_start_index, with_ce, failed_check), tp_group,
                     self._tp_state(tp_group))
            raise AssertionError("unreachable: the exchange raises the shared verdict")

        width = spec.width
        compute_dtype = compute_dtype_for(spec.dtype)
        tensors = self.vocab_tensors(spec.device, compute_dtype)
        flat_targets = targets.reshape(-1).to(torch.long)
        valid = flat_targets != self.ignore_index
        owned = valid & (flat_targets >= vocab_start_index) & (flat_targets < vocab_start_index + width)
        local_targets = (flat_targets - vocab_start_index).clamp(0, max(width - 1, 0))
        index = torch.searchsorted(tensors.token_ids, flat_targets).clamp(max=len(self.vocab) - 1)
        positions = (tensors.token_ids[index] == flat_targets).nonzero().squeeze(1)
        lo = bisect.bisect_left(self.token_id_list, vocab_start_index)
        hi = bisect.bisect_left(self.token_id_list, vocab_start_index + width)
        return ForwardPlan(loss=self, spec=spec, tensors=tensors, targets=flat_targets, valid=valid, owned=owned,
                           local_targets=local_targets, positions=positions, numeric_targets=index[positions],
                           numeric_columns=(lo, hi), local_numeric_columns=tensors.token_ids[lo:hi] - vocab_start_index,
                           vocab_start_index=vocab_start_index, tp_group=tp_group,
                           tp_state=self._tp_state(tp_group) if tensor_parallel else None,
                           compute_dtype=compute_dtype, with_ce=with_ce)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, tp_group=None,
                 vocab_start_index: Optional[int] = 0) -> torch.Tensor:
        from .loss import numeric_loss_alone

        return numeric_loss_alone(self, logits, targets, tp_group, vocab_start_index)

    # -- composition: ``SMMDLoss(vocab) + 0.3 * NTLoss(vocab)`` --------------------------------

    def weighted_terms(self) -> list:
        """``[(loss, weight)]``: this loss with weight 1 (a :class:`WeightedNumericLosses` lists its terms)."""
        return [(self, 1.0)]

    def __mul__(self, weight) -> "WeightedNumericLosses":
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise ValueError(f"a numeric loss can be scaled by a finite number >= 0, not {weight!r}")
        return WeightedNumericLosses([(term, term_weight * float(weight))
                                      for term, term_weight in self.weighted_terms()])

    __rmul__ = __mul__

    def __add__(self, other) -> "WeightedNumericLosses":
        if not isinstance(other, NumericLoss):
            return NotImplemented
        return WeightedNumericLosses(self.weighted_terms() + other.weighted_terms())


class WeightedNumericLosses(NumericLoss):
    """Several numeric losses on one vocabulary as one: ``sum_i weight_i * loss_i`` at each position.

    Built with arithmetic, ``SMMDLoss(vocab) + 0.3 * NTLoss(vocab)``, and accepted wherever a numeric
    loss is. The terms share the exchanged numeric slice (still one collective); each term's value
    is a statistic of its own (``smmd``, ``ntl_was``, ...), so the terms must have distinct names.
    """

    def __init__(self, terms: list):
        if not terms:
            raise ValueError("a weighted sum of numeric losses needs at least one term")
        first = terms[0][0]
        super().__init__(first.vocab, first.ignore_index)
        for term, weight in terms:
            if term.vocab.fingerprint != first.vocab.fingerprint or term.ignore_index != first.ignore_index:
                raise ValueError(f"numeric losses combined in one sum must share their NumericVocab and ignore_index; "
                                 f"{term!r} differs from {first!r}")
            if not (math.isfinite(weight) and weight >= 0):
                raise ValueError(f"weight {weight!r} of {term!r} must be a finite number >= 0")
        names = [term.name for term, _ in terms]
        if len(set(names)) != len(names):
            raise ValueError(f"the terms of a weighted sum need distinct names, got {names}; combine different losses "
                             "(SMMD, NTL-WAS, NTL-MSE), or one loss with one weight")
        self.terms = list(terms)

    @property
    def name(self) -> str:
        return "+".join(term.name for term, _ in self.terms)

    @property
    def needs_mass(self) -> bool:
        return any(term.needs_mass for term, _ in self.terms)

    def weighted_terms(self) -> list:
        return list(self.terms)

    def options(self) -> tuple:
        return tuple((type(term).__name__, term.options(), weight) for term, weight in self.terms)

    def __repr__(self):
        return " + ".join(f"{weight:g} * {term!r}" for term, weight in self.terms)

    def numeric_terms(self, q: torch.Tensor, numeric_targets: torch.Tensor, mass: Optional[torch.Tensor],
                      compute_dtype: torch.dtype) -> NumericTerms:
        value = grad_q = grad_mass = None
        parts = {}
        for term, weight in self.terms:
            terms = term.numeric_terms(q, numeric_targets, mass, compute_dtype)
            value = weight * terms.value.double() if value is None else value + weight * terms.value.double()
            grad_q = weight * terms.grad_q.double() if grad_q is None else grad_q + weight * terms.grad_q.double()
            if terms.grad_mass is not None:
                grad_mass = weight * terms.grad_mass if grad_mass is None else grad_mass + weight * terms.grad_mass
            parts.update(terms.parts)
        return NumericTerms(value=value, grad_q=grad_q, grad_mass=grad_mass, parts=parts)
