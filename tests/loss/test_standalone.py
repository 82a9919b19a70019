"""A numeric loss called on its own (``NTLoss(vocab)(logits, targets)``): ntloss's ``reduction``,
``loss_weights`` and per-call ``ignore_index`` against a float64 reference; the reweighed loss's fp32
accuracy where the numbers hold all the mass; bad options and weights named on every rank; one
collective vocab-parallel."""

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import CollectiveSpy, run_ranks
from helpers.reference import reference_ntl, reference_ntl_per_position, reference_smmd, relative_error

from smmd_scale import NTLoss, NumericVocab, SMMDLoss

from conftest import random_problem

LOSSES = [("ntl", dict(kind="was")), ("ntl", dict(kind="was", reweigh=False)),
          ("ntl", dict(kind="was", squash_factor=9.0)), ("ntl", dict(kind="mse")),
          ("ntl", dict(kind="mse", reweigh=False)), ("smmd", dict())]


def build(family, options, vocab, **extra):
    return NTLoss(vocab, **options, **extra) if family == "ntl" else SMMDLoss(vocab, **extra)


def reference_per_position(family, options, logits, targets, vocab, ignore_index=-100):
    if family == "ntl":
        return reference_ntl_per_position(logits, targets, vocab.token_ids, vocab.values, ignore_index=ignore_index,
                                          **options)
    flat_logits, flat_targets = logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)
    return torch.stack([reference_smmd(flat_logits[row:row + 1], flat_targets[row:row + 1], vocab.token_ids,
                                       vocab.values, ignore_index=ignore_index)
                        for row in range(flat_targets.numel())]).view(targets.shape)


@pytest.mark.parametrize("family, options", LOSSES, ids=lambda value: str(value))
def test_reductions_weights_and_ignore_index_match_the_float64_reference(generator, family, options):
    vocab, logits, targets = random_problem(generator, numeric_share=0.5)
    loss = build(family, options, vocab)
    weights = torch.rand(targets.shape, generator=generator, dtype=torch.float64) * 2
    weights[torch.rand(targets.shape, generator=generator) < 0.2] = 0.0
    other_ignore = targets.masked_fill(targets == -100, -1)  # this call ignores -1 instead
    numeric = loss.numeric_mask(targets).double()
    for call_targets, ignore_index in ((targets, None), (other_ignore, -1)):
        for reduction in ("mean", "sum", "none"):
            for loss_weights in (None, weights):
                ours = logits.clone().requires_grad_(True)
                value = loss(ours, call_targets, reduction=reduction, loss_weights=loss_weights,
                             ignore_index=ignore_index)
                reference_logits = logits.clone().requires_grad_(True)
                per_position = reference_per_position(family, options, reference_logits, call_targets, vocab,
                                                      ignore_index=-100 if ignore_index is None else ignore_index)
                w = numeric if loss_weights is None else numeric * loss_weights
                expected = {"none": per_position * (1 if loss_weights is None else loss_weights),
                            "sum": (per_position * w).sum(),
                            "mean": (per_position * w).sum() / w.sum().clamp_min(torch.finfo(torch.float64).eps)}
                expected = expected[reduction]
                assert value.shape == expected.shape and value.dtype == torch.float64
                value.sum().backward()
                expected.sum().backward()
                assert relative_error(value.detach(), expected.detach()) <= 1e-10
                assert relative_error(ours.grad, reference_logits.grad) <= 1e-10


@pytest.mark.parametrize("kind", ["mse", "was"])
def test_fp32_keeps_its_accuracy_when_the_numbers_hold_all_the_mass(generator, kind):
    """Every non-number logit at -inf: 1 - mass is exactly 0 and the reweighing adds nothing (a fp32
    full-row log-sum-exp made it ~1e-7, which NTL-MSE multiplies by 1.01 * 81: 2.6e-4 of a small loss)."""
    vocab_size = 2000
    token_ids = torch.randperm(vocab_size, generator=generator)[:10]
    vocab = NumericVocab(token_ids.tolist(), list(range(10)), vocab_size)
    worst = worst_grad = 0.0
    for sharpness in (1.0, 4.0, 12.0):  # up to nearly one-hot: small losses, where a fixed error shows most
        logits = torch.full((4, 16, vocab_size), float("-inf"))
        logits[..., token_ids] = torch.randn(4, 16, 10, generator=generator) * sharpness
        targets = token_ids[torch.randint(0, 10, (4, 16), generator=generator)]
        targets[:, ::5] = 7  # a non-numeric target contributes nothing
        ours = logits.clone().requires_grad_(True)
        value = NTLoss(vocab, kind=kind)(ours, targets)
        value.backward()
        reference_logits = logits.double().requires_grad_(True)
        expected = reference_ntl(reference_logits, targets, vocab.token_ids, vocab.values, kind=kind)
        expected.backward()
        finite = torch.isfinite(logits)
        worst = max(worst, relative_error(value.detach(), expected.detach()))
        worst_grad = max(worst_grad, relative_error(ours.grad[finite], reference_logits.grad[finite]))
        assert (ours.grad[~finite] == 0).all()
    assert worst <= 1e-6 and worst_grad <= 1e-6, (worst, worst_grad)


def test_bad_options_and_weights_are_named(generator):
    vocab, logits, targets = random_problem(generator, shape=(2, 5))
    loss = NTLoss(vocab)
    with pytest.raises(ValueError, match=r"reduction='avg' must be one of \('mean', 'sum', 'none'\)"):
        loss(logits, targets, reduction="avg")
    weights = torch.ones(2, 5)
    weights[1, 2] = -0.5
    with pytest.raises(ValueError, match=r"loss_weights\[7\] = -0.5 must be a finite number >= 0"):
        loss(logits, targets, loss_weights=weights)
    weights[1, 2] = float("nan")
    with pytest.raises(ValueError, match=r"loss_weights\[7\] = nan must be a finite number >= 0"):
        loss(logits, targets, loss_weights=weights)
    with pytest.raises(ValueError, match=r"loss_weights hold 5 positions in 1 dims but targets hold 10 in 2 dims"):
        loss(logits, targets, loss_weights=torch.ones(5))
    with pytest.raises(TypeError, match="loss_weights must be a real torch.Tensor"):
        loss(logits, targets, loss_weights=[1.0] * 10)
    with pytest.raises(TypeError, match="ignore_index='x' must be an int"):
        loss(logits, targets, ignore_index="x")
    with pytest.raises(ValueError, match=r"targets\[\d+\] = -100 is outside the vocabulary .* ignore_index=-1"):
        loss(logits, targets.masked_fill(torch.arange(10).view(2, 5) == 3, -100), ignore_index=-1)


def _vocab_parallel_standalone(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    vocab, logits, targets = random_problem(generator, vocab_size=97, numeric_size=12, shape=(3, 9))
    width = logits.shape[-1]
    start, end = (0, 40) if rank == 0 else (40, width)  # uneven shards
    for loss in (NTLoss(vocab), NTLoss(vocab, kind="mse", reweigh=False), SMMDLoss(vocab) + 0.3 * NTLoss(vocab)):
        weights = torch.rand(targets.shape, generator=generator, dtype=torch.float64)
        full = logits.clone().requires_grad_(True)
        single = loss(full, targets, reduction="none", loss_weights=weights)
        (single * 3).sum().backward()
        shard = logits[..., start:end].clone().requires_grad_(True)
        with CollectiveSpy() as forward:
            value = loss(shard, targets, dist.group.WORLD, start, reduction="none", loss_weights=weights)
        with CollectiveSpy() as backward:
            (value * 3).sum().backward()
        assert relative_error(value.detach(), single.detach()) <= 1e-10
        assert relative_error(shard.grad, full.grad[..., start:end]) <= 1e-10
        assert forward.calls in (1, 2) and backward.calls == 0
    # a bad weight on one rank: both ranks raise its error, from the one exchange
    weights = torch.ones(targets.shape)
    if rank == 1:
        weights[0, 4] = -2.0
    try:
        NTLoss(vocab)(logits[..., start:end], targets, dist.group.WORLD, start, loss_weights=weights)
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.gloo
def test_vocab_parallel_standalone_equals_one_device_and_bad_weights_raise_on_every_rank():
    outcomes = run_ranks(_vocab_parallel_standalone, 2, int(torch.randint(0, 2**31, (1, ))))
    assert all(outcome.ok for outcome in outcomes), [outcome.traceback for outcome in outcomes]
    for outcome in outcomes:
        assert outcome.value.startswith("tensor-parallel rank 1 of the group: loss_weights[4] = -2.0 must be"), outcome


@pytest.mark.parametrize("family", ["smmd", "ntl-was"])
def test_the_benchmarks_before_contender_computes_the_loss_alone(generator, family):
    """``benchmarks.contenders.standalone_before`` (bench_ntl_standalone's "before" row: the numeric slice
    alone, no full-softmax pass) still runs on today's plan and gives the loss alone's mean, for a loss
    without the mass (SMMD) and one with it (NTL-WAS, reweighed)."""
    from benchmarks.contenders.standalone_before import numeric_loss_mean

    vocab = NumericVocab(list(range(10, 20)), [float(value) for value in range(10)], 40)
    loss = SMMDLoss(vocab) if family == "smmd" else NTLoss(vocab)
    logits = torch.randn(12, 40, generator=generator, dtype=torch.float64)
    targets = torch.randint(10, 20, (12, ), generator=generator)
    targets[::3] = torch.randint(0, 10, (4, ), generator=generator)
    targets[1] = -100
    # float64, the same terms summed in another order: a few ulp of values of order 1
    torch.testing.assert_close(numeric_loss_mean(loss, logits, targets), loss(logits, targets), rtol=1e-12, atol=1e-14)
