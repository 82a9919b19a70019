"""The loss compiles: ``torch.compile(fullgraph=True)`` of a function that calls either op traces into
one graph (no host read breaks it: the checks that need a value become device-side asserts inside a
compiled graph, and the numeric positions are held at a fixed capacity), gives what eager gives, and
is not compiled again when only the number of numeric positions changes: per-position losses and the
digit-run ones (DEL, number-level NTL: their runs found at the capacity, their gradients
hand-written). The HF-installed loss under ``torch.compile(model)`` adds no graph break of ours.

Dynamo's own tracing (backend ``eager``) is quick and runs in the fast loop; inductor's code
generation (tens of CPU-seconds per graph on this machine) runs with the slow tests.
"""

from pathlib import Path

import pytest
import torch
import torch._dynamo.testing
from helpers import models

import smmd_scale
from smmd_scale import NumericVocab, SMMDLoss, linear_numeric_cross_entropy, numeric_cross_entropy
from smmd_scale.registry import build_numeric_loss

TOKENS, HIDDEN, VOCAB = 64, 16, 300
DIGITS = list(range(10, 20))
PACKAGE = str(Path(smmd_scale.__file__).resolve().parent)


def vocab():
    return NumericVocab(DIGITS, [float(value) for value in range(10)], VOCAB)


def targets_with(numbers: int, generator) -> torch.Tensor:
    """Targets with exactly ``numbers`` numeric positions (and some ignored ones)."""
    targets = torch.randint(20, VOCAB, (TOKENS, ), generator=generator)
    targets[:numbers] = torch.randint(10, 20, (numbers, ), generator=generator)
    targets[-3:] = -100
    return targets


def materialized(loss):
    def objective(logits, targets):
        return numeric_cross_entropy(logits, targets, loss, weight=0.5).total
    return objective


def fused(loss):
    def objective(hidden, head, targets):
        return linear_numeric_cross_entropy(hidden, head, targets, loss, weight=0.5).total
    return objective


def inputs_for(kind: str, generator) -> list:
    if kind == "materialized":
        return [torch.randn(TOKENS, VOCAB, generator=generator)]
    return [torch.randn(TOKENS, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator)]


def value_and_grads(function, inputs, targets):
    inputs = [tensor.clone().requires_grad_() for tensor in inputs]
    total = function(*inputs, targets)
    total.backward()
    return total.detach(), [tensor.grad for tensor in inputs]


def check_against_eager(compiled, eager, inputs, targets, value_rtol=None, **tolerance) -> None:
    got, expected = value_and_grads(compiled, inputs, targets), value_and_grads(eager, inputs, targets)
    value_tolerance = tolerance if value_rtol is None else dict(rtol=value_rtol, atol=0)
    torch.testing.assert_close(got[0], expected[0], **value_tolerance)
    for got_grad, expected_grad in zip(got[1], expected[1]):
        torch.testing.assert_close(got_grad, expected_grad, **tolerance)


@pytest.mark.parametrize("kind", ["materialized", "fused"])
@pytest.mark.parametrize("loss_name", ["smmd", "ntl-was", "dist2", "del", "ntl-number"])
def test_one_graph_and_no_recompile_when_the_numbers_change(generator, kind, loss_name):
    loss = build_numeric_loss(vocab(), [(loss_name, 1.0)])
    eager = materialized(loss) if kind == "materialized" else fused(loss)
    inputs = inputs_for(kind, generator)
    # The loss's per-device copies (vocabulary, SMMD's kernel) are cached by the first eager call; a
    # compiled graph reads the cache and never fills it (a cache it filled would fail its own guard).
    value_and_grads(eager, inputs, targets_with(5, generator))
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(eager, fullgraph=True, backend=counter)
    for numbers in (20, 7, 0, TOKENS - 3):
        # Dynamo's graph run by eager kernels: the same ops in the same order, so the same bits in the
        # gradients. The total's numeric term is a sum over the rows of a plan: compiled, the fixed
        # capacity's (TOKENS rows, spare zeros included), eager on the CPU, the exact positions: the same
        # fp32 terms added in another order, a few ulp (seen: up to 1.8e-7 relative; 1e-6 is ~8 ulp).
        check_against_eager(compiled, eager, inputs, targets_with(numbers, generator), value_rtol=1e-6, rtol=0, atol=0)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times for 4 counts of numeric positions"


def test_a_bad_target_still_fails_inside_a_compiled_graph(generator):
    """The out-of-vocabulary check is a device-side assert in a graph (no host read): still an error."""
    loss = SMMDLoss(vocab())
    compiled = torch.compile(materialized(loss), fullgraph=True, backend="eager")
    targets = targets_with(5, generator)
    targets[9] = VOCAB + 4
    with pytest.raises(RuntimeError, match="targets hold an id outside the vocabulary"):
        compiled(*inputs_for("materialized", generator), targets)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["materialized", "fused"])
def test_inductor_compiles_the_op_and_matches_eager(generator, kind):
    loss = SMMDLoss(vocab())
    eager = materialized(loss) if kind == "materialized" else fused(loss)
    inputs = inputs_for(kind, generator)
    compiled = torch.compile(eager, fullgraph=True)  # inductor, CPU code generation
    for numbers in (20, 0):
        # fp32 with inductor's fused, reordered reductions: a few ulp of values of order 1-10, over
        # sums of at most V = 300 terms
        check_against_eager(compiled, eager, inputs, targets_with(numbers, generator), rtol=1e-5, atol=1e-6)


def test_the_installed_hf_loss_compiles_once_for_every_call(generator):
    """``torch.compile(model)`` with the installed loss, called with other numbers each time, reading the
    statistics on one call and not the others (as a logging interval does): one graph, compiled once.
    Until 2026-11-29 the hook counted its calls in an int (``self.calls += 1``), a guard that failed on
    every call: a recompilation per call, and eager after Dynamo's limit of 8."""
    model = models.tiny_llama(96, hidden_size=32, max_positions=64, seed=0)
    installed = smmd_scale.install(model, SMMDLoss(NumericVocab(list(range(20, 30)), list(range(10)), 96)),
                                   weight=0.3)
    counter = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=counter)
    for call in range(10):
        ids = torch.randint(0, 96, (2, 12), generator=generator)
        ids[:, 2:2 + call % 7] = torch.randint(20, 30, (2, call % 7), generator=generator)
        compiled(input_ids=ids, labels=ids).loss.backward()
        if call == 3:
            assert installed.last_stats["numeric_tokens"] >= 2 * (call % 7)
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times in 10 calls"


def test_the_installed_hf_loss_adds_no_graph_break_of_ours(generator):
    model = models.tiny_llama(96, hidden_size=32, max_positions=64, seed=0)
    smmd_scale.install(model, SMMDLoss(NumericVocab(list(range(20, 30)), list(range(10)), 96)), weight=0.3)
    ids = torch.randint(0, 96, (2, 12), generator=generator)
    ids[:, 2:8] = torch.randint(20, 30, (2, 6), generator=generator)
    explanation = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    ours = [reason for reason in explanation.break_reasons
            if any(str(Path(frame.filename).resolve()).startswith(PACKAGE) for frame in reason.user_stack)]
    assert not ours, [(reason.reason, reason.user_stack[-1]) for reason in ours]
    assert explanation.graph_count >= 1
    # And the compiled model trains: its loss is eager's and back-propagates.
    compiled = torch.compile(model, backend="eager")
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert loss.item() == pytest.approx(model(input_ids=ids, labels=ids).loss.item(), rel=1e-6)
