"""A pytest plugin that runs ntloss 0.3.2's own test suite (its sdist's ``tests/``) on smmd_scale's NTL.

    pip download ntloss==0.3.2 --no-deps --no-binary :all: -d /tmp/ntloss_sdist
    tar xzf /tmp/ntloss_sdist/ntloss-0.3.2.tar.gz -C /tmp/ntloss_sdist
    PYTHONPATH=plugin:tests python -m pytest /tmp/ntloss_sdist/ntloss-0.3.2/tests -p helpers.ntloss_suite

Before the suite imports ``ntloss``, the plugin puts a module of that name in ``sys.modules`` whose
classes are thin adapters: ntloss's constructor arguments become a :class:`smmd_scale.NumericVocab`
(``digit_level=True``: ``policy="digits"``; else ``policy="floats"`` without a bound) and our loss
(``NTLoss`` -> ``NTLoss(kind="was")``, ``NTLossDotProduct`` -> ``kind="mse"``, ``NumberLevelLoss`` ->
``NumberLevelNTLoss``); a call is our loss's call with the same ``reduction``, ``loss_weights`` and
``ignore_index``. The attributes the suite reads (``dist_lookup``, ``number_values_dense``, ...) are
read off our objects; ``convert_digits_to_numbers`` runs our :func:`smmd_scale.number_level.digit_spans`.
``NumberLevelLossLooped`` stays the installed package's own loop implementation, so the suite's
equivalence tests compare ours with ntloss's reference loop.

The suite loads the hub tokenizers ``t5-small`` and ``gpt2``. With no hub access (and no cached
copy) the plugin hands it local stand-ins of the same sizes (32,100 and 50,257 tokens) that spell the
tokens the suite uses as those tokenizers do: the digits ``0``..``9`` as tokens, sentencepiece
``▁7`` / byte-level ``Ġ7`` space-marked digits beside them, ``A``, ``.``, ``+``, ...
"""

from __future__ import annotations

import math
import os
import sys
import types

import torch

STAND_IN_SIZES = {"t5-small": 32100, "gpt2": 50257}


def stand_in_tokenizer(name: str):
    """A local WordLevel tokenizer shaped like the hub's ``name`` for what the suite reads of it."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    size = STAND_IN_SIZES[name]
    marker = "▁" if name == "t5-small" else "Ġ"
    words = ["<pad>", "</s>", "<unk>"] if name == "t5-small" else []
    words += [str(d) for d in range(10)] + [marker + str(d) for d in range(10)]
    words += [marker + word for word in ("10", "12", "100", "2010")] + ["10", "00", "1.5"]
    words += list("ABCEa.+,-E") + [marker + letter for letter in "ABCa"]
    words = list(dict.fromkeys(words))
    extra = [f"<extra_id_{k}>" for k in range(100)] if name == "t5-small" else ["<|endoftext|>"]
    words += [f"w{k}" for k in range(size - len(words) - len(extra))] + extra
    unknown = "<unk>" if name == "t5-small" else "<|endoftext|>"
    model = models.WordLevel({word: index for index, word in enumerate(words)}, unk_token=unknown)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model), unk_token=unknown,
                                   **({"eos_token": "</s>", "pad_token": "<pad>"} if name == "t5-small" else
                                      {"eos_token": "<|endoftext|>", "bos_token": "<|endoftext|>"}))


def _patch_hub_tokenizers() -> None:
    from transformers import AutoTokenizer

    original = AutoTokenizer.from_pretrained.__func__

    def from_pretrained(cls, name, *args, **kwargs):
        if name in STAND_IN_SIZES:
            try:
                return original(cls, name, *args, **{**kwargs, "local_files_only": True})
            except OSError:
                return stand_in_tokenizer(name)
        return original(cls, name, *args, **kwargs)

    AutoTokenizer.from_pretrained = classmethod(from_pretrained)


def _is_number(something, finite: bool = True) -> bool:
    """ntloss.utils.is_number's contract: convertible to a float (and finite)."""
    try:
        value = float(something)
    except ValueError:
        return False
    return math.isfinite(value) or not finite


class _Adapter:
    """ntloss's constructor and call on one of our losses."""

    def __init__(self, tokenizer, vocab_size=None, digit_level: bool = True):
        from smmd_scale import NumericVocab

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size if vocab_size is not None else len(tokenizer)
        self.digit_level = digit_level
        self.vocab = NumericVocab.from_tokenizer(tokenizer, policy="digits" if digit_level else "floats",
                                                 max_value=None, vocab_size=self.vocab_size)
        self.number_token_ids = self.vocab.token_ids
        self.number_values_dense = self.vocab.values
        self.is_number_token = torch.zeros(self.vocab_size, dtype=torch.bool)
        self.is_number_token[self.vocab.token_ids] = True
        self.vocab_to_dist_idx = torch.full((self.vocab_size, ), -1, dtype=torch.long)
        self.vocab_to_dist_idx[self.vocab.token_ids] = torch.arange(len(self.vocab))

    def forward(self, logits, labels, loss_weights=None, reduction: str = "mean", ignore_index: int = -100):
        return self.loss(logits, labels, reduction=reduction, loss_weights=loss_weights, ignore_index=ignore_index)

    __call__ = forward

    def predict_numbers(self, logits):
        """(expected value, mass on the numbers) at every position."""
        numeric = logits[..., self.vocab.token_ids].double()
        expected = torch.softmax(numeric, dim=-1) @ self.vocab.values
        mass = torch.exp(torch.logsumexp(numeric, dim=-1) - torch.logsumexp(logits.double(), dim=-1))
        return expected, mass


class NTLoss(_Adapter):
    def __init__(self, tokenizer, vocab_size=None, digit_level: bool = True, reweigh: bool = True,
                 squash_factor=None):
        from smmd_scale import NTLoss as Ours

        super().__init__(tokenizer, vocab_size, digit_level)
        self.loss = Ours(self.vocab, kind="was", reweigh=reweigh, squash_factor=squash_factor)
        self.dist_lookup = self.loss.distances
        self.max_dist = torch.tensor(self.loss.max_distance)


class NTLossDotProduct(_Adapter):
    def __init__(self, tokenizer, vocab_size=None, digit_level: bool = True, reweigh: bool = True,
                 loss_function=None):
        from smmd_scale import NTLoss as Ours

        if loss_function not in (None, torch.nn.functional.mse_loss):
            raise NotImplementedError("smmd_scale's NTL-MSE is the squared error; other loss functions are not offered")
        super().__init__(tokenizer, vocab_size, digit_level)
        self.loss = Ours(self.vocab, kind="mse", reweigh=reweigh)
        self.max_dist = torch.tensor(self.loss.max_distance)


class NumberLevelLoss(_Adapter):
    def __init__(self, tokenizer, vocab_size=None, float_level: bool = False, reweigh: bool = True,
                 max_number_length: int = 20):
        from smmd_scale import NumberLevelNTLoss

        super().__init__(tokenizer, vocab_size, digit_level=True)
        self.dot = tokenizer.convert_tokens_to_ids(".")
        self.float_level = float_level
        self.loss = NumberLevelNTLoss(self.vocab, reweigh=reweigh, float_level=float_level,
                                      dot_token_ids=[self.dot] if self.dot is not None else [],
                                      max_number_length=max_number_length)
        self.max_dist = torch.tensor(1.0)

    def _prepare_number_token_targets(self, labels, loss_weights, ignore_index):
        numeric = self.loss.numeric_mask(labels) & (labels != ignore_index)
        y = torch.full(labels.shape, float("nan"), device=labels.device)
        index = torch.searchsorted(self.vocab.token_ids.to(labels.device), labels[numeric])
        y[numeric] = self.vocab.values.to(labels.device, torch.float32)[index]
        weights = loss_weights[numeric] if loss_weights is not None else torch.ones(int(numeric.sum()))
        return y, weights

    def convert_digits_to_numbers(self, y, yhat, number_token_positions, labels):
        from smmd_scale.number_level import digit_spans

        positions = number_token_positions.reshape(-1).nonzero().squeeze(1)
        dots = torch.tensor([self.dot]) if self.float_level and self.dot is not None else None
        spans = digit_spans(labels, positions, dot_ids=dots, max_number_length=self.loss.max_number_length)
        scale = torch.pow(10.0, spans.exponent.double())
        numbers = spans.first.numel()
        firsts = positions[spans.first]
        out = []
        for digits in (y, yhat):
            flat = digits.reshape(-1).clone()
            joined = torch.zeros(numbers, dtype=torch.float64, device=flat.device).index_add_(
                0, spans.number, flat[positions].double() * scale)
            flat[positions] = float("nan")
            flat[firsts] = joined.to(flat.dtype)
            out.append(flat.view(digits.shape))
        first_mask = torch.zeros(labels.numel(), dtype=torch.bool, device=labels.device)
        first_mask[firsts] = True
        return out[0], out[1], first_mask.view(labels.shape)


def _install() -> None:
    import ntloss as installed  # the real package: its loop implementation stays the equivalence reference

    looped = installed.NumberLevelLossLooped
    module = types.ModuleType("ntloss")
    module.NTLoss, module.NTLossDotProduct, module.NumberLevelLoss = NTLoss, NTLossDotProduct, NumberLevelLoss
    module.NumberLevelLossLooped = looped
    module.__version__ = "0.3.2 (smmd_scale adapter)"
    utils = types.ModuleType("ntloss.utils")
    utils.is_number = _is_number
    module.utils = utils
    sys.modules["ntloss"], sys.modules["ntloss.utils"] = module, utils
    _patch_hub_tokenizers()


def pytest_configure(config):
    """``NTLOSS_SUITE_TARGET=ntloss``: only the stand-in tokenizers, the suite on the package itself
    (that the stand-ins are faithful enough: it passes there)."""
    if os.environ.get("NTLOSS_SUITE_TARGET", "smmd_scale") == "ntloss":
        _patch_hub_tokenizers()
    else:
        _install()
