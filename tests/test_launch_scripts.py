"""launch/pretrain.sh and launch/continue_pretrain.sh compose the deepspeed command a user expects
from their environment variables. A stand-in `deepspeed` first on PATH records its arguments, so
these tests check the command line itself; train.py under the real launcher is test_launch.py's."""

import os
import subprocess
from pathlib import Path

import pytest

from launching import REPO

STUB = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD"
"""


def launch(tmp_path: Path, script: str, **variables) -> tuple:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "deepspeed").write_text(STUB)
    (bin_dir / "deepspeed").chmod(0o755)
    record = tmp_path / "argv.txt"
    record.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items()
           if key not in {"NUM_NODES", "GPUS_PER_NODE", "HOSTFILE", "MODEL", "DATA", "TOKENIZER", "MODEL_DIR", "TP"}}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", RECORD=str(record), **{k: str(v) for k, v in variables.items()})
    completed = subprocess.run(["bash", str(REPO / "launch" / script), "--seed", "7"], env=env,
                               capture_output=True, text=True, timeout=60)
    argv = record.read_text().splitlines() if record.exists() else None
    return completed, argv


def flag(argv: list, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_pretrain_single_node_command(tmp_path):
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/data/tok", DATA="/data/a.jsonl /data/b.jsonl",
                             MODEL="7b", GPUS_PER_NODE=4, MASTER_PORT=29811)
    assert completed.returncode == 0, completed.stderr
    assert flag(argv, "--num_nodes") == "1" and flag(argv, "--num_gpus") == "4"
    assert flag(argv, "--master_port") == "29811" and "--hostfile" not in argv
    assert argv[argv.index("launch/train.py") + 1:argv.index("launch/train.py") + 5] == [
        "--deepspeed_config", "ds_configs/zero3.json", "--tp", "1"]
    assert flag(argv, "--model") == "7b" and flag(argv, "--tokenizer") == "/data/tok"
    data = argv.index("--data")
    assert argv[data + 1:data + 3] == ["/data/a.jsonl", "/data/b.jsonl"]  # several files stay several
    assert flag(argv, "--smmd_weight") == "1.0" and "--resume" in argv
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
    assert flag(argv, "--tp") == "2"
    assert flag(argv, "--output_dir") == "outputs/continue-llama-3-8b"
    assert flag(argv, "--export_hf") == "outputs/continue-llama-3-8b/hf"
