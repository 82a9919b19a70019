"""NTLoss (NTL-WAS, NTL-MSE) as a numeric loss of the plugin: against a float64 reference and the
installed ntloss package, combined with SMMD, through the fused linear head, and vocab-parallel on
real gloo groups of 2 and 4 ranks with exactly the one collective SMMD uses."""

import ntloss
import pytest
import torch
import torch.distributed as dist
from helpers import style_tokenizers
from helpers.distributed import CollectiveSpy, run_ranks, values_or_raise
from helpers.reference import reference_ntl, reference_smmd, relative_error

import smmd_scale
from smmd_scale import NTLoss, NumericVocab, SMMDLoss, linear_numeric_cross_entropy, numeric_cross_entropy

from conftest import random_problem

OPTIONS = [dict(kind="was"), dict(kind="was", reweigh=False), dict(kind="was", squash_factor=9.0),
           dict(kind="mse"), dict(kind="mse", reweigh=False)]


def option_id(options):
    return "-".join(f"{key}={value}" for key, value in options.items())


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_matches_the_float64_reference(generator, options, device):
    for _ in range(3):
        vocab, logits, targets = random_problem(generator, duplicate_values=bool(torch.randint(0, 2, (1, ))))
        ntl = NTLoss(vocab, **options)
        ours = logits.to(device, copy=True).requires_grad_(True)
        out = numeric_cross_entropy(ours, targets.to(device), ntl, weight=0.7)
        out.total.backward()
        reference_logits = logits.clone().requires_grad_(True)
        expected_ntl = reference_ntl(reference_logits, targets, vocab.token_ids, vocab.values, **options)
        expected_ce = torch.nn.functional.cross_entropy(reference_logits.reshape(-1, vocab.vocab_size),
                                                        targets.reshape(-1)) if (targets != -100).any() else 0.0
        (expected_ce + 0.7 * expected_ntl).backward()
        # float64 both ways, the same math in another order: a few ulp relative (abs=1e-12: a loss of exactly 0).
        assert relative_error(out.numeric.detach().cpu(), expected_ntl.detach()) <= 1e-10
        assert relative_error(ours.grad.cpu(), reference_logits.grad) <= 1e-10
        assert out.stats[ntl.name] == pytest.approx(expected_ntl.item(), rel=1e-10, abs=1e-12)
        alone = logits.clone().requires_grad_(True)
        value = ntl(alone, targets)  # the loss alone (reweigh needs the full softmax: the fused op inside)
        value.backward()
        reference_alone = logits.clone().requires_grad_(True)
        reference_ntl(reference_alone, targets, vocab.token_ids, vocab.values, **options).backward()
        # float64 both ways, the same math in another order: a few ulp relative.
        assert relative_error(value.detach(), expected_ntl.detach()) <= 1e-10
        assert relative_error(alone.grad, reference_alone.grad) <= 1e-10


def test_a_weighted_sum_with_smmd_is_the_sum_of_its_terms(generator):
    vocab, logits, targets = random_problem(generator, numeric_share=0.6)
    combined = SMMDLoss(vocab) + 0.3 * NTLoss(vocab) + 0.5 * NTLoss(vocab, kind="mse", reweigh=False)
    assert isinstance(combined, smmd_scale.WeightedNumericLosses) and combined.needs_mass
    ours = logits.clone().requires_grad_(True)
    out = numeric_cross_entropy(ours, targets, combined, weight=1.0)
    out.total.backward()
    reference_logits = logits.clone().requires_grad_(True)
    parts = {"smmd": reference_smmd(reference_logits, targets, vocab.token_ids, vocab.values),
             "ntl_was": reference_ntl(reference_logits, targets, vocab.token_ids, vocab.values),
             "ntl_mse": reference_ntl(reference_logits, targets, vocab.token_ids, vocab.values, kind="mse",
                                      reweigh=False)}
    expected = parts["smmd"] + 0.3 * parts["ntl_was"] + 0.5 * parts["ntl_mse"]
    ce = torch.nn.functional.cross_entropy(reference_logits.reshape(-1, vocab.vocab_size), targets.reshape(-1))
    (ce + expected).backward()
    # float64 both ways, the same math in another order: a few ulp relative.
    assert relative_error(out.numeric.detach(), expected.detach()) <= 1e-10
    assert relative_error(ours.grad, reference_logits.grad) <= 1e-10
    for name, value in parts.items():
        assert out.stats[name] == pytest.approx(value.item(), rel=1e-10)
    assert {"mmd", "smooth"} <= set(out.stats)


def test_composition_rules(generator):
    vocab, _, _ = random_problem(generator)
    other = NumericVocab(vocab.token_ids.tolist(), (vocab.values + 1).tolist(), vocab.vocab_size)
    with pytest.raises(ValueError, match="must share their NumericVocab"):
        SMMDLoss(vocab) + NTLoss(other)
    with pytest.raises(ValueError, match=r"distinct names, got \['ntl_was', 'ntl_was'\]"):
        NTLoss(vocab) + 0.5 * NTLoss(vocab, squash_factor=3.0)
    for bad in (float("nan"), -1.0, float("inf")):
        with pytest.raises(ValueError, match="finite number >= 0"):
            bad * NTLoss(vocab)
    assert repr(SMMDLoss(vocab) + 0.25 * NTLoss(vocab)).startswith("1 * SMMDLoss(") and "0.25 * NTLoss(kind='was'" \
        in repr(SMMDLoss(vocab) + 0.25 * NTLoss(vocab))


@pytest.mark.parametrize("options, error, match", [
    (dict(kind="l1"), ValueError, r"kind='l1' is not one of \('was', 'mse'\)"),
    (dict(squash_factor=1.0), ValueError, "squash_factor=1.0 must be a finite number > 1"),
    (dict(squash_factor=float("nan")), ValueError, "squash_factor=nan"),
    (dict(reweigh="yes"), TypeError, "reweigh='yes' must be True or False"),
])
def test_bad_options_are_named(generator, options, error, match):
    vocab, _, _ = random_problem(generator)
    with pytest.raises(error, match=match):
        NTLoss(vocab, **options)


@pytest.mark.parametrize("kind", ["mse", "was"])
@pytest.mark.parametrize("reweigh", [False, True])
def test_value_scale_is_the_largest_value_the_loss_reaches(generator, kind, reweigh):
    """The size a trainer warns about is attained: the target at the smallest value, all the mass on the
    largest one (or, reweighed, outside the numbers)."""
    vocab_size, count = 40, 12
    token_ids = torch.randperm(vocab_size, generator=generator)[:count]
    values = torch.randperm(1000, generator=generator)[:count].double()
    vocab = NumericVocab(token_ids.tolist(), values.tolist(), vocab_size)
    loss = NTLoss(vocab, kind=kind, reweigh=reweigh)
    value_range = float(values.max() - values.min())
    expected = (value_range ** 2 if kind == "mse" else value_range) * (1.01 if reweigh else 1.0)
    # float64 both ways: the same range (squared) times 1.01, a few ulp apart at most.
    assert loss.value_scale == pytest.approx(expected, rel=1e-12)
    non_numeric = next(token for token in range(vocab_size) if token not in token_ids.tolist())
    peak = non_numeric if reweigh else int(token_ids[values.argmax()])
    logits = torch.zeros(1, vocab_size, dtype=torch.float64)
    logits[0, peak] = 60.0  # every other token's probability is below e^-60: the value is the bound to ~1e-24
    reached = float(loss(logits, token_ids[values.argmin()].reshape(1)))
    assert reached == pytest.approx(expected, rel=1e-12) and reached <= expected
    # Bounded whatever the values: NTL-WAS on squashed distances, SMMD.
    assert NTLoss(vocab, kind="was", squash_factor=9.0).value_scale is None and SMMDLoss(vocab).value_scale is None


def test_a_vocabulary_without_numbers_or_with_one_value_is_refused(tokenizer_dir):
    with pytest.raises(ValueError, match="empty numeric vocabulary"):
        NTLoss(NumericVocab([], [], 10))
    with pytest.raises(ValueError, match="fewer than two distinct values"):
        NTLoss(NumericVocab([1, 2], [3.0, 3.0], 10))
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    words = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2},
                                                                                unk_token="[UNK]")))
    with pytest.raises(ValueError, match="no numeric token found under policy='digits'"):
        NumericVocab.from_tokenizer(words, policy="digits")


def test_a_digit_level_request_on_a_vocabulary_without_the_ten_digits_is_refused():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast
    partial = {**{str(d): d for d in range(7)}, "x": 7, "[UNK]": 8}
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(partial, unk_token="[UNK]")))
    vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits")
    with pytest.raises(ValueError, match=r"digit_level=True needs a vocabulary of the ten digits 0..9; it has the "
                                         r"digits \[0, 1, 2, 3, 4, 5, 6\], misses \[7, 8, 9\]"):
        NTLoss(vocab, digit_level=True)
    with pytest.raises(ValueError, match=r"also holds the values \[12.0\]"):
        NTLoss(NumericVocab(list(range(11)), list(range(10)) + [12], 20), digit_level=True)
    assert NTLoss(NumericVocab(list(range(10)), list(range(10)), 20), digit_level=True).kind == "was"


# ------------------------------------------------------------------------------------------------
# The installed ntloss package (0.3.2) as the reference
# ------------------------------------------------------------------------------------------------


def _ntloss_and_ours(tokenizer, digit_level, kind, reweigh, squash_factor):
    """(ntloss object, our NTLoss) on the same number tokens: ntloss's own selection, as a NumericVocab."""
    if kind == "was":
        theirs = ntloss.NTLoss(tokenizer, digit_level=digit_level, reweigh=reweigh, squash_factor=squash_factor)
    else:
        theirs = ntloss.NTLossDotProduct(tokenizer, digit_level=digit_level, reweigh=reweigh)
    vocab = NumericVocab(theirs.number_token_ids.tolist(), theirs.number_values_dense.double().tolist(),
                         theirs.vocab_size)
    return theirs, NTLoss(vocab, kind=kind, reweigh=reweigh, squash_factor=squash_factor)


PARITY = [("qwen_style", True, "was", True, None), ("qwen_style", True, "was", False, None),
          ("qwen_style", True, "was", True, 9.0), ("qwen_style", True, "mse", True, None),
          ("qwen_style", True, "mse", False, None), ("llama3_style", False, "was", True, None),
          ("llama3_style", False, "was", False, 9.0), ("llama3_style", False, "was", True, 9.0),
          ("llama3_style", False, "mse", False, None), ("llama3_style", False, "mse", True, None)]


@pytest.mark.parametrize("style, digit_level, kind, reweigh, squash_factor", PARITY)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_parity_with_the_ntloss_package(generator, style, digit_level, kind, reweigh, squash_factor, dtype):
    """Loss and gradient within 1e-6 of ntloss's (gradient: relative to its norm). ntloss computes in
    the logits' dtype, and its own float32 rounding reaches 1e-6 at these shapes, so our float32
    result is held against the package's float64 result; in float64 both agree to ntloss's float32
    distance table (near 1e-7)."""
    tokenizer = getattr(style_tokenizers, style)()
    theirs, ours = _ntloss_and_ours(tokenizer, digit_level, kind, reweigh, squash_factor)
    width = theirs.vocab_size
    logits = torch.randn(3, 17, width, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, width, (3, 17), generator=generator)
    numeric_ids = ours.vocab.token_ids
    pick = torch.rand(3, 17, generator=generator) < 0.5
    labels[pick] = numeric_ids[torch.randint(0, len(numeric_ids), (int(pick.sum()), ), generator=generator)]
    labels[:, ::6] = -100
    their_logits, our_logits = logits.clone().requires_grad_(True), logits.to(dtype).requires_grad_(True)
    their_loss = theirs(their_logits, labels)
    their_loss.backward()
    our_loss = ours(our_logits, labels)
    our_loss.backward()
    assert our_loss.dtype == dtype
    assert our_loss.item() == pytest.approx(their_loss.item(), rel=1e-6)
    difference = (our_logits.grad.double() - their_logits.grad).norm() / their_logits.grad.norm()
    assert difference.item() <= 1e-6


@pytest.mark.parametrize("options", OPTIONS, ids=option_id)
def test_ntl_is_float64_exact_against_our_reference_on_the_ntloss_selection(generator, options):
    """ntloss builds its tables in float32, so parity with it stops near 1e-7; our own float64
    reference holds to 1e-10 on the same token selection."""
    tokenizer = style_tokenizers.llama3_style()
    theirs, ours = _ntloss_and_ours(tokenizer, False, options["kind"], options.get("reweigh", True),
                                    options.get("squash_factor"))
    logits = torch.randn(2, 9, theirs.vocab_size, generator=generator, dtype=torch.float64) * 3
    labels = ours.vocab.token_ids[torch.randint(0, len(ours.vocab), (2, 9), generator=generator)]
    value = ours(logits, labels)
    expected = reference_ntl(logits, labels, ours.vocab.token_ids, ours.vocab.values, **options)
    # float64 both ways, the same math in another order: a few ulp relative.
    assert relative_error(value, expected) <= 1e-10


@pytest.mark.parametrize("style", ["qwen_style", "llama2_style", "gpt2_style"])
def test_digits_policy_reproduces_ntloss_digit_level(style):
    tokenizer = getattr(style_tokenizers, style)()
    theirs = ntloss.NTLoss(tokenizer, digit_level=True)
    their_tokens = set(tokenizer.convert_ids_to_tokens(theirs.number_token_ids.tolist()))
    ours = NumericVocab.from_tokenizer(tokenizer, policy="digits")
    extra = set(ours.tokens) - their_tokens
    assert their_tokens <= set(ours.tokens) and len(their_tokens) == 10
    if style == "qwen_style":  # a digit tokenizer: the same set
        assert not extra
    elif style == "llama2_style":  # the same digits, and their byte-fallback spellings
        assert extra == {f"<0x{0x30 + d:02X}>" for d in range(10)}
    else:  # GPT-2 style: the space-marked digits count too
        assert extra == {f"Ġ{d}" for d in range(10)}


# ------------------------------------------------------------------------------------------------
# The fused linear head and vocabulary parallelism
# ------------------------------------------------------------------------------------------------


def test_fused_linear_head_with_ntl(generator):
    vocab, _, targets = random_problem(generator, vocab_size=150, shape=(3, 10))
    hidden = torch.randn(3, 10, 12, generator=generator, dtype=torch.float64)
    head = torch.randn(150, 12, generator=generator, dtype=torch.float64)
    for numeric in (NTLoss(vocab), SMMDLoss(vocab) + 0.3 * NTLoss(vocab, kind="mse")):
        fused = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        out = linear_numeric_cross_entropy(*fused, targets, numeric, 0.9, chunk_size=37)
        out.total.backward()
        materialized = [hidden.clone().requires_grad_(True), head.clone().requires_grad_(True)]
        reference = numeric_cross_entropy(materialized[0] @ materialized[1].T, targets, numeric, 0.9)
        reference.total.backward()
        # float64 both ways: the head's chunks of 37 rows only reorder the additions, a few ulp relative.
        assert out.total.item() == pytest.approx(reference.total.item(), rel=1e-10)
        for ours, expected in zip(fused, materialized):
            assert relative_error(ours.grad, expected.grad) <= 1e-10


def _vocab_parallel_ntl(rank, world_size, seed):
    generator = torch.Generator().manual_seed(seed)
    report = []
    for _ in range(4):
        vocab_size = int(torch.randint(8 * world_size, 200, (1, ), generator=generator))
        vocab, logits, targets = random_problem(generator, vocab_size=vocab_size)
        vocab_size = logits.shape[-1]
        bounds = [vocab_size * k // world_size for k in range(world_size + 1)]
        start, end = bounds[rank], bounds[rank + 1]
        losses = {"smmd": SMMDLoss(vocab), "ntl_was": NTLoss(vocab, squash_factor=5.0),
                  "ntl_mse": NTLoss(vocab, kind="mse"), "combined": SMMDLoss(vocab) + 0.3 * NTLoss(vocab)}
        payload = {}
        for name, numeric in losses.items():
            full = logits.clone().requires_grad_(True)
            single = numeric_cross_entropy(full, targets, numeric, weight=0.6)
            single.total.backward()
            for _ in range(2):  # the second call runs at the capacity the first one grew
                shard = logits[..., start:end].clone().requires_grad_(True)
                with CollectiveSpy() as forward:
                    out = numeric_cross_entropy(shard, targets, numeric, weight=0.6, tp_group=dist.group.WORLD,
                                             vocab_start_index=start)
                with CollectiveSpy() as backward:
                    out.total.backward()
                # float64 both ways: the shards' log-sum-exps merge in another order, a few ulp relative.
                assert abs(out.total.item() - single.total.item()) <= 1e-10 * max(abs(single.total.item()), 1.0)
                assert relative_error(shard.grad, full.grad[..., start:end]) <= 1e-10
                assert backward.calls == 0 and forward.calls == out.stats["comm_calls"]
            payload[name] = (forward.calls, forward.bytes)
        # NTL adds no collective and no byte: the same one exchange as SMMD alone
        assert len(set(payload.values())) == 1 and payload["smmd"][0] == 1, payload
        report.append(payload["smmd"])
    return report


@pytest.mark.gloo
@pytest.mark.parametrize("world_size", [2, 4])
def test_vocab_parallel_ntl_equals_single_device_with_one_collective(world_size):
    reports = values_or_raise(run_ranks(_vocab_parallel_ntl, world_size, int(torch.randint(0, 2**31, (1, )))))
    assert all(report == reports[0] for report in reports)


def _megatron_entry_point_with_ntl(rank, world_size, seed):
    """Megatron's [s, b, V/T] equal shards: per-token CE and NTL equal one device's; their masked
    mean is NTLoss's value, and the gradients match."""
    from smmd_scale import vocab_parallel_numeric_cross_entropy

    generator = torch.Generator().manual_seed(seed)
    vocab_size, s, b = 16 * world_size, 7, 3
    vocab = NumericVocab(torch.randperm(vocab_size, generator=generator)[:9].tolist(), list(range(9)), vocab_size)
    ntl = NTLoss(vocab, kind="was" if seed % 2 else "mse")
    logits = torch.randn(s, b, vocab_size, generator=generator, dtype=torch.float64)
    target = torch.randint(0, vocab_size, (s, b), generator=generator)
    target[::2] = vocab.token_ids[torch.randint(0, 9, target[::2].shape, generator=generator)]
    width = vocab_size // world_size
    shard = logits[..., rank * width:(rank + 1) * width].clone().requires_grad_(True)
    ce, ntl_values = vocab_parallel_numeric_cross_entropy(shard, target, ntl, tp_group=dist.group.WORLD)
    full = logits.clone().requires_grad_(True)
    ce_full, ntl_full = vocab_parallel_numeric_cross_entropy(full, target, ntl)
    # float64 both ways: the shards' log-sum-exps merge in another order, a few ulp of CE ~ 1-10 and NTL <= 65
    # (~1e-14; allclose's default rtol=1e-5 adds room); so for the mean and the gradients (<= 1) below.
    assert torch.allclose(ce, ce_full, atol=1e-12) and torch.allclose(ntl_values, ntl_full, atol=1e-12)
    numeric = ntl.numeric_mask(target)
    assert (ntl_values[~numeric] == 0).all()
    assert abs(ntl_values[numeric].mean().item() - ntl(logits, target).item()) <= 1e-10
    mask = (torch.rand(s, b, generator=generator) < 0.7).double()  # a Megatron loss mask
    ((ce * mask).sum() + 0.5 * (ntl_values * mask).sum()).backward()
    ((ce_full * mask).sum() + 0.5 * (ntl_full * mask).sum()).backward()
    assert torch.allclose(shard.grad, full.grad[..., rank * width:(rank + 1) * width], atol=1e-12)
    return True


@pytest.mark.gloo
def test_megatron_entry_point_takes_ntl_on_two_ranks():
    seed = int(torch.randint(0, 2**31, (1, )))
    assert values_or_raise(run_ranks(_megatron_entry_point_with_ntl, 2, seed)) == [True, True]
