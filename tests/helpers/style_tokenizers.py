"""Small tokenizers in the styles of real model families, built locally (no hub) with ``tokenizers``.

Each builder trains a tiny tokenizer on a fixed in-memory corpus with the pre-tokenization of the
family it imitates, so its numeric tokens have the real family's *shape* (``Ġ12`` vs ``12`` vs single
digits, space markers, byte-fallback pieces, special and reserved tokens at the real positions), and
returns it wrapped as a ``transformers.PreTrainedTokenizerFast``. Training is deterministic and takes
well under a second per builder. The raw ``tokenizers.Tokenizer`` is ``tokenizer.backend_tokenizer``.
"""

from __future__ import annotations

import json
import random

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Sentences with the kinds of numbers a pre-training corpus holds: counts, years, prices, times,
# decimals, thousands separators. Filled with a seeded RNG, so every build sees the same text.
_TEMPLATES = (
    "In {year} the team sold {n} cars for ${n},000 each.",
    "The meeting at {h}:{m} lasted {n} minutes, about {x}.{y} hours.",
    "Room {n} has {n2} seats and {n} windows.",
    "She was born in {year} and moved {n} times before {year2}.",
    "Add {n} and {n2} to get the answer; then divide by {d}.",
    "The price rose from {x}.{y} to {n}.{y} dollars in {year}.",
)
_WORDS = "the of and to in is was for on that with as by at from this have are be".split()


def _corpus(seed: int = 0, sentences: int = 400) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for index in range(sentences):
        fields = dict(year=rng.choice([1999, 2000, 2010, 2019, 2023, 2024]), year2=rng.randint(1990, 2030),
                      n=rng.choice([1, 2, 3, 5, 7, 10, 12, 12, 12, 20, 24, 50, 100, 365]), n2=rng.randint(0, 999),
                      h=rng.randint(0, 23), m=f"{rng.randint(0, 59):02d}", x=rng.randint(0, 9), y=rng.randint(0, 99),
                      d=rng.randint(2, 9))
        lines.append(_TEMPLATES[index % len(_TEMPLATES)].format(**fields))
        lines.append(" ".join(rng.choice(_WORDS) for _ in range(8)))
    return lines


def _all_digit_groups(max_digits: int) -> list[str]:
    """Every ASCII digit string of length 1..max_digits, zero-padded ones included ("0", "00", "007")."""
    return [f"{number:0{width}d}" for width in range(1, max_digits + 1) for number in range(10**width)]


# The pre-tokenization regexes of Llama-3 (tiktoken-style, digits in groups of 1..3) and Qwen2
# (same shape, one digit at a time). Numbers never carry a leading space in either: the space is
# its own "Ġ" piece.
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _train_byte_level_bpe(pre_tokenizer, lines: list[str], vocab_size: int) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(lines, trainer=trainer)
    return tokenizer


def gpt2_style() -> PreTrainedTokenizerFast:
    """GPT-2 / GPT-J / early OPT: byte-level BPE with the GPT-2 regex (``ByteLevel(add_prefix_space=False)``).

    Whole numbers become one token when frequent, with and without the space marker: ``12`` and
    ``Ġ12``, ``2024`` and ``Ġ2024``, ``000`` (from ``1,000``), ``Ġ0`` ... plus the 10 single digits of
    the byte alphabet. ``<|endoftext|>`` is the last id, a special token.
    """
    tokenizer = _train_byte_level_bpe(pre_tokenizers.ByteLevel(add_prefix_space=False), _corpus(), vocab_size=700)
    tokenizer.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>", eos_token="<|endoftext|>",
                                   unk_token="<|endoftext|>")


def llama3_style() -> PreTrainedTokenizerFast:
    """Llama-3 (and tiktoken cl100k/o200k): byte-level BPE whose regex cuts digit runs into groups of 1..3.

    Like the real vocabulary, every digit string of length 1..3 is one token: the canonical ``0``..``999``
    and the zero-padded ``00``, ``07``, ``000``, ``007`` ... (1110 in all), never with a ``Ġ`` marker.
    Specials ``<|begin_of_text|>``, ``<|end_of_text|>`` and ``<|reserved_special_token_0..7|>`` follow the
    BPE vocabulary, as in Llama-3.
    """
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    lines = _corpus() + [" ".join(_all_digit_groups(3))]
    tokenizer = _train_byte_level_bpe(pre_tokenizer, lines, vocab_size=4000)
    reserved = [f"<|reserved_special_token_{k}|>" for k in range(8)]
    tokenizer.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"] + reserved)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|begin_of_text|>",
                                   eos_token="<|end_of_text|>", extra_special_tokens=reserved)


def qwen_style() -> PreTrainedTokenizerFast:
    """Qwen / Qwen2 / Qwen2.5: byte-level BPE whose regex isolates every digit (``\\p{N}``).

    The only numeric tokens are the single digits ``0``..``9``; specials ``<|endoftext|>``,
    ``<|im_start|>``, ``<|im_end|>`` follow the BPE vocabulary.
    """
    pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer = _train_byte_level_bpe(pre_tokenizer, _corpus(), vocab_size=700)
    tokenizer.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   extra_special_tokens=["<|im_start|>", "<|im_end|>"])


def llama2_style() -> PreTrainedTokenizerFast:
    """Llama-2 / Mistral-7B: sentencepiece BPE with split digits and byte fallback.

    Layout of the real vocabulary: ``<unk>``, ``<s>``, ``</s>`` at ids 0..2 (in the model vocabulary
    and registered as specials), the 256 byte-fallback pieces ``<0x00>``..``<0xFF>`` at ids 3..258, then
    the learned pieces with the ``▁`` space marker. Digits are split one by one before merging, so the
    numeric tokens are exactly ``0``..``9``; a space before a number is a lone ``▁`` piece.
    """
    specials = ["<unk>", "<s>", "</s>"]
    trained = Tokenizer(models.BPE(unk_token="<unk>"))
    trained.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    trained.train_from_iterator(_corpus(), trainer=trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                                       show_progress=False))
    learned = json.loads(trained.to_str())["model"]
    pieces = specials + [f"<0x{byte:02X}>" for byte in range(256)]
    pieces += [piece for piece, _ in sorted(learned["vocab"].items(), key=lambda item: item[1])
               if piece not in specials]
    merges = [tuple(merge.split(" ")) if isinstance(merge, str) else tuple(merge) for merge in learned["merges"]]

    tokenizer = Tokenizer(models.BPE(vocab={piece: index for index, piece in enumerate(pieces)}, merges=merges,
                                     unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = trained.pre_tokenizer
    tokenizer.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Metaspace(replacement="▁", prepend_scheme="first")])
    tokenizer.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
