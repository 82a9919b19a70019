"""The console commands ``pip install`` makes (setup.cfg's ``console_scripts``). ``pip install -e .``
installs the loss plugin alone, and these commands with it, but not what they run on: each command
first checks that the extra it needs is installed and, where it is not, says what to install (one
line, exit 2) instead of failing on an import. Nothing heavy is imported before that check.
"""

from __future__ import annotations

import importlib
import re
import sys
from importlib import metadata

DISTRIBUTION = "smmd-scale"
# Console command -> (the program it runs, the extra that program needs).
PROGRAMS = {
    "smmd-train": ("smmd_train.train:cli", "train"),
    "smmd-sweep": ("smmd_train.tools.scaling:main", "train"),
    "smmd-estimate": ("smmd_train.tools.memory:main", "train"),
    "smmd-evaluate": ("smmd_numeracy.evaluate_cli:cli", "train"),
    "smmd-convert-gguf": ("smmd_train.tools.gguf_convert:main", "finetune"),
}


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def extra_requirements(extra: str) -> list:
    """The distributions ``extra`` adds, as the installed metadata of smmd-scale declares them (an
    extra that includes another, ``smmd-scale[train]``, adds that one's too)."""
    needed = []
    for requirement in metadata.requires(DISTRIBUTION) or []:
        specifier, _, marker = requirement.partition(";")
        if " ".join(marker.replace("'", '"').split()) != f'extra == "{extra}"':
            continue
        name = re.match(r"[A-Za-z0-9._-]+", specifier.strip()).group()
        included = re.search(r"\[(.+)\]", specifier)
        if _canonical(name) == DISTRIBUTION and included:
            needed += [inner for part in included.group(1).split(",") for inner in extra_requirements(part.strip())]
        else:
            needed.append(name)
    return needed


def missing_requirements(extra: str) -> list:
    """The distributions of ``extra`` that are not installed."""
    missing = []
    for name in extra_requirements(extra):
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _run(command: str, argv):
    target, extra = PROGRAMS[command]
    missing = missing_requirements(extra)
    if missing:
        print(f"{command} needs smmd-scale's {extra} extra, which is not installed (missing: {', '.join(missing)}): "
              f'pip install "smmd-scale[{extra}]" (in a checkout: pip install -e ".[{extra}]")', file=sys.stderr)
        return 2
    module, function = target.split(":")
    if command in ("smmd-train", "smmd-sweep"):  # a user's own losses register before the trainer reads the registry
        from .loss_modules import import_loss_modules

        import_loss_modules(sys.argv[1:] if argv is None else argv)
    return getattr(importlib.import_module(module), function)(argv)


def train(argv=None):
    return _run("smmd-train", argv)


def sweep(argv=None):
    return _run("smmd-sweep", argv)


def estimate(argv=None):
    return _run("smmd-estimate", argv)


def evaluate(argv=None):
    return _run("smmd-evaluate", argv)


def convert_gguf(argv=None):
    return _run("smmd-convert-gguf", argv)
