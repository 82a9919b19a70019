"""A refused option as data, so that each tool can name it in its own words.

    raise Refusal("{sigmas} must be a non-empty sequence of finite positive numbers", sigmas=Named("sigmas", s))
    str(error)                         # "sigmas=(-1.0,) must be ..."            (the library's words)
    error.worded({"sigmas": "--smmd_sigmas"})   # "--smmd_sigmas -1.0 must be ..."  (train.py's flags)

The text is a format string whose fields are the options it names (:class:`Named`): with a value
(``policy='digits'`` / ``--numeric_policy digits``), bare (``max_value`` / ``--numeric_max_value``), as
the library call that sets it (``NumericVocab.from_tokenizer(tokenizer, policy='digits')`` /
``--numeric_policy digits``), or the value None (``None`` / ``leave the flag out``).
"""

from __future__ import annotations

from typing import NamedTuple, Optional

_BARE = object()


class Named(NamedTuple):
    """An option a refusal names: its keyword, and its value (bare: the option itself, no value);
    ``call``: the library call that sets it, with ``{}`` where the keyword and value go."""

    keyword: str
    value: object = _BARE
    call: Optional[str] = None

    def library(self) -> str:
        words = self.keyword if self.value is _BARE else f"{self.keyword}={self.value!r}"
        return words if self.call is None else self.call.format(words)

    def tool(self, names: dict) -> str:
        if self.keyword not in names:
            return self.library()
        if self.value is _BARE:
            return names[self.keyword]
        shown = " ".join(map(str, self.value)) if isinstance(self.value, (tuple, list)) else str(self.value)
        return f"{names[self.keyword]} {shown}"


NONE = Named("None")  # the value None, where an option accepts it: "or None for ..." / "or leave the flag out"


class Refusal(ValueError):
    """A ``ValueError`` whose message names options as data: ``text`` (a format string) and ``named``
    (field -> :class:`Named`). ``str()`` is the library's words; :meth:`worded` a tool's."""

    def __init__(self, text: str, **named: Named):
        self.text, self.named = text, named
        super().__init__(self.worded({}))

    def worded(self, names: dict) -> str:
        """The message with each named option in a tool's words: ``names`` maps a keyword to how the
        tool spells it (a flag); the value None is then "leave the flag out"."""
        fields = {}
        for field, option in self.named.items():
            if option is NONE:
                fields[field] = "leave the flag out" if names else "None"
            else:
                fields[field] = option.tool(names)
        return self.text.format(**fields)


def literal(value) -> str:
    """``str(value)`` as literal text in a refusal's format string (its braces doubled)."""
    return str(value).replace("{", "{{").replace("}", "}}")


def digits_vocabulary(call: str = "NumericVocab.from_tokenizer(tokenizer, {})") -> Named:
    """The vocabulary of the ten digits, as the library call that builds it (a tool: its policy flag)."""
    return Named("policy", "digits", call)
