"""Names removed in 0.3.0 (the second-round spellings, kept through 0.2.0 with a warning): each is
refused by name with what replaced it, in an ``AttributeError`` (a module attribute or a property) or a
``TypeError`` (the second-round ``install`` call)."""

from __future__ import annotations

# removed name -> what to use instead
REMOVED = {
    "smmd_cross_entropy": "numeric_cross_entropy (its numeric loss is the numeric_loss argument)",
    "linear_smmd_cross_entropy": "linear_numeric_cross_entropy (its numeric loss is the numeric_loss argument)",
    "vocab_parallel_smmd_cross_entropy": "vocab_parallel_numeric_cross_entropy (the numeric_loss argument)",
    "SMMDOutput": "NumericOutput",
    "SMMDCausalLMLoss": "NumericCausalLMLoss",
    "NumericOutput.smmd": "NumericOutput.numeric",
    "NumericCausalLMLoss.smmd": "NumericCausalLMLoss.numeric_loss",
    "install(model, vocab, ...)": "install(model, numeric_loss, ...), the loss built on the vocabulary: "
                                  "install(model, SMMDLoss(vocab))",
}


def removed_error(name: str, error: type = AttributeError) -> Exception:
    """The error for a use of the removed ``name`` (a key of :data:`REMOVED`)."""
    return error(f"smmd_scale: {name} was removed in 0.3.0; use {REMOVED[name]}")


def module_attribute(module: str, name: str):
    """A module's ``__getattr__`` for a name it does not have: the removed ones named as such."""
    if name in REMOVED:
        raise removed_error(name)
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
