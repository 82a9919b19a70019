"""The Number Token Loss (Zausinger et al., "Regress, Don't Guess", ICML 2025) as a numeric loss of
the plugin: the definitions of the ``ntloss`` package (0.3.2), computed from the same exchanged
numeric slice as SMMD, so it runs on full logits, vocabulary-parallel shards and the fused linear
head and adds no collective.

At a position whose target is the numeric token t, with ``q = softmax`` over the numeric tokens:

* ``kind="was"`` (NTL-WAS, the paper's default): ``sum_j D[t, j] q_j``, the Wasserstein-1 distance
  between q and the one-hot target, with ``D`` the value distances ``|v_i - v_j|`` or, with
  ``squash_factor``, the non-zero distances mapped affinely onto ``[1, squash_factor]`` (when all
  non-zero distances are equal the map is undefined and they are kept: ntloss divides by zero);
* ``kind="mse"`` (NTL-MSE): ``(sum_j q_j v_j - v_t)^2``, the squared error of the expected value.

``reweigh=True`` (ntloss's default, not used in the paper's experiments) scales the loss by the
probability mass the full softmax puts on the numeric tokens and adds ``1.01 * max_distance *
(1 - mass)`` (``max_distance``: ``max D`` for WAS, ``(max v - min v)^2`` for MSE), so a prediction
that puts its mass outside the numbers costs more than the worst number; its gradient reaches
every logit of the position through the mass. The loss is the mean over numeric-target positions
(ignored and non-numeric positions contribute nothing); with none it is an exact 0 that still
back-propagates (ntloss returns a constant 0 there).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .numeric_loss import IGNORE_INDEX, NumericLoss, NumericTerms, terms_from_q
from .refusal import NONE, Named, Refusal, digits_vocabulary, literal
from .value_kernel import squash_distances
from .vocab import NumericVocab

KINDS = ("was", "mse")
# ntloss: a reweighed loss for all mass outside the numbers is this much above the worst number.
REWEIGH_MARGIN = 1.01


class NTLoss(NumericLoss):
    """NTL-WAS (``kind="was"``) or NTL-MSE (``kind="mse"``) over the tokens of ``vocab``.

    ``loss = NTLoss(vocab)(logits, targets)``, or in one pass with CE:
    ``numeric_cross_entropy(logits, targets, NTLoss(vocab), weight=0.3)``. Defaults are ntloss's:
    ``reweigh=True``, ``squash_factor=None`` (raw distances). The numeric tokens are ``vocab``'s:
    ``NumericVocab.from_tokenizer(tokenizer, policy="digits")`` gives ntloss's ``digit_level=True``
    set on digit tokenizers, and also counts space-marked spellings (``Ġ7``) and byte-fallback digits
    (``<0x37>``) where a tokenizer has them. ``digit_level=True`` checks that the vocabulary is the ten
    digits (ntloss only logs an error when it is not).
    """

    def __init__(self, vocab: NumericVocab, kind: str = "was", reweigh: bool = True,
                 squash_factor: Optional[float] = None, ignore_index: int = IGNORE_INDEX, digit_level: bool = False):
        super().__init__(vocab, ignore_index)
        if digit_level:
            found = sorted({int(value) for value in vocab.values.tolist() if value in range(10)})
            others = sorted({value for value in vocab.values.tolist() if value not in range(10)})
            if len(found) != 10 or others:
                missing = sorted(set(range(10)) - set(found))
                raise Refusal(literal(f"digit_level=True needs a vocabulary of the ten digits 0..9; it has the digits "
                                      f"{found}" + (f", misses {missing}" if missing else "")
                                      + (f" and also holds the values {others[:5]}" if others else ""))
                              + "; build it with {digits} from a tokenizer that has all ten",
                              digits=digits_vocabulary())
        if kind not in KINDS:
            raise Refusal("{kind} is not one of " + literal(KINDS) + " (NTL-WAS or NTL-MSE)", kind=Named("kind", kind))
        if not isinstance(reweigh, bool):
            raise TypeError(f"reweigh={reweigh!r} must be True or False")
        if squash_factor is not None and (isinstance(squash_factor, bool)
                                          or not isinstance(squash_factor, (int, float))
                                          or not math.isfinite(squash_factor) or squash_factor <= 1):
            raise Refusal("{squash_factor} must be a finite number > 1 (how much worse the farthest number is than "
                          "the closest wrong one), or {none} for the raw distances",
                          squash_factor=Named("squash_factor", squash_factor), none=NONE)
        if int(torch.unique(vocab.values).numel()) < 2:
            raise ValueError(f"the numeric vocabulary has {len(vocab)} token(s) but fewer than two distinct values; "
                             "NTL compares values, so it would be identically 0; check how the vocabulary was built")
        self.kind, self.reweigh = kind, reweigh
        self.squash_factor = None if squash_factor is None else float(squash_factor)
        values = vocab.values
        distances = (values[:, None] - values[None, :]).abs()
        self.distances = distances if squash_factor is None else squash_distances(distances, self.squash_factor)
        self.max_distance = float(self.distances.max()) if kind == "was" else float((values.max() - values.min())
                                                                                      ** 2)
        self._device_distances = {}

    @property
    def name(self) -> str:
        return f"ntl_{self.kind}"

    @property
    def needs_mass(self) -> bool:
        return self.reweigh

    def __repr__(self):
        return (f"NTLoss(kind={self.kind!r}, reweigh={self.reweigh}, squash_factor={self.squash_factor}, "
                f"ignore_index={self.ignore_index}, vocab={self.vocab!r})")

    def options(self) -> tuple:
        return self.kind, self.reweigh, self.squash_factor

    @property
    def value_scale(self) -> Optional[float]:
        """NTL-MSE is a squared value error, up to ``(max v - min v)^2``; raw NTL-WAS a value distance, up
        to ``max v - min v``; ``reweigh`` adds ``REWEIGH_MARGIN`` for mass outside the numbers. NTL-WAS on
        squashed distances is at most ``squash_factor`` (x the margin), whatever the values: None."""
        if self.kind == "was" and self.squash_factor is not None:
            return None
        return self.max_distance * (REWEIGH_MARGIN if self.reweigh else 1.0)

    gradient = "hand-written"  # numeric_terms; numeric_value is its autograd reference

    def numeric_value(self, plan, numeric) -> torch.Tensor:
        """The loss written plainly, for autograd: the reference :meth:`numeric_terms` is tested against.
        WAS: ``sum_j D[t, j] q_j``; MSE: ``(E_q[value] - value_t)^2``; reweighed by the mass on the
        numeric tokens, ``mass * loss + margin * max distance * (1 - mass)`` (ntloss's)."""
        q, targets = numeric.q, plan.numeric_targets
        if self.kind == "was":
            value = (self.distances.to(device=q.device, dtype=q.dtype)[targets] * q).sum(dim=-1)
        else:
            values = self.vocab.values.to(device=q.device, dtype=q.dtype)
            value = (q @ values - values[targets]) ** 2
        if self.reweigh:
            value = value * numeric.mass + REWEIGH_MARGIN * self.max_distance * (1.0 - numeric.mass)
        return value

    def _distances_on(self, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        key = (device, dtype)
        if key not in self._device_distances:
            self._device_distances[key] = self.distances.to(device=device, dtype=dtype)
        return self._device_distances[key]

    def numeric_terms(self, q: torch.Tensor, numeric_targets: torch.Tensor, mass: Optional[torch.Tensor],
                      compute_dtype: torch.dtype) -> NumericTerms:
        # O(P N): kept in q's float64.
        if self.kind == "was":
            distances = self._distances_on(q.device, q.dtype)[numeric_targets]  # [P, N]: D[t, j]
            value, grad_q = (distances * q).sum(dim=-1), distances
        else:
            values = self.vocab.on(q.device, q.dtype)[1]
            error = q @ values - values[numeric_targets]
            value, grad_q = error.square(), 2.0 * error[:, None] * values[None, :]
        grad_mass = None
        if self.reweigh:
            grad_mass = value - REWEIGH_MARGIN * self.max_distance
            value = value * mass + REWEIGH_MARGIN * self.max_distance * (1.0 - mass)
            grad_q = grad_q * mass[:, None]
        return terms_from_q(q, value, grad_q, {self.name: value}, grad_mass, mass)
