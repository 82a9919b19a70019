"""The small tools' command lines, each declared once: a frozen dataclass whose fields carry their
flags and help (:func:`option`), parsed by :func:`parse_options` into an instance of it. The tools
read typed fields; only this module and train.py's own configuration (``smmd_train.config.arguments``,
``smmd_train.config.run_config``) see argparse's namespace.

    @dataclass(frozen=True)
    class ConvertOptions:
        gguf: str = option(help="a .gguf file")                       # no flag: a positional argument
        force: bool = option("--force", action="store_true", default=False, help="replace the folder")

    options, parser = parse_options(ConvertOptions, argv, prog="smmd-convert-gguf")
    options.gguf, options.force                                       # parser: for parser.exit(...) with its prog

Imports nothing but the standard library: the launcher builder and the demo's ``--help`` use it
before torch or DeepSpeed load.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence, TypeVar

Options = TypeVar("Options")
NO_DEFAULT = dataclasses.MISSING


def option(*flags: str, default=NO_DEFAULT, one_of: Optional[str] = None, at_most_one_of: Optional[str] = None,
           **settings):
    """A field of a tool's options: its ``flags`` (none: a positional argument named like the field),
    ``default`` (the field's and the flag's), ``one_of`` (the fields that share this name form a group
    of which exactly one must be given), ``at_most_one_of`` (likewise, a group of which at most one may be
    given) and argparse's other ``add_argument`` settings (``help``, ``type``, ``action``, ``choices``,
    ``nargs``, ``required``, ``metavar``)."""
    metadata = {"flags": flags, "one_of": one_of, "at_most_one_of": at_most_one_of, "settings": settings}
    return dataclasses.field(default=default, metadata=metadata)


def build_parser(options: type, *, subcommand: Optional[tuple] = None, **parser_settings) -> argparse.ArgumentParser:
    """The parser of the dataclass ``options`` (``ArgumentParser(**parser_settings)``); with
    ``subcommand`` (name, help) its options belong to that one required subcommand."""
    parser = argparse.ArgumentParser(**parser_settings)
    target = parser
    if subcommand is not None:
        name, help_text = subcommand
        target = parser.add_subparsers(dest="command", required=True).add_parser(name, help=help_text)
    groups = {}
    for item in dataclasses.fields(options):
        flags, one_of, settings = item.metadata["flags"], item.metadata["one_of"], dict(item.metadata["settings"])
        at_most_one_of = item.metadata["at_most_one_of"]
        if item.default is not NO_DEFAULT:
            settings["default"] = item.default
        if one_of is not None or at_most_one_of is not None:
            key = (one_of, at_most_one_of)
            if key not in groups:
                groups[key] = target.add_mutually_exclusive_group(required=one_of is not None)
            group = groups[key]
        else:
            group = target
        if flags:
            group.add_argument(*flags, dest=item.name, **settings)
        else:
            group.add_argument(item.name, **settings)
    return parser


def parse_options(options: type[Options], argv: Optional[Sequence[str]] = None, *, known_only: bool = False,
                  subcommand: Optional[tuple] = None, **parser_settings):
    """``(options instance, parser)`` from ``argv`` (default: ``sys.argv[1:]``); the parser exits 2 with
    its usage on a bad command line, as argparse does. ``known_only``: ``(options instance, the
    arguments it does not know, parser)``, those left for another program."""
    parser = build_parser(options, subcommand=subcommand, **parser_settings)
    if known_only:
        namespace, rest = parser.parse_known_args(argv)
    else:
        namespace, rest = parser.parse_args(argv), None
    values = {item.name: getattr(namespace, item.name) for item in dataclasses.fields(options)}
    parsed = options(**values)
    return (parsed, rest, parser) if known_only else (parsed, parser)
