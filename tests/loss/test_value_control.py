"""The value-structure control (``NumericVocab.shuffled``): the same tokens with their distinct values
permuted, and each registered loss's ``reads_values`` held to what the control does to it: a loss that
says it reads the values computes another loss on the shuffled vocabulary, one that says it does not
(DEL) computes the same, bit for bit."""

import pytest
import torch

from smmd_scale import NumericVocab
from smmd_scale.refusal import Refusal
from smmd_scale.registry import NUMERIC_LOSSES, build_numeric_loss, options_from

VOCAB = 40
DIGITS = list(range(10, 20))  # the ten digits' ids; 5 is the dot


def digits() -> NumericVocab:
    return NumericVocab(DIGITS, [float(value) for value in range(10)], VOCAB, tokens=[str(d) for d in range(10)])


def test_shuffling_permutes_the_distinct_values_and_keeps_the_tokens():
    # 5 and a second spelling of 5 (id 30), as "5" and "Ġ5": they keep sharing whatever value 5 gets
    vocab = NumericVocab([*DIGITS, 30], [*range(10), 5.0], VOCAB)
    for seed in range(20):
        shuffled = vocab.shuffled(seed)
        assert shuffled.token_id_list == vocab.token_id_list and shuffled.vocab_size == VOCAB
        assert torch.equal(torch.unique(shuffled.values), torch.unique(vocab.values))  # the same values, moved
        assert not torch.equal(shuffled.values, vocab.values)  # a value moved
        assert shuffled.values[5] == shuffled.values[10]  # the two spellings of 5
        assert torch.equal(vocab.shuffled(seed).values, shuffled.values)  # the seed decides it
        assert shuffled.fingerprint != vocab.fingerprint
    assert len({tuple(vocab.shuffled(seed).values.tolist()) for seed in range(20)}) > 15
    built = NumericVocab([10, 11], [0.0, 1.0], VOCAB)  # two values: the one permutation that moves one
    assert built.shuffled(0).values.tolist() == [1.0, 0.0]


def test_tokenizer_fields_stay_and_bad_input_is_refused_by_name():
    vocab = digits()
    vocab.tokenizer_size, vocab.policy = 49152, "digits"
    shuffled = vocab.shuffled(3)
    assert (shuffled.tokenizer_size, shuffled.policy, shuffled.tokens) == (49152, "digits", vocab.tokens)
    with pytest.raises(Refusal, match="one distinct value"):
        NumericVocab([10, 11], [7.0, 7.0], VOCAB).shuffled(0)
    for seed in (-1, 1.5, True, "0"):
        with pytest.raises(Refusal, match="seed"):
            vocab.shuffled(seed)


def problem(generator):
    """Logits [2, 16, V] and targets with digit runs (some through the dot, id 5) and ignored positions."""
    targets = torch.randint(20, VOCAB, (2, 16), generator=generator)
    flat = targets.view(-1)
    flat[::3] = torch.randint(10, 20, (len(flat[::3]), ), generator=generator)
    flat[1::3] = torch.randint(10, 20, (len(flat[1::3]), ), generator=generator)
    flat[7] = 5
    flat[::11] = -100
    return torch.randn(2, 16, VOCAB, generator=generator, dtype=torch.float64), targets


@pytest.mark.parametrize("name", list(NUMERIC_LOSSES))
def test_every_loss_declares_whether_it_reads_the_values(generator, name):
    logits, targets = problem(generator)
    defaults = options_from(lambda option: option.default)
    plain, shuffled = (build_numeric_loss(vocab, [(name, 1.0)], defaults, dot_token_ids=[5])
                       for vocab in (digits(), digits().shuffled(0)))
    assert plain.reads_values == shuffled.reads_values
    on_values, on_shuffled = plain(logits, targets), shuffled(logits, targets)
    assert on_values > 0 and on_shuffled > 0
    if plain.reads_values:
        # float64 sums round at ~1e-15 relative, and the values move the loss far above that: over 300 seeds
        # the smallest relative change was 1.6e-5 (NTL-WAS); 1e-9 fails only on a near-exact coincidence
        assert abs(on_shuffled - on_values) > 1e-9 * abs(on_values), name
    else:
        assert torch.equal(on_shuffled, on_values), name


def test_a_sum_reads_the_values_when_a_term_that_counts_does():
    vocab = digits()
    assert build_numeric_loss(vocab, [("del", 1.0), ("dist2", 0.3)], dot_token_ids=[5]).reads_values
    assert not build_numeric_loss(vocab, [("del", 1.0), ("dist2", 0.0)], dot_token_ids=[5]).reads_values
    assert not build_numeric_loss(vocab, [("del", 0.5)], dot_token_ids=[5]).reads_values
