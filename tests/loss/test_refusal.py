"""A refused option as data (``smmd_scale.refusal``): the library's words and a tool's from one refusal,
without rewriting text."""

import pytest

from smmd_scale import NTLoss, NumericVocab, SMMDLoss
from smmd_scale.refusal import NONE, Named, Refusal, digits_vocabulary, literal
from smmd_scale.registry import LossOptionError, build_numeric_loss

FLAGS = {"sigmas": "--smmd_sigmas", "squash_factor": "--ntl_squash_factor", "policy": "--numeric_policy",
         "max_value": "--numeric_max_value"}


def test_one_refusal_in_the_library_s_words_and_a_tool_s():
    refusal = Refusal("{sigmas} is bad; build it with {digits}, or {none} for " + literal("{raw}") + ", or a larger "
                      "{larger} (not {other})", sigmas=Named("sigmas", (-1.0, 2.0)), digits=digits_vocabulary(),
                      none=NONE, larger=Named("max_value"), other=Named("alpha", 0.5))
    assert str(refusal) == ("sigmas=(-1.0, 2.0) is bad; build it with NumericVocab.from_tokenizer(tokenizer, "
                            "policy='digits'), or None for {raw}, or a larger max_value (not alpha=0.5)")
    assert refusal.worded(FLAGS) == ("--smmd_sigmas -1.0 2.0 is bad; build it with --numeric_policy digits, or leave "
                                     "the flag out for {raw}, or a larger --numeric_max_value (not alpha=0.5)")
    assert isinstance(refusal, ValueError)


def test_the_losses_and_the_vocabulary_refuse_as_data():
    vocab = NumericVocab(list(range(10)), list(range(10)), 20)
    with pytest.raises(Refusal) as refused:
        SMMDLoss(vocab, sigmas=(-1.0, ))
    assert refused.value.worded(FLAGS) == "--smmd_sigmas -1.0 must be a non-empty sequence of finite positive numbers"
    with pytest.raises(Refusal) as refused:
        NTLoss(vocab, squash_factor=0.5)
    assert refused.value.worded(FLAGS).endswith(", or leave the flag out for the raw distances")
    assert str(refused.value).endswith(", or None for the raw distances")
    # Built from the registry, the refusal travels inside LossOptionError with the entry that refused.
    with pytest.raises(LossOptionError) as refused:
        build_numeric_loss(NumericVocab([3, 4], [1.0, 20.0], 20), [("del", 1.0)])
    assert refused.value.entry.name == "del"
    assert "build it with --numeric_policy digits from a tokenizer" in refused.value.worded(FLAGS)
    assert "build it with NumericVocab.from_tokenizer(tokenizer, policy='digits')" in str(refused.value)
