"""launch/pretrain.sh and launch/continue_pretrain.sh compose the deepspeed command a user expects
from their environment variables, through smmd_train.launcher (the builder the Python tools use). A
stand-in `deepspeed` (DEEPSPEED) records its arguments, so these tests check the command line itself;
train.py under the real launcher is test_launch.py's."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.launching import REPO

from smmd_train.launcher import launch_command

STUB = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD"
pwd > "$RECORD.cwd"
"""
TRAIN_SCRIPT = str(REPO / "launch" / "train.py")


def launch(tmp_path: Path, script: str, cwd=None, **variables) -> tuple:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "deepspeed").write_text(STUB)
    (bin_dir / "deepspeed").chmod(0o755)
    record = tmp_path / "argv.txt"
    record.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items()
           if key not in {"NUM_NODES", "GPUS_PER_NODE", "HOSTFILE", "MODEL", "DATA", "TOKENIZER", "MODEL_DIR", "TP",
                          "MASTER_ADDR", "MASTER_PORT"}}
    env.update(PYTHON=sys.executable, DEEPSPEED=str(bin_dir / "deepspeed"), RECORD=str(record),
               **{k: str(v) for k, v in variables.items()})
    completed = subprocess.run(["bash", str(REPO / "launch" / script), "--seed", "7"], env=env, cwd=cwd,
                               capture_output=True, text=True, timeout=60)
    argv = record.read_text().splitlines() if record.exists() else None
    return completed, argv


def flag(argv: list, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_pretrain_single_node_command(tmp_path):
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/data/tok", DATA="/data/a.jsonl /data/b.jsonl",
                             MODEL="7b", GPUS_PER_NODE=4, MASTER_PORT=29811, SP=2)
    assert completed.returncode == 0, completed.stderr
    assert flag(argv, "--num_nodes") == "1" and flag(argv, "--num_gpus") == "4"
    assert flag(argv, "--master_port") == "29811" and "--hostfile" not in argv
    assert argv[argv.index(TRAIN_SCRIPT) + 1:argv.index(TRAIN_SCRIPT) + 7] == [
        "--deepspeed_config", str(REPO / "ds_configs" / "zero3.json"), "--tp", "1", "--sp", "2"]
    assert flag(argv, "--model") == "7b" and flag(argv, "--tokenizer") == "/data/tok"
    data = argv.index("--data")
    assert argv[data + 1:data + 3] == ["/data/a.jsonl", "/data/b.jsonl"]  # several files stay several
    assert flag(argv, "--numeric_loss") == "smmd:1" and "--resume" in argv
    assert argv[-2:] == ["--seed", "7"]  # extra arguments reach train.py last


def test_multi_node_needs_an_existing_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/t", DATA="/d", NUM_NODES=2, HOSTFILE=hostfile)
    assert completed.returncode == 2 and argv is None
    assert f"HOSTFILE={hostfile} does not exist" in completed.stderr
    hostfile.write_text("node-001 slots=8\nnode-002 slots=8\n")
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/t", DATA="/d", NUM_NODES=2, HOSTFILE=hostfile)
    assert completed.returncode == 0, completed.stderr
    assert flag(argv, "--num_nodes") == "2" and flag(argv, "--hostfile") == str(hostfile)


@pytest.mark.parametrize("script, missing", [("pretrain.sh", "TOKENIZER"), ("continue_pretrain.sh", "MODEL_DIR")])
def test_a_missing_required_variable_is_named(tmp_path, script, missing):
    completed, argv = launch(tmp_path, script, DATA="/d")
    assert completed.returncode != 0 and argv is None
    assert f"set {missing}" in completed.stderr


def test_continue_pretrain_command(tmp_path):
    completed, argv = launch(tmp_path, "continue_pretrain.sh", MODEL_DIR="/models/llama-3-8b", DATA="/data/math.jsonl",
                             DS_CONFIG="ds_configs/zero3_offload.json", TP=2, LR="1e-5")
    assert completed.returncode == 0, completed.stderr
    assert flag(argv, "--model") == "/models/llama-3-8b" and "--tokenizer" not in argv
    assert flag(argv, "--deepspeed_config") == "ds_configs/zero3_offload.json" and flag(argv, "--lr") == "1e-5"
    assert flag(argv, "--tp") == "2" and flag(argv, "--sp") == "1"
    assert flag(argv, "--output_dir") == "outputs/continue-llama-3-8b"
    assert flag(argv, "--export_hf") == "outputs/continue-llama-3-8b/hf"


def test_without_gpus_per_node_deepspeed_counts_the_devices(tmp_path):
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/t", DATA="/d")
    assert completed.returncode == 0, completed.stderr
    assert "--num_gpus" not in argv  # it would launch that many ranks whatever the node has
    assert flag(argv, "--master_addr") == "127.0.0.1" and int(flag(argv, "--master_port")) > 0


def test_a_hostfile_launch_leaves_the_master_to_deepspeed_unless_given(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-001 slots=8\nnode-002 slots=8\n")
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/t", DATA="/d", NUM_NODES=2, HOSTFILE=hostfile)
    assert completed.returncode == 0, completed.stderr
    assert "--master_addr" not in argv and "--master_port" not in argv  # DeepSpeed: the first host, 29500
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/t", DATA="/d", NUM_NODES=2, HOSTFILE=hostfile,
                             MASTER_ADDR="10.0.0.7", MASTER_PORT=29600)
    assert completed.returncode == 0, completed.stderr
    assert flag(argv, "--master_addr") == "10.0.0.7" and flag(argv, "--master_port") == "29600"


def test_the_builder_on_one_node_and_across_a_hostfile():
    one_node = launch_command("train.py", "--x", deepspeed="ds")
    assert one_node[:5] == ["ds", "--num_nodes", "1", "--master_addr", "127.0.0.1"]
    assert one_node[5] == "--master_port" and int(one_node[6]) > 0 and one_node[7:] == ["train.py", "--x"]
    assert launch_command("train.py", processes=2, master_port=1234, deepspeed="ds") == [
        "ds", "--num_nodes", "1", "--num_gpus", "2", "--master_addr", "127.0.0.1", "--master_port", "1234", "train.py"]
    assert launch_command("train.py", nodes=2, hostfile="hosts", deepspeed="ds") == [
        "ds", "--hostfile", "hosts", "--num_nodes", "2", "train.py"]
    with pytest.raises(ValueError, match="nodes=2 needs a hostfile naming them"):
        launch_command("train.py", nodes=2)
    with pytest.raises(ValueError, match="nodes=0 must be at least 1"):
        launch_command("train.py", nodes=0)


def test_the_builder_s_command_line_entry_reports_a_bad_placement():
    completed = subprocess.run([sys.executable, "-m", "smmd_train.launcher", "--nodes", "2", "train.py"],
                               capture_output=True, text=True, timeout=60)
    assert completed.returncode == 2 and "nodes=2 needs a hostfile naming them" in completed.stderr


@pytest.mark.parametrize("script, required", [("pretrain.sh", {"TOKENIZER": "/t"}),
                                              ("continue_pretrain.sh", {"MODEL_DIR": "/models/m"})])
def test_neither_launcher_passes_a_device_count_or_master_the_user_did_not_set(tmp_path, script, required):
    """Multi-node from a login node: a forced --num_gpus would start that many ranks whatever a node
    has (and drop CUDA_VISIBLE_DEVICES); a forced --master_addr would make every rank dial the login
    node. DeepSpeed's defaults (the devices it counts, the hostfile's first host) are right."""
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-001 slots=8\nnode-002 slots=8\n")
    completed, argv = launch(tmp_path, script, DATA="/d", NUM_NODES=2, HOSTFILE=hostfile, **required)
    assert completed.returncode == 0, completed.stderr
    launcher_args = argv[:argv.index(TRAIN_SCRIPT)]
    assert launcher_args == ["--hostfile", str(hostfile), "--num_nodes", "2"]


@pytest.mark.parametrize("script, required, model_flag", [
    ("pretrain.sh", {"TOKENIZER": "tok"}, "--tokenizer"),
    ("continue_pretrain.sh", {"MODEL_DIR": "models/m"}, "--model")])
def test_relative_paths_are_the_caller_s(tmp_path, script, required, model_flag):
    """The launchers start the ranks in the caller's folder and pass relative paths as given, so
    ``DATA=data/a.jsonl`` means the caller's ``data/a.jsonl`` (scaling.sh's rule too); only the
    launcher's own files (train.py, the default DeepSpeed config and hostfile) are found beside it."""
    caller = tmp_path / "project"
    caller.mkdir()
    completed, argv = launch(tmp_path, script, cwd=caller, DATA="data/a.jsonl", OUTPUT_DIR="runs/one",
                             DS_CONFIG="my_zero3.json", **required)
    assert completed.returncode == 0, completed.stderr
    assert Path(str(tmp_path / "argv.txt") + ".cwd").read_text().strip() == str(caller)
    assert TRAIN_SCRIPT in argv
    assert flag(argv, "--data") == "data/a.jsonl" and flag(argv, "--output_dir") == "runs/one"
    assert flag(argv, "--deepspeed_config") == "my_zero3.json"
    assert flag(argv, model_flag) == next(iter(required.values()))
    assert not (REPO / "runs").exists()
