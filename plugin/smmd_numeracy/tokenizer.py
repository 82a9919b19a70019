"""A Llama-3-style tokenizer for the numeracy suite, trained locally (no hub).

    tokenizer = train_numeric_tokenizer(texts)       # Llama-3 style, 0..999 one token each

**Tokenizer.** ``train_numeric_tokenizer``: byte-level BPE with the Llama-3 pre-tokenizer, digits cut
into groups of 1..3 and never joined to a space or a letter; like Llama-3 every group of 1..3 ASCII
digits (0..999 and the zero-padded 00..09, 000..099) is one token, so " 46" is the two tokens
``Ġ`` and ``46``.
"""

from __future__ import annotations

import json
from typing import Iterable

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>"

# Llama-3's pre-tokenization regex (tiktoken cl100k style): digit runs cut into groups of 1..3 that
# never carry a space or a letter; the space before a number is its own piece ("Ġ").
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# Every ASCII digit group a number splits into: "0".."9", "00".."99", "000".."999" (1110 strings).
_DIGIT_GROUPS = tuple(f"{number:0{width}d}" for width in (1, 2, 3) for number in range(10 ** width))
_SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
_BYTE_ALPHABET_SIZE = 256


def _llama3_pre_tokenizer(*then) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"), *then,
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def train_numeric_tokenizer(texts: Iterable[str], vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A Llama-3-style byte-level BPE tokenizer of at most ``vocab_size`` tokens trained on ``texts``.

    Layout: the 256 byte tokens and the text merges learned from ``texts``; then every other digit group
    of ``_DIGIT_GROUPS`` (0..999 and the zero-padded 00..09, 000..099 are one token each, as in Llama-3); then
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
    minimum = _BYTE_ALPHABET_SIZE + len(_DIGIT_GROUPS) - 10 + len(_SPECIAL_TOKENS)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < minimum:
        raise ValueError(f"vocab_size must be an int >= {minimum} (256 bytes, {len(_DIGIT_GROUPS) - 10} multi-digit "
                         f"groups, {len(_SPECIAL_TOKENS)} specials); got {vocab_size!r}")
    text_tokenizer = Tokenizer(models.BPE())
    text_tokenizer.pre_tokenizer = _llama3_pre_tokenizer(pre_tokenizers.Split(Regex(r"\p{N}+"), behavior="removed"))
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(_DIGIT_GROUPS) + 10 - len(_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    text_tokenizer.train_from_iterator(texts, trainer=trainer)

    learned = json.loads(text_tokenizer.to_str())["model"]
    vocab = dict(learned["vocab"])
    merges = [tuple(merge) for merge in learned["merges"]]
    for group in _DIGIT_GROUPS[10:]:
        vocab[group] = len(vocab)
    merges += [(group[0], group[1]) for group in _DIGIT_GROUPS if len(group) == 2]
    merges += [pair for group in _DIGIT_GROUPS if len(group) == 3 for pair in ((group[:2], group[2]),
                                                                                (group[0], group[1:]))]

    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=True))
    tokenizer.pre_tokenizer = _llama3_pre_tokenizer()
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(_SPECIAL_TOKENS))
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN,
                                   pad_token=PAD_TOKEN, padding_side="left", clean_up_tokenization_spaces=False)
