"""The numeric sub-vocabulary ``V_num`` (docs/objective.md): which token ids are numbers, and their values.

``NumericVocab`` is a small, immutable-by-convention record: ``token_ids`` ``[N]`` int64 sorted
ascending, ``values`` ``[N]`` float64 aligned with them, and ``vocab_size``, the width of the
logits it indexes (the model's possibly padded vocabulary, not necessarily ``len(tokenizer)``).

``NumericVocab.from_tokenizer`` is the paper's Algorithm 1 done over the *whole* vocabulary:
every token string is stripped of at most one space marker and parsed with an explicit ASCII
pattern, so every spelling the model can emit for a number is found (``12`` and ``Ġ12``), and
nothing that Python's ``int``/``float`` would also accept (``٣``, ``1_000``, ``1e5``, ``nan``) is.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import re
from typing import Optional, Sequence

import numpy as np
import torch

from . import compat
from .refusal import Named, Refusal, literal

POLICIES = ("integers", "digits", "floats")

# Space markers real tokenizers put in front of a word: GPT-2-style byte-level BPE ("Ġ"),
# sentencepiece ("▁"), and tokenizers whose vocab keeps a literal leading space.
SPACE_MARKERS = ("Ġ", "▁", " ")

# Explicit ASCII patterns (used with fullmatch) instead of str.isdigit()/int()/float(), which also
# accept non-ASCII digits ("٣", "３", "²"), "_" separators, exponents, "nan" and "inf".
# Integer parts are canonical (no leading zeros): a token like "07" or "000" is the tail of a longer
# number ("2007", "1,000"), so giving it the value 7 or 0 would teach the wrong distance.
_NUMBER_PATTERNS = {
    "integers": re.compile(r"0|[1-9][0-9]*"),
    "digits": re.compile(r"[0-9]"),
    "floats": re.compile(r"(?:0|[1-9][0-9]*)(?:\.[0-9]+)?|\.[0-9]+"),
}

# Sentencepiece byte-fallback tokens of the ASCII digits (Llama-2, Mistral): "<0x30>" decodes to "0".
_BYTE_FALLBACK_DIGIT = re.compile(r"<0x3([0-9])>")

# Error messages list at most this many offending values.
_MAX_LISTED = 5



def count_below(sorted_ids: list, value: int) -> int:
    """``bisect.bisect_left(sorted_ids, value)`` in plain Python, so that ``torch.compile`` traces it
    into a constant (the C ``_bisect`` is opaque to Dynamo and breaks a ``fullgraph=True`` graph)."""
    low, high = 0, len(sorted_ids)
    while low < high:
        middle = (low + high) // 2
        if sorted_ids[middle] < value:
            low = middle + 1
        else:
            high = middle
    return low


class NumericVocab:
    """The numeric sub-vocabulary V_num: N token ids with parsed values, for logits of width vocab_size.

    token_ids:      ``[N]`` int64, sorted ascending, unique, each in ``[0, vocab_size)``.
    values:         ``[N]`` float64, finite, aligned with ``token_ids``; several ids may share a value
                    (``5`` and ``Ġ5``), which makes their distance 0.
    vocab_size:     width of the logits this vocab indexes (the model's possibly padded vocab size).
    tokens:         the token strings aligned with ``token_ids`` when known, else ``None``.
    tokenizer_size: ``len(tokenizer)`` when built by :meth:`from_tokenizer`, else ``None``.
    policy:         the policy :meth:`from_tokenizer` used, else ``None``.

    The constructor copies its inputs to CPU tensors and sorts the (id, value, token) triples by id,
    so the order the caller lists them in does not matter.
    """

    def __init__(self, token_ids, values, vocab_size: int, tokens: Optional[Sequence[str]] = None):
        vocab_size = _check_vocab_size(vocab_size)
        token_ids = _as_1d_tensor(token_ids, "token_ids")
        values = _as_1d_tensor(values, "values")
        if token_ids.numel() != values.numel():
            raise ValueError(f"token_ids and values must have equal length; got {token_ids.numel()} token_ids and "
                             f"{values.numel()} values")
        if token_ids.numel() == 0:
            raise ValueError("empty numeric vocabulary: token_ids and values are empty; give at least one numeric "
                             "token (or build it with NumericVocab.from_tokenizer)")
        if token_ids.is_floating_point() or token_ids.is_complex() or token_ids.dtype == torch.bool:
            raise TypeError(f"token_ids must be integers; got dtype {token_ids.dtype} "
                            f"(first values {token_ids[:_MAX_LISTED].tolist()}); pass token ids as ints / an int64 "
                            f"tensor")
        if values.is_complex() or values.dtype == torch.bool:
            raise TypeError(f"values must be real numbers; got dtype {values.dtype}")
        token_ids = token_ids.to(torch.int64)
        values = values.to(torch.float64)
        if tokens is not None:
            tokens = tuple(tokens)
            if len(tokens) != token_ids.numel() or not all(isinstance(token, str) for token in tokens):
                raise ValueError(f"tokens must be {token_ids.numel()} strings aligned with token_ids; got "
                                 f"{len(tokens)} items of types {sorted({type(t).__name__ for t in tokens})}")

        unique_ids, counts = torch.unique(token_ids, return_counts=True)
        duplicates = unique_ids[counts > 1]
        if duplicates.numel():
            raise ValueError(f"token_ids must be unique (one value per token); {duplicates.numel()} ids repeat, e.g. "
                             f"{duplicates[:_MAX_LISTED].tolist()}")
        outside = token_ids[(token_ids < 0) | (token_ids >= vocab_size)]
        if outside.numel():
            raise ValueError(f"token_ids must lie in [0, vocab_size={vocab_size}); {outside.numel()} do not, e.g. "
                             f"{outside[:_MAX_LISTED].tolist()}; pass the width of the model's logits "
                             f"(e.g. model.config.vocab_size) as vocab_size")
        not_finite = ~torch.isfinite(values)
        if not_finite.any():
            offenders = list(zip(token_ids[not_finite].tolist(), values[not_finite].tolist()))
            raise ValueError(f"values must be finite; {len(offenders)} are not, as (token_id, value): "
                             f"{offenders[:_MAX_LISTED]}")

        order = torch.argsort(token_ids)
        self.token_ids: torch.Tensor = token_ids[order]  # indexing copies: the caller's tensors are not shared
        self.values: torch.Tensor = values[order]
        self.vocab_size: int = vocab_size
        self.tokens: Optional[tuple] = None if tokens is None else tuple(tokens[i] for i in order.tolist())
        self.tokenizer_size: Optional[int] = None
        self.policy: Optional[str] = None
        self.token_id_list: list = self.token_ids.tolist()  # sorted ascending, on the host
        self._device_copies = {}

    def on(self, device: torch.device, dtype: torch.dtype) -> tuple:
        """``(token_ids [N] int64, values [N] dtype)`` on ``device``, copied once per (device, dtype)."""
        key = (torch.device(device), dtype)
        if key not in self._device_copies:
            copies = (self.token_ids.to(device), self.values.to(device=device, dtype=dtype))
            if torch.compiler.is_compiling():
                return copies  # (a cache filled from a compiled graph is a guard that fails on the next call)
            self._device_copies[key] = copies
        return self._device_copies[key]

    def __len__(self) -> int:
        return self.token_ids.numel()

    def index_table(self, device: torch.device) -> torch.Tensor:
        """``[vocab_size]`` int64 on ``device``: each token id's index among the numeric tokens, -1 for
        the others (made once per device; 8 bytes per vocabulary entry)."""
        key = (torch.device(device), "index")
        if key not in self._device_copies:
            table = torch.full((self.vocab_size, ), -1, dtype=torch.int64, device=device)
            table[self.token_ids.to(device)] = torch.arange(len(self), dtype=torch.int64, device=device)
            if torch.compiler.is_compiling():
                return table  # as in on()
            self._device_copies[key] = table
        return self._device_copies[key]

    def count_below(self, token_id: int) -> int:
        """How many numeric token ids are below ``token_id`` (``bisect_left`` on the sorted ids)."""
        return count_below(self.token_id_list, token_id)

    @property
    def fingerprint(self) -> int:
        """A deterministic 62-bit id (0 <= f < 2**62) of (vocab_size, token_ids, values).

        Hashes fixed-width little-endian bytes, so it is the same in every process and on every
        machine; ranks compare it to check that they all hold the same vocabulary. 62 bits keep it a
        non-negative int64 with headroom, so it can travel in an integer tensor through a collective.
        """
        digest = hashlib.sha256()
        digest.update(np.array([self.vocab_size, len(self)], dtype="<i8").tobytes())
        digest.update(self.token_ids.numpy().astype("<i8").tobytes())
        # + 0.0 turns -0.0 into 0.0: equal values must hash equal.
        digest.update((self.values + 0.0).numpy().astype("<f8").tobytes())
        return int.from_bytes(digest.digest()[:8], "little") >> 2

    def shuffled(self, seed: int) -> "NumericVocab":
        """The same tokens with their values permuted: the value-structure control of a numeric loss.

        The distinct values are permuted among themselves (tokens that shared a value still share
        one, ``5`` and ``Ġ5`` alike), by the first permutation that moves a value drawn from a
        generator seeded with ``seed``: a loss keeps its shape and its targets' tokens, but a value's
        neighbours are no longer the numbers next to it. Needs two distinct values or more."""
        if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
            raise Refusal("{seed} must be an integer >= 0", seed=Named("seed", seed))
        distinct, index = torch.unique(self.values, return_inverse=True)
        if distinct.numel() < 2:
            raise Refusal(literal(f"shuffling the values of {self!r} changes nothing: it has one distinct value "
                                  f"({distinct.item():g})") + "; a value-structure control needs two or more")
        generator = torch.Generator(device="cpu").manual_seed(int(seed))
        order = torch.arange(distinct.numel())
        permutation = order
        while torch.equal(permutation, order):  # a permutation of k >= 2 values moves one with odds >= 1/2
            permutation = torch.randperm(distinct.numel(), generator=generator)
        shuffled = NumericVocab(self.token_ids, distinct[permutation][index], self.vocab_size, tokens=self.tokens)
        shuffled.tokenizer_size, shuffled.policy = self.tokenizer_size, self.policy
        return shuffled

    def __repr__(self) -> str:
        text = (f"NumericVocab(N={len(self)}, values {self.values.min().item():g}..{self.values.max().item():g}, "
                f"vocab_size={self.vocab_size}")
        if self.tokenizer_size is not None:
            text += f"; tokenizer has {self.tokenizer_size} tokens, policy={self.policy!r}"
        return text + ")"

    @classmethod
    def from_tokenizer(cls, tokenizer, policy: str = "integers", max_value: Optional[float] = 999,
                       vocab_size: Optional[int] = None) -> "NumericVocab":
        """Scan every token of ``tokenizer`` and keep those that are numbers under ``policy``.

        tokenizer:  a Hugging Face tokenizer (``PreTrainedTokenizerBase``) or a raw ``tokenizers.Tokenizer``.
        policy:     ``"integers"``: ASCII decimal integers in canonical form (``0``, ``7``, ``120``; not
                    ``07``), value <= max_value. ``"digits"``: one ASCII digit ``0``..``9`` (max_value is
                    ignored). ``"floats"``: ``12``, ``1.5``, ``.5``, ``0.25`` (canonical integer part; never
                    ``1.``, ``1e5``, ``nan``, ``inf``, signs, ``_``/``,`` separators or non-ASCII digits),
                    value <= max_value.
        max_value:  inclusive upper bound on values; ``None`` means no bound.
        vocab_size: width of the model's logits; defaults to the tokenizer's length (with added tokens).
                    Models often pad their embeddings (e.g. to a multiple of 64), so it may be larger.

        A token may carry one space marker (``Ġ``, ``▁`` or a space) in front; it maps to the value of
        the bare token. Sentencepiece byte-fallback tokens of the digits (``<0x30>`` .. ``<0x39>``, in
        Llama-2 and Mistral) decode to a digit, so they are numeric with that value under every policy:
        probability on them is probability on that digit. Special tokens are never numeric. Added tokens
        appended beyond the model's own vocabulary (``tokenizer.add_tokens(["4242"])``) are excluded
        too: they are matched before the pre-tokenizer runs, so text is not split into them the way the
        model splits numbers, and their embeddings are new. An added token that only re-registers a
        token of the model's own vocabulary (same string, same id) stays: the model emits that id for
        that text anyway.
        """
        if policy not in POLICIES:
            raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
        _check_max_value(max_value)
        token_to_id, tokenizer_size, excluded_ids = _scan_tokenizer(tokenizer)
        if vocab_size is None:
            vocab_size = tokenizer_size
        vocab_size = _check_vocab_size(vocab_size)
        if vocab_size < tokenizer_size:
            raise ValueError(f"vocab_size={vocab_size} is smaller than the tokenizer's {tokenizer_size} tokens: logits "
                             f"of width {vocab_size} cannot score every token the tokenizer produces; pass the "
                             f"model's logits width (>= {tokenizer_size}, e.g. model.config.vocab_size)")

        upper_bound = math.inf if max_value is None or policy == "digits" else max_value
        triples = []
        for token, token_id in token_to_id.items():
            if token_id in excluded_ids:
                continue
            value = _parse_numeric_token(token, policy)
            if value is not None and value <= upper_bound:
                triples.append((token_id, value, token))
        if not triples:
            raise Refusal("no numeric token found under {policy} with {max_value} among "
                          + literal(f"{tokenizer_size} tokens of {type(tokenizer).__name__}")
                          + "; try {digits} or {floats}, or a larger {larger}", policy=Named("policy", policy),
                          max_value=Named("max_value", max_value), digits=Named("policy", "digits"),
                          floats=Named("policy", "floats"), larger=Named("max_value"))

        triples.sort()
        token_ids, values, tokens = zip(*triples)
        vocab = cls(list(token_ids), list(values), vocab_size, tokens=tokens)
        vocab.tokenizer_size = tokenizer_size
        vocab.policy = policy
        return vocab


def dot_token_ids(tokenizer) -> tuple:
    """The ids of the decimal point in ``tokenizer``: ``.``, with one space marker in front or as the
    byte-fallback token ``<0x2E>``; special and appended added tokens excluded (as in
    :meth:`NumericVocab.from_tokenizer`). A loss that reads decimals (DEL) joins digits across them."""
    token_to_id, _, excluded_ids = _scan_tokenizer(tokenizer)
    spellings = {".", "<0x2E>", *(marker + "." for marker in SPACE_MARKERS)}
    return tuple(sorted(token_id for token, token_id in token_to_id.items()
                        if token in spellings and token_id not in excluded_ids))


def _parse_numeric_token(token: str, policy: str) -> Optional[float]:
    """The value of one token string under ``policy``, or ``None`` if it is not numeric (no max_value)."""
    byte = _BYTE_FALLBACK_DIGIT.fullmatch(token)
    if byte is not None:  # a digit in every policy
        return float(byte.group(1))
    for marker in SPACE_MARKERS:
        if token.startswith(marker):
            token = token[len(marker):]
            break
    if _NUMBER_PATTERNS[policy].fullmatch(token) is None:
        return None
    value = float(token)
    return value if math.isfinite(value) else None  # a 400-digit token overflows to inf


def _scan_tokenizer(tokenizer) -> tuple[dict, int, set]:
    """(token string -> id incl. added tokens, tokenizer length incl. added tokens, ids never numeric).

    tokenizers and transformers are imported here, not at module import: the loss needs neither.
    """
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

    if isinstance(tokenizer, Tokenizer):
        token_to_id = tokenizer.get_vocab(with_added_tokens=True)
        tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
        added_tokens = tokenizer.get_added_tokens_decoder()
        special_ids = set()
        model_token_to_id = tokenizer.model.token_to_id
    elif isinstance(tokenizer, PreTrainedTokenizerBase):
        token_to_id = tokenizer.get_vocab()
        tokenizer_size = len(tokenizer)
        added_tokens = tokenizer.added_tokens_decoder
        special_ids = set(tokenizer.all_special_ids)
        model_token_to_id = compat.model_token_to_id(tokenizer)
    else:
        raise TypeError(f"from_tokenizer expects a Hugging Face tokenizer (PreTrainedTokenizerBase) or a "
                        f"tokenizers.Tokenizer; got {type(tokenizer).__module__}.{type(tokenizer).__qualname__}")
    appended_ids = {token_id for token_id, added in added_tokens.items()
                    if added.special or model_token_to_id(added.content) != token_id}
    return token_to_id, tokenizer_size, special_ids | appended_ids


def _as_1d_tensor(data, name: str) -> torch.Tensor:
    if isinstance(data, torch.Tensor):
        tensor = data.detach().cpu()
    else:
        try:
            # Through numpy: torch.as_tensor would read a list of Python floats as float32.
            tensor = torch.as_tensor(np.asarray(data))
        except (TypeError, ValueError, RuntimeError) as error:
            raise TypeError(f"{name} must be a 1-D sequence or tensor of numbers; got {type(data).__name__} "
                            f"({error})") from None
    if tensor.dim() != 1:
        raise ValueError(f"{name} must be 1-D; got shape {tuple(tensor.shape)}")
    return tensor


def _check_vocab_size(vocab_size) -> int:
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size must be an int (the width of the model's logits); got "
                        f"{type(vocab_size).__name__} {vocab_size!r}")
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive (the width of the model's logits); got {vocab_size}")
    return int(vocab_size)


def _check_max_value(max_value) -> None:
    if max_value is None:
        return
    if isinstance(max_value, bool) or not isinstance(max_value, numbers.Real):
        raise TypeError(f"max_value must be a number or None (no upper bound); got {type(max_value).__name__} "
                        f"{max_value!r}")
    if not math.isfinite(max_value) or max_value < 0:
        raise ValueError(f"max_value must be a finite number >= 0, or None for no upper bound; got {max_value}")
