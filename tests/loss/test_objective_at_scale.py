"""The objective of one optimizer step is the same number and the same gradient under any layout.

Given the step's counts (``num_items_in_batch``: valid targets, ``num_numeric_in_batch``:
numeric-target positions, over all its micro-batches and ranks), each call returns its share and
the shares add up to ``sum(CE) / n_valid + weight * sum(numeric loss) / n_numeric`` of the whole
step. The reference is the whole step in one call without counts (that call's own means are the
step's), in float64; the layouts split it by micro-batch (accumulation), by sequence shard (as
sequence parallelism does after shifting the labels over the whole sequence), across data-parallel
gloo ranks, and across the vocabulary (TP), with the numbers spread, all in one micro-batch or
shard, and absent from the step.
"""

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_ranks, values_or_raise

from smmd_scale import NTLoss, NumericVocab, SMMDLoss, linear_numeric_cross_entropy, numeric_cross_entropy

SEQUENCES, LENGTH, HIDDEN = 8, 12, 6
LOSSES = ("smmd", "ntl", "sum")


def numeric_loss(kind, vocab):
    if kind == "smmd":
        return SMMDLoss(vocab)
    if kind == "ntl":
        return NTLoss(vocab, kind="was")  # reweighs by the numeric mass: its gradient reaches every column
    return SMMDLoss(vocab) + 0.3 * NTLoss(vocab, kind="mse", reweigh=False)


def step_problem(seed: int, placement: str):
    """(vocab, logits [SEQUENCES, LENGTH, V] float64, targets) for one optimizer step; ``placement``:
    ``spread`` (numbers anywhere), ``one_block`` (all in sequence 2, positions 0..5), ``none``."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = 40
    vocab = NumericVocab(list(range(10, 22)), [0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 89, 144], vocab_size)
    logits = torch.randn(SEQUENCES, LENGTH, vocab_size, generator=generator, dtype=torch.float64) * 2
    others = torch.cat([torch.arange(0, 10), torch.arange(22, vocab_size)])
    targets = others[torch.randint(0, len(others), (SEQUENCES, LENGTH), generator=generator)]
    targets[torch.rand(SEQUENCES, LENGTH, generator=generator) < 0.2] = -100
    if placement == "spread":
        numeric = torch.rand(SEQUENCES, LENGTH, generator=generator) < 0.25
        targets[numeric] = torch.randint(10, 22, (int(numeric.sum()), ), generator=generator)
    elif placement == "one_block":
        targets[2, :6] = torch.randint(10, 22, (6, ), generator=generator)
    return vocab, logits, targets


def step_counts(loss, targets):
    return int((targets != -100).sum()), int(loss.numeric_mask(targets).sum())


def reference(loss, logits, targets, weight):
    leaf = logits.clone().requires_grad_(True)
    out = numeric_cross_entropy(leaf, targets, loss, weight=weight)
    out.total.backward()
    return out, leaf.grad


def shares(loss, logits, targets, weight, pieces, counts):
    """The step as calls on ``pieces`` (index tuples into [SEQUENCES, LENGTH]): summed totals and
    parts, and the gradient of the whole logits assembled from the pieces."""
    leaf = logits.clone().requires_grad_(True)
    total = ce = numeric = 0.0
    for piece in pieces:
        out = numeric_cross_entropy(leaf[piece], targets[piece], loss, weight=weight, num_items_in_batch=counts[0],
                                    num_numeric_in_batch=counts[1])
        out.total.backward()
        total, ce, numeric = total + out.total.item(), ce + out.ce.item(), numeric + out.numeric.item()
    return (total, ce, numeric), leaf.grad


def layouts():
    accumulation = {f"accumulation {k}": [(slice(i * SEQUENCES // k, (i + 1) * SEQUENCES // k), ) for i in range(k)]
                    for k in (1, 2, 4)}
    sequence = {f"sequence shards {k}": [(slice(None), slice(i * LENGTH // k, (i + 1) * LENGTH // k))
                                         for i in range(k)] for k in (2, 4)}
    uneven = {"micro-batches 1,3,4": [(slice(0, 1), ), (slice(1, 4), ), (slice(4, 8), )]}
    return {**accumulation, **sequence, **uneven}


@pytest.mark.parametrize("kind", LOSSES)
@pytest.mark.parametrize("placement", ["spread", "one_block", "none"])
def test_shares_of_any_layout_add_up_to_the_step(kind, placement):
    seed = int(torch.randint(0, 2**31, (1, )))
    vocab, logits, targets = step_problem(seed, placement)
    loss, weight = numeric_loss(kind, vocab), 0.7
    counts = step_counts(loss, targets)
    expected, expected_grad = reference(loss, logits, targets, weight)
    if placement == "none":
        assert counts[1] == 0 and expected.numeric.item() == 0.0
    for name, pieces in layouts().items():
        (total, ce, numeric), grad = shares(loss, logits, targets, weight, pieces, counts)
        scale = abs(expected.total.item())
        # float64 both ways: the shares add the same per-token terms in other groupings, a few ulp relative
        # (the numeric part's bound is absolute when the step has no number: 0 both ways then).
        assert abs(total - expected.total.item()) <= 1e-10 * scale, (seed, name)
        assert abs(ce - expected.ce.item()) <= 1e-10 * scale, (seed, name)
        assert abs(numeric - expected.numeric.item()) <= 1e-10 * max(abs(expected.numeric.item()), 1.0), (seed, name)
        assert abs(total - (ce + weight * numeric)) <= 1e-10 * scale, (seed, name)  # the parts add up
        assert (grad - expected_grad).abs().max().item() <= 1e-10 * expected_grad.abs().max().item(), (seed, name)


def test_without_counts_each_call_keeps_its_own_means():
    """The per-call definition (documented): a micro-batch's numeric mean counts as much as any
    other micro-batch's, whatever its number of numeric positions; the counts are what fix it."""
    vocab, logits, targets = step_problem(int(torch.randint(0, 2**31, (1, ))), "one_block")
    loss = SMMDLoss(vocab)
    halves = [numeric_cross_entropy(logits[part], targets[part], loss) for part in (slice(0, 4), slice(4, 8))]
    whole = numeric_cross_entropy(logits, targets, loss)
    assert halves[1].numeric.item() == 0.0  # the numbers are all in the first half
    # float64 both ways: the same positions' values, in a call of 4 sequences or of 8, a few ulp apart at most.
    assert halves[0].numeric.item() == pytest.approx(whole.numeric.item(), rel=1e-12)
    averaged = (halves[0].numeric.item() + halves[1].numeric.item()) / 2
    assert averaged == pytest.approx(whole.numeric.item() / 2, rel=1e-12)  # the silent halving counts fix


@pytest.mark.parametrize("kind", LOSSES)
def test_fused_linear_shares_add_up_to_the_step(kind):
    seed = int(torch.randint(0, 2**31, (1, )))
    vocab, _, targets = step_problem(seed, "one_block")
    generator = torch.Generator().manual_seed(seed + 1)
    hidden = torch.randn(SEQUENCES, LENGTH, HIDDEN, generator=generator, dtype=torch.float64)
    head = torch.randn(vocab.vocab_size, HIDDEN, generator=generator, dtype=torch.float64)
    loss, weight = numeric_loss(kind, vocab), 0.5
    counts = step_counts(loss, targets)

    def run(pieces, with_counts):
        h, w = hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)
        total = 0.0
        for piece in pieces:
            kwargs = dict(num_items_in_batch=counts[0], num_numeric_in_batch=counts[1]) if with_counts else {}
            out = linear_numeric_cross_entropy(h[piece], w, targets[piece], loss, weight, chunk_size=7, **kwargs)
            out.total.backward()
            total += out.total.item()
        return total, h.grad, w.grad

    expected, expected_hidden, expected_head = run([(slice(None), )], with_counts=False)
    for name, pieces in layouts().items():
        total, grad_hidden, grad_head = run(pieces, with_counts=True)
        # float64 both ways: the pieces (and chunks of 7) add the same terms in other groupings, a few ulp relative.
        assert abs(total - expected) <= 1e-10 * abs(expected), (seed, name)
        assert (grad_hidden - expected_hidden).abs().max() <= 1e-10 * expected_hidden.abs().max(), (seed, name)
        assert (grad_head - expected_head).abs().max() <= 1e-10 * expected_head.abs().max(), (seed, name)


def test_a_negative_numeric_count_is_named():
    vocab, logits, targets = step_problem(0, "spread")
    with pytest.raises(ValueError, match=r"num_numeric_in_batch=-3 must be >= 0"):
        numeric_cross_entropy(logits, targets, SMMDLoss(vocab), num_numeric_in_batch=-3)


def _data_and_tensor_parallel(rank, world_size, seed, tp_size, accumulation):
    """DP x TP on ``world_size`` ranks: DP rank d takes sequences d, d + DP, ...; with TP each rank
    holds its slice of the vocabulary. Returns what the rank checked (every check asserts here)."""
    dp_size = world_size // tp_size
    dp_rank, tp_rank = rank // tp_size, rank % tp_size
    tp_groups = [dist.new_group(list(range(d * tp_size, (d + 1) * tp_size))) for d in range(dp_size)]
    dp_groups = [dist.new_group(list(range(t, world_size, tp_size))) for t in range(tp_size)]
    tp_group = tp_groups[dp_rank] if tp_size > 1 else None
    dp_group = dp_groups[tp_rank]
    checked = []
    for kind in LOSSES:
        for placement in ("spread", "one_block", "none"):
            vocab, logits, targets = step_problem(seed, placement)
            loss, weight = numeric_loss(kind, vocab), 0.7
            expected, expected_grad = reference(loss, logits, targets, weight)
            # Counted before the forward (as the trainer does): local counts, one small all-reduce.
            mine = list(range(dp_rank, SEQUENCES, dp_size))
            local = torch.tensor(step_counts(loss, targets[mine]), dtype=torch.float64)
            dist.all_reduce(local, group=dp_group)
            counts = (int(local[0]), int(local[1]))
            width = vocab.vocab_size // tp_size
            start = tp_rank * width
            leaf = logits.clone().requires_grad_(True)
            parts = torch.zeros(3, dtype=torch.float64)
            for micro in range(accumulation):
                rows = mine[micro::accumulation]
                shard = leaf[rows][..., start:start + width]
                out = numeric_cross_entropy(shard, targets[rows], loss, weight=weight, tp_group=tp_group,
                                            vocab_start_index=start, num_items_in_batch=counts[0],
                                            num_numeric_in_batch=counts[1])
                out.total.backward()
                parts += torch.tensor([out.total.item(), out.ce.item(), out.numeric.item()], dtype=torch.float64)
            dist.all_reduce(parts, group=dp_group)  # what DP's gradient all-reduce sums
            total, ce, numeric = parts.tolist()
            scale = abs(expected.total.item())
            # float64 on every rank: the ranks, shards and micro-batches add the same terms in other groupings.
            assert abs(total - expected.total.item()) <= 1e-10 * scale, (kind, placement)
            assert abs(ce - expected.ce.item()) <= 1e-10 * scale, (kind, placement)
            assert abs(numeric - expected.numeric.item()) <= 1e-10 * max(abs(expected.numeric.item()), 1), kind
            # This rank's rows and columns of the gradient are the step's (the rest belong to other ranks).
            got = leaf.grad[mine][..., start:start + width]
            want = expected_grad[mine][..., start:start + width]
            assert (got - want).abs().max().item() <= 1e-10 * expected_grad.abs().max().item(), (kind, placement)
            checked.append((kind, placement, counts))
    return checked


@pytest.mark.gloo
@pytest.mark.parametrize("world_size,tp_size,accumulation", [(2, 1, 1), (2, 1, 2), (4, 1, 1), (4, 1, 2), (2, 2, 1),
                                                             (4, 2, 2)])
def test_data_and_tensor_parallel_layouts_give_the_step(world_size, tp_size, accumulation):
    seed = int(torch.randint(0, 2**31, (1, )))
    results = values_or_raise(run_ranks(_data_and_tensor_parallel, world_size, seed, tp_size, accumulation))
    assert all(result == results[0] for result in results)  # every rank counted the same step
    assert len(results[0]) == len(LOSSES) * 3
    assert all(counts[1] == 0 for _, placement, counts in results[0] if placement == "none")


def _megatron_micro_batches(rank, world_size, seed):
    """Megatron's layout on TP=2 ranks: [s, b, V/2] shards of micro-batches; the loss_func outputs
    summed over micro-batches give the step's sums and counts, whatever the split."""
    from smmd_scale.integrations.megatron import loss_func_outputs, vocab_parallel_numeric_cross_entropy

    vocab, logits, targets = step_problem(seed, "one_block")
    loss = numeric_loss("sum", vocab)
    logits, targets = logits.transpose(0, 1), targets.transpose(0, 1)  # [s, b, V], [s, b]
    mask = (targets != -100).double()
    width = vocab.vocab_size // world_size
    results = {}
    for split in (1, 2, 4):
        leaf = logits.clone().requires_grad_(True)
        loss_sum, tokens, numeric_sum, numeric_positions = 0.0, 0, 0.0, 0.0
        for part in range(split):
            columns = slice(part * SEQUENCES // split, (part + 1) * SEQUENCES // split)
            shard = leaf[:, columns, rank * width:(rank + 1) * width]
            ce, numeric = vocab_parallel_numeric_cross_entropy(shard, targets[:, columns].contiguous(), loss,
                                                               tp_group=dist.group.WORLD)
            total, count, report = loss_func_outputs(ce, numeric, mask[:, columns], targets[:, columns], loss,
                                                     weight=0.7)
            total.backward()
            loss_sum, tokens = loss_sum + total.item(), tokens + int(count)
            numeric_sum += report["numeric loss"][0].item()
            numeric_positions += report["numeric loss"][1].item()
            assert report["lm loss"][1].item() == count
        results[split] = (loss_sum, tokens, numeric_sum, numeric_positions, leaf.grad[..., rank * width:
                                                                                      (rank + 1) * width].clone())
    expected = numeric_cross_entropy(logits.transpose(0, 1), targets.transpose(0, 1), loss, weight=0.7)
    valid, numeric_count = step_counts(loss, targets)
    for split, (loss_sum, tokens, numeric_sum, numeric_positions, grad) in results.items():
        assert tokens == valid and numeric_positions == numeric_count, split
        # float64: the micro-batches and the two vocabulary shards add the same terms in other groupings.
        assert abs(numeric_sum / numeric_positions - expected.numeric.item()) <= 1e-10 * expected.numeric.item()
        # Megatron divides by the step's tokens: CE mean + weight x numeric sum per token.
        per_token = expected.ce.item() + 0.7 * numeric_sum / tokens
        assert abs(loss_sum / tokens - per_token) <= 1e-10 * per_token, split
        assert (grad - results[1][4]).abs().max().item() <= 1e-10 * results[1][4].abs().max().item(), split
    return True


@pytest.mark.gloo
def test_megatron_loss_func_pairs_add_up_over_micro_batches():
    seed = int(torch.randint(0, 2**31, (1, )))
    assert values_or_raise(run_ranks(_megatron_micro_batches, 2, seed)) == [True, True]
