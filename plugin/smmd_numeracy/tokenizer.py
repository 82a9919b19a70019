"""A Llama-3-style tokenizer for the numeracy suite, trained locally (no hub).

    tokenizer = train_numeric_tokenizer(texts)                 # Llama-3 style, 0..999 one token each
    tokenizer = train_numeric_tokenizer(texts, max_digits=1)   # digit-level (T5 / NTL style): 0..9 only

**Tokenizer.** ``train_numeric_tokenizer``: byte-level BPE with the Llama-3 pre-tokenizer, digits cut
into groups of 1..``max_digits`` and never joined to a space or a letter; like Llama-3 (``max_digits=3``)
every group of 1..3 ASCII digits (0..999 and the zero-padded 00..09, 000..099) is one token, so " 46"
is the two tokens ``Ġ`` and ``46``. With ``max_digits=1`` every digit is its own token ("46" is ``4``
``6``), as in the tokenizers the Number Token Loss paper used (T5's, digits split).
"""

from __future__ import annotations

import json
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

# Llama-3's pre-tokenization regex (tiktoken cl100k style): digit runs cut into groups of 1..3 (here
# 1..max_digits) that never carry a space or a letter; the space before a number is its own piece ("Ġ").
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{{L}}\p{{N}}]?\p{{L}}+|\p{{N}}{{1,{max_digits}}}"
                 r"| ?[^\s\p{{L}}\p{{N}}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
MAX_DIGITS = (1, 2, 3)
_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
_BYTE_ALPHABET_SIZE = 256


def _digit_groups(max_digits: int) -> tuple:
    """Every ASCII digit group a number splits into: "0".."9", "00".."99", ... up to ``max_digits``
    digits (1110 strings for 3)."""
    return tuple(f"{number:0{width}d}" for width in range(1, max_digits + 1) for number in range(10 ** width))


def _llama3_pre_tokenizer(max_digits: int, *then) -> pre_tokenizers.PreTokenizer:
    split = Regex(_LLAMA3_SPLIT.format(max_digits=max_digits))
    return pre_tokenizers.Sequence([pre_tokenizers.Split(split, behavior="isolated"), *then,
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_numeric_tokenizer(texts: Iterable[str], vocab_size: int = 2048, max_digits: int = 3
                            ) -> PreTrainedTokenizerFast:
    """A Llama-3-style byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts``.

    Layout: the 256 byte tokens (the ten digits among them) and the text merges learned from ``texts``;
    then every other digit group of up to ``max_digits`` digits (for 3: 0..999 and the zero-padded
    00..09, 000..099 are one token each, as in Llama-3; for 1 there are none: digit-level numbers); then
    the specials ``<|begin_of_text|>`` (bos), ``<|end_of_text|>`` (eos), ``<|pad|>`` (pad).

    The merges are learned on text with the digit runs removed (pre-tokenization never joins digits
    with anything else, so the number merges are independent of the text merges) and the number
    merges are written by hand: "ab" from a + b, "abc" from both ab + c and a + bc, so a group ends
    as one token whichever of its two-digit merges applies first. ``ignore_merges`` is on, as in
    Llama-3's tokenizer.json. No BOS is added on encode: the training pipeline packs documents with
    EOS only, and evaluation tokenizes prompts with the default special tokens, so both see the same
    text. ``padding_side="left"``: evaluation generates from left-padded batches.
    Deterministic for the same ``texts``; about a second per megabyte of text.
    """
    if max_digits not in MAX_DIGITS or isinstance(max_digits, bool):
        raise ValueError(f"max_digits must be one of {MAX_DIGITS} (digits per number token); got {max_digits!r}")
    digit_groups = _digit_groups(max_digits)
    minimum = _BYTE_ALPHABET_SIZE + len(digit_groups) - 10 + len(_SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an int >= {minimum} (256 bytes, {len(digit_groups) - 10} multi-digit "
                         f"groups, {len(_SPECIAL_TOKENS)} specials); got {vocab_size!r}")
    text_tokenizer = Tokenizer(models.BPE())
    text_tokenizer.pre_tokenizer = _llama3_pre_tokenizer(
        max_digits, pre_tokenizers.Split(Regex(r"\p{N}+"), behavior="removed"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(digit_groups) + 10 - len(_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text_tokenizer.train_from_iterator(texts, trainer=trainer)

    learned = json.loads(text_tokenizer.to_str())["model"]
    vocab = dict(learned["vocab"])
    merges = [tuple(merge) for merge in learned["merges"]]
    for group in digit_groups[10:]:
        vocab[group] = len(vocab)
    merges += [(group[0], group[1]) for group in digit_groups if len(group) == 2]
    merges += [pair for group in digit_groups if len(group) == 3 for pair in ((group[:2], group[2]),
                                                                               (group[0], group[1:]))]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = _llama3_pre_tokenizer(max_digits)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, padding_side="left", clean_up_tokenization_spaces=False)
