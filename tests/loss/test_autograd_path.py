"""A numeric loss that defines only ``numeric_value`` (a differentiable function of the numeric
slice) gets its gradient from autograd: it equals the hand-written gradient of the same loss on
full logits, alone, and through the fused linear head, also where the loss reads the mass."""

import pytest
import torch
from helpers.reference import relative_error

from smmd_scale import NTLoss, NumericLoss, linear_numeric_cross_entropy, numeric_cross_entropy
from smmd_scale.ntl import REWEIGH_MARGIN

from conftest import random_problem


class AutogradWasserstein(NumericLoss):
    """NTL-WAS written as a value only: ``sum_j D[t, j] q_j``, reweighed by the mass as ntloss does."""

    def __init__(self, vocab, reweigh: bool):
        super().__init__(vocab)
        self.reweigh = reweigh
        self.distances = (vocab.values[:, None] - vocab.values[None, :]).abs()

    name = "ntl_was"

    @property
    def needs_mass(self):
        return self.reweigh

    def options(self):
        return ("autograd", self.reweigh)

    def numeric_value(self, plan, numeric):
        value = (self.distances.to(numeric.q)[plan.numeric_targets] * numeric.q).sum(dim=-1)
        if not self.reweigh:
            return value
        largest = float(self.distances.max())
        return value * numeric.mass + REWEIGH_MARGIN * largest * (1 - numeric.mass)


@pytest.mark.parametrize("reweigh", [False, True])
def test_autograd_equals_the_hand_written_gradient(generator, reweigh):
    for _ in range(3):
        vocab, logits, targets = random_problem(generator, duplicate_values=bool(torch.randint(0, 2, (1, ))))
        results = []
        for loss in (NTLoss(vocab, reweigh=reweigh), AutogradWasserstein(vocab, reweigh)):
            ours = logits.clone().requires_grad_(True)
            out = numeric_cross_entropy(ours, targets, loss, weight=0.7)
            out.total.backward()
            alone = logits.clone().requires_grad_(True)
            value = loss(alone, targets)
            value.backward()
            results.append((out.total.detach(), ours.grad, value.detach(), alone.grad, out.stats["ntl_was"]))
        (total, grad, value, alone_grad, stat), expected = results
        # both float64 from the same formulas in another order: 1e-10 is far above the rounding
        assert relative_error(total, expected[0]) <= 1e-10 and relative_error(grad, expected[1]) <= 1e-10
        assert relative_error(value, expected[2]) <= 1e-10 and relative_error(alone_grad, expected[3]) <= 1e-10
        assert stat == pytest.approx(expected[4], rel=1e-10, abs=1e-12)


def test_autograd_through_the_fused_linear_head(generator):
    vocab, _, targets = random_problem(generator, vocab_size=120, shape=(3, 9))
    hidden = torch.randn(3, 9, 10, generator=generator, dtype=torch.float64)
    head = torch.randn(120, 10, generator=generator, dtype=torch.float64)
    grads = []
    for loss in (NTLoss(vocab), AutogradWasserstein(vocab, reweigh=True)):
        inputs = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        linear_numeric_cross_entropy(*inputs, targets, loss, 0.9, chunk_size=29).total.backward()
        grads.append([tensor.grad for tensor in inputs])
    for ours, expected in zip(*grads):
        assert relative_error(ours, expected) <= 1e-10  # float64, as above


def test_a_loss_without_value_or_gradient_says_what_to_define(generator):
    vocab, logits, targets = random_problem(generator, numeric_share=0.9)

    class Empty(NumericLoss):
        name = "empty"

        def options(self):
            return ()

    with pytest.raises(NotImplementedError, match="defines neither numeric_value .* nor numeric_terms"):
        numeric_cross_entropy(logits, targets, Empty(vocab))
