"""The console commands in setup.cfg: each names a callable that imports and answers --help, the
launch/ scripts that launchers start by path run the same programs (the one-process tools that no
launcher starts have none), and where only the loss plugin is installed each says what to install."""

import configparser
import importlib
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO

from smmd_train import commands

LAUNCH_SCRIPTS = {"smmd-train": "train.py", "smmd-sweep": "scaling.py", "smmd-estimate": "estimate.py",
                  "smmd-evaluate": "evaluate.py"}
ONE_PROCESS_TOOLS = {"smmd-convert-gguf"}


def console_scripts() -> dict:
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    lines = config["options.entry_points"]["console_scripts"].strip().splitlines()
    return dict(tuple(part.strip() for part in line.split("=")) for line in lines)


def test_the_commands_are_declared():
    assert sorted(console_scripts()) == sorted([*LAUNCH_SCRIPTS, *ONE_PROCESS_TOOLS]) == sorted(commands.PROGRAMS)
    for command, target in console_scripts().items():
        module_name, function_name = target.split(":")
        assert module_name == "smmd_train.commands", command
        assert function_name == command.removeprefix("smmd-").replace("-", "_"), command


def test_each_extra_the_commands_name_is_setup_cfg_s():
    """The installed metadata the commands read says what setup.cfg says (a stale install fails here)."""
    config = configparser.ConfigParser()
    config.read(REPO / "setup.cfg")
    extras = config["options.extras_require"]
    declared = {extra: [line.split(">")[0].split("<")[0].split("=")[0].strip()
                        for line in extras[extra].strip().splitlines()] for extra in ("train", "finetune")}
    assert commands.extra_requirements("train") == declared["train"]
    assert commands.extra_requirements("finetune") == declared["train"] + declared["finetune"][1:]
    assert declared["finetune"][0] == "smmd-scale[train]"
    assert {extra for _, extra in commands.PROGRAMS.values()} == {"train", "finetune"}


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
    program_module = commands.PROGRAMS[command][0].split(":")[0]
    assert program_module in (REPO / "launch" / LAUNCH_SCRIPTS[command]).read_text()


@pytest.mark.slow  # starts processes: a venv, pip, and each command
def test_with_the_loss_plugin_alone_each_command_says_what_to_install(tmp_path):
    """``pip install -e .`` of this checkout into a fresh virtual environment (no dependencies, no
    index: the build uses this environment's setuptools), then each console command pip wrote, run
    as a user would: one line naming the extra and the pip command, exit 2."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=hang_guard(120))
    python = venv / "bin" / "python"
    build_environment = {"PYTHONPATH": sysconfig.get_paths()["purelib"], "PATH": str(Path(sys.executable).parent)}
    completed = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
                                "--no-build-isolation", "--no-index", "-q", "-e", str(REPO)],
                               env=build_environment, capture_output=True, text=True, timeout=hang_guard(600))
    assert completed.returncode == 0, completed.stderr
    for command, (_, extra) in commands.PROGRAMS.items():
        completed = subprocess.run([str(venv / "bin" / command), "--help"], capture_output=True, text=True,
                                   env={"PATH": str(venv / "bin")}, timeout=hang_guard(120))
        assert completed.returncode == 2, (command, completed.stderr)
        assert completed.stdout == ""
        lines = completed.stderr.splitlines()
        assert len(lines) == 1, completed.stderr
        assert lines[0].startswith(f"{command} needs smmd-scale's {extra} extra, which is not installed (missing: "
                                   "deepspeed, transformers, "), lines[0]
        assert lines[0].endswith(f'pip install "smmd-scale[{extra}]" (in a checkout: pip install -e ".[{extra}]")')


@pytest.mark.slow
def test_a_mistyped_flag_is_refused_before_deepspeed_and_transformers_load():
    # A wall-clock bound would flake on a shared machine; what makes the refusal fast is that the two
    # heavy imports (seconds each, on every rank of a launch) have not happened when the parser refuses.
    # Python's -X importtime lists on stderr every module the process imported.
    completed = subprocess.run([sys.executable, "-X", "importtime", str(REPO / "launch" / "train.py"),
                                "--max_stpes", "3"], cwd=REPO, capture_output=True, text=True, timeout=hang_guard(120))
    assert completed.returncode == 2
    assert "unknown option --max_stpes; did you mean --max_steps" in completed.stderr
    imported = {line.rsplit("|", 1)[1].strip() for line in completed.stderr.splitlines()
                if line.startswith("import time:") and "|" in line}
    assert "torch" in imported  # the listing works (smmd_scale's registry imports torch)
    assert not imported & {"deepspeed", "transformers"}, sorted(imported & {"deepspeed", "transformers"})


@pytest.mark.slow
def test_the_help_shows_the_usage_example_as_written():
    completed = subprocess.run([sys.executable, str(REPO / "launch" / "train.py"), "--help"], cwd=REPO,
                               capture_output=True, text=True, timeout=hang_guard(120))
    assert completed.returncode == 0, completed.stderr
    lines = completed.stdout.splitlines()
    first = lines.index("    deepspeed --hostfile hostfile launch/train.py --deepspeed_config ds_configs/zero3.json "
                        "--tp 2 \\")
    assert lines[first + 1] == ("        --model 7b --tokenizer /data/tokenizer --data /data/corpus.jsonl "
                                "--output_dir /ckpt/run1")


def test_the_loss_modules_are_read_off_the_command_line_before_any_parser():
    """``--loss_module`` as argparse reads it (several after one flag, ``=``, the flag repeated), found
    by the pre-scan that launch/train.py, smmd-train and smmd-sweep run before the trainer is imported;
    a module that cannot be imported is named with the flag."""
    from smmd_train.loss_modules import import_loss_modules, loss_modules_in

    argv = ["--model", "tiny", "--loss_module", "a", "b.c", "--lr", "0.1", "--loss_module=d", "--numeric_loss",
            "smmd", "--loss_module", "e"]
    assert loss_modules_in(argv) == ["a", "b.c", "d", "e"]
    assert loss_modules_in(["--model", "tiny", "--numeric_loss", "smmd"]) == []
    assert import_loss_modules(["--loss_module", "json"]) == ["json"]
    with pytest.raises(SystemExit, match=r"^--loss_module no_such_module_here: cannot import it \(No module named"):
        import_loss_modules(["--loss_module", "no_such_module_here"])
