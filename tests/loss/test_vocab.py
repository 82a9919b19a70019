"""NumericVocab: explicit construction, validation, and Algorithm 1 over real tokenizer styles."""

from __future__ import annotations

import os
import random
import re

import numpy as np
import pytest
import torch
from helpers import style_tokenizers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import ByT5Tokenizer, PreTrainedTokenizerFast

from smmd_scale.vocab import NumericVocab

STYLES = ("gpt2_style", "llama2_style", "llama3_style", "qwen_style")


def fresh_rng() -> tuple[random.Random, int]:
    seed = int.from_bytes(os.urandom(4), "little")
    return random.Random(seed), seed


def as_dict(vocab: NumericVocab) -> dict[int, float]:
    return dict(zip(vocab.token_ids.tolist(), vocab.values.tolist()))


def by_token(vocab: NumericVocab) -> dict[str, float]:
    return dict(zip(vocab.tokens, vocab.values.tolist()))


# ----------------------------------------------------------------------------------------------
# Explicit construction
# ----------------------------------------------------------------------------------------------

def test_construction_sorts_by_id_and_keeps_triples_aligned():
    rng, seed = fresh_rng()
    vocab_size = rng.randint(50, 5000)
    n = rng.randint(1, 40)
    ids = rng.sample(range(vocab_size), n)
    values = [rng.choice([rng.randint(0, 999), rng.uniform(-5, 5)]) for _ in range(n)]
    tokens = [f"tok{token_id}" for token_id in ids]
    expected = {token_id: (value, token) for token_id, value, token in zip(ids, values, tokens)}

    permutation = rng.sample(range(n), n)
    vocabs = [NumericVocab(ids, values, vocab_size, tokens=tokens),
              NumericVocab(torch.tensor([ids[i] for i in permutation], dtype=torch.int32),
                           np.array([values[i] for i in permutation]), vocab_size,
                           tokens=[tokens[i] for i in permutation])]
    for vocab in vocabs:
        assert vocab.token_ids.dtype == torch.int64 and vocab.values.dtype == torch.float64, seed
        assert vocab.token_ids.tolist() == sorted(ids), seed
        assert {i: (v, t) for i, v, t in zip(vocab.token_ids.tolist(), vocab.values.tolist(), vocab.tokens)} \
            == expected, seed
        assert len(vocab) == n and vocab.vocab_size == vocab_size
        assert vocab.tokenizer_size is None and vocab.policy is None
    assert vocabs[0].fingerprint == vocabs[1].fingerprint, seed


def test_shared_values_are_allowed():
    vocab = NumericVocab([30, 5, 17], [5.0, 5.0, 7.0], vocab_size=32, tokens=["Ġ5", "5", "7"])
    assert vocab.token_ids.tolist() == [5, 17, 30]
    assert vocab.values.tolist() == [5.0, 7.0, 5.0]
    assert vocab.tokens == ("5", "7", "Ġ5")


def test_construction_copies_inputs_to_cpu():
    token_ids = torch.tensor([3, 1, 2])
    values = torch.tensor([3.0, 1.0, 2.0], dtype=torch.float64, requires_grad=True)
    vocab = NumericVocab(token_ids, values, vocab_size=4)
    token_ids[0] = 0
    with torch.no_grad():
        values.fill_(-1.0)
    assert vocab.token_ids.tolist() == [1, 2, 3] and vocab.values.tolist() == [1.0, 2.0, 3.0]
    assert vocab.token_ids.device.type == "cpu" and not vocab.values.requires_grad


def test_fingerprint_is_deterministic_and_sees_every_field():
    rng, seed = fresh_rng()
    vocab_size = rng.randint(20, 2000)
    ids = rng.sample(range(vocab_size), rng.randint(2, min(30, vocab_size - 1)))  # one id stays unused
    values = [float(rng.randint(0, 999)) for _ in ids]
    base = NumericVocab(ids, values, vocab_size)
    assert 0 <= base.fingerprint < 2**62
    assert NumericVocab(ids[::-1], values[::-1], vocab_size).fingerprint == base.fingerprint, seed

    unused_id = next(i for i in range(vocab_size) if i not in ids)
    position = rng.randrange(len(ids))
    changed_id = ids.copy()
    changed_id[position] = unused_id
    changed_value = values.copy()
    changed_value[position] += 0.5
    variants = [NumericVocab(changed_id, values, vocab_size), NumericVocab(ids, changed_value, vocab_size),
                NumericVocab(ids, values, vocab_size + 1), NumericVocab(ids[1:], values[1:], vocab_size)]
    assert all(variant.fingerprint != base.fingerprint for variant in variants), seed


def test_fingerprint_is_pinned():
    # Ranks of one job may run on different machines and Python builds; the fingerprint must not
    # depend on either (no hash(), fixed-width little-endian bytes). A deliberate change of the
    # hashing updates this constant.
    vocab = NumericVocab([10, 11, 12, 300], [0.0, 1.0, 2.0, 2.5], vocab_size=512)
    assert vocab.fingerprint == 962850670483463252
    assert NumericVocab([10, 11, 12, 300], [-0.0, 1.0, 2.0, 2.5], vocab_size=512).fingerprint == vocab.fingerprint


def test_repr_says_size_values_and_vocab_size():
    text = repr(NumericVocab([7, 3, 9], [12.0, 0.0, 999.0], vocab_size=128))
    assert text == "NumericVocab(N=3, values 0..999, vocab_size=128)"


# ----------------------------------------------------------------------------------------------
# Validation: the exception type, the offending values in the message
# ----------------------------------------------------------------------------------------------

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(token_ids=[1, 2], values=[1.0, 2.0, 3.0]), ValueError, r"2 token_ids and 3 values"),
    (dict(token_ids=[[1, 2], [3, 4]], values=[[1.0, 2.0], [3.0, 4.0]]), ValueError,
     r"token_ids must be 1-D; got shape \(2, 2\)"),
    (dict(token_ids=5, values=5.0), ValueError, r"token_ids must be 1-D; got shape \(\)"),
    (dict(token_ids="123", values=[1.0]), TypeError, r"token_ids must be a 1-D sequence .* got str"),
    (dict(token_ids=[1, 2], values=["1", "2"]), TypeError, r"values must be a 1-D sequence .* got list"),
    (dict(token_ids=torch.tensor([1.0, 2.5]), values=[1.0, 2.0]), TypeError,
     r"token_ids must be integers; got dtype torch.float32 \(first values \[1.0, 2.5\]\)"),
    (dict(token_ids=[True, False], values=[1.0, 2.0]), TypeError, r"token_ids must be integers; got dtype torch.bool"),
    (dict(token_ids=[1, 2], values=[True, False]), TypeError, r"values must be real numbers; got dtype torch.bool"),
    (dict(token_ids=[], values=[]), ValueError, r"empty numeric vocabulary"),
    (dict(token_ids=torch.empty(0, dtype=torch.int64), values=torch.empty(0)), ValueError,
     r"empty numeric vocabulary"),
    (dict(token_ids=[3, 7, 3, 9, 7], values=[0.0] * 5), ValueError, r"2 ids repeat, e\.g\. \[3, 7\]"),
    (dict(token_ids=list(range(8)) * 2, values=[0.0] * 16), ValueError,
     r"8 ids repeat, e\.g\. \[0, 1, 2, 3, 4\]$"),
    (dict(token_ids=[-1, 3, 10, 11], values=[0.0] * 4), ValueError,
     r"\[0, vocab_size=10\); 3 do not, e\.g\. \[-1, 10, 11\]"),
    (dict(token_ids=[1, 2, 3], values=[0.0, NAN, -INF]), ValueError,
     r"2 are not, as \(token_id, value\): \[\(2, nan\), \(3, -inf\)\]"),
    (dict(token_ids=[1, 2], values=[0.0, 1.0], tokens=["1"]), ValueError, r"tokens must be 2 strings"),
    (dict(token_ids=[1, 2], values=[0.0, 1.0], tokens=["1", 2]), ValueError,
     r"tokens must be 2 strings .* \['int', 'str'\]"),
])
def test_constructor_rejects_bad_inputs(kwargs, error, message):
    kwargs.setdefault("vocab_size", 10)
    with pytest.raises(error, match=message):
        NumericVocab(**kwargs)


@pytest.mark.parametrize("vocab_size, error, message", [
    (10.0, TypeError, r"vocab_size must be an int .* got float 10\.0"),
    (True, TypeError, r"vocab_size must be an int .* got bool True"),
    ("10", TypeError, r"got str '10'"),
    (0, ValueError, r"vocab_size must be positive .* got 0"),
    (-3, ValueError, r"got -3"),
])
def test_constructor_rejects_bad_vocab_size(vocab_size, error, message):
    with pytest.raises(error, match=message):
        NumericVocab([1], [1.0], vocab_size=vocab_size)


# ----------------------------------------------------------------------------------------------
# from_tokenizer on the styles of real model families
# ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizers_by_style():
    return {style: getattr(style_tokenizers, style)() for style in STYLES}


def reference_integers(tokenizer, max_value=999) -> dict[int, float]:
    """Algorithm 1 for policy "integers", written differently: str methods and an int round trip; a
    sentencepiece byte-fallback token of a digit ("<0x35>") counts as that digit."""
    never = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    numeric = {}
    for token, token_id in tokenizer.get_vocab().items():
        if token_id not in never and len(token) == 6 and token[:3] == "<0x" and token[-1] == ">" \
                and 0x30 <= int(token[3:5], 16) <= 0x39:
            numeric[token_id] = float(chr(int(token[3:5], 16)))
            continue
        body = token[1:] if token[:1] in ("Ġ", "▁", " ") else token
        if token_id in never or not (body.isascii() and body.isdigit()) or str(int(body)) != body:
            continue
        if max_value is None or int(body) <= max_value:
            numeric[token_id] = float(body)
    return numeric


@pytest.mark.parametrize("style", STYLES)
def test_style_matches_reference_and_excludes_specials(tokenizers_by_style, style):
    tokenizer = tokenizers_by_style[style]
    vocab = NumericVocab.from_tokenizer(tokenizer)
    assert as_dict(vocab) == reference_integers(tokenizer)
    assert not set(vocab.token_ids.tolist()) & set(tokenizer.all_special_ids)
    assert vocab.tokens == tuple(tokenizer.convert_ids_to_tokens(vocab.token_ids.tolist()))
    assert vocab.vocab_size == vocab.tokenizer_size == len(tokenizer) and vocab.policy == "integers"
    assert NumericVocab.from_tokenizer(tokenizer).fingerprint == vocab.fingerprint


def test_gpt2_style_has_marked_and_bare_numbers(tokenizers_by_style):
    tokenizer = tokenizers_by_style["gpt2_style"]
    vocab_tokens = tokenizer.get_vocab()
    numeric = by_token(NumericVocab.from_tokenizer(tokenizer))
    assert numeric["12"] == numeric["Ġ12"] == 12.0
    assert numeric["Ġ0"] == numeric["0"] == 0.0
    for token, value in numeric.items():  # a marked variant has its bare token's value
        if token.startswith("Ġ") and token[1:] in numeric:
            assert numeric[token[1:]] == value
    for non_canonical in ("00", "000"):  # tails of "1,000": in the vocabulary, not numbers
        assert non_canonical in vocab_tokens and non_canonical not in numeric
    assert "Ġ2024" in vocab_tokens and "Ġ2024" not in numeric  # over max_value=999

    unbounded = by_token(NumericVocab.from_tokenizer(tokenizer, max_value=None))
    assert unbounded["Ġ2024"] == 2024.0 and unbounded["Ġ1999"] == 1999.0
    assert as_dict(NumericVocab.from_tokenizer(tokenizer, max_value=None)) == reference_integers(tokenizer, None)
    assert by_token(NumericVocab.from_tokenizer(tokenizer, policy="digits")) == {
        **{str(d): float(d) for d in range(10)}, **{f"Ġ{d}": float(d) for d in range(10)}}


def test_llama2_style_is_the_ten_digits_and_their_byte_fallback_tokens(tokenizers_by_style):
    """A sentencepiece tokenizer with byte fallback (Llama-2, Mistral) spells each digit twice: the
    piece "5" and the byte token "<0x35>", which decodes to "5". Both are numeric with value 5."""
    tokenizer = tokenizers_by_style["llama2_style"]
    digit_ids = tokenizer.convert_tokens_to_ids([str(d) for d in range(10)])
    byte_ids = tokenizer.convert_tokens_to_ids([f"<0x{0x30 + d:02X}>" for d in range(10)])
    assert tokenizer.decode(byte_ids) == "0123456789"
    expected = {**{token_id: float(d) for d, token_id in enumerate(digit_ids)},
                **{token_id: float(d) for d, token_id in enumerate(byte_ids)}}
    for policy in ("integers", "digits", "floats"):
        vocab = NumericVocab.from_tokenizer(tokenizer, policy=policy)
        assert as_dict(vocab) == expected and len(vocab) == 20, policy
    vocab_tokens = tokenizer.get_vocab()
    assert vocab_tokens["<0x31>"] == 3 + ord("1") and vocab_tokens["▁"] > 258  # byte fallback, lone marker
    assert tokenizer.tokenize(" 42") == ["▁", "4", "2"]


def test_llama3_style_is_exactly_0_to_999(tokenizers_by_style):
    tokenizer = tokenizers_by_style["llama3_style"]
    vocab_tokens = tokenizer.get_vocab()
    vocab = NumericVocab.from_tokenizer(tokenizer)
    assert len(vocab) == 1000
    assert sorted(vocab.values.tolist()) == [float(v) for v in range(1000)]
    assert by_token(vocab) == {str(v): float(v) for v in range(1000)}
    padded = ("00", "07", "000", "007", "099")
    assert all(token in vocab_tokens for token in padded)
    for policy in ("integers", "floats"):
        kept = by_token(NumericVocab.from_tokenizer(tokenizer, policy=policy))
        assert not set(padded) & set(kept), policy
    assert by_token(NumericVocab.from_tokenizer(tokenizer, max_value=99)) == {str(v): float(v) for v in range(100)}
    assert len(NumericVocab.from_tokenizer(tokenizer, policy="digits")) == 10
    assert tokenizer.tokenize("1007 cars in 2024") == ["100", "7", "Ġcars", "Ġin", "Ġ", "202", "4"]


def test_qwen_style_is_exactly_the_ten_digits(tokenizers_by_style):
    tokenizer = tokenizers_by_style["qwen_style"]
    vocab = NumericVocab.from_tokenizer(tokenizer, max_value=None)
    assert by_token(vocab) == {str(d): float(d) for d in range(10)}
    im_ids = tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"])
    assert im_ids == [len(tokenizer) - 2, len(tokenizer) - 1]


@pytest.mark.parametrize("style", STYLES)
def test_added_tokens_that_look_numeric_are_excluded(style):
    tokenizer = getattr(style_tokenizers, style)()
    before = NumericVocab.from_tokenizer(tokenizer, max_value=None)
    tokenizer.add_tokens(["4242", "Ġ77", "▁8"])
    tokenizer.add_tokens(["31337"], special_tokens=True)
    after = NumericVocab.from_tokenizer(tokenizer, max_value=None)
    assert len(tokenizer) == before.tokenizer_size + 4 == after.tokenizer_size
    assert torch.equal(after.token_ids, before.token_ids) and torch.equal(after.values, before.values)


def test_re_registered_model_token_stays_numeric():
    # add_tokens on a string the model already has keeps its model id; the model still emits it.
    tokenizer = style_tokenizers.gpt2_style()
    before = NumericVocab.from_tokenizer(tokenizer)
    model_id = tokenizer.convert_tokens_to_ids("12")
    tokenizer.add_tokens(["12", "4242"])
    assert model_id in tokenizer.added_tokens_decoder and tokenizer.convert_tokens_to_ids("12") == model_id
    after = NumericVocab.from_tokenizer(tokenizer)
    assert torch.equal(after.token_ids, before.token_ids) and as_dict(after)[model_id] == 12.0


def test_python_backend_tokenizer():
    # ByT5 is a pure-Python ("slow") HF tokenizer: one token per byte, digits at ids 3 + ord(c).
    tokenizer = ByT5Tokenizer()
    expected = {3 + ord(str(d)): float(d) for d in range(10)}
    assert as_dict(NumericVocab.from_tokenizer(tokenizer, policy="digits")) == expected
    tokenizer.add_tokens(["42", "7"])  # "42" is new (excluded); "7" re-registers the byte token 58 (kept)
    vocab = NumericVocab.from_tokenizer(tokenizer)
    assert as_dict(vocab) == expected and vocab.tokenizer_size == len(tokenizer)


@pytest.mark.parametrize("style", STYLES)
def test_raw_tokenizer_gives_the_same_vocab(tokenizers_by_style, style):
    wrapped = tokenizers_by_style[style]
    raw = wrapped.backend_tokenizer
    assert isinstance(raw, Tokenizer)
    for policy, max_value in (("integers", 999), ("digits", 999), ("floats", None)):
        from_wrapped = NumericVocab.from_tokenizer(wrapped, policy=policy, max_value=max_value)
        from_raw = NumericVocab.from_tokenizer(raw, policy=policy, max_value=max_value)
        assert torch.equal(from_raw.token_ids, from_wrapped.token_ids)
        assert torch.equal(from_raw.values, from_wrapped.values)
        assert from_raw.tokens == from_wrapped.tokens
        assert from_raw.tokenizer_size == from_wrapped.tokenizer_size == raw.get_vocab_size(with_added_tokens=True)
        assert from_raw.fingerprint == from_wrapped.fingerprint


@pytest.mark.parametrize("style", STYLES)
def test_padded_vocab_size_is_accepted_and_reported(tokenizers_by_style, style):
    tokenizer = tokenizers_by_style[style]
    padded = (len(tokenizer) + 127) // 128 * 128 + 128
    vocab = NumericVocab.from_tokenizer(tokenizer, vocab_size=padded)
    assert vocab.vocab_size == padded and vocab.tokenizer_size == len(tokenizer)
    assert torch.equal(vocab.token_ids, NumericVocab.from_tokenizer(tokenizer).token_ids)
    assert f"vocab_size={padded}; tokenizer has {len(tokenizer)} tokens, policy='integers'" in repr(vocab)

    with pytest.raises(ValueError, match=rf"vocab_size={len(tokenizer) - 1} is smaller than the tokenizer's "
                                         rf"{len(tokenizer)} tokens"):
        NumericVocab.from_tokenizer(tokenizer, vocab_size=len(tokenizer) - 1)


# ----------------------------------------------------------------------------------------------
# Policies on a hand-made vocabulary holding every tricky spelling
# ----------------------------------------------------------------------------------------------

TRICKY_TOKENS = [
    "0", "7", "12", "Ġ12", "▁7", " 8", "Ġ5", "2024", "1.5", ".5", "0.25", "Ġ3.14", "1.50", "0.0", "3.14159",
    "1.", "1e5", "1E5", "nan", "NaN", "inf", "Infinity", "-1", "+1", "٣", "３", "²", "1_000", "1,000",
    "ĠĠ5", "Ġ▁5", "▁ 5", "007", "00", "00.5", "1.2.3", "12\n", "5 ", "Ġ", "▁", "hello", "<unk>",
]


def tricky_tokenizer() -> PreTrainedTokenizerFast:
    raw = Tokenizer(models.WordLevel({token: index for index, token in enumerate(TRICKY_TOKENS)}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")


@pytest.mark.parametrize("policy, max_value, expected", [
    ("integers", 999, {"0": 0, "7": 7, "12": 12, "Ġ12": 12, "▁7": 7, " 8": 8, "Ġ5": 5}),
    ("integers", None, {"0": 0, "7": 7, "12": 12, "Ġ12": 12, "▁7": 7, " 8": 8, "Ġ5": 5, "2024": 2024}),
    ("integers", 7, {"0": 0, "7": 7, "▁7": 7, "Ġ5": 5}),
    ("digits", 999, {"0": 0, "7": 7, "▁7": 7, " 8": 8, "Ġ5": 5}),
    ("digits", 3, {"0": 0, "7": 7, "▁7": 7, " 8": 8, "Ġ5": 5}),  # max_value is ignored for digits
    ("floats", 999, {"0": 0, "7": 7, "12": 12, "Ġ12": 12, "▁7": 7, " 8": 8, "Ġ5": 5, "1.5": 1.5, ".5": 0.5,
                     "0.25": 0.25, "Ġ3.14": 3.14, "1.50": 1.5, "0.0": 0.0, "3.14159": 3.14159}),
    ("floats", 1.0, {"0": 0, ".5": 0.5, "0.25": 0.25, "0.0": 0.0}),
    ("floats", None, {"0": 0, "7": 7, "12": 12, "Ġ12": 12, "▁7": 7, " 8": 8, "Ġ5": 5, "1.5": 1.5, ".5": 0.5,
                      "0.25": 0.25, "Ġ3.14": 3.14, "1.50": 1.5, "0.0": 0.0, "3.14159": 3.14159, "2024": 2024}),
])
def test_policies_accept_exactly_the_plain_ascii_numbers(policy, max_value, expected):
    vocab = NumericVocab.from_tokenizer(tricky_tokenizer(), policy=policy, max_value=max_value)
    assert by_token(vocab) == {token: float(value) for token, value in expected.items()}
    assert vocab.token_ids.tolist() == sorted(TRICKY_TOKENS.index(token) for token in expected)


def reference_float(token: str):
    """The "floats" policy written without a regex; None when not numeric."""
    body = token[1:] if token[:1] in ("Ġ", "▁", " ") else token
    whole, dot, fraction = body.partition(".")
    if not body.isascii() or not all(part.isdigit() for part in (whole, fraction) if part):
        return None
    if (whole == "" and fraction == "") or (dot and fraction == "") or (len(whole) > 1 and whole[0] == "0"):
        return None
    return float(body)


def test_floats_policy_on_random_spellings():
    rng, seed = fresh_rng()
    alphabet = ["0", "0", "1", "5", "9", ".", ".", "e", "-", "+", "_", ",", "٣", "３", "²", "Ġ", "▁", " ", "n"]
    tokens = sorted({"".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5))) for _ in range(3000)})
    raw = Tokenizer(models.WordLevel({token: index for index, token in enumerate(tokens)}, unk_token=tokens[0]))
    expected = {index: reference_float(token) for index, token in enumerate(tokens)}
    expected = {index: value for index, value in expected.items() if value is not None}
    assert len(expected) > 20, seed
    assert as_dict(NumericVocab.from_tokenizer(raw, policy="floats", max_value=None)) == expected, seed


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(policy="ints"), ValueError, r"unknown policy 'ints'; choose one of \('integers', 'digits', 'floats'\)"),
    (dict(policy=None), ValueError, r"unknown policy None"),
    (dict(max_value=-1), ValueError, r"max_value must be a finite number >= 0, or None .* got -1"),
    (dict(max_value=INF), ValueError, r"got inf"),
    (dict(max_value=NAN), ValueError, r"got nan"),
    (dict(max_value=True), TypeError, r"max_value must be a number or None .* got bool True"),
    (dict(max_value="999"), TypeError, r"got str '999'"),
    (dict(vocab_size=1000.0), TypeError, r"vocab_size must be an int .* got float 1000\.0"),
    (dict(vocab_size=0), ValueError, r"vocab_size must be positive"),
])
def test_from_tokenizer_rejects_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        NumericVocab.from_tokenizer(tricky_tokenizer(), **kwargs)


def test_from_tokenizer_rejects_other_objects():
    with pytest.raises(TypeError, match=r"PreTrainedTokenizerBase\) or a tokenizers\.Tokenizer; got builtins\.dict"):
        NumericVocab.from_tokenizer({"12": 0})
    with pytest.raises(TypeError, match=r"got tokenizers\.models\.WordLevel"):
        NumericVocab.from_tokenizer(models.WordLevel({"1": 0, "<unk>": 1}, unk_token="<unk>"))


def test_no_numeric_token_names_policy_and_max_value():
    raw = Tokenizer(models.WordLevel({"<unk>": 0, "hello": 1, "1.5": 2}, unk_token="<unk>"))
    with pytest.raises(ValueError, match=re.escape("no numeric token found under policy='integers' with "
                                                   "max_value=999 among 3 tokens of Tokenizer; try policy='digits' or "
                                                   "policy='floats', or a larger max_value")):
        NumericVocab.from_tokenizer(raw)
    assert by_token(NumericVocab.from_tokenizer(raw, policy="floats")) == {"1.5": 1.5}
