"""The second-round names of the public surface, kept one release as deprecated aliases: each use
warns once per call site with the new name (``FutureWarning``, shown to users by default)."""

from __future__ import annotations

import functools
import warnings
from typing import Callable, Optional


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(f"smmd_scale: {old} is deprecated and will be removed in the next release; use {new}",
                  FutureWarning, stacklevel=stacklevel)


def renamed(function: Callable, old: str, keywords: Optional[dict] = None) -> Callable:
    """``function`` under its old name ``old``: it warns, then calls ``function``, passing the old
    keyword arguments in ``keywords`` (old -> new) under their new names."""
    keywords = keywords or {}

    @functools.wraps(function)
    def alias(*args, **kwargs):
        warn_renamed(old, function.__name__)
        for old_keyword, new_keyword in keywords.items():
            if old_keyword in kwargs:
                kwargs[new_keyword] = kwargs.pop(old_keyword)
        return function(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = f"Deprecated alias of :func:`{function.__name__}` (kept for one release)."
    return alias


def renamed_class(cls: type, old: str) -> type:
    """A subclass of ``cls`` named ``old`` whose construction warns (``isinstance`` still holds)."""

    def __init__(self, *args, **kwargs):
        warn_renamed(old, cls.__name__)
        cls.__init__(self, *args, **kwargs)

    return type(old, (cls, ), {"__init__": __init__, "__doc__": f"Deprecated alias of :class:`{cls.__name__}`.",
                               "__module__": cls.__module__})


def loss_of_vocab_install(vocab, numeric_loss=None, **smmd_options):
    """The numeric loss of a second-round ``install(model, vocab, weight, numeric_loss=None,
    **smmd_options)`` call (warns): ``numeric_loss``, which must be built on ``vocab``, or else
    ``SMMDLoss(vocab, **smmd_options)``."""
    from .numeric_loss import NumericLoss
    from .smmd import SMMDLoss

    warn_renamed("install(model, vocab, ...)", "install(model, numeric_loss, ...), the loss built on the vocab: "
                 "install(model, SMMDLoss(vocab))", stacklevel=4)
    if numeric_loss is None:
        return SMMDLoss(vocab, **smmd_options)
    if smmd_options:
        raise TypeError(f"pass SMMD options ({sorted(smmd_options)}) to SMMDLoss inside numeric_loss, not to install")
    if not isinstance(numeric_loss, NumericLoss) or numeric_loss.vocab.fingerprint != vocab.fingerprint:
        raise ValueError(f"numeric_loss must be a smmd_scale numeric loss built on the vocab passed to install; got "
                         f"{numeric_loss!r}")
    return numeric_loss
