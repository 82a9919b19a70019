"""Soft-target numeric cross-entropy: at a position whose target is the numeric token y, the model's
distribution over the numeric tokens is pulled toward soft targets that fall off with the value
distance,

    t_j = exp(-(v_j - v_y)^2 / tau) / sum_k exp(-(v_k - v_y)^2 / tau)      over the N numeric tokens

in two named parameterisations, each as its authors' code computes it, each in a module of its own:

* **DIST2** (``smmd_scale.dist2.DIST2Loss``; "Teaching Metric Distance to Discrete Autoregressive
  Language Models", arXiv 2503.02379; the re-implementation ``DIST2loss`` in PolyU-VCLab/DEL):
  ``KL(t || q) = sum_j t_j (log t_j - log q_j)`` with ``q = softmax`` over the numeric tokens (the
  numeric slice is the normaliser), temperature ``tau`` (the re-implementation's is 1). With
  ``place_weighted=True`` each position is weighted by its place in its run of numeric targets (1
  for the last, 2 for the one before, ...), as that re-implementation does.
* **Gaussian label smoothing** (``smmd_scale.gauss_ls.GaussianLabelSmoothingLoss``; the NTL paper's
  baseline, tum-ai/number-token-loss ``GaussianLabelSmoother``): the cross-entropy ``-sum_j t_j log p_j`` with
  ``p`` the **full-vocabulary** softmax and ``tau = 2 sigma^2``. The smoother uses it *instead of* CE
  at number targets; here it is a term added to CE (``CE + weight * loss``), see docs/objective.md.

This module holds what they share (:class:`SoftTargetLoss`). Both have a hand-written gradient,
``w (q - t)`` through the numeric logits (and, for the full-vocabulary normaliser, ``-1`` through the
log of the numeric tokens' mass); ``numeric_value`` states the same loss for autograd (tested equal).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from .call_plan import NumericSlice
from .numeric_loss import IGNORE_INDEX, NumericLoss, NumericTerms
from .refusal import Named, Refusal
from .vocab import NumericVocab


def positive(name: str, value) -> float:
    """``value`` as a float, or a refusal naming ``name`` unless it is a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
        raise Refusal("{option} must be a finite number > 0", option=Named(name, value))
    return float(value)


class SoftTargetLoss(NumericLoss):
    """The shared math: soft targets at temperature ``tau`` and, per position, ``weight * (sum_j t_j
    (log t_j - log p_j))`` (KL) or ``weight * (-sum_j t_j log p_j)`` (CE), ``p`` normalised over the
    numeric tokens or the full vocabulary. Subclasses name a parameterisation."""

    #: "numeric" (the numeric slice) or "vocab" (the full softmax) normalises the model's distribution.
    normaliser = "numeric"
    #: "kl" or "ce": the two differ by the targets' entropy, a constant per target (same gradient).
    divergence = "kl"

    def __init__(self, vocab: NumericVocab, tau: float, ignore_index: int = IGNORE_INDEX):
        super().__init__(vocab, ignore_index)
        if int(torch.unique(vocab.values).numel()) < 2:
            raise ValueError(f"the numeric vocabulary has {len(vocab)} token(s) but fewer than two distinct values; "
                             "soft targets over one value are the one-hot target (plain CE)")
        self.tau = positive("tau", tau)

    @property
    def needs_mass(self) -> bool:
        return self.normaliser == "vocab"

    def soft_targets(self, numeric_targets: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """``[P, N]`` the targets ``t`` (rows sum to 1), in ``like``'s dtype and device."""
        values = self.vocab.on(like.device, like.dtype)[1]
        return torch.softmax(-(values[None, :] - values[numeric_targets][:, None]).square() / self.tau, dim=-1)

    def position_weights(self, plan) -> Optional[torch.Tensor]:
        """``[P]`` a weight per numeric position, or None (all 1)."""
        return None

    def unweighted_value(self, targets: torch.Tensor, numeric: NumericSlice) -> torch.Tensor:
        """``[P]`` the KL or CE from ``targets [P, N]`` to the model's distribution (``log p = log q``,
        plus ``log mass`` for the full-vocabulary normaliser)."""
        log_p = numeric.log_q + numeric.log_mass[:, None] if self.needs_mass else numeric.log_q
        value = -(targets * log_p).sum(dim=-1)
        if self.divergence == "kl":  # xlogy: a target that underflowed to 0 adds 0, not 0 * -inf
            value = value + torch.xlogy(targets, targets).sum(dim=-1)
        return value

    gradient = "hand-written"  # terms_for_call; numeric_value is its autograd reference

    def numeric_value(self, plan, numeric: NumericSlice) -> torch.Tensor:
        """The loss for autograd: the reference the hand-written :meth:`terms_for_call` is tested against."""
        value = self.unweighted_value(self.soft_targets(plan.numeric_targets, numeric.logits), numeric)
        weights = self.position_weights(plan)
        return value if weights is None else value * weights

    def terms_for_call(self, plan, numeric: NumericSlice) -> NumericTerms:
        # O(P N): float64 throughout.
        targets = self.soft_targets(plan.numeric_targets, numeric.logits)
        value = self.unweighted_value(targets, numeric)
        grad_logits = numeric.q - targets
        grad_log_mass = -torch.ones_like(value) if self.needs_mass else None
        weights = self.position_weights(plan)
        if weights is not None:
            value, grad_logits = value * weights, grad_logits * weights[:, None]
            grad_log_mass = None if grad_log_mass is None else grad_log_mass * weights
        return NumericTerms(value=value, grad_logits=grad_logits, grad_log_mass=grad_log_mass,
                            parts={self.name: value})


# The losses that lived here until 0.3.0, each now in a module of its own.
_MOVED = {"DIST2Loss": "smmd_scale.dist2", "GaussianLabelSmoothingLoss": "smmd_scale.gauss_ls"}


def __getattr__(name: str):
    if name in _MOVED:
        raise ImportError(f"{name} moved to {_MOVED[name]} in smmd-scale 0.3.0 (from smmd_scale import {name} "
                          "works as before)", name=__name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
