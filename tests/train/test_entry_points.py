"""The console commands in setup.cfg: each names a callable that imports and answers --help, and
the launch/ scripts that launchers start by path run the same programs (the one-process tools that no
launcher starts have none)."""

import configparser
import importlib
import subprocess
import sys

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


@pytest.mark.slow
def test_a_mistyped_flag_is_refused_before_deepspeed_and_transformers_load():
    # A wall-clock bound would flake on a shared machine; what makes the refusal fast is that the two
    # heavy imports (seconds each, on every rank of a launch) have not happened when the parser refuses.
    # Python's -X importtime lists on stderr every module the process imported.
    completed = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "launch" / "train.py"),
                                "--max_stpes", "3"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert completed.returncode == 2
    assert "unknown option --max_stpes; did you mean --max_steps" in completed.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in completed.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "torch" in imported  # the listing works (smmd_scale's registry imports torch)
    assert not imported & {"deepspeed", "transformers"}, sorted(imported & {"deepspeed", "transformers"})


@pytest.mark.slow
def test_the_help_shows_the_usage_example_as_written():
    completed = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    first = lines.index("    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json "
                        "--tp 2 \\")
    assert lines[first + 1] == ("        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl "
                                "--output_dir /ckpt/run1")
