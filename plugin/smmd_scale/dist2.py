"""DIST2 ("Teaching Metric Distance to Discrete Autoregressive Language Models", arXiv 2503.02379; the
re-implementation ``DIST2loss`` in PolyU-VCLab/DEL): ``KL(t || q)`` from soft targets ``t_j ~ exp(-(v_j -
v_y)^2 / tau)`` over the numeric tokens to ``q``, the softmax over the numeric tokens; with
``place_weighted=True`` each position weighted by its place in its run of numeric targets. The soft-target
machinery and the hand-written gradient it shares with Gaussian label smoothing: ``smmd_scale.soft_target``.
"""

from __future__ import annotations

from typing import Optional

import torch

from .number_level import runs_along
from .numeric_loss import IGNORE_INDEX
from .sequence_shard import run_context
from .soft_target import SoftTargetLoss
from .vocab import NumericVocab


class DIST2Loss(SoftTargetLoss):
    """DIST2: ``KL(t || softmax over the numeric tokens)``, ``t_j ~ exp(-(v_j - v_y)^2 / tau)``.

    ``DIST2Loss(vocab, tau=1.0)``; ``place_weighted=True`` weights each position by its place in its
    run of numeric targets along ``sequence_dim`` (the last one 1, the one before 2, ...), as the DEL
    authors' re-implementation does on digit tokenizers.
    """

    name = "dist2"

    def __init__(self, vocab: NumericVocab, tau: float = 1.0, place_weighted: bool = False, sequence_dim: int = -1,
                 ignore_index: int = IGNORE_INDEX):
        super().__init__(vocab, tau, ignore_index)
        if not isinstance(place_weighted, bool):
            raise TypeError(f"place_weighted={place_weighted!r} must be True or False")
        if isinstance(sequence_dim, bool) or not isinstance(sequence_dim, int):
            raise TypeError(f"sequence_dim={sequence_dim!r} must be an int")
        self.place_weighted, self.sequence_dim = place_weighted, sequence_dim

    def __repr__(self):
        return (f"DIST2Loss(tau={self.tau:g}, place_weighted={self.place_weighted}, sequence_dim={self.sequence_dim}, "
                f"ignore_index={self.ignore_index}, vocab={self.vocab!r})")

    def options(self) -> tuple:
        return self.tau, self.place_weighted, self.sequence_dim

    def position_weights(self, plan) -> Optional[torch.Tensor]:
        if not self.place_weighted:
            return None
        context = run_context(plan, self.sequence_dim)
        runs = runs_along(context.marked().view(context.targets.shape), self.sequence_dim)
        return (runs.length - runs.index)[context.positions[context.of_call]].to(torch.float64)
