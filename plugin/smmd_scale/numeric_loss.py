"""What a numeric loss is: a :class:`NumericVocab`, ``ignore_index``, and its math at the positions
whose target is numeric — nothing per call, no collective state.

A numeric loss is a function of the numeric slice at the positions whose target is numeric
(:class:`~smmd_scale.call_plan.NumericSlice`): the numeric logits ``[P, N]``, ``q = softmax`` over
them and, for losses that read it, the probability ``mass`` the full softmax puts on the numeric
tokens ``[P]``. A new loss subclasses :class:`NumericLoss` and implements :attr:`~NumericLoss.name`,
:meth:`~NumericLoss.options` and either :meth:`~NumericLoss.numeric_value` (the loss as a
differentiable function of the slice: autograd gives its gradient) or, as an optimisation,
:meth:`~NumericLoss.numeric_terms` (the value and a hand-written gradient); plus an entry in
``registry.py`` for the command line, its options and the monitor. The ops (``loss.py``,
``fused_linear.py``) chain the gradient through the softmax, so it runs on full logits,
vocabulary-parallel shards and the fused linear head with the same one exchange.
Calling a loss runs the standalone op (:func:`smmd_scale.standalone.numeric_loss_alone`), so this
module imports it; the ops never import a loss: they see one only through the small protocol in
``call_plan.py``. A loss whose value at a position depends on other positions (number-level NTL:
a number spans several digit positions) overrides :meth:`~NumericLoss.terms_for_call`, which sees
the call's plan (its targets and positions), and :meth:`~NumericLoss.value_owners`.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import math
from dataclasses import KW_ONLY, dataclass, field
from typing import Optional

import torch

from .call_plan import NumericSlice
from .standalone import numeric_loss_alone
from .vocab import NumericVocab

# The target that means "no target here": torch's, Hugging Face's and Megatron's ignore_index.
IGNORE_INDEX = -100

def options_fingerprint(*parts) -> int:
    """A deterministic 62-bit fingerprint of loss options (identical across processes)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 2


@dataclass
class NumericTerms:
    """What a numeric loss returns for the P numeric-target positions of a call, its gradient in one
    coordinate system, the numeric logits (a loss whose gradient is simplest in ``q``, the softmax over
    the numeric tokens, converts it with :func:`terms_from_q`).

    value:         ``[P]`` the loss at each position (>= 0)
    grad_logits:   ``[P, N]`` d value / d numeric logits with the mass held fixed (float64), or None
    grad_log_mass: ``[P]`` d value / d log(mass), mass the full softmax's probability on the numeric
                   tokens, or None when the loss does not depend on it (the ops add the log-mass's own
                   dependence on every logit)
    parts:         named ``[P]`` statistics, one per name in the loss's ``stat_names`` (the loss's own
                   value under its ``name`` first, then e.g. SMMD's ``mmd`` and ``smooth``)
    comm_calls, comm_bytes: collectives the loss ran itself and their payload bytes (number-level
                   NTL on a sequence shard, ``smmd_scale.sequence_shard``); 0 for the others
    """

    value: torch.Tensor
    # (keywords only after the value: a loss written for the fields of 0.2, ``NumericTerms(value, grad_q,
    # grad_mass, parts)``, fails here instead of landing its d/dq in the logits' place)
    _: KW_ONLY
    grad_logits: Optional[torch.Tensor] = None
    grad_log_mass: Optional[torch.Tensor] = None
    parts: dict = field(default_factory=dict)
    comm_calls: int = 0
    comm_bytes: int = 0


def terms_from_q(q: torch.Tensor, value: torch.Tensor, grad_q: torch.Tensor, parts: dict,
                 grad_mass: Optional[torch.Tensor] = None, mass: Optional[torch.Tensor] = None,
                 **counts) -> NumericTerms:
    """:class:`NumericTerms` of a loss whose gradient is ``grad_q = d value / d q`` (q ``[P, N]`` float64,
    the softmax over the numeric tokens) and ``grad_mass = d value / d mass``: chained through the
    softmax into the numeric logits, ``q_k (g_k - sum_j q_j g_j)`` in float64 (it subtracts nearly equal
    numbers), and ``d / d log(mass) = grad_mass * mass``. ``counts``: ``comm_calls``, ``comm_bytes``."""
    weighted = q * grad_q  # q_k g_k (float64: the product promotes g exactly)
    grad_logits = torch.addcmul(weighted, q, weighted.sum(dim=-1, keepdim=True), value=-1)
    grad_log_mass = None if grad_mass is None else grad_mass.double() * mass
    return NumericTerms(value=value, grad_logits=grad_logits, grad_log_mass=grad_log_mass, parts=parts, **counts)


class NumericLoss:
    """Base of the numeric losses: a :class:`NumericVocab`, ``ignore_index`` and the math.

    ``loss(logits, targets)`` is the loss alone (mean over numeric-target positions; an exact 0 that
    still back-propagates when there are none); pass ``tp_group`` and ``vocab_start_index`` for a
    vocabulary-parallel shard. For CE + the numeric loss in one pass use
    :func:`smmd_scale.numeric_cross_entropy` or :func:`smmd_scale.linear_numeric_cross_entropy`.
    Losses combine: ``SMMDLoss(vocab) + 0.3 * NTLoss(vocab)``.
    """

    #: True when :meth:`numeric_terms` needs the full softmax's mass on the numeric tokens.
    needs_mass = False

    def __init__(self, vocab: NumericVocab, ignore_index: int = IGNORE_INDEX):
        if not isinstance(vocab, NumericVocab):
            raise TypeError(f"vocab must be a smmd_scale.NumericVocab, got {type(vocab).__name__}; build one with "
                            "NumericVocab(token_ids, values, vocab_size) or NumericVocab.from_tokenizer(tokenizer)")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index={ignore_index!r} must be an int")
        self.vocab = vocab
        self.ignore_index = ignore_index

    #: How the loss's gradient is formed: "autograd" (through :meth:`numeric_value`) or "hand-written"
    #: (:meth:`numeric_terms` or :meth:`terms_for_call`, with :meth:`numeric_value` kept as its autograd
    #: reference, which tests/loss/test_gradient_contract.py holds it to; :attr:`gradient_reference`
    #: names another reference where a loss has none of its own).
    gradient = "autograd"
    gradient_reference: Optional[str] = None
    #: Whether the loss reads the numeric tokens' values (False: it sees only which token is which, as
    #: DEL does); a value-structure control (``NumericVocab.shuffled``) changes only a loss that does
    #: (tests/loss/test_value_control.py holds every registered loss to what it declares).
    reads_values = True

    # -- what subclasses provide --------------------------------------------------------------

    @property
    def name(self) -> str:
        """The loss's name in statistics and TensorBoard (``smmd``, ``ntl_was``, ...)."""
        raise NotImplementedError

    @property
    def stat_names(self) -> tuple:
        """The names of the ``[P]`` parts :meth:`numeric_terms` reports (its value under :attr:`name`
        first); override to report more (SMMD adds its two terms)."""
        return (self.name, )

    def options(self) -> tuple:
        """The options that change the loss (they enter the fingerprint ranks compare)."""
        raise NotImplementedError

    @property
    def value_scale(self) -> Optional[float]:
        """The largest value the loss can take at one position when that grows with the vocabulary's
        numeric values (a loss measured in value units: next to CE it needs a weight that fits the
        values' range), or None when the loss is bounded whatever the values are (SMMD: by its kernel
        on squashed distances). None unless a loss overrides it."""
        return None

    def numeric_value(self, plan, numeric: NumericSlice) -> torch.Tensor:
        """The loss ``[P]`` at the numeric positions of ``plan`` (``smmd_scale.call_plan.CallPlan``: its
        ``numeric_targets``, ``positions``, ``targets``) as a differentiable function of ``numeric``'s
        ``logits`` and ``log_mass`` (float64 leaves; ``q``, ``log_q`` and ``mass`` are formed from
        them): autograd gives the gradient (:func:`autograd_terms`). Each position's logits may feed
        only its own value (or, with :meth:`value_owners`, its owner's)."""
        raise NotImplementedError(f"{type(self).__name__} defines neither numeric_value (autograd's gradient) nor "
                                  "numeric_terms (a hand-written one)")

    def numeric_terms(self, q: torch.Tensor, numeric_targets: torch.Tensor, mass: Optional[torch.Tensor],
                      compute_dtype: torch.dtype) -> NumericTerms:
        """A hand-written gradient: the loss at P positions from ``q [P, N]`` and (if
        :attr:`needs_mass`) ``mass [P]``, both float64, and ``numeric_targets [P]``; work that is
        O(P N) can stay in float64, heavier work runs in ``compute_dtype`` (the logits' precision, at
        least float32). A loss whose gradient is simplest in q returns :func:`terms_from_q`'s terms. A
        loss that defines only :meth:`numeric_value` leaves this to autograd."""
        raise NotImplementedError

    def terms_for_call(self, plan, numeric: NumericSlice) -> NumericTerms:
        """The loss and its gradient for one call's plan (``smmd_scale.call_plan.CallPlan``): what the
        ops call. :meth:`numeric_terms` where the loss has it (a hand-written gradient), else
        autograd through :meth:`numeric_value`. A loss whose hand-written gradient needs more of the
        call than the numeric targets (the positions, the other targets) overrides this."""
        if type(self).numeric_terms is not NumericLoss.numeric_terms:
            return self.numeric_terms(numeric.q, plan.numeric_targets, numeric.mass, plan.compute_dtype)
        return autograd_terms(self, plan, numeric)

    def value_owners(self, plan) -> Optional[torch.Tensor]:
        """``[P]``: for each numeric position of ``plan``, the position (index into ``plan.positions``)
        whose value its gradient belongs to, or None when each position owns its own value (a
        number-level loss keeps a number's value at its first digit)."""
        return None

    def mass_rows(self, plan) -> Optional[torch.Tensor]:
        """Which of ``plan``'s P numeric positions the loss reads the mass at (indices), or None for
        all of them; a standalone call computes the full-row log-sum-exp only there."""
        return None

    # -- identity and use -----------------------------------------------------------------------

    @functools.cached_property
    def fingerprint(self) -> int:
        """A 62-bit id of (loss type, vocabulary, options) that tensor-parallel ranks compare."""
        return options_fingerprint(type(self).__name__, self.vocab.fingerprint, self.ignore_index, *self.options())

    def numeric_mask(self, targets: torch.Tensor) -> torch.Tensor:
        """``targets [...]`` -> bool ``[...]``: where the target is a numeric token and not ``ignore_index``
        (where the loss applies)."""
        return torch.isin(targets, self.vocab.on(targets.device, torch.float32)[0]) & (targets != self.ignore_index)

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor, tp_group=None, vocab_start_index: Optional[int] = 0,
                 *, reduction: str = "mean", loss_weights: Optional[torch.Tensor] = None,
                 ignore_index: Optional[int] = None) -> torch.Tensor:
        """The loss alone on ``logits [..., V]`` (or a vocab-parallel shard): ``reduction`` ``"mean"``
        (default), ``"sum"`` or ``"none"``; ``loss_weights`` per position (targets' shape, >= 0);
        ``ignore_index`` for this call (default: the loss's). See
        :func:`smmd_scale.standalone.numeric_loss_alone`."""
        loss = self if ignore_index is None else self.with_ignore_index(ignore_index)
        return numeric_loss_alone(loss, logits, targets, tp_group, vocab_start_index, reduction, loss_weights)

    def with_ignore_index(self, ignore_index: int) -> "NumericLoss":
        """A copy of this loss with another ``ignore_index`` (its own fingerprint)."""
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"ignore_index={ignore_index!r} must be an int")
        if ignore_index == self.ignore_index:
            return self
        other = copy.copy(self)
        other.__dict__.pop("fingerprint", None)  # the cached fingerprint includes ignore_index
        other.ignore_index = ignore_index
        return other

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
    def reads_values(self) -> bool:
        """Whether a term that counts (weight > 0) reads the values."""
        return any(term.reads_values for term, weight in self.terms if weight > 0)

    @property
    def needs_mass(self) -> bool:
        return any(term.needs_mass for term, _ in self.terms)

    @property
    def stat_names(self) -> tuple:
        names = []
        for term, _ in self.terms:
            names += [name for name in term.stat_names if name not in names]
        return tuple(names)

    def weighted_terms(self) -> list:
        return list(self.terms)

    def options(self) -> tuple:
        return tuple((type(term).__name__, term.options(), weight) for term, weight in self.terms)

    def __repr__(self):
        return " + ".join(f"{weight:g} * {term!r}" for term, weight in self.terms)

    def terms_for_call(self, plan, numeric: NumericSlice) -> NumericTerms:
        return self._combine([term.terms_for_call(plan, numeric) for term, _ in self.terms])

    def value_owners(self, plan) -> Optional[torch.Tensor]:
        """The terms' owners when they all agree (one kind of loss); a sum that mixes per-position and
        number-level terms gives each position its own (exact under reductions that weigh a number's
        digit positions alike)."""
        owners = [term.value_owners(plan) for term, _ in self.terms]
        if all(owner is None for owner in owners):
            return None
        first = owners[0]
        return first if all(owner is not None and torch.equal(owner, first) for owner in owners) else None

    def mass_rows(self, plan) -> Optional[torch.Tensor]:
        rows = [term.mass_rows(plan) for term, _ in self.terms if term.needs_mass]
        return None if not rows or any(row is None for row in rows) else torch.unique(torch.cat(rows))

    def _combine(self, all_terms: list) -> NumericTerms:
        def weighted_sum(field_name: str) -> Optional[torch.Tensor]:
            found = [weight * getattr(terms, field_name).double() for (_, weight), terms in zip(self.terms, all_terms)
                     if getattr(terms, field_name) is not None]
            return torch.stack(found).sum(dim=0) if found else None

        parts = {}
        for terms in all_terms:
            parts.update(terms.parts)
        return NumericTerms(value=weighted_sum("value"), grad_logits=weighted_sum("grad_logits"),
                            grad_log_mass=weighted_sum("grad_log_mass"), parts=parts,
                            comm_calls=sum(terms.comm_calls for terms in all_terms),
                            comm_bytes=sum(terms.comm_bytes for terms in all_terms))


def autograd_terms(loss: NumericLoss, plan, numeric: NumericSlice) -> NumericTerms:
    """``loss``'s :meth:`~NumericLoss.numeric_value` at ``plan``'s P positions, with its gradient by
    autograd (float64): ``grad_logits`` with respect to the numeric logits, the log-mass held fixed,
    and ``grad_log_mass`` (the ops add the log-mass's own dependence on the logits)."""
    logits = numeric.logits.detach().requires_grad_()
    log_mass = None if numeric.log_mass is None else numeric.log_mass.detach().requires_grad_()
    with torch.enable_grad():
        log_q = torch.log_softmax(logits, dim=-1)
        inputs = NumericSlice(logits, log_q.exp(), log_q, None if log_mass is None else log_mass.exp(), log_mass)
        value = loss.numeric_value(plan, inputs)
        leaves = [logits] if log_mass is None else [logits, log_mass]
        grads = torch.autograd.grad(value.sum(), leaves, allow_unused=True)
    grad_logits = torch.zeros_like(logits) if grads[0] is None else grads[0]
    grad_log_mass = None
    if log_mass is not None:
        grad_log_mass = torch.zeros_like(log_mass) if grads[1] is None else grads[1]
    value = value.detach()
    return NumericTerms(value=value, grad_logits=grad_logits.detach(), grad_log_mass=grad_log_mass,
                        parts={loss.name: value})
