"""The Llama-3-style tokenizer (``smmd_numeracy.train_numeric_tokenizer``), trained on text with numbers
and words: Tier B's questions and answers (``Q: ... A: -27``, signed, digit by digit in Tier B's own
tokenizer) and Tier C's plain-text paragraphs. Every digit group of up to three digits is one token
whatever the text; the rest are the merges the text teaches."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer

import smmd_numeracy as numeracy
from smmd_numeracy import tier_b, tier_c
from smmd_scale import NumericVocab

from conftest import SESSION_SEED


@pytest.fixture
def rng(request) -> random.Random:
    return random.Random(f"{SESSION_SEED}/{request.node.nodeid}")


@pytest.fixture(scope="module")
def corpus_texts() -> list[str]:
    problems = [problem for level in tier_b.TRAIN_LEVELS for problem in tier_b.generate_problems(level, 800, seed=0)]
    return [tier_b.text(*problem) for problem in problems] + tier_c.plain_text().split("\n\n")


@pytest.fixture(scope="module")
def tokenizer(corpus_texts):
    return numeracy.train_numeric_tokenizer(corpus_texts)


def test_every_digit_group_is_one_token(tokenizer):
    digit_groups = [f"{number:0{width}d}" for width in (1, 2, 3) for number in range(10**width)]
    for group in digit_groups:
        assert tokenizer.tokenize(group) == [group]
    assert all(len(tokenizer.encode(str(number), add_special_tokens=False)) == 1 for number in range(1000))
    assert tokenizer.tokenize("1234") == ["123", "4"]
    assert tokenizer.tokenize("x12345678y") == ["x", "123", "456", "78", "y"]
    # The merges alone make every group one token too, without ignore_merges' whole-word lookup.
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    state["model"]["ignore_merges"] = False
    merges_only = Tokenizer.from_str(json.dumps(state))
    assert all(merges_only.encode(group).tokens == [group] for group in digit_groups)


def test_numeric_vocab_is_exactly_0_to_999(tokenizer):
    vocab = NumericVocab.from_tokenizer(tokenizer)
    assert len(vocab) == 1000
    assert vocab.values.tolist() == list(range(1000))
    assert sorted(vocab.tokens, key=int) == [str(number) for number in range(1000)]


def test_answers_are_a_space_token_then_one_numeric_token(tokenizer, rng):
    assert tokenizer.tokenize("A: 46.") == ["A", ":", "Ġ", "46", "."]
    checked = 0
    for split in tier_b.TEST_SPLITS:
        for question, answer in tier_b.generate_problems(split, 40, seed=rng.randrange(2**32)):
            if answer < 0 or answer > 999:  # (a sign is its own token; four digits are two)
                continue
            prompt = tier_b.prompt(question)
            assert tokenizer.tokenize(tier_b.text(question, answer)) == tokenizer.tokenize(prompt) + ["Ġ", str(answer)]
            checked += 1
    assert checked >= 20, checked  # (about half of Tier B's answers are 0..999)


def test_decode_inverts_encode(tokenizer, corpus_texts, rng):
    texts = rng.sample(corpus_texts, 100) + ["naïve café – 12½ km², 😀 tabs\tand\n\nnewlines  ", "A:46 B: 007"]
    for text in texts:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_special_tokens_padding_and_size(tokenizer, tmp_path):
    specials = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token)
    assert specials == ("<|begin_of_text|>", "<|end_of_text|>", "<|pad|>")
    ids = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id]
    assert len(set(ids)) == 3 and ids == list(range(len(tokenizer) - 3, len(tokenizer)))
    assert tokenizer.tokenize("<|end_of_text|>") == ["<|end_of_text|>"]
    assert len(tokenizer) <= 2048
    assert tokenizer("Q: What is 1 + 2? A:")["input_ids"] == tokenizer.encode("Q: What is 1 + 2? A:",
                                                                              add_special_tokens=False)
    assert tokenizer.padding_side == "left"
    batch = tokenizer(["A: 1", "Q: What is 1 + 2? A:"], padding=True)
    assert batch["input_ids"][0][0] == tokenizer.pad_token_id and batch["attention_mask"][0][0] == 0

    tokenizer.save_pretrained(tmp_path)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert (reloaded.padding_side, reloaded.pad_token, reloaded.bos_token, reloaded.eos_token) == \
        ("left", "<|pad|>", "<|begin_of_text|>", "<|end_of_text|>")
    text = "Q: How many minutes are in 9 hours? A: 540."
    assert reloaded(text)["input_ids"] == tokenizer(text)["input_ids"]


def test_training_is_deterministic_and_fills_the_requested_size(corpus_texts, tokenizer):
    again = numeracy.train_numeric_tokenizer(corpus_texts)
    assert again.backend_tokenizer.to_str() == tokenizer.backend_tokenizer.to_str()
    assert len(numeracy.train_numeric_tokenizer(corpus_texts, vocab_size=1500)) == 1500
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 1359"):
        numeracy.train_numeric_tokenizer(corpus_texts, vocab_size=1000)
