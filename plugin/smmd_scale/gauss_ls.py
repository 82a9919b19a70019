"""Gaussian label smoothing on number tokens (the NTL paper's baseline, tum-ai/number-token-loss
``GaussianLabelSmoother``): the cross-entropy from soft targets ``t_j ~ exp(-(v_j - v_y)^2 / (2 sigma^2))``
over the numeric tokens to the **full-vocabulary** softmax, as a term next to CE. The soft-target
machinery and the hand-written gradient it shares with DIST2: ``smmd_scale.soft_target``.
"""

from __future__ import annotations

from .numeric_loss import IGNORE_INDEX
from .soft_target import SoftTargetLoss, positive
from .vocab import NumericVocab


class GaussianLabelSmoothingLoss(SoftTargetLoss):
    """Gaussian label smoothing on number tokens: ``-sum_j t_j log p_j``, ``p`` the full-vocabulary
    softmax, ``t_j ~ exp(-(v_j - v_y)^2 / (2 sigma^2))`` over the numeric tokens.

    ``GaussianLabelSmoothingLoss(vocab, sigma=1.0)``: a term next to CE; the smoother's own objective
    (this loss *instead of* CE at number targets) is ``CE + loss - CE at the number targets``.
    """

    name = "gauss_ls"
    normaliser = "vocab"
    divergence = "ce"

    def __init__(self, vocab: NumericVocab, sigma: float = 1.0, ignore_index: int = IGNORE_INDEX):
        self.sigma = positive("sigma", sigma)
        super().__init__(vocab, 2.0 * self.sigma * self.sigma, ignore_index)

    def __repr__(self):
        return (f"GaussianLabelSmoothingLoss(sigma={self.sigma:g}, ignore_index={self.ignore_index}, "
                f"vocab={self.vocab!r})")

    def options(self) -> tuple:
        return (self.sigma, )
