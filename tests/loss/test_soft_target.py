"""DIST2 and Gaussian label smoothing on number tokens (the soft-target losses, smmd_scale/soft_target.py)
and DEL, together: against float64 references written from the papers' math (plain loops, independent
of ours) on full logits, alone, through the fused linear head and summed with SMMD/NTL; the hand-written
soft-target gradient against autograd's; the registry's options and the refused ones; vocabulary-parallel
on real gloo groups of 2 and 4 ranks with uneven shards and the one collective; through the Hugging Face
hook (logits and fused head), Megatron's entry point on 2 ranks and train.py's command line. DEL's place
weights and sequence-first targets alone: tests/loss/test_del.py."""

import math

import pytest
import torch
import torch.distributed as dist
from helpers.digit_problems import IGNORE, digit_problem
from helpers.distributed import CollectiveSpy, run_ranks, values_or_raise
from helpers.reference import relative_error

import smmd_scale
from smmd_scale import (
    DigitEntropyLoss,
    DIST2Loss,
    GaussianLabelSmoothingLoss,
    NTLoss,
    NumericLoss,
    NumericVocab,
    SMMDLoss,
    linear_numeric_cross_entropy,
    numeric_cross_entropy,
)
from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss

# ------------------------------------------------------------------------------------------------
# References from the math: one position at a time
# ------------------------------------------------------------------------------------------------


def numeric_positions(targets, token_ids):
    """``[(row, column)]`` of the numeric targets of ``targets [B, T]`` in reading order."""
    ids = set(token_ids.tolist())
    return [(row, column) for row in range(targets.shape[0]) for column in range(targets.shape[1])
            if int(targets[row, column]) in ids]


def run_places(targets, member_ids):
    """``{(row, column): (place from the run's start, run length)}`` for targets in ``member_ids``."""
    places = {}
    for row in range(targets.shape[0]):
        column = 0
        while column < targets.shape[1]:
            if int(targets[row, column]) not in member_ids:
                column += 1
                continue
            end = column
            while end < targets.shape[1] and int(targets[row, end]) in member_ids:
                end += 1
            for place in range(end - column):
                places[(row, column + place)] = (place, end - column)
            column = end
    return places


def reference_soft_target(logits, targets, token_ids, values, tau, full_vocabulary, kl, place_weighted=False):
    """Mean over numeric positions of KL(t || p) or CE(t, p), t_j ~ exp(-(v_j - v_y)^2 / tau)."""
    positions = numeric_positions(targets, token_ids)
    places = run_places(targets, set(token_ids.tolist()))
    index_of = {int(token): k for k, token in enumerate(token_ids)}
    total = logits.sum() * 0
    for row, column in positions:
        row_logits = logits[row, column]
        if full_vocabulary:
            log_p = torch.log_softmax(row_logits, dim=-1)[token_ids]
        else:
            log_p = torch.log_softmax(row_logits[token_ids], dim=-1)
        target_value = values[index_of[int(targets[row, column])]]
        weights = torch.exp(-(values - target_value) ** 2 / tau)
        soft = weights / weights.sum()
        value = -(soft * log_p).sum()
        if kl:
            value = value + (soft * torch.log(soft)).sum()
        if place_weighted:
            place, length = places[(row, column)]
            value = value * (length - place)
        total = total + value
    return total / max(len(positions), 1)


def del_place_weight(run_tokens, place, base):
    """The weight of the digit at ``place`` of a run of tokens ("d" digit, "." dot), read as the paper
    describes it: integer digits 2, 4, 6, ... from the units (the last digit before the first dot, or
    of the run when it has no dot after its start), decimals base^-2, base^-3, ... after the dot."""
    dot = run_tokens.index(".") if "." in run_tokens else None
    if dot is None or dot == 0:
        return 2.0 * (len(run_tokens) - place)
    if place < dot:
        return 2.0 * (dot - place)
    return base ** -(place - dot + 1)


def reference_del(logits, targets, token_ids, dot_ids, base=1.02, scale=0.01):
    positions = numeric_positions(targets, token_ids)
    places = run_places(targets, set(token_ids.tolist()) | set(dot_ids))
    total = logits.sum() * 0
    for row, column in positions:
        place, length = places[(row, column)]
        start = column - place
        run_tokens = ["." if int(targets[row, start + k]) in dot_ids else "d" for k in range(length)]
        digit_logits = logits[row, column][token_ids]
        probabilities = torch.softmax(digit_logits, dim=-1)
        target = (token_ids == targets[row, column]).double()
        entropy = -(target * torch.log(torch.sigmoid(digit_logits))
                    + (1 - target) * torch.log(1 - torch.sigmoid(digit_logits)))
        total = total + scale * del_place_weight(run_tokens, place, base) * (probabilities * entropy).mean()
    return total / max(len(positions), 1)


def losses_and_references(vocab, dot, generator):
    tau = 0.3 + 3 * torch.rand(1, generator=generator).item()
    sigma = 0.3 + 2 * torch.rand(1, generator=generator).item()
    base = 1.0 + torch.rand(1, generator=generator).item()
    token_ids, values = vocab.token_ids, vocab.values
    return [
        (DIST2Loss(vocab, tau=tau), lambda x, y: reference_soft_target(x, y, token_ids, values, tau, False, True)),
        (DIST2Loss(vocab, tau=tau, place_weighted=True),
         lambda x, y: reference_soft_target(x, y, token_ids, values, tau, False, True, place_weighted=True)),
        (GaussianLabelSmoothingLoss(vocab, sigma=sigma),
         lambda x, y: reference_soft_target(x, y, token_ids, values, 2 * sigma * sigma, True, False)),
        (DigitEntropyLoss(vocab, dot_token_ids=[dot], place_base=base, scale=0.05),
         lambda x, y: reference_del(x, y, token_ids, [dot], base, 0.05)),
    ]


# ------------------------------------------------------------------------------------------------
# One process
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("duplicate", [False, True], ids=["ten-digits", "spelled-twice"])
def test_each_loss_matches_its_float64_reference(generator, duplicate):
    for _ in range(2):
        vocab, dot, logits, targets = digit_problem(generator, duplicate=duplicate)
        for loss, reference in losses_and_references(vocab, dot, generator):
            ours = logits.clone().requires_grad_(True)
            out = numeric_cross_entropy(ours, targets, loss, weight=0.7)
            out.total.backward()
            expected_logits = logits.clone().requires_grad_(True)
            expected = reference(expected_logits, targets)
            expected_ce = torch.nn.functional.cross_entropy(expected_logits.reshape(-1, vocab.vocab_size),
                                                            targets.reshape(-1))
            (expected_ce + 0.7 * expected).backward()
            # float64 throughout, the same math in another order: 1e-10 is far above its rounding
            assert relative_error(out.numeric.detach(), expected.detach()) <= 1e-10, loss
            assert relative_error(ours.grad, expected_logits.grad) <= 1e-10, loss
            assert out.stats[loss.name] == pytest.approx(expected.item(), rel=1e-10, abs=1e-14)
            alone = logits.clone().requires_grad_(True)
            value = loss(alone, targets)
            value.backward()
            expected_alone = logits.clone().requires_grad_(True)
            reference(expected_alone, targets).backward()
            assert relative_error(value.detach(), expected.detach()) <= 1e-10, loss
            assert relative_error(alone.grad, expected_alone.grad) <= 1e-10, loss



@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_hand_written_soft_target_gradient_equals_autograd_s(generator, index):
    vocab, dot, logits, targets = digit_problem(generator, duplicate=True)
    loss = losses_and_references(vocab, dot, generator)[index][0]

    class ViaAutograd(type(loss)):
        terms_for_call = NumericLoss.terms_for_call  # no numeric_terms: autograd through numeric_value

    autograd = ViaAutograd.__new__(ViaAutograd)
    autograd.__dict__.update(loss.__dict__)
    results = []
    for numeric in (loss, autograd):
        ours = logits.clone().requires_grad_(True)
        out = numeric_cross_entropy(ours, targets, numeric, weight=0.5)
        out.total.backward()
        results.append((out.total.detach(), ours.grad))
    assert relative_error(results[0][0], results[1][0]) <= 1e-12  # the same float64 values, summed apart
    assert relative_error(results[0][1], results[1][1]) <= 1e-12


def test_fused_linear_head_and_sums_with_smmd_and_ntl(generator):
    vocab, dot, _, targets = digit_problem(generator, batch=2, length=15, vocab_size=60)
    hidden = torch.randn(2, 15, 8, generator=generator, dtype=torch.float64)
    head = torch.randn(60, 8, generator=generator, dtype=torch.float64)
    new = [loss for loss, _ in losses_and_references(vocab, dot, generator)]
    candidates = [*new, SMMDLoss(vocab) + 0.3 * new[0] + 0.5 * new[3] + 0.2 * new[2] + 0.4 * NTLoss(vocab)]
    for numeric in candidates:
        fused = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        out = linear_numeric_cross_entropy(*fused, targets, numeric, 0.9, chunk_size=7)
        out.total.backward()
        materialized = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        reference = numeric_cross_entropy(materialized[0] @ materialized[1].T, targets, numeric, 0.9)
        reference.total.backward()
        assert out.total.item() == pytest.approx(reference.total.item(), rel=1e-10)  # float64 both
        for ours, expected in zip(fused, materialized):
            assert relative_error(ours.grad, expected.grad) <= 1e-10
    # the sum is the sum of its terms, each logged under its own name
    summed = numeric_cross_entropy(hidden @ head.T, targets, candidates[-1], 1.0)
    for term, _ in candidates[-1].weighted_terms():
        alone = numeric_cross_entropy(hidden @ head.T, targets, term, 1.0)
        # float64 both ways: the same term's statistic inside the sum or alone, at most a few ulp apart.
        assert summed.stats[term.name] == pytest.approx(alone.stats[term.name], rel=1e-12)


def test_the_registry_builds_each_with_its_options_and_dots():
    vocab = NumericVocab(list(range(10)), list(range(10)), 16)
    built = build_numeric_loss(vocab, [("dist2", 1.0), ("gauss-ls", 0.5), ("del", 2.0)],
                               {"dist2": {"tau": 2.0, "place_weighted": True}, "gauss_ls": {"sigma": 0.5},
                                "del": {"place_base": 1.1, "scale": 0.02}}, dot_token_ids=[13])
    (dist2, _), (gauss, _), (digit_entropy, weight) = built.weighted_terms()
    assert (dist2.tau, dist2.place_weighted, gauss.sigma, gauss.tau) == (2.0, True, 0.5, 0.5)
    assert (digit_entropy.dot_token_ids, digit_entropy.place_base, digit_entropy.scale, weight) == ((13, ), 1.1, 0.02,
                                                                                                  2.0)
    assert {"dist2", "gauss-ls", "del"} <= set(NUMERIC_LOSSES)


@pytest.mark.parametrize("build, message", [
    (lambda vocab: DIST2Loss(vocab, tau=0), r"tau=0 must be a finite number > 0"),
    (lambda vocab: GaussianLabelSmoothingLoss(vocab, sigma=math.inf), r"sigma=inf must be a finite number > 0"),
    (lambda vocab: DigitEntropyLoss(vocab, place_base=1.0), r"place_base=1.0 must be a finite number > 1"),
    (lambda vocab: DigitEntropyLoss(vocab, dot_token_ids=[3]), r"dot_token_ids \[3\] include numeric tokens"),
    (lambda vocab: DigitEntropyLoss(NumericVocab([1, 2], [1, 20], 16)), r"needs a vocabulary of the ten digits"),
])
def test_bad_options_are_named(build, message):
    with pytest.raises(ValueError, match=message):
        build(NumericVocab(list(range(10)), list(range(10)), 16))


# ------------------------------------------------------------------------------------------------
# Vocabulary-parallel: uneven shards, the one collective
# ------------------------------------------------------------------------------------------------


def _vocab_parallel_new_losses(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    vocab_size = int(torch.randint(16 * world_size, 90, (1, ), generator=generator))
    vocab, dot, logits, targets = digit_problem(generator, batch=2, length=17, vocab_size=vocab_size)
    cuts = sorted(torch.randperm(vocab_size - 1, generator=generator)[:world_size - 1].add(1).tolist())
    bounds = [0, *cuts, vocab_size]  # uneven shards
    start, end = bounds[rank], bounds[rank + 1]
    hidden = torch.randn(2, 17, 6, generator=generator, dtype=torch.float64)
    head = torch.randn(vocab_size, 6, generator=generator, dtype=torch.float64)
    new = [loss for loss, _ in losses_and_references(vocab, dot, generator)]
    losses = {"smmd": SMMDLoss(vocab), **{loss.name + str(k): loss for k, loss in enumerate(new)},
              "sum": SMMDLoss(vocab) + 0.3 * new[0] + 0.2 * new[2] + 0.5 * new[3] + NTLoss(vocab, kind="mse")}
    counts = {}
    for name, numeric in losses.items():
        full = logits.clone().requires_grad_(True)
        single = numeric_cross_entropy(full, targets, numeric, weight=0.6)
        single.total.backward()
        for _ in range(2):  # the second call runs at the capacity the first one grew: one collective
            shard = logits[..., start:end].clone().requires_grad_(True)
            with CollectiveSpy() as forward:
                out = numeric_cross_entropy(shard, targets, numeric, weight=0.6, tp_group=dist.group.WORLD,
                                            vocab_start_index=start)
            with CollectiveSpy() as backward:
                out.total.backward()
            # float64 on every rank; the exchange sums exact zeros with one rank's values
            assert abs(out.total.item() - single.total.item()) <= 1e-10 * max(abs(single.total.item()), 1.0), name
            assert relative_error(shard.grad, full.grad[..., start:end]) <= 1e-10, name
            assert forward.calls == out.stats["comm_calls"] and backward.calls == 0, name
        assert forward.calls == 1, name
        alone = logits[..., start:end].clone().requires_grad_(True)
        expected_alone = logits.clone().requires_grad_(True)
        value = numeric(alone, targets, tp_group=dist.group.WORLD, vocab_start_index=start)
        value.backward()
        numeric(expected_alone, targets).backward()
        # float64 on every rank, as above: the shards' sums merge in another order, a few ulp relative.
        assert abs(value.item() - numeric(logits, targets).item()) <= 1e-10 * max(abs(value.item()), 1.0), name
        assert relative_error(alone.grad, expected_alone.grad[..., start:end]) <= 1e-10, name
        leaves = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        expected = numeric_cross_entropy(leaves[0] @ leaves[1].T, targets, numeric, 0.6)
        expected.total.backward()
        for _ in range(2):
            fused = [hidden.clone().requires_grad_(True), head[start:end].clone().requires_grad_(True)]
            with CollectiveSpy() as fused_forward:
                out = linear_numeric_cross_entropy(*fused, targets, numeric, 0.6, tp_group=dist.group.WORLD,
                                                   vocab_start_index=start, chunk_size=5)
            with CollectiveSpy() as fused_backward:
                out.total.backward()
            # float64 both ways: the chunks of 5 rows and the shards only reorder the additions, a few ulp relative.
            assert abs(out.total.item() - expected.total.item()) <= 1e-10 * max(abs(expected.total.item()), 1.0), name
            assert relative_error(fused[0].grad, leaves[0].grad) <= 1e-10, name
            assert relative_error(fused[1].grad, leaves[1].grad[start:end]) <= 1e-10, name
            assert fused_forward.calls == out.stats["comm_calls"] and fused_backward.calls == 1, name  # dX's
        assert fused_forward.calls == 1, name
        counts[name] = (forward.calls, forward.bytes)
    # the new losses add no collective and no byte: the same one exchange as SMMD alone
    assert len(set(counts.values())) == 1, counts
    return counts


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_equals_one_device_with_the_one_collective(world_size):
    reports = values_or_raise(run_ranks(_vocab_parallel_new_losses, world_size, int(torch.randint(0, 2**31, (1, )))))
    assert all(report == reports[0] for report in reports)


# ------------------------------------------------------------------------------------------------
# The Hugging Face hook and the Megatron entry point
# ------------------------------------------------------------------------------------------------

HF_VOCAB_SIZE, HF_DIGITS, HF_DOT = 96, list(range(20, 30)), 30  # ten digit tokens (values 0..9) and a "."


def hf_losses(vocab, sequence_dim=-1):
    """Each new loss and their sum with SMMD and NTL, on a vocabulary of the ten digits and a "."."""
    dist2 = DIST2Loss(vocab, tau=2.0, place_weighted=True, sequence_dim=sequence_dim)
    gauss = GaussianLabelSmoothingLoss(vocab, sigma=0.7)
    digit_entropy = DigitEntropyLoss(vocab, dot_token_ids=[HF_DOT], scale=0.05, sequence_dim=sequence_dim)
    return {"dist2": DIST2Loss(vocab, tau=0.5), "dist2_place": dist2, "gauss_ls": gauss, "del": digit_entropy,
            "sum": SMMDLoss(vocab) + 0.3 * dist2 + 0.2 * gauss + 0.5 * digit_entropy + 0.4 * NTLoss(vocab)}


def hf_batch(generator, rows=2, length=14):
    """Token ids with digit runs holding dots (numbers such as 12.05), and labels with a masked start."""
    ids = torch.randint(0, HF_VOCAB_SIZE, (rows, length), generator=generator)
    digits = torch.randint(20, 30, (rows, 8), generator=generator)
    ids[:, 2:10] = torch.where(torch.rand(rows, 8, generator=generator) < 0.2, HF_DOT, digits)
    labels = ids.clone()
    labels[:, :1] = IGNORE
    return ids, labels


@pytest.mark.parametrize("fused_linear", [False, True], ids=["logits", "fused-linear"])
def test_the_hf_hook_trains_on_ce_plus_each_new_loss(generator, fused_linear):
    """install(model, numeric_loss, ...) on a float64 Llama: the model's loss, its gradients and the
    hook's statistics are CE + weight x the loss called directly on the model's logits and shifted labels."""
    from helpers import models

    vocab = NumericVocab(HF_DIGITS, list(range(10)), HF_VOCAB_SIZE)
    ids, labels = hf_batch(generator)
    shifted = torch.cat([labels[:, 1:], torch.full((labels.shape[0], 1), IGNORE)], dim=1)
    for name, numeric in hf_losses(vocab).items():
        model = models.tiny_llama(HF_VOCAB_SIZE, hidden_size=32, max_positions=64, seed=1).double()
        installed = smmd_scale.install(model, numeric, weight=0.4, fused_linear=fused_linear)
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        assert installed.last_path == ("fused_linear" if fused_linear else "logits"), name
        direct_model = models.tiny_llama(HF_VOCAB_SIZE, hidden_size=32, max_positions=64, seed=1).double()
        logits = direct_model(input_ids=ids).logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, HF_VOCAB_SIZE), shifted.reshape(-1))
        value = numeric(logits, shifted)
        (ce + 0.4 * value).backward()
        # float64 model and loss on both sides; the fused head sums the same products in blocks
        assert loss.item() == pytest.approx((ce + 0.4 * value).item(), rel=1e-10), name
        assert installed.hook.last_losses.numeric.item() == pytest.approx(value.item(), rel=1e-10), name
        for term, _ in numeric.weighted_terms():
            assert installed.last_stats[term.name] == pytest.approx(term(logits, shifted).item(), rel=1e-10), name
        for (parameter, ours), theirs in zip(model.named_parameters(), direct_model.parameters()):
            assert relative_error(ours.grad, theirs.grad) <= 1e-10, (name, parameter)
        assert value.item() > 0, name


def _megatron_entry_point_with_the_new_losses(rank, world_size, seed):
    """Megatron's [s, b, V/T] equal shards, its losses built with sequence_dim=0: per-token CE and each
    loss equal one device's; their masked mean is the loss on the batch-first layout; the gradients and
    loss_func_outputs' report match."""
    from smmd_scale.integrations.megatron import loss_func_outputs, vocab_parallel_numeric_cross_entropy

    generator = torch.Generator().manual_seed(seed)
    vocab = NumericVocab(HF_DIGITS, list(range(10)), HF_VOCAB_SIZE)
    ids, _ = hf_batch(generator, rows=3, length=16)
    target = ids.transpose(0, 1).contiguous()  # [s, b]
    logits = 3 * torch.randn(*target.shape, HF_VOCAB_SIZE, generator=generator, dtype=torch.float64)
    mask = (torch.rand(target.shape, generator=generator) < 0.8).double()  # a Megatron loss mask
    width = HF_VOCAB_SIZE // world_size
    batch_first = hf_losses(vocab)
    for name, numeric in hf_losses(vocab, sequence_dim=0).items():
        shard = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
        ce, values = vocab_parallel_numeric_cross_entropy(shard, target, numeric, tp_group=dist.group.WORLD)
        full = logits.clone().requires_grad_(True)
        ce_full, values_full = vocab_parallel_numeric_cross_entropy(full, target, numeric)
        # float64; the exchange sums exact zeros with one rank's values
        assert relative_error(ce, ce_full) <= 1e-12 and relative_error(values, values_full) <= 1e-12, name
        numeric_positions = numeric.numeric_mask(target)
        assert (values[~numeric_positions] == 0).all(), name
        expected = batch_first[name](logits.transpose(0, 1), target.transpose(0, 1))
        # float64 both ways: the same per-position values averaged in another order, a few ulp relative.
        assert abs(values[numeric_positions].mean().item() - expected.item()) <= 1e-10 * abs(expected.item()), name
        total, tokens, report = loss_func_outputs(ce, values, mask, target, numeric, weight=0.5)
        total_full, _, report_full = loss_func_outputs(ce_full, values_full, mask, target, numeric, weight=0.5)
        total.backward()
        total_full.backward()
        # float64: per-token values equal to 1e-12 (above), reduced alike; the shard's softmax uses the merged lse.
        assert tokens == int(mask.sum()) and report["numeric loss"][1] == (numeric_positions * mask).sum(), name
        assert relative_error(report["numeric loss"], report_full["numeric loss"]) <= 1e-12, name
        assert relative_error(shard.grad, full.grad[..., rank * width:(rank + 1) * width]) <= 1e-12, name
    return True


@pytest.mark.gloo
def test_the_megatron_entry_point_takes_the_new_losses_on_two_ranks():
    seed = int(torch.randint(0, 2**31, (1, )))
    assert values_or_raise(run_ranks(_megatron_entry_point_with_the_new_losses, 2, seed)) == [True, True]


# ------------------------------------------------------------------------------------------------
# train.py
# ------------------------------------------------------------------------------------------------


def test_train_plans_the_new_losses_from_the_command_line(tmp_path, tokenizer_dir):
    from helpers.corpora import write_corpus
    from helpers.launching import REPO, train_flags
    from transformers import AutoTokenizer

    from smmd_train.config.arguments import parse_args
    from smmd_train.config.run_config import RunConfig
    from smmd_train.distributed.groups import Launch
    from smmd_train.run import prepare_run

    corpus = write_corpus(tmp_path / "train.jsonl", 50)
    flags = train_flags(deepspeed_config=REPO / "ds_configs" / "zero3.json", model="tiny", tokenizer=tokenizer_dir,
                        data=[corpus], seq_len=48, micro_batch_size=2, max_steps=2, output_dir=tmp_path / "run",
                        numeric_loss=["dist2:0.5", "gauss-ls:0.3", "del"], numeric_policy="digits", dist2_tau=2.0,
                        gauss_ls_sigma=0.5, del_scale=0.02)
    planned = prepare_run(RunConfig.from_args(parse_args(flags)), Launch(0, 1, 0, 1, "single"), until="plan").plan
    (dist2, dist2_weight), (gauss, gauss_weight), (digit_entropy, del_weight) = planned.numeric_loss.weighted_terms()
    assert (type(dist2), dist2.tau, dist2_weight) == (DIST2Loss, 2.0, 0.5)
    assert (type(gauss), gauss.sigma, gauss_weight) == (GaussianLabelSmoothingLoss, 0.5, 0.3)
    assert (type(digit_entropy), digit_entropy.scale, del_weight) == (DigitEntropyLoss, 0.02, 1.0)
    dots = [token_id for token, token_id in AutoTokenizer.from_pretrained(tokenizer_dir).get_vocab().items()
            if token.lstrip("Ġ▁ ") == "." and len(token) <= 2]
    assert dots and set(digit_entropy.dot_token_ids) == set(dots)  # the tokenizer's "." found by the plan
