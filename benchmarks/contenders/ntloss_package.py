"""CE + NTL-WAS from the ``ntloss`` package (the Number Token Loss paper's own implementation), called
as its README does, on full logits: the contender bench_loss measures next to smmd_scale."""

from importlib import metadata

import torch


class Unavailable(Exception):
    """An optional contender cannot run here; the message says why."""


def ntloss_tokenizer(vocab_size: int, token_ids: torch.Tensor):
    """A local WordLevel tokenizer of exactly V tokens: "0".."N-1" at ``token_ids``, fillers elsewhere."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = [f"w{index}" for index in range(vocab_size)]  # fillers never parse as numbers
    for value, token_id in enumerate(token_ids.tolist()):
        words[token_id] = str(value)
    unknown = next(word for word in words if word.startswith("w"))
    model = models.WordLevel({word: index for index, word in enumerate(words)}, unk_token=unknown)
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(model))


def build_ntloss(vocab_size: int, numeric_size: int, token_ids: torch.Tensor, cross_entropy):
    try:
        import ntloss
    except ImportError as error:
        raise Unavailable(f"not installed ({error}); pip install --no-deps ntloss loguru") from error
    try:
        # digit_level=True (the default) keeps only the tokens "0".."9"; the multi-digit tokens
        # "10".."999" count only with digit_level=False. For N = 10 both select the same tokens.
        ntl = ntloss.NTLoss(tokenizer=ntloss_tokenizer(vocab_size, token_ids), digit_level=False)
    except Exception as error:  # a third-party package: record what went wrong, do not hide the row
        raise Unavailable(f"ntloss {metadata.version('ntloss')} failed to set up: {error!r}") from error
    found = int(ntl.is_number_token.sum())
    if found != numeric_size:
        raise Unavailable(f"ntloss found {found} number tokens, expected {numeric_size}")
    # NTLoss wants [batch, seq, V] logits and [batch, seq] labels
    return lambda logits, targets: cross_entropy(logits, targets) + ntl(logits[None], targets[None])
