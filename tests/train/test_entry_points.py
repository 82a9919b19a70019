"""The console commands in setup.cfg: each names a callable that imports and answers --help, and
the launch/ scripts that launchers start by path run the same programs (the one-process tools that no
launcher starts have none)."""

import configparser
import importlib

import pytest
from helpers.launching import REPO

LAUNCH_SCRIPTS = {"smmd-train": "train.py", "smmd-sweep": "scaling.py", "smmd-estimate": "estimate.py",
                  "smmd-evaluate": "evaluate.py"}
ONE_PROCESS_TOOLS = {"smmd-convert-gguf"}


def console_scripts() -> dict:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=")) for line in lines)


def test_the_commands_are_declared():
    assert sorted(console_scripts()) == sorted([*LAUNCH_SCRIPTS, *ONE_PROCESS_TOOLS])


@pytest.mark.parametrize("command", sorted([*LAUNCH_SCRIPTS, *ONE_PROCESS_TOOLS]))
def test_each_command_s_target_imports_and_answers_help(command, capsys):
    module_name, function_name = console_scripts()[command].split(":")
    target = getattr(importlib.import_module(module_name), function_name)
    with pytest.raises(SystemExit) as exit_status:
        target(["--help"])
    assert exit_status.value.code == 0
    assert "usage:" in capsys.readouterr().out
    if command in ONE_PROCESS_TOOLS:
        return
    # The launch/ script of the same program calls into the same module.
    assert module_name in (REPO / "launch" / LAUNCH_SCRIPTS[command]).read_text()
