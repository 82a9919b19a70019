"""Digit targets for the tests of DIST2, Gaussian label smoothing and DEL (tests/loss/test_soft_target.py,
tests/loss/test_del.py): a random float64 problem on a vocabulary of the ten digits (or digits spelled twice),
a "." token, other ids and ignored positions."""

import torch

from smmd_scale import NumericVocab

IGNORE = -100


def digit_problem(generator, batch=3, length=24, vocab_size=40, duplicate=False):
    """Digit targets in runs with dots (some at a run's start or end), other ids and ignore_index."""
    ids = torch.randperm(vocab_size, generator=generator)
    token_ids, dot = ids[:10 + 3 * duplicate], int(ids[13])
    values = list(range(10)) + ([1, 5, 9] if duplicate else [])
    order = torch.argsort(token_ids)
    token_ids, values = token_ids[order], torch.tensor(values, dtype=torch.float64)[order]
    vocab = NumericVocab(token_ids.tolist(), values.tolist(), vocab_size)
    choice = torch.rand(batch, length, generator=generator)
    targets = torch.randint(0, vocab_size, (batch, length), generator=generator)
    digits = token_ids[torch.randint(0, len(token_ids), (batch, length), generator=generator)]
    targets = torch.where(choice < 0.6, digits, targets)
    targets = torch.where((choice >= 0.6) & (choice < 0.7), torch.full_like(targets, dot), targets)
    targets = torch.where(choice >= 0.93, torch.full_like(targets, IGNORE), targets)
    logits = 3 * torch.randn(batch, length, vocab_size, generator=generator, dtype=torch.float64)
    return vocab, dot, logits, targets
