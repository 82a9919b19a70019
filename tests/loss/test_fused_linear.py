"""linear_numeric_cross_entropy: CE + SMMD from the head's input without the logits, against
numeric_cross_entropy on the materialized logits (float64, fresh random shapes), on one device and on
real gloo groups of 2 and 4 ranks (uneven head shards), with its collectives counted."""

import pytest
import torch
import torch.distributed as dist
from helpers.distributed import run_ranks, values_or_raise
from test_parallel import CollectiveSpy
from torch.utils._python_dispatch import TorchDispatchMode

from smmd_scale import NumericVocab, SMMDLoss, linear_numeric_cross_entropy, numeric_cross_entropy


def problem(generator, dtype=torch.float64, with_bias=True, numeric_share=0.4, ignore_share=0.15, shape=None,
            vocab_size=None):
    def draw(low, high):
        return int(torch.randint(low, high, (1, ), generator=generator))

    vocab_size = vocab_size or draw(40, 400)
    hidden_size = draw(2, 40)
    shape = shape or (draw(1, 4), draw(1, 20))
    numeric_size = draw(2, min(30, vocab_size))  # a vocabulary of 16 cannot hold 29 numeric tokens
    token_ids = torch.randperm(vocab_size, generator=generator)[:numeric_size]
    values = torch.randperm(3 * numeric_size, generator=generator)[:numeric_size].double()
    vocab = NumericVocab(token_ids.tolist(), values.tolist(), vocab_size)
    hidden = torch.randn(*shape, hidden_size, generator=generator, dtype=torch.float64).to(dtype)
    head = (torch.randn(vocab_size, hidden_size, generator=generator, dtype=torch.float64) * 0.7).to(dtype)
    bias = (torch.randn(vocab_size, generator=generator, dtype=torch.float64)).to(dtype) if with_bias else None
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    numeric = torch.rand(shape, generator=generator) < numeric_share
    targets[numeric] = token_ids[torch.randint(0, numeric_size, (int(numeric.sum()), ), generator=generator)]
    targets[torch.rand(shape, generator=generator) < ignore_share] = -100
    return vocab, hidden, head, bias, targets


def fused_and_materialized(vocab, hidden, head, bias, targets, weight=1.0, num_items=None, chunk_size=None,
                           device="cpu", **options):
    """(output, grads on the CPU) of the fused op on ``device`` and of numeric_cross_entropy on
    hidden @ head.T + bias on the CPU."""
    smmd = SMMDLoss(vocab, **options)
    results = []
    for fused in (True, False):
        where = device if fused else "cpu"
        leaves = [tensor.to(where, copy=True).requires_grad_(True) for tensor in (hidden, head, bias)
                  if tensor is not None]
        h, w, b = (leaves + [None])[:3]
        if fused:
            out = linear_numeric_cross_entropy(h, w, targets.to(where), smmd, weight, bias=b,
                                               num_items_in_batch=num_items, chunk_size=chunk_size)
        else:
            logits = h @ w.T if b is None else h @ w.T + b
            out = numeric_cross_entropy(logits, targets, smmd, weight, num_items_in_batch=num_items)
        out.total.backward()
        results.append((out, [leaf.grad.cpu() for leaf in leaves]))
    return results


def relative(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("case", ["bias", "no_bias", "no_numeric_target", "all_ignored", "num_items"])
def test_fused_equals_materialized_float64(generator, case, device):
    for trial in range(4):
        vocab, hidden, head, bias, targets = problem(generator, with_bias=case != "no_bias",
                                                     numeric_share=0.0 if case == "no_numeric_target" else 0.4)
        if case == "all_ignored":
            targets.fill_(-100)
        num_items = int((targets != -100).sum()) + 5 if case == "num_items" else None
        vocab_rows = head.shape[0]
        chunk = [None, 1, 7, vocab_rows, vocab_rows // 3 + 1][trial % 5]  # divides the head's rows or not
        (fused, fused_grads), (reference, reference_grads) = fused_and_materialized(
            vocab, hidden, head, bias, targets, weight=0.7, num_items=num_items, chunk_size=chunk, device=device)
        # float64 both ways: the head's chunks only reorder the additions, a few ulp relative (the floors 1e-12 and
        # abs=1e-14 for values that are exactly 0 both ways: no target, no numeric target).
        for name in ("total", "ce", "numeric"):
            assert abs(getattr(fused, name).item() - getattr(reference, name).item()) <= \
                1e-10 * max(abs(getattr(reference, name).item()), 1e-12), (case, trial, name)
        for fused_grad, reference_grad in zip(fused_grads, reference_grads):
            assert relative(fused_grad, reference_grad) <= 1e-10, (case, trial)
        for key in ("mmd", "smooth", "numeric_mae"):
            assert fused.stats[key] == pytest.approx(reference.stats[key], rel=1e-10, abs=1e-14)
        for key in ("numeric_tokens", "numeric_accuracy", "tokens", "comm_calls", "comm_bytes"):
            assert fused.stats[key] == reference.stats[key]
        assert fused.stats["backward_comm_calls"] == 0 and fused.stats["backward_comm_bytes"] == 0


def test_options_and_three_dimensional_hidden(generator):
    vocab, hidden, head, bias, targets = problem(generator, shape=(3, 11))
    (fused, grads), (reference, reference_grads) = fused_and_materialized(
        vocab, hidden, head, bias, targets, mode="mmd", kernel="laplace", sigmas=(1.0, 3.0), chunk_size=5)
    # float64 both ways: the head's chunks of 5 only reorder the additions, a few ulp relative.
    assert fused.total.item() == pytest.approx(reference.total.item(), rel=1e-10)
    assert all(relative(a, b) <= 1e-10 for a, b in zip(grads, reference_grads))


def test_bf16_inputs_are_within_bf16_tolerance_of_an_fp32_reference(generator):
    vocab, hidden, head, bias, targets = problem(generator, dtype=torch.float32, vocab_size=300)
    smmd = SMMDLoss(vocab)
    half = [tensor.to(torch.bfloat16).requires_grad_(True) for tensor in (hidden, head, bias)]
    out = linear_numeric_cross_entropy(*half[:2], targets, smmd, bias=half[2], chunk_size=64)
    out.total.backward()
    full = [tensor.to(torch.bfloat16).float().requires_grad_(True) for tensor in (hidden, head, bias)]
    reference = numeric_cross_entropy(full[0] @ full[1].T + full[2], targets, smmd)
    reference.total.backward()
    assert out.total.dtype == torch.float32
    # The head's products come out in bf16 (each logit rounded by up to 2^-9 relative) where the reference's stay
    # fp32: the loss moves by ~1e-3 relative (measured <= 1.1e-3); the gradients, bf16 products of such rounded
    # terms (2^-8 relative each), by up to 2.9e-2 (measured over 560 draws).
    assert out.total.item() == pytest.approx(reference.total.item(), rel=2e-2)
    for ours, theirs in zip(half, full):
        assert ours.grad.dtype == torch.bfloat16
        assert relative(ours.grad.float(), theirs.grad) <= 5e-2


class LargestTensor(TorchDispatchMode):
    """Records the largest tensor any operation produces while active."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for value in result if isinstance(result, (tuple, list)) else (result, ):
            if isinstance(value, torch.Tensor):
                self.largest = max(self.largest, value.numel())
        return result


def test_never_a_tokens_by_vocabulary_tensor(generator):
    tokens, hidden_size, vocab_size, chunk = 64, 16, 3000, 250
    vocab = NumericVocab(list(range(100, 200)), list(range(100)), vocab_size)
    hidden = torch.randn(tokens, hidden_size, generator=generator, requires_grad=True)
    head = torch.randn(vocab_size, hidden_size, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab_size, (tokens, ), generator=generator)
    targets[::2] = torch.randint(100, 200, (tokens // 2, ), generator=generator)
    with LargestTensor() as watch:
        out = linear_numeric_cross_entropy(hidden, head, targets, SMMDLoss(vocab), chunk_size=chunk)
        out.total.backward()
    # the head's gradient [V, H] is an output; no [tokens, V] logits, softmax or gradient exists
    assert watch.largest == vocab_size * hidden_size
    assert tokens * chunk < vocab_size * hidden_size < tokens * vocab_size


def test_default_chunk_size_follows_the_memory_budget():
    from smmd_scale.block_plan import MIN_BLOCK_ELEMENTS
    from smmd_scale.fused_linear import default_chunk_size

    assert default_chunk_size(4096, 1024, 32000) == 1024  # a block as large as hidden (DeepSpeed's rule)
    assert default_chunk_size(8, 64, 2048) == 2048  # small inputs: the whole head in one block
    assert default_chunk_size(MIN_BLOCK_ELEMENTS, 1, 10) == 1
    assert default_chunk_size(100, 4, 10**9) == MIN_BLOCK_ELEMENTS // 100


def _bad(generator):
    vocab, hidden, head, bias, targets = problem(generator, dtype=torch.float32, vocab_size=50, shape=(2, 5))
    return SMMDLoss(vocab), hidden, head, bias, targets


@pytest.mark.parametrize("change, error, match", [
    (lambda h, w, b, t: (h[..., :-1], w, b, t), ValueError, r"head_weight must be \[V_local, H\] with H = hidden's"),
    (lambda h, w, b, t: (h, w[:-3], b[:-3], t), ValueError, "head_weight has 47 rows but the numeric vocabulary was "
                                                          "built for vocab_size=50"),
    (lambda h, w, b, t: (h, w.double(), b, t), TypeError, "must share one floating dtype; got torch.float32, "
                                                        "torch.float64"),
    (lambda h, w, b, t: (h.long(), w, b, t), TypeError, "must share one floating dtype"),
    (lambda h, w, b, t: (h, w, b.to("meta"), t), ValueError, "must be on hidden's device cpu"),
    (lambda h, w, b, t: (h, w, b[:-1], t), ValueError, r"bias has 49 elements in 1 dims; expected \[50\]"),
    # Positions 0-2 are made ignored, so position 3 is the first bad one whatever the random draw (adding 50 to
    # every target turned an ignored -100 into -50, which the message names as the first bad one).
    (lambda h, w, b, t: (h, w, b, torch.where(torch.arange(t.numel()).view_as(t) < 3, -100, t + 150)), ValueError,
     r"targets\[3\] = \d+ is outside the vocabulary \[0, 50\)"),
    (lambda h, w, b, t: (h[:, :0], w, b, t[:, :0]), ValueError, "hidden holds 0 tokens"),
    (lambda h, w, b, t: (h, w, b, t[:, :3]), ValueError, "targets hold 6 positions"),
])
def test_bad_inputs_are_named(generator, change, error, match):
    smmd, *tensors = _bad(generator)
    hidden, head, bias, targets = change(*tensors)
    with pytest.raises(error, match=match):
        linear_numeric_cross_entropy(hidden, head, targets, smmd, bias=bias)


def test_bad_chunk_size(generator):
    smmd, hidden, head, bias, targets = _bad(generator)
    with pytest.raises(ValueError, match="chunk_size=0 must be a positive int"):
        linear_numeric_cross_entropy(hidden, head, targets, smmd, chunk_size=0)
    with pytest.raises(TypeError, match="chunk_size=2.5 must be an int"):
        linear_numeric_cross_entropy(hidden, head, targets, smmd, chunk_size=2.5)


# ------------------------------------------------------------------------------------------------
# Vocabulary-parallel: real gloo groups
# ------------------------------------------------------------------------------------------------


def _tp_equals_single_device(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    report = []
    for trial in range(6):
        vocab, hidden, head, bias, targets = problem(generator, with_bias=trial % 2 == 0,
                                                     vocab_size=int(torch.randint(8 * world_size, 300, (1, ),
                                                                                  generator=generator)))
        if trial == 4:  # no numeric target at all
            targets = torch.where(torch.isin(targets, vocab.token_ids), torch.full_like(targets, -100), targets)
        vocab_size = head.shape[0]
        cuts = sorted(torch.randperm(vocab_size - 1, generator=generator)[:world_size - 1].add(1).tolist())
        bounds = [0] + cuts + [vocab_size]
        start, end = bounds[rank], bounds[rank + 1]
        num_items = None if trial % 3 else int((targets != -100).sum()) + 2
        smmd = SMMDLoss(vocab)

        leaves = [tensor.clone().requires_grad_(True) for tensor in (hidden, head, bias) if tensor is not None]
        single = linear_numeric_cross_entropy(leaves[0], leaves[1], targets, smmd, 0.8,
                                           bias=leaves[2] if bias is not None else None, num_items_in_batch=num_items)
        single.total.backward()
        for repeat in range(2):  # the second call runs at the capacity the first one grew
            h = hidden.clone().requires_grad_(True)
            w = head[start:end].clone().requires_grad_(True)
            b = None if bias is None else bias[start:end].clone().requires_grad_(True)
            with CollectiveSpy() as forward:
                out = linear_numeric_cross_entropy(h, w, targets, smmd, 0.8, bias=b, tp_group=dist.group.WORLD,
                                                vocab_start_index=start, num_items_in_batch=num_items,
                                                chunk_size=int(torch.randint(1, 60, (1, ), generator=generator)))
            with CollectiveSpy() as backward:
                out.total.backward()
            # float64 on every rank: the shards, their merge and the chunks reorder the additions, a few ulp relative.
            for name in ("total", "ce", "numeric"):
                assert abs(getattr(out, name).item() - getattr(single, name).item()) <= \
                    1e-10 * max(abs(getattr(single, name).item()), 1e-12), (trial, name)
            assert relative(h.grad, leaves[0].grad) <= 1e-10
            assert relative(w.grad, leaves[1].grad[start:end]) <= 1e-10
            if b is not None:
                assert relative(b.grad, leaves[2].grad[start:end]) <= 1e-10
            assert forward.calls == out.stats["comm_calls"] and forward.bytes == out.stats["comm_bytes"]
            assert backward.calls == 1 == out.stats["backward_comm_calls"]
            assert backward.bytes == out.stats["backward_comm_bytes"] == h.numel() * 8
            report.append((trial, repeat, forward.calls, backward.calls))
    return report


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_fused_equals_single_device(world_size):
    reports = values_or_raise(run_ranks(_tp_equals_single_device, world_size, int(torch.randint(0, 2**31, (1, )))))
    assert all(report == reports[0] for report in reports)
    # After a group's first call one all-reduce per forward (the capacity may grow once more), one in backward.
    assert all(forward in (1, 2) and backward == 1 for _, _, forward, backward in reports[0])
    assert all(forward == 1 for trial, repeat, forward, _ in reports[0] if repeat == 1)


def _bad_on_one_rank(rank, world_size):
    vocab_size, hidden_size, tokens = 20 * world_size, 8, 6
    vocab = NumericVocab([1, 5, vocab_size - 2], [1.0, 5.0, 9.0], vocab_size)
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=generator)
    head = torch.randn(vocab_size, hidden_size, generator=generator)
    targets = torch.tensor([1, 5, 7, vocab_size - 2, -100, 3])
    shard = head[rank * 20:(rank + 1) * 20]
    outcomes = []
    for bad in ("width", "dtype", "chunk"):
        h, w, chunk = hidden, shard, None
        if rank == world_size - 1:
            if bad == "width":
                w = shard[:, :-1]
            elif bad == "dtype":
                w = shard.double()
            else:
                chunk = -1
        try:
            linear_numeric_cross_entropy(h, w, targets, SMMDLoss(vocab), tp_group=dist.group.WORLD,
                                      vocab_start_index=rank * 20, chunk_size=chunk)
            outcomes.append("no error")
        except (ValueError, TypeError) as error:
            outcomes.append(f"{type(error).__name__}: {error}")
    healthy = linear_numeric_cross_entropy(hidden, shard, targets, SMMDLoss(vocab), tp_group=dist.group.WORLD,
                                        vocab_start_index=rank * 20)
    assert torch.isfinite(healthy.total)
    return outcomes


@pytest.mark.gloo
def test_bad_input_on_one_rank_raises_on_every_rank():
    outcomes = values_or_raise(run_ranks(_bad_on_one_rank, 2, timeout=120, pg_timeout=30))
    assert outcomes[0] == outcomes[1]
    width, dtype, chunk = outcomes[0]
    assert "rank 1 of the group: head_weight must be [V_local, H]" in width
    assert dtype.startswith("TypeError: tensor-parallel rank 1 of the group: hidden, head_weight and bias must share")
    assert "rank 1 of the group: chunk_size=-1 must be a positive int" in chunk


def test_a_second_backward_with_retain_graph_adds_the_same_gradients(generator):
    """The fused backward recomputes every block from its saved inputs and changes nothing it saved,
    so retain_graph=True works as for any torch op: the second backward adds the same gradients."""
    vocab, hidden, head, bias, targets = problem(generator)
    leaves = [tensor.clone().requires_grad_(True) for tensor in (hidden, head, bias)]
    out = linear_numeric_cross_entropy(leaves[0], leaves[1], targets, SMMDLoss(vocab), bias=leaves[2], chunk_size=9,
                                       z_loss=1e-3, logit_softcap=5.0)
    out.total.backward(retain_graph=True)
    once = [leaf.grad.clone() for leaf in leaves]
    out.total.backward()
    for leaf, grad in zip(leaves, once):
        assert torch.equal(leaf.grad, 2 * grad)


@pytest.mark.parametrize("fused", [False, True], ids=["materialized", "fused"])
def test_ignore_index_equal_to_a_numeric_token_contributes_nothing(generator, fused):
    """With ignore_index a numeric token's id, its positions enter neither CE nor the numeric loss:
    the same result as marking them -100."""
    vocab, hidden, head, bias, targets = problem(generator, numeric_share=0.6, ignore_share=0.0)
    ignored_id = int(vocab.token_ids[0])
    targets.view(-1)[::3] = ignored_id
    results = []
    for ignore_index, marked in ((ignored_id, targets), (-100, torch.where(targets == ignored_id, -100, targets))):
        smmd = SMMDLoss(vocab, ignore_index=ignore_index)
        h = hidden.clone().requires_grad_(True)
        if fused:
            out = linear_numeric_cross_entropy(h, head, marked, smmd, bias=bias)
        else:
            out = numeric_cross_entropy(h @ head.T + bias, marked, smmd)
        out.total.backward()
        results.append((out, h.grad))
        assert not smmd.numeric_mask(marked)[marked == ignored_id].any()  # Megatron's count of numeric positions
    (ignoring, grad_ignoring), (marking, grad_marking) = results
    assert ignoring.stats["numeric_tokens"] == marking.stats["numeric_tokens"]
    assert ignoring.stats["tokens"] == marking.stats["tokens"]
    # float64 both ways, the same positions dropped: at most a few ulp apart (abs=1e-14: a numeric term of 0).
    for name in ("total", "ce", "numeric"):
        assert getattr(ignoring, name).item() == pytest.approx(getattr(marking, name).item(), rel=1e-12, abs=1e-14)
    assert relative(grad_ignoring, grad_marking) <= 1e-12


def test_mixed_dtypes_under_autocast_compute_as_autocast_would(generator):
    """bf16 hidden with an fp32 head weight and bias under torch.autocast (what HF Trainer's bf16 AMP
    hands the head): the product in bf16, as autocast runs the head's linear; each gradient in its
    input's dtype, equal to the same op on the autocast-cast inputs (bf16 weight and bias)."""
    vocab, hidden, head, bias, targets = problem(generator, dtype=torch.float32, vocab_size=200)
    smmd = SMMDLoss(vocab)
    mixed = [hidden.bfloat16().requires_grad_(True), head.clone().requires_grad_(True),
             bias.clone().requires_grad_(True)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = linear_numeric_cross_entropy(mixed[0], mixed[1], targets, smmd, bias=mixed[2], chunk_size=33)
    out.total.backward()
    cast = [hidden.bfloat16().requires_grad_(True), head.bfloat16().requires_grad_(True),
            bias.bfloat16().requires_grad_(True)]
    expected = linear_numeric_cross_entropy(cast[0], cast[1], targets, smmd, bias=cast[2], chunk_size=33)
    expected.total.backward()
    assert out.total.item() == expected.total.item()
    assert [leaf.grad.dtype for leaf in mixed] == [torch.bfloat16, torch.float32, torch.float32]
    assert torch.equal(mixed[0].grad, cast[0].grad)
    # the weight's gradient is the bf16 product cast to fp32; the bias's is summed in fp32
    assert torch.equal(mixed[1].grad, cast[1].grad.float())
    # the cast run's bias gradient is bf16, ours summed in fp32: bf16 rounding (2^-9 each), measured <= 3.4e-3
    assert relative(mixed[2].grad, cast[2].grad.float()) <= 1e-2
    # the materialized op on autocast's own logits agrees to bf16 accuracy
    reference = [hidden.bfloat16().requires_grad_(True), head.clone().requires_grad_(True),
                 bias.clone().requires_grad_(True)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(*reference)
    materialized = numeric_cross_entropy(logits, targets, smmd)
    materialized.total.backward()
    # both read autocast's bf16 logits and compute the loss in fp32: fp32 rounding, measured <= 1.2e-7
    assert out.total.item() == pytest.approx(materialized.total.item(), rel=1e-6)
    # both backwards run bf16 products, rounding in different places: bf16 accuracy (2^-8), measured <= 7e-3
    for ours, theirs in zip(mixed, reference):
        assert ours.grad.dtype == theirs.grad.dtype and relative(ours.grad.float(), theirs.grad.float()) <= 2e-2


def test_mixed_dtypes_without_autocast_are_refused(generator):
    vocab, hidden, head, bias, targets = problem(generator, dtype=torch.float32, vocab_size=60)
    with pytest.raises(TypeError, match="must share one floating dtype; got torch.bfloat16, torch.float32 and "
                                        "torch.float32 .mixed floating dtypes are accepted under torch.autocast"):
        linear_numeric_cross_entropy(hidden.bfloat16(), head, targets, SMMDLoss(vocab), bias=bias)
