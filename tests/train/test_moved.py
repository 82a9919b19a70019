"""The trainer's modules moved into rooms in 0.3.0 (``smmd_train.moved``): every old module path and
every name taken from an old module that became a room's package is refused by name with where it went,
through ``import`` and through ``python -m`` as the shell launchers call it; the table matches the files;
``python -m smmd_train.checkpoint convert`` keeps its spelling."""

import importlib
import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment

import smmd_train
from smmd_train.moved import BECAME_ROOMS, MOVED

TRAINER = REPO / "plugin" / "smmd_train"


def module_file(dotted: str):
    """The file (module or package) of a dotted name under plugin/, or None."""
    path = REPO / "plugin" / dotted.replace(".", "/")
    return next((found for found in (path.with_suffix(".py"), path / "__init__.py") if found.exists()), None)


def test_the_table_matches_the_files():
    assert {old.rpartition(".")[2] for old in MOVED} | {room.rpartition(".")[2] for room in BECAME_ROOMS} \
        == {"arguments", "run_config", "numeric_targets", "launcher", "sequence_parallel", "preflight",
            "process_start", "process_end", "presets", "autotp", "commits", "universal", "resume", "experiment",
            "export", "dashboards", "metrics_file", "loss_reporter", "evaluation", "schedule", "guard", "memory",
            "scaling", "gguf_convert", "dry_run", "options", "tables",
            "config", "data", "distributed", "model", "checkpoint", "monitor"}
    for old, new in MOVED.items():
        assert module_file(old) is None, f"{old} is still there"
        assert module_file(new) is not None and module_file(new).suffix == ".py", new
    for room, modules in BECAME_ROOMS.items():
        assert module_file(room).name == "__init__.py", room
        assert all(module_file(module) for module in modules), room


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_module_path_is_refused_naming_the_new_one(old):
    assert smmd_train.moved.MovedModuleFinder in {type(finder) for finder in sys.meta_path}
    with pytest.raises(ModuleNotFoundError, match=rf"^{old} moved to {MOVED[old]} in smmd-scale 0\.3\.0"):
        importlib.import_module(old)
    assert importlib.import_module(MOVED[old]).__name__ == MOVED[old]


def test_a_name_of_a_module_that_became_a_room_is_refused_naming_its_module():
    cases = {"smmd_train.config": "load_config", "smmd_train.data": "PackedBatches",
             "smmd_train.distributed": "init_distributed", "smmd_train.model": "build_model",
             "smmd_train.checkpoint": "Checkpointer", "smmd_train.monitor": "TrainingMonitor"}
    assert set(cases) == set(BECAME_ROOMS)
    for room, name in cases.items():
        holder = next(module for module in BECAME_ROOMS[room] if hasattr(importlib.import_module(module), name))
        with pytest.raises(ImportError, match=rf"^{room} is a room since smmd-scale 0\.3\.0: {name} is in {holder}$"):
            exec(f"from {room} import {name}", {})
    # a room's own module is taken from it as a module is from a package, also before it was imported
    # (smmd_train.monitor.training imports dashboards: the name is the old module's too)
    fresh = subprocess.run([sys.executable, "-c", "from smmd_train.monitor import dashboards, training; "
                            "from smmd_train.data import packing; from smmd_train.checkpoint import universal; "
                            "print(dashboards.__name__, packing.__name__)"],
                           env=environment(), capture_output=True, text=True, timeout=hang_guard(120))
    assert fresh.stdout.split() == ["smmd_train.monitor.dashboards", "smmd_train.data.packing"], fresh.stderr[-2000:]
    with pytest.raises(AttributeError, match="has no attribute 'never_there'"):
        importlib.import_module("smmd_train.model").never_there  # noqa: B018 (the attribute read is the test)


def test_python_dash_m_with_an_old_path_fails_naming_the_new_one_and_checkpoint_keeps_its_spelling():
    old = subprocess.run([sys.executable, "-m", "smmd_train.launcher", "--help"], env=environment(),
                         capture_output=True, text=True, timeout=hang_guard(120))
    assert old.returncode != 0
    assert "smmd_train.launcher moved to smmd_train.distributed.launcher" in old.stderr, old.stderr[-2000:]
    kept = subprocess.run([sys.executable, "-m", "smmd_train.checkpoint", "convert", "--help"], env=environment(),
                          capture_output=True, text=True, timeout=hang_guard(120))
    assert kept.returncode == 0 and "usage: python -m smmd_train.checkpoint convert" in kept.stdout, kept.stderr[-2000:]
