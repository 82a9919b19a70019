"""The gradient contract: every loss declares how its gradient is formed (``NumericLoss.gradient``), and
every hand-written gradient equals autograd's through the loss's own plain reference
(``numeric_value``), through the whole op: the values, the logits' gradient and, for the losses
that read the numeric mass, its part, in float64 on fresh random inputs."""

import pytest
import torch

from smmd_scale import NumericVocab, numeric_cross_entropy
from smmd_scale.numeric_loss import NumericLoss
from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss, options_from

VOCAB_SIZE, DOT = 40, 13
# float64 throughout; the hand-written and the autograd gradients differ in the order of their
# additions only (a few ulp of values of order 10): 1e-10 relative leaves room for that and nothing else.
RELATIVE = 1e-10


def loss_named(name: str, group: str = "", **options) -> NumericLoss:
    """The registered loss ``name`` at its defaults, with ``options`` of its option ``group`` changed."""
    vocab = NumericVocab(list(range(20, 30)), [float(value) for value in range(10)], VOCAB_SIZE)
    defaults = options_from(lambda option: option.default)
    if group:
        defaults[group] = {**defaults[group], **options}
    return build_numeric_loss(vocab, [(name, 1.0)], defaults, dot_token_ids=[DOT])


def via_autograd(loss: NumericLoss) -> NumericLoss:
    """The same loss (its state shared) with the base class's gradient: autograd through numeric_value."""
    class ViaAutograd(type(loss)):
        numeric_terms = NumericLoss.numeric_terms
        terms_for_call = NumericLoss.terms_for_call
        stat_names = NumericLoss.stat_names  # (autograd reports the value alone, not SMMD's two terms)

    copy = ViaAutograd.__new__(ViaAutograd)
    copy.__dict__.update(loss.__dict__)
    return copy


def relative(found: torch.Tensor, expected: torch.Tensor) -> float:
    return float((found - expected).abs().max() / expected.abs().max().clamp_min(1e-300))


@pytest.mark.parametrize("name", list(NUMERIC_LOSSES))
def test_every_loss_declares_how_its_gradient_is_formed(name):
    loss = loss_named(name)
    overrides = (type(loss).numeric_terms is not NumericLoss.numeric_terms
                 or type(loss).terms_for_call is not NumericLoss.terms_for_call)
    assert loss.gradient in ("autograd", "hand-written"), loss.gradient
    assert overrides == (loss.gradient == "hand-written"), (name, loss.gradient)
    if loss.gradient == "hand-written" and loss.gradient_reference is None:
        assert type(loss).numeric_value is not NumericLoss.numeric_value, f"{name}: no autograd reference"


HAND_WRITTEN_WITH_OWN_REFERENCE = [name for name in NUMERIC_LOSSES
                                   if loss_named(name).gradient == "hand-written"
                                   and loss_named(name).gradient_reference is None]
VARIANTS = {"smmd": [{}, {"group": "smmd", "mode": "mmd"}, {"group": "smmd", "mode": "smooth"},
                     {"group": "smmd", "kernel": "laplace"}],
            "ntl-was": [{}, {"group": "ntl", "reweigh": False}, {"group": "ntl", "squash_factor": 9.0}],
            "ntl-mse": [{}, {"group": "ntl", "reweigh": False}],
            "del": [{}, {"group": "del", "place_base": 1.5, "scale": 0.3}]}


@pytest.mark.parametrize("name", HAND_WRITTEN_WITH_OWN_REFERENCE)
def test_a_hand_written_gradient_equals_autograd_through_its_reference(generator, name):
    assert {"smmd", "ntl-was", "ntl-mse"} <= set(HAND_WRITTEN_WITH_OWN_REFERENCE)
    seen = set()
    for options in VARIANTS.get(name, [{}]):
        loss = loss_named(name, **options)
        seen.add(loss.options())
        targets = torch.randint(0, VOCAB_SIZE, (3, 16), generator=generator)
        digits = torch.rand(3, 16, generator=generator) < 0.6
        targets = torch.where(digits, torch.randint(20, 30, (3, 16), generator=generator), targets)
        targets[0, :2] = -100
        logits = 2 * torch.randn(3, 16, VOCAB_SIZE, generator=generator, dtype=torch.float64)
        results = []
        for numeric in (loss, via_autograd(loss)):
            leaf = logits.clone().requires_grad_(True)
            output = numeric_cross_entropy(leaf, targets, numeric, weight=0.7, reduction="none")
            output.total.sum().backward()
            results.append((output.numeric.detach(), leaf.grad))
        (value, grad), (reference_value, reference_grad) = results
        assert relative(value, reference_value) <= RELATIVE, (name, options)
        assert relative(grad, reference_grad) <= RELATIVE, (name, options)
        assert value.abs().sum() > 0  # numbers were there to compare
    assert len(seen) == len(VARIANTS.get(name, [{}]))  # each variant a loss of its own


def test_terms_take_their_gradients_by_keyword_in_the_logits_coordinates():
    """``NumericTerms`` holds d value / d numeric logits and d value / d log(mass), by keyword only: a loss
    written for 0.2's fields (``NumericTerms(value, grad_q, grad_mass, parts)``) fails instead of landing its
    d/dq where the logits' gradient goes."""
    from smmd_scale.numeric_loss import NumericTerms, terms_from_q

    value, grad_q = torch.zeros(2, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    with pytest.raises(TypeError, match="positional"):
        NumericTerms(value, grad_q, None, {})
    q = torch.softmax(torch.randn(2, 3, dtype=torch.float64), dim=-1)
    terms = terms_from_q(q, value, grad_q, {"x": value}, grad_mass=torch.ones(2), mass=torch.full((2, ), 0.5))
    # the chain through the softmax, by its Jacobian: d q_j / d z_k = q_j ([j = k] - q_k)
    jacobian = torch.diag_embed(q) - q[:, :, None] * q[:, None, :]
    # (float64: the two forms differ by the rounding of sums of 3 terms of order 1)
    torch.testing.assert_close(terms.grad_logits, torch.einsum("pj,pjk->pk", grad_q, jacobian), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(terms.grad_log_mass, torch.full((2, ), 0.5, dtype=torch.float64))  # d/dlog m = m d/dm
