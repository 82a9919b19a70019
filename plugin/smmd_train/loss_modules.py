"""``--loss_module MODULE [MODULE ...]``: a user's own numeric losses, imported before the trainer reads
the loss registry. Each module registers its losses when imported
(``smmd_scale.registry.register_numeric_loss``); from then on they are train.py's like the built-in
ones: ``--numeric_loss NAME:WEIGHT``, their option flags, ``loss/<stat_name>`` in TensorBoard, HParams
columns, the resume record. ``launch/train.py`` and ``smmd-train`` import them first (:func:`import_loss_modules`
on the command line); train.py's parser names the flag and checks it again. Nothing else is imported here.
"""

from __future__ import annotations

import importlib
from typing import Sequence

FLAG = "--loss_module"


def loss_modules_in(argv: Sequence[str]) -> list:
    """The module names given with ``--loss_module`` (``--loss_module a b``, ``--loss_module=a``, or the
    flag repeated) in a command line, in order, before any parser exists."""
    found, taking = [], False
    for token in map(str, argv):
        if token == FLAG:
            taking = True
        elif token.startswith(FLAG + "="):
            found.append(token.split("=", 1)[1])
            taking = False
        elif taking and not token.startswith("-"):
            found.append(token)
        else:
            taking = False
    return found


def import_loss_modules(argv: Sequence[str]) -> list:
    """Import each ``--loss_module`` of ``argv``; a module that cannot be imported fails naming the flag."""
    names = loss_modules_in(argv)
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as error:
            raise SystemExit(f"{FLAG} {name}: cannot import it ({error}); put its folder on PYTHONPATH") from error
    return names
