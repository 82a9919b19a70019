"""The trainer's modules that moved into rooms in 0.3.0, refused by their old names with the new one.

An old module path (``import smmd_train.launcher``, ``python -m smmd_train.gguf_convert``) fails in a
``ModuleNotFoundError`` that names where the module went (:class:`MovedModuleFinder`, installed when
``smmd_train`` is imported); a name taken from an old module that is now a room's package
(``from smmd_train.model import build_model``) fails in an ``ImportError`` naming the module that holds
it (:func:`room_attribute`). ``python -m smmd_train.checkpoint convert`` kept its spelling: the room
runs the conversion command.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

# old module -> where it is now
MOVED = {
    "smmd_train.arguments": "smmd_train.config.arguments", "smmd_train.run_config": "smmd_train.config.run_config",
    "smmd_train.numeric_targets": "smmd_train.data.numeric_targets",
    "smmd_train.launcher": "smmd_train.distributed.launcher",
    "smmd_train.sequence_parallel": "smmd_train.distributed.sequence_parallel",
    "smmd_train.preflight": "smmd_train.distributed.preflight",
    "smmd_train.process_start": "smmd_train.distributed.process_start",
    "smmd_train.process_end": "smmd_train.distributed.process_end",
    "smmd_train.presets": "smmd_train.model.presets", "smmd_train.autotp": "smmd_train.model.autotp",
    "smmd_train.commits": "smmd_train.checkpoint.commits", "smmd_train.universal": "smmd_train.checkpoint.universal",
    "smmd_train.resume": "smmd_train.checkpoint.resume", "smmd_train.experiment": "smmd_train.checkpoint.experiment",
    "smmd_train.export": "smmd_train.checkpoint.export",
    "smmd_train.dashboards": "smmd_train.monitor.dashboards",
    "smmd_train.metrics_file": "smmd_train.monitor.metrics_file",
    "smmd_train.loss_reporter": "smmd_train.components.loss_reporter",
    "smmd_train.evaluation": "smmd_train.components.evaluation",
    "smmd_train.schedule": "smmd_train.components.schedule",
    "smmd_train.guard": "smmd_train.components.guard",
    "smmd_train.memory": "smmd_train.tools.memory", "smmd_train.scaling": "smmd_train.tools.scaling",
    "smmd_train.gguf_convert": "smmd_train.tools.gguf_convert", "smmd_train.dry_run": "smmd_train.tools.dry_run",
    "smmd_train.options": "smmd_cli.options", "smmd_train.tables": "smmd_cli.tables",
}
# old module that is now a room's package -> the room's modules that hold what it held
BECAME_ROOMS = {
    "smmd_train.config": ("smmd_train.config.deepspeed", ),
    "smmd_train.data": ("smmd_train.data.sources", "smmd_train.data.packing", "smmd_train.data.batches"),
    "smmd_train.distributed": ("smmd_train.distributed.groups", ),
    "smmd_train.model": ("smmd_train.model.build", ),
    "smmd_train.checkpoint": ("smmd_train.checkpoint.saving", ),
    "smmd_train.monitor": ("smmd_train.monitor.training", ),
}


def moved_error(old: str) -> ModuleNotFoundError:
    return ModuleNotFoundError(f"{old} moved to {MOVED[old]} in smmd-scale 0.3.0 (the trainer in rooms; "
                               "docs/changelog.md)", name=old)


class MovedModuleFinder(importlib.abc.MetaPathFinder):
    """Refuses the old module paths of :data:`MOVED` by name."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname in MOVED:
            raise moved_error(fullname)
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(finder, MovedModuleFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModuleFinder())


def room_attribute(room: str, name: str):
    """A room package's ``__getattr__`` (``room`` one of :data:`BECAME_ROOMS`): a name its old module
    held is refused naming the room's module that holds it now."""
    # (a module of the room itself is not refused: ``from room import module`` asks here first, then
    # imports it when this raises AttributeError)
    if not name.startswith("__") and importlib.util.find_spec(f"{room}.{name}") is None:
        for module in BECAME_ROOMS[room]:
            if hasattr(importlib.import_module(module), name):
                raise ImportError(f"{room} is a room since smmd-scale 0.3.0: {name} is in {module}",
                                  name=room)
    raise AttributeError(f"module {room!r} has no attribute {name!r}")
