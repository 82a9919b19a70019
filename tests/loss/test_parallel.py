"""Vocabulary-parallel SMMD + CE on real gloo process groups (2 and 4 ranks, and DP x TP = 2 x 2).

Every rank builds the same random problem from a shared seed, computes the single-device result
on the full logits, then the vocab-parallel result on its own shard, and asserts they agree.
"""

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import CollectiveSpy, run_ranks, values_or_raise
from helpers.reference import FP32_CE_TOLERANCE, FP32_GRAD_TOLERANCE, FP32_OFFSETS, fp32_ce_errors

from smmd_scale import NumericVocab, SMMDLoss, numeric_cross_entropy, vocab_parallel_numeric_cross_entropy

pytestmark = pytest.mark.gloo


def _uneven_bounds(generator, vocab_size, tp_size):
    cuts = sorted(torch.randperm(vocab_size - 1, generator=generator)[:tp_size - 1].add(1).tolist())
    return [0] + cuts + [vocab_size]


def _problem(generator, tp_size, placement, dtype):
    vocab_size = int(torch.randint(tp_size * 8, 240, (1, ), generator=generator))
    bounds = _uneven_bounds(generator, vocab_size, tp_size)
    if placement == "one_rank":  # every numeric token in one shard (of at least two ids)
        wide = [rank for rank in range(tp_size) if bounds[rank + 1] - bounds[rank] >= 2]
        owner = wide[int(torch.randint(0, len(wide), (1, ), generator=generator))]
        pool = torch.arange(bounds[owner], bounds[owner + 1])
    elif placement == "none_on_some":  # the first shard holds none (unless the rest hold fewer than two ids)
        pool = torch.arange(min(bounds[1], vocab_size - 2), vocab_size)
    else:
        pool = torch.arange(vocab_size)
    numeric_size = int(torch.randint(2, min(len(pool), 30) + 1, (1, ), generator=generator))
    token_ids = pool[torch.randperm(len(pool), generator=generator)[:numeric_size]]
    values = torch.randint(0, 40, (numeric_size, ), generator=generator).double()
    if values.unique().numel() < 2:  # SMMD refuses a vocabulary of one value (about 1 draw in 1,000)
        values[1] = values[0] + 1
    shape = (int(torch.randint(1, 4, (1, ), generator=generator)), int(torch.randint(1, 14, (1, ),
                                                                                       generator=generator)))
    logits = (torch.randn(*shape, vocab_size, generator=generator, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    numeric = torch.rand(shape, generator=generator) < 0.4
    targets[numeric] = token_ids[torch.randint(0, numeric_size, (int(numeric.sum()), ), generator=generator)]
    targets[torch.rand(shape, generator=generator) < 0.15] = -100
    return NumericVocab(token_ids.tolist(), values.tolist(), vocab_size), logits, targets, bounds


def _close(actual, expected, dtype):
    actual, expected = torch.as_tensor(actual, dtype=torch.float64), torch.as_tensor(expected, dtype=torch.float64)
    if dtype == torch.float64:
        # float64: the shards' (max, log-sum) merge regroups sums of values of order 10 (measured 1.8e-15).
        return (actual - expected).abs().max().item() <= 1e-10
    # fp32: the same regrouping at fp32 ulp (measured 2.4e-7 of the largest, gradients 5.8e-7); floor: a zero one.
    scale = max(expected.abs().max().item(), 1e-6)
    return (actual - expected).abs().max().item() / scale <= 1e-5


def _tp_equals_single_device(rank, world_size, seed, trials):
    group = dist.group.WORLD
    generator = torch.Generator().manual_seed(seed)
    checked = 0
    for trial in range(trials):
        placement = ("spread", "one_rank", "none_on_some")[trial % 3]
        dtype = (torch.float64, torch.float32)[trial % 2]
        vocab, logits, targets, bounds = _problem(generator, world_size, placement, dtype)
        if trial % 5 == 4:  # a batch with no numeric target at all
            targets = torch.where(torch.isin(targets, vocab.token_ids), torch.full_like(targets, -100), targets)
        weight = float(torch.rand(1, generator=generator) * 2)
        num_items = None if trial % 4 else int((targets != -100).sum()) + 3
        start, end = bounds[rank], bounds[rank + 1]
        smmd = SMMDLoss(vocab, sigmas=(1.0, 3.0))

        full = logits.clone().requires_grad_(True)
        single = numeric_cross_entropy(full, targets, smmd, weight=weight, num_items_in_batch=num_items)
        single.total.backward()
        for _ in range(2):  # the second call runs at the capacity the first one grew
            shard = logits[..., start:end].clone().requires_grad_(True)
            parallel = numeric_cross_entropy(shard, targets, smmd, weight=weight, tp_group=group,
                                          vocab_start_index=start, num_items_in_batch=num_items)
            parallel.total.backward()
            for name in ("total", "ce", "numeric"):
                assert _close(getattr(parallel, name).detach(), getattr(single, name).detach(), dtype), \
                    (trial, name, placement)
            assert _close(shard.grad, full.grad[..., start:end], dtype), (trial, "grad", placement)
            for key in ("numeric_tokens", "tokens", "numeric_accuracy"):
                assert parallel.stats[key] == single.stats[key]
            for key in ("mmd", "smooth", "numeric_mae"):
                assert _close(parallel.stats[key], single.stats[key], dtype)

        shard = logits[..., start:end].clone().requires_grad_(True)
        alone = smmd(shard, targets, tp_group=group, vocab_start_index=start)
        alone.backward()
        reference = logits.clone().requires_grad_(True)
        expected = smmd(reference, targets)
        expected.backward()
        assert _close(alone.detach(), expected.detach(), dtype)
        assert _close(shard.grad, reference.grad[..., start:end], dtype)
        checked += 1
    return checked


@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_equals_single_device(world_size):
    seed = int(torch.randint(0, 2**31, (1, )))
    assert values_or_raise(run_ranks(_tp_equals_single_device, world_size, seed, 12)) == [12] * world_size


def _megatron_layout(rank, world_size, seed):
    """Megatron's [s, b, V/T] equal shards with vocab_start_index inferred from the rank."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size, s, b = 16 * world_size, 7, 3
    vocab = NumericVocab(torch.randperm(vocab_size, generator=generator)[:9].tolist(), list(range(9)), vocab_size)
    smmd = SMMDLoss(vocab)
    logits = torch.randn(s, b, vocab_size, generator=generator, dtype=torch.float64)
    target = torch.randint(0, vocab_size, (s, b), generator=generator)
    target[::2] = vocab.token_ids[torch.randint(0, 9, (target[::2].shape), generator=generator)]
    width = vocab_size // world_size
    shard = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    ce, smmd_values = vocab_parallel_numeric_cross_entropy(shard, target, smmd, tp_group=dist.group.WORLD)
    full = logits.clone().requires_grad_(True)
    ce_full, smmd_full = vocab_parallel_numeric_cross_entropy(full, target, smmd)
    assert ce.shape == (s, b) and smmd_values.shape == (s, b)
    # float64 values of order 1-10, the shards' sums regrouped: a few ulp (measured 8.9e-16).
    assert torch.allclose(ce, ce_full, atol=1e-12) and torch.allclose(smmd_values, smmd_full, atol=1e-12)
    assert (smmd_values[~smmd.numeric_mask(target)] == 0).all()
    mask = (torch.rand(s, b, generator=generator) < 0.7).double()  # a Megatron loss mask
    ((ce * mask).sum() + 0.5 * (smmd_values * mask).sum()).backward()
    ((ce_full * mask).sum() + 0.5 * (smmd_full * mask).sum()).backward()
    # float64 gradients of order 1, the same regrouping (measured 2.2e-16).
    assert torch.allclose(shard.grad, full.grad[..., rank * width:(rank + 1) * width], atol=1e-12)
    return True


def test_megatron_entry_point_two_ranks():
    assert values_or_raise(run_ranks(_megatron_layout, 2, int(torch.randint(0, 2**31, (1, ))))) == [True, True]


def _fp32_errors(rank, world_size, seed):
    vocab_size = 3000
    bounds = [vocab_size * k // world_size + (k % 2) * 7 * (0 < k < world_size) for k in range(world_size + 1)]
    smmd = SMMDLoss(NumericVocab(list(range(10, 30)), list(range(20)), vocab_size))

    def per_token_ce(shard, targets):
        return vocab_parallel_numeric_cross_entropy(shard, targets, smmd, tp_group=dist.group.WORLD,
                                                 vocab_start_index=bounds[rank])[0]

    return [fp32_ce_errors(per_token_ce, offset, seed, vocab_size=vocab_size, start=bounds[rank],
                           end=bounds[rank + 1]) for offset in FP32_OFFSETS]


@pytest.mark.parametrize("world_size", [2, 4])
def test_fp32_cross_entropy_keeps_megatron_accuracy_at_large_logits(world_size):
    """Per-token CE within 4e-6 and its gradient within 6e-7 of float64 at logits N(0, 3) + 0, 30,
    300 and 1000 (uneven shards): the exchange carries each rank's (max, log-sum) pair, so no
    rounding at the logits' magnitude reaches CE or the softmax's rescaling."""
    errors = values_or_raise(run_ranks(_fp32_errors, world_size, int(torch.randint(0, 2**31, (1, )))))
    for rank_errors in errors:
        for offset, (ce_error, grad_error) in zip(FP32_OFFSETS, rank_errors):
            assert ce_error <= FP32_CE_TOLERANCE and grad_error <= FP32_GRAD_TOLERANCE, (offset, ce_error, grad_error)


def _data_times_tensor_parallel(rank, world_size, seed):
    """World 4 = 2 data-parallel replicas x 2 tensor-parallel ranks; each TP group has its own batch."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    data_rank, tp_rank = divmod(rank, 2)
    generator = torch.Generator().manual_seed(seed + data_rank)
    vocab, logits, targets, bounds = _problem(generator, 2, "spread", torch.float64)
    smmd = SMMDLoss(vocab)
    full = logits.clone().requires_grad_(True)
    single = numeric_cross_entropy(full, targets, smmd, weight=0.5)
    single.total.backward()
    start, end = bounds[tp_rank], bounds[tp_rank + 1]
    shard = logits[..., start:end].clone().requires_grad_(True)
    parallel = numeric_cross_entropy(shard, targets, smmd, weight=0.5, tp_group=groups[data_rank],
                                  vocab_start_index=start)
    parallel.total.backward()
    # float64, vocab sums the 2 shards regroup: a few ulp (measured: total 1.8e-15 of ~10, gradient 1.1e-16).
    assert abs(parallel.total.item() - single.total.item()) <= 1e-10
    assert (shard.grad - full.grad[..., start:end]).abs().max().item() <= 1e-10
    return round(single.total.item(), 12)


def test_data_parallel_times_tensor_parallel():
    totals = values_or_raise(run_ranks(_data_times_tensor_parallel, 4, int(torch.randint(0, 2**31, (1, )))))
    assert totals[0] == totals[1] and totals[2] == totals[3] and totals[0] != totals[2]


def _collectives_and_bytes(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    tokens, vocab_size, numeric_size = 64, 512 * world_size, 40
    bounds = [vocab_size * k // world_size for k in range(world_size + 1)]
    vocab = NumericVocab(torch.randperm(vocab_size, generator=generator)[:numeric_size].tolist(),
                         list(range(numeric_size)), vocab_size)
    smmd = SMMDLoss(vocab)
    report = []
    for dtype in (torch.float32, torch.bfloat16):
        for call in range(3):
            logits = torch.randn(tokens, vocab_size, generator=generator).to(dtype)
            targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
            numeric = torch.rand(tokens, generator=generator) < 0.3
            targets[numeric] = vocab.token_ids[torch.randint(0, numeric_size, (int(numeric.sum()), ),
                                                             generator=generator)]
            shard = logits[:, bounds[rank]:bounds[rank + 1]].clone().requires_grad_(True)
            with CollectiveSpy() as forward:
                out = numeric_cross_entropy(shard, targets, smmd, tp_group=dist.group.WORLD,
                                         vocab_start_index=bounds[rank])
            with CollectiveSpy() as backward:
                out.total.backward()
            assert backward.calls == 0
            assert forward.calls == out.stats["comm_calls"] and forward.bytes == out.stats["comm_bytes"]
            # Every numeric target counts, also the random non-numeric draws that hit a numeric id.
            report.append((str(dtype), call, forward.calls, forward.bytes, int(smmd.numeric_mask(targets).sum())))
    return report


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_collective_per_forward_none_in_backward_and_byte_budget(world_size):
    reports = values_or_raise(run_ranks(_collectives_and_bytes, world_size, int(torch.randint(0, 2**31, (1, )))))
    assert all(report == reports[0] for report in reports)  # identical accounting on every rank
    tokens, numeric_size, vocab_size = 64, 40, 512 * world_size
    high_water = 0
    for dtype, call, calls, payload, numeric_positions in reports[0]:
        # One all-reduce whenever the call has no more numeric positions than an earlier call (the
        # capacity keeps the high-water mark); a group's first call grows it with a second round.
        if (dtype, call) == ("torch.float32", 0):
            assert calls == 2
        elif numeric_positions <= high_water:
            assert calls == 1, (dtype, call, calls, numeric_positions, high_water)
        else:
            assert calls in (1, 2)
        high_water = max(high_water, numeric_positions)
        element = 2 if "bfloat16" in dtype else 4
        header = world_size * 12 * 8
        # per rank and token a (max, log-sum) pair of fp32 slots, the target logit, the numeric rows
        budget = header + 8 * tokens * world_size + element * tokens + element * tokens * numeric_size + 64
        assert payload <= budget * calls  # capacity never exceeds the token count here (P <= tokens)
        assert payload < 0.2 * tokens * vocab_size * 4  # far below all-gathering the logits
