"""DEL's own reading of numbers: its place weights on the paper's examples (12.05, .5, 7., 305) and
Megatron's sequence-first targets read as the batch-first ones. Its float64 reference from the paper's
math, vocabulary-parallel, fused and through the hooks, together with DIST2's and Gaussian label
smoothing's: tests/loss/test_soft_target.py."""

import torch
from helpers.digit_problems import digit_problem

import smmd_scale
from smmd_scale import DigitEntropyLoss, NumericVocab


def test_del_place_weights_read_the_paper_s_examples():
    """12.05 -> units 2, tens 4, decimals base^-2, base^-3; .5 and 7. and 305 (no dot inside)."""
    vocab = NumericVocab(list(range(10)), list(range(10)), 16)
    dot = 12
    loss = DigitEntropyLoss(vocab, dot_token_ids=[dot])
    targets = torch.tensor([[1, 2, dot, 0, 5, 13, dot, 5, 13, 7, dot, 13, 3, 0, 5]])
    plan = smmd_scale.call_plan.plan_call(loss, smmd_scale.call_plan.LogitsSpec((1, 15, 16), torch.float64,
                                                                               torch.device("cpu")),
                                          targets, None, 0, with_ce=False)
    expected = [4, 2, 1.02 ** -2, 1.02 ** -3, 2, 2, 6, 4, 2]
    # Integers exact, the powers of 1.02 within an ulp (2.2e-16) in float64; allclose's default atol=1e-8 applies too.
    assert torch.allclose(loss.place_weights(plan), torch.tensor(expected, dtype=torch.float64), rtol=1e-15)


def test_del_reads_megatron_s_sequence_first_targets(generator):
    vocab, dot, logits, targets = digit_problem(generator)
    batch_first = DigitEntropyLoss(vocab, dot_token_ids=[dot])
    sequence_first = DigitEntropyLoss(vocab, dot_token_ids=[dot], sequence_dim=0)
    expected = batch_first(logits, targets, reduction="none")
    found = sequence_first(logits.transpose(0, 1), targets.transpose(0, 1), reduction="none")
    # float64, the same math on the transposed layout: a reduction may add in another order there, a few ulp
    # of its terms (~1e-2, ulp 1.7e-18) whatever the sum (measured over 3,000 seeds: 2% differ, by at most
    # 1.8e-18, once on a value of 1.2e-5; torch.equal failed on those, e.g. generator seed 51).
    torch.testing.assert_close(found.transpose(0, 1), expected, rtol=1e-13, atol=1e-16)
