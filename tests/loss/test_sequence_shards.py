"""Numbers that cross a sequence-parallel shard boundary (``smmd_scale.sequence_shard``): DEL, DIST2's
place weights and number-level NTL on the shards of a sequence add up to the one-device loss and
gradient (float64), on one process (SP 1, and DEL's shards, which need no collective) and on real
gloo groups of 2 and 4 ranks with even and uneven shards, materialized and through the fused linear
head; number-level NTL runs one collective exactly when a number crosses a boundary, the others none."""

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import CollectiveSpy, run_ranks, values_or_raise
from helpers.reference import relative_error

from smmd_scale import (
    DigitEntropyLoss,
    DIST2Loss,
    NumberLevelNTLoss,
    NumericVocab,
    SMMDLoss,
    linear_numeric_cross_entropy,
    numeric_cross_entropy,
)
from smmd_scale.sequence_shard import SequenceShard

IGNORE, BATCH, LENGTH, VOCAB_SIZE, HIDDEN = -100, 3, 24, 40, 6


def crossing_problem(generator, bounds):
    """(vocab of the ten digits at random ids, the dot's id, targets [BATCH, LENGTH]): random
    non-digit tokens and ignored positions, and at each inner shard boundary b an integer across b
    (row 0), a decimal whose dot is at b (row 1) and one whose dot is just before b (row 2), so a
    boundary cuts a decimal number at its dot and right after it; short shards make numbers that
    cross several boundaries."""
    ids = torch.randperm(VOCAB_SIZE, generator=generator)
    vocab = NumericVocab(ids[:10].tolist(), list(range(10)), VOCAB_SIZE)
    dot, others = int(ids[10]), ids[11:]
    targets = others[torch.randint(0, others.numel(), (BATCH, LENGTH), generator=generator)]
    targets[torch.rand(BATCH, LENGTH, generator=generator) < 0.1] = IGNORE

    def write(row, first, pattern):  # "d" a random digit, "." the dot
        for place, kind in enumerate(pattern):
            cell = first + place
            if 0 <= cell < LENGTH:
                targets[row, cell] = dot if kind == "." else vocab.token_ids[torch.randint(0, 10, (1, ),
                                                                                         generator=generator)]

    for boundary in bounds[1:-1]:
        write(0, boundary - 2, "dddd")
        write(1, boundary - 2, "dd.dd")
        write(2, boundary - 2, "d.ddd")
    return vocab, dot, targets


def losses(vocab, dot):
    """The losses that read whole numbers, and a sum of them with SMMD."""
    found = {"del": DigitEntropyLoss(vocab, dot_token_ids=[dot]),
             "dist2_place": DIST2Loss(vocab, place_weighted=True)}
    for reweigh in (True, False):
        for float_level in (True, False):
            found[f"ntl_number-reweigh={reweigh}-float={float_level}"] = NumberLevelNTLoss(
                vocab, reweigh=reweigh, float_level=float_level, dot_token_ids=[dot])
    found["sum"] = (DigitEntropyLoss(vocab, dot_token_ids=[dot]) + 0.3 * SMMDLoss(vocab)
                    + 0.5 * NumberLevelNTLoss(vocab, float_level=True, dot_token_ids=[dot]))
    return found


def step_counts(targets, vocab) -> dict:
    """The counts train.py passes every shard: the whole micro-batch's valid and numeric targets."""
    return {"num_items_in_batch": int((targets != IGNORE).sum()),
            "num_numeric_in_batch": int(torch.isin(targets, vocab.token_ids).sum())}


def test_one_shard_is_the_plain_call(generator):
    """SP 1: a shard that is the whole sequence changes nothing, bit for bit."""
    vocab, dot, targets = crossing_problem(generator, (0, 9, 17, LENGTH))
    logits = torch.randn(BATCH, LENGTH, VOCAB_SIZE, generator=generator, dtype=torch.float64) * 3
    for name, loss in losses(vocab, dot).items():
        plain, sharded = (logits.clone().requires_grad_(True) for _ in range(2))
        expected = numeric_cross_entropy(plain, targets, loss, weight=0.7)
        expected.total.backward()
        out = numeric_cross_entropy(sharded, targets, loss, weight=0.7,
                                    sequence_shard=SequenceShard(targets, (0, LENGTH), 0))
        out.total.backward()
        assert torch.equal(out.total, expected.total) and torch.equal(sharded.grad, plain.grad), name
        assert out.stats["comm_calls"] == 0, name


def test_del_shards_need_no_collective(generator):
    """DEL and DIST2's place weights on uneven shards of one process (no process group: they run no
    collective) add up to the whole sequence's; without the shard they do not."""
    bounds = (0, 5, 6, 14, LENGTH)
    vocab, dot, targets = crossing_problem(generator, bounds)
    logits = torch.randn(BATCH, LENGTH, VOCAB_SIZE, generator=generator, dtype=torch.float64) * 3
    counts = step_counts(targets, vocab)
    for loss in (DigitEntropyLoss(vocab, dot_token_ids=[dot]), DIST2Loss(vocab, place_weighted=True)):
        whole = logits.clone().requires_grad_(True)
        expected = numeric_cross_entropy(whole, targets, loss, weight=0.7)
        expected.total.backward()
        totals, cut = [], 0.0
        for rank, (start, end) in enumerate(zip(bounds, bounds[1:])):
            piece = logits[:, start:end].clone().requires_grad_(True)
            out = numeric_cross_entropy(piece, targets[:, start:end], loss, weight=0.7, **counts,
                                        sequence_shard=SequenceShard(targets, bounds, rank))
            out.total.backward()
            totals.append(out.total.item())
            # float64: the shards' sums only regroup the one-device sum's terms
            assert relative_error(piece.grad, whole.grad[:, start:end]) <= 1e-10, loss.name
            cut += numeric_cross_entropy(logits[:, start:end], targets[:, start:end], loss, weight=0.7,
                                         **counts).total.item()
        # The shards' sum is the one-device sum up to rounding, and the cut numbers' is not: the one bound
        # separates them (cutting a number moves DEL's place weights by factors 1.02^k on its digits' terms, a
        # change of about 1e-7..1e-5 of a total that CE dominates; rounding in float64 is about 1e-15).
        assert abs(sum(totals) - expected.total.item()) <= 1e-10 * abs(expected.total.item()), loss.name
        assert abs(cut - expected.total.item()) > 1e-10 * abs(expected.total.item()), loss.name  # numbers cut


def test_a_shard_that_is_not_the_call_s_slice_is_refused(generator):
    vocab, dot, targets = crossing_problem(generator, (0, 12, LENGTH))
    logits = torch.randn(BATCH, 12, VOCAB_SIZE, generator=generator, dtype=torch.float64)
    loss = DigitEntropyLoss(vocab, dot_token_ids=[dot])
    for shard, message in ((SequenceShard(targets, (0, 12, LENGTH), 1), "targets differ from shard 1"),
                           (SequenceShard(targets, (0, 10, LENGTH), 0), r"expected \(3, 10\)")):
        with pytest.raises(ValueError, match=message):
            numeric_cross_entropy(logits, targets[:, :12], loss, sequence_shard=shard)
    with pytest.raises(ValueError, match="must be ints rising from 0 to the sequence length 24"):
        SequenceShard(targets, (0, 13, 12, LENGTH), 0)
    with pytest.raises(ValueError, match="finds numbers along sequence_dim=0"):
        numeric_cross_entropy(logits, targets[:, :12], DigitEntropyLoss(vocab, dot_token_ids=[dot], sequence_dim=0),
                              sequence_shard=SequenceShard(targets, (0, 12, LENGTH), 0))


def _shards_equal_one_device(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randperm(LENGTH - 1, generator=generator)[:world_size - 1].add(1).tolist())
    report = {}
    for layout, bounds in (("even", tuple(range(0, LENGTH + 1, LENGTH // world_size))),
                           ("uneven", (0, *cuts, LENGTH))):
        vocab, dot, targets = crossing_problem(generator, bounds)
        logits = torch.randn(BATCH, LENGTH, VOCAB_SIZE, generator=generator, dtype=torch.float64) * 3
        hidden = torch.randn(BATCH, LENGTH, HIDDEN, generator=generator, dtype=torch.float64)
        head = torch.randn(VOCAB_SIZE, HIDDEN, generator=generator, dtype=torch.float64)
        start, end = bounds[rank], bounds[rank + 1]
        shard = SequenceShard(targets, bounds, rank, dist.group.WORLD)
        counts = step_counts(targets, vocab)
        for name, loss in losses(vocab, dot).items():
            whole = logits.clone().requires_grad_(True)
            expected = numeric_cross_entropy(whole, targets, loss, weight=0.7)
            expected.total.backward()
            piece = logits[:, start:end].clone().requires_grad_(True)
            with CollectiveSpy() as forward:
                out = numeric_cross_entropy(piece, targets[:, start:end], loss, weight=0.7, sequence_shard=shard,
                                            **counts)
            with CollectiveSpy() as backward:
                out.total.backward()
            assert forward.calls == out.stats["comm_calls"] and forward.bytes == out.stats["comm_bytes"], name
            assert backward.calls == 0, name
            calls = forward.calls
            totals = torch.stack([out.total.detach(), numeric_cross_entropy(  # without the shard: numbers cut
                logits[:, start:end], targets[:, start:end], loss, weight=0.7, **counts).total])
            dist.all_reduce(totals)
            # float64; the shards' sums regroup the one-device sums' terms (and the crossing numbers'
            # expected values are summed in another order): rounding at 1e-16
            reference = expected.total.item()
            assert abs(totals[0].item() - reference) <= 1e-10 * max(abs(reference), 1.0), (layout, name)
            # cut numbers: beyond the same bound (a change of about 1e-7..1e-5 of the total for DEL's place
            # weights, more for the number-level losses; a drawn case had 5.5e-7, under the 1e-6 once used here)
            assert abs(totals[1].item() - reference) > 1e-10 * max(abs(reference), 1.0), (layout, name)
            assert relative_error(piece.grad, whole.grad[:, start:end]) <= 1e-10, (layout, name)

            leaves = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
            expected = linear_numeric_cross_entropy(*leaves, targets, loss, 0.7)
            expected.total.backward()
            fused = [hidden[:, start:end].clone().requires_grad_(True), head.clone().requires_grad_(True)]
            with CollectiveSpy() as forward:
                out = linear_numeric_cross_entropy(*fused, targets[:, start:end], loss, 0.7, chunk_size=7,
                                                   sequence_shard=shard, **counts)
            out.total.backward()
            assert forward.calls == calls == out.stats["comm_calls"], name
            total, head_grad = out.total.detach().clone(), fused[1].grad.clone()
            dist.all_reduce(total)
            dist.all_reduce(head_grad)
            reference = expected.total.item()
            # float64, as above: the shards and the head's chunks of 7 regroup the one-device sums' terms
            assert abs(total.item() - reference) <= 1e-10 * max(abs(reference), 1.0), (layout, name, "fused")
            assert relative_error(fused[0].grad, leaves[0].grad[:, start:end]) <= 1e-10, (layout, name, "fused")
            assert relative_error(head_grad, leaves[1].grad) <= 1e-10, (layout, name, "fused")
            report[f"{layout}/{name}"] = calls
        # no number across a boundary: number-level NTL runs no collective either
        apart = targets.clone()
        for boundary in bounds[1:-1]:
            apart[:, boundary - 1:boundary + 1] = IGNORE  # an ignored target ends a run
        loss = NumberLevelNTLoss(vocab, float_level=True, dot_token_ids=[dot])
        with CollectiveSpy() as forward:
            out = numeric_cross_entropy(logits[:, start:end], apart[:, start:end], loss, weight=0.7,
                                        sequence_shard=SequenceShard(apart, bounds, rank, dist.group.WORLD))
        report[f"{layout}/apart"] = forward.calls + out.stats["comm_calls"]
    return report


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_sequence_shards_equal_one_device(world_size):
    reports = values_or_raise(run_ranks(_shards_equal_one_device, world_size, int(torch.randint(0, 2**31, (1, )))))
    assert all(report == reports[0] for report in reports)
    for name, calls in reports[0].items():
        # one all-reduce of the crossing numbers' partial sums; none for the place weights
        assert calls == (1 if "ntl_number" in name or "sum" in name else 0), (name, calls)
