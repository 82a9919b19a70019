"""Number-level NTL (``ntl-number``): against a float64 reference and the installed ntloss package's
``NumberLevelLoss`` (0.3.2) on a digit tokenizer, on full logits, standalone and in the CE op, through
the fused linear head, vocab-parallel on real gloo groups of 2 and 4 ranks (one collective forward),
and planned from train.py's command line."""

import ntloss
import pytest
import torch
import torch.distributed as dist
from helpers import style_tokenizers
from helpers.distributed import CollectiveSpy, run_ranks, values_or_raise
from helpers.reference import reference_number_level, relative_error

from smmd_scale import (
    NTLoss,
    NumberLevelNTLoss,
    NumericVocab,
    SMMDLoss,
    linear_numeric_cross_entropy,
    numeric_cross_entropy,
)
from smmd_scale.loss import per_token_losses
from smmd_scale.number_level import digit_spans

DIGITS = [str(d) for d in range(10)]


def digit_problem(generator, vocab_size=60, shape=(3, 30), dot=None, digit_share=0.6, dtype=torch.float64):
    """(vocab of the ten digits at random ids, logits, targets): runs of digits, a few dots, ignored ids."""
    token_ids = torch.randperm(vocab_size, generator=generator)[:11]
    vocab = NumericVocab(token_ids[:10].tolist(), list(range(10)), vocab_size)
    dot = int(token_ids[10]) if dot is None else dot
    logits = (torch.randn(*shape, vocab_size, generator=generator, dtype=torch.float64) * 3).to(dtype)
    targets = torch.randint(0, vocab_size, shape, generator=generator)
    pick = torch.rand(shape, generator=generator) < digit_share
    targets[pick] = vocab.token_ids[torch.randint(0, 10, (int(pick.sum()), ), generator=generator)]
    targets[torch.rand(shape, generator=generator) < 0.1] = dot
    targets[torch.rand(shape, generator=generator) < 0.08] = -100
    return vocab, dot, logits, targets


OPTIONS = [dict(reweigh=True, float_level=False), dict(reweigh=False, float_level=False),
           dict(reweigh=True, float_level=True), dict(reweigh=False, float_level=True)]


def option_id(options):
    return "-".join(f"{key}={value}" for key, value in options.items())


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_matches_the_float64_reference(generator, options):
    vocab, dot, logits, targets = digit_problem(generator)
    loss = NumberLevelNTLoss(vocab, dot_token_ids=[dot], **options)
    dots = (dot, ) if options["float_level"] else ()
    weights = torch.rand(targets.shape, generator=generator, dtype=torch.float64)
    for reduction in ("mean", "sum", "none"):
        for loss_weights in (None, weights):
            ours = logits.clone().requires_grad_(True)
            value = loss(ours, targets, reduction=reduction, loss_weights=loss_weights)
            reference_logits = logits.clone().requires_grad_(True)
            per_position = reference_number_level(reference_logits, targets, vocab.token_ids, vocab.values,
                                                  reweigh=options["reweigh"], dot_ids=dots)
            carries = (per_position != 0).double()  # numbers' first digits (a loss is never exactly 0 here)
            w = carries if loss_weights is None else carries * loss_weights
            expected = {"none": per_position * (1 if loss_weights is None else loss_weights),
                        "sum": (per_position * w).sum(), "mean": (per_position * w).sum() / w.sum()}[reduction]
            assert value.shape == expected.shape
            # a downstream weighting that differs within a number: the gradient still follows the number
            probe = torch.rand(targets.shape, generator=generator, dtype=torch.float64)
            (value * probe if reduction == "none" else value).sum().backward()
            (expected * probe if reduction == "none" else expected).sum().backward()
            # float64 both ways, the same math in another order: a few ulp relative.
            assert relative_error(value.detach(), expected.detach()) <= 1e-10
            assert relative_error(ours.grad, reference_logits.grad) <= 1e-10
    # in the CE op: the per-token numeric loss is the reference's, with its gradient
    ours = logits.clone().requires_grad_(True)
    out = numeric_cross_entropy(ours, targets, loss, weight=0.7)
    out.total.backward()
    reference_logits = logits.clone().requires_grad_(True)
    per_position = reference_number_level(reference_logits, targets, vocab.token_ids, vocab.values,
                                          reweigh=options["reweigh"], dot_ids=dots)
    digits = loss.numeric_mask(targets).sum()
    ce = torch.nn.functional.cross_entropy(reference_logits.reshape(-1, vocab.vocab_size), targets.reshape(-1))
    (ce + 0.7 * per_position.sum() / digits).backward()
    # float64 both ways, the same math in another order: a few ulp relative.
    assert relative_error(out.numeric.detach(), per_position.sum().detach() / digits) <= 1e-10
    assert relative_error(ours.grad, reference_logits.grad) <= 1e-10
    assert out.stats["ntl_number"] == pytest.approx((per_position.sum() / digits).item(), rel=1e-10)


def test_digit_spans_on_fixed_sequences():
    # A 1 2 3 B 4 5 | 7 . 2 . . 9 : the digit ids are 0..9, "." is 10, letters 11+
    targets = torch.tensor([[11, 1, 2, 3, 12, 4, 5], [7, 10, 2, 10, 10, 9, 13]])
    positions = (targets < 10).reshape(-1).nonzero().squeeze(1)
    spans = digit_spans(targets, positions)
    assert spans.number.tolist() == [0, 0, 0, 1, 1, 2, 3, 4]
    assert spans.exponent.tolist() == [2, 1, 0, 1, 0, 0, 0, 0]
    assert spans.first.tolist() == [0, 3, 5, 6, 7]
    floats = digit_spans(targets, positions, dot_ids=torch.tensor([10]))
    assert floats.number.tolist() == [0, 0, 0, 1, 1, 2, 2, 3] and floats.exponent.tolist() == [2, 1, 0, 1, 0, 1, 0, 0]
    # Megatron's [s, b] layout: the sequence runs down dim 0
    spans_sb = digit_spans(targets.T.contiguous(), (targets.T < 10).reshape(-1).nonzero().squeeze(1), sequence_dim=0)
    assert sorted(spans_sb.exponent.tolist()) == sorted(spans.exponent.tolist())
    assert digit_spans(targets, positions, max_number_length=2).exponent.tolist() == [1, 1, 0, 1, 0, 0, 0, 0]


def test_bad_options_are_named():
    digits = NumericVocab(list(range(10)), list(range(10)), 20)
    with pytest.raises(ValueError, match=r"needs a vocabulary of the ten digits 0..9; this one has the digits "
                                         r"\[0, 1, 2, 3, 4, 5, 6, 7, 8, 9\] and the values \[10.0, 11.0\]"):
        NumberLevelNTLoss(NumericVocab(list(range(12)), list(range(12)), 20))
    with pytest.raises(ValueError, match="float_level=True joins numbers across a dot: pass dot_token_ids"):
        NumberLevelNTLoss(digits, float_level=True)
    with pytest.raises(ValueError, match=r"dot_token_ids \[3\] include numeric tokens"):
        NumberLevelNTLoss(digits, float_level=True, dot_token_ids=[3])
    with pytest.raises(ValueError, match="max_number_length=0 must be a positive int"):
        NumberLevelNTLoss(digits, max_number_length=0)
    with pytest.raises(ValueError, match="sequence_dim=2 is not a dim of targets of shape"):
        NumberLevelNTLoss(digits, sequence_dim=2)(torch.zeros(2, 3, 20), torch.zeros(2, 3, dtype=torch.long))


# ------------------------------------------------------------------------------------------------
# The installed ntloss package's NumberLevelLoss as the reference
# ------------------------------------------------------------------------------------------------


def ntloss_and_ours(tokenizer, reweigh, float_level):
    theirs = ntloss.NumberLevelLoss(tokenizer, reweigh=reweigh, float_level=float_level)
    vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits", vocab_size=theirs.vocab_size)
    assert vocab.token_id_list == theirs.number_token_ids.tolist()  # a digit tokenizer: the same ten tokens
    return theirs, NumberLevelNTLoss(vocab, reweigh=reweigh, float_level=float_level,
                                     dot_token_ids=[tokenizer.convert_tokens_to_ids(".")])


def labelled_digits(generator, theirs, ours, shape=(3, 24)):
    width = theirs.vocab_size
    logits = torch.randn(*shape, width, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, width, shape, generator=generator)
    pick = torch.rand(shape, generator=generator) < 0.6
    labels[pick] = ours.vocab.token_ids[torch.randint(0, 10, (int(pick.sum()), ), generator=generator)]
    labels[torch.rand(shape, generator=generator) < 0.1] = theirs.dot
    labels[:, ::7] = -100
    return logits, labels


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_parity_with_the_ntloss_package(generator, options, dtype):
    """Standalone (every reduction, with loss weights) and per token in the CE op: within 1e-6 of ntloss
    in fp32 (held against ntloss's fp64 result: its own fp32 rounding reaches 1e-6) and 1e-10 in fp64."""
    theirs, ours = ntloss_and_ours(style_tokenizers.qwen_style(), **options)
    logits, labels = labelled_digits(generator, theirs, ours)
    weights = torch.rand(labels.shape, generator=generator, dtype=torch.float64)
    # fp64: ntloss computes in the logits' dtype too, so only the order of operations differs (a few ulp).
    tolerance = 1e-6 if dtype == torch.float32 else 1e-10
    for reduction in ("mean", "sum", "none"):
        for loss_weights in (None, weights):
            their_logits = logits.clone().requires_grad_(True)
            our_logits = logits.to(dtype, copy=True).requires_grad_(True)
            their_loss = theirs(their_logits, labels, reduction=reduction, loss_weights=loss_weights)
            our_loss = ours(our_logits, labels, reduction=reduction,
                            loss_weights=None if loss_weights is None else loss_weights.to(dtype))
            their_loss.sum().backward()
            our_loss.sum().backward()
            assert our_loss.dtype == dtype and our_loss.shape == their_loss.shape
            assert relative_error(our_loss.detach(), their_loss.detach()) <= tolerance
            assert ((our_logits.grad.double() - their_logits.grad).norm() / their_logits.grad.norm()).item() \
                <= tolerance
    per_token = per_token_losses(logits.to(dtype), labels, ours).numeric.view(labels.shape)
    assert relative_error(per_token, theirs(logits, labels, reduction="none")) <= tolerance


def test_fused_linear_head_equals_ntloss_per_token(generator):
    theirs, ours = ntloss_and_ours(style_tokenizers.qwen_style(), reweigh=True, float_level=True)
    width = theirs.vocab_size
    _, labels = labelled_digits(generator, theirs, ours, shape=(2, 20))
    hidden = torch.randn(2, 20, 16, generator=generator, dtype=torch.float64)
    head = torch.randn(width, 16, generator=generator, dtype=torch.float64) * 0.5
    for numeric in (ours, SMMDLoss(ours.vocab) + 0.3 * ours):
        fused = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        losses = linear_numeric_cross_entropy(*fused, labels, numeric, 0.9, chunk_size=53)
        losses.total.backward()
        materialized = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        reference = numeric_cross_entropy(materialized[0] @ materialized[1].T, labels, numeric, 0.9)
        reference.total.backward()
        # float64 both ways: the head's chunks of 53 rows only reorder the additions, a few ulp relative.
        assert losses.total.item() == pytest.approx(reference.total.item(), rel=1e-10)
        for mine, expected in zip(fused, materialized):
            assert relative_error(mine.grad, expected.grad) <= 1e-10
    logits = hidden @ head.T
    from smmd_scale.fused_linear import linear_per_token_losses

    per_token = linear_per_token_losses(hidden, head, labels, ours).numeric.view(labels.shape)
    # float64 both ways (ntloss computes in the logits' dtype): only the order of operations differs.
    assert relative_error(per_token, theirs(logits, labels, reduction="none")) <= 1e-10


# ------------------------------------------------------------------------------------------------
# Vocabulary parallelism: one collective forward, none in backward
# ------------------------------------------------------------------------------------------------


def _vocab_parallel_number_level(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    theirs, ours = ntloss_and_ours(style_tokenizers.qwen_style(), reweigh=True, float_level=True)
    width = theirs.vocab_size
    cuts = sorted(torch.randperm(width - 1, generator=generator)[:world_size - 1].add(1).tolist())  # uneven shards
    bounds = [0, *cuts, width]
    start, end = bounds[rank], bounds[rank + 1]
    report = []
    # A call whose P numeric positions exceed the exchange's capacity runs a second collective and grows the
    # capacity to ceil(1.125 P) rounded up to 8 rows; a later call with more positions than that grows it again.
    # Two independent draws of labelled_digits have P = 33 +- 4 (of 60 labelled cells), and in about 1 pair in
    # 12 the second exceeds what the first grew (seed 0: P = 27, capacity 32, then P = 34), so the batch with
    # more digit positions goes first.
    batches = sorted((labelled_digits(generator, theirs, ours) for _ in range(2)),
                     key=lambda batch: -int(torch.isin(batch[1], ours.vocab.token_ids).sum()))
    for logits, labels in batches:
        expected = theirs(logits, labels, reduction="none")
        for loss in (ours, NumberLevelNTLoss(ours.vocab, reweigh=False), ours + 0.5 * NTLoss(ours.vocab)):
            full = logits.clone().requires_grad_(True)
            single = numeric_cross_entropy(full, labels, loss, weight=0.6)
            single.total.backward()
            shard = logits[..., start:end].clone().requires_grad_(True)
            with CollectiveSpy() as forward:
                out = numeric_cross_entropy(shard, labels, loss, weight=0.6, tp_group=dist.group.WORLD,
                                            vocab_start_index=start)
            with CollectiveSpy() as backward:
                out.total.backward()
            # float64 both ways: the shards' sums merge in another order, a few ulp relative; so below.
            assert abs(out.total.item() - single.total.item()) <= 1e-10 * max(abs(single.total.item()), 1.0)
            assert relative_error(shard.grad, full.grad[..., start:end]) <= 1e-10
            assert backward.calls == 0 and forward.calls == out.stats["comm_calls"] <= 2
            report.append(forward.calls)
        per_token = per_token_losses(logits[..., start:end], labels, ours, tp_group=dist.group.WORLD,
                                     vocab_start_index=start).numeric.view(labels.shape)
        assert relative_error(per_token, expected) <= 1e-10
        # standalone, vocab-parallel: ntloss's mean, one collective
        shard = logits[..., start:end].clone().requires_grad_(True)
        full = logits.clone().requires_grad_(True)
        with CollectiveSpy() as forward:
            alone = ours(shard, labels, tp_group=dist.group.WORLD, vocab_start_index=start)
        alone.backward()
        their_mean = theirs(full, labels)
        their_mean.backward()
        assert forward.calls == 1 and abs(alone.item() - their_mean.item()) <= 1e-10 * their_mean.item()
        assert relative_error(shard.grad, full.grad[..., start:end]) <= 1e-10
    # after the first call grew the capacity, every call is the one collective
    assert report[-3:] == [1, 1, 1], report
    return report


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_number_level_equals_ntloss_with_one_collective(world_size):
    reports = values_or_raise(run_ranks(_vocab_parallel_number_level, world_size, int(torch.randint(0, 2**31, (1, )))))
    assert all(report == reports[0] for report in reports)


# ------------------------------------------------------------------------------------------------
# train.py
# ------------------------------------------------------------------------------------------------


def test_train_plans_ntl_number_from_the_command_line(tmp_path, tokenizer_dir):
    from helpers.corpora import write_corpus
    from helpers.launching import REPO, train_flags

    from smmd_train.config.arguments import parse_args
    from smmd_train.config.run_config import RunConfig
    from smmd_train.distributed.groups import Launch
    from smmd_train.run import prepare_run

    corpus = write_corpus(tmp_path / "train.jsonl", 50)

    def plan(**options):
        flags = train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny", tokenizer=tokenizer_dir,
                            data=[corpus], seq_len=48, micro_batch_size=2, max_steps=2, output_dir=tmp_path / "run",
                            **options)
        return prepare_run(RunConfig.from_args(parse_args(flags)), Launch(0, 1, 0, 1, "single"), until="plan").plan

    planned = plan(numeric_loss=["smmd:1", "ntl-number:0.3"], numeric_policy="digits", ntl_reweigh=False)
    (_, smmd_weight), (number_level, weight) = planned.numeric_loss.weighted_terms()
    assert isinstance(number_level, NumberLevelNTLoss) and weight == 0.3 and number_level.reweigh is False
    assert number_level.vocab is planned.numeric_vocab and len(planned.numeric_vocab) == 10
    with pytest.raises(ValueError, match="number-level NTL joins digits into numbers, so it needs a vocabulary of "
                                         "the ten digits"):
        plan(numeric_loss=["ntl-number"])  # the default policy reads 0..999 from this Llama-3-style tokenizer


def test_megatron_layout_reads_the_sequence_down_dim_0(generator):
    """Megatron's ``[s, b]`` targets with ``sequence_dim=0``: the per-token loss of its entry point is
    ntloss's on the ``[b, s]`` transpose."""
    from smmd_scale import vocab_parallel_numeric_cross_entropy

    theirs, ours = ntloss_and_ours(style_tokenizers.qwen_style(), reweigh=True, float_level=True)
    logits, labels = labelled_digits(generator, theirs, ours, shape=(3, 24))
    megatron = NumberLevelNTLoss(ours.vocab, float_level=True, dot_token_ids=ours.dot_token_ids, sequence_dim=0)
    _, per_token = vocab_parallel_numeric_cross_entropy(logits.transpose(0, 1).contiguous(), labels.T.contiguous(),
                                                        megatron)
    # float64 both ways (ntloss computes in the logits' dtype): only the order of operations differs.
    assert relative_error(per_token.T, theirs(logits, labels, reduction="none")) <= 1e-10
