"""launch/pretrain.sh and launch/continue_pretrain.sh compose the deepspeed command a user expects
from their environment variables, through smmd_train.distributed.launcher (the builder the Python tools use). A
stand-in `deepspeed` (DEEPSPEED) records its arguments, so these tests check the command line itself;
train.py under the real launcher is test_launch.py's. A flag that the DeepSpeed config could decide
is passed only when its variable is set; a stand-in that resolves train.py's plan from the command
line and environment the script produced shows a user's JSON is then read, not contradicted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO

from smmd_train.distributed.launcher import launch_command

STUB = """#!/usr/bin/env bash
printf '%s\\n' "$@" > "$RECORD"
pwd > "$RECORD.cwd"
printf '%s' "${SMMD_FLAG_SOURCES-unset}" > "$RECORD.sources"
"""
TRAIN_SCRIPT = str(REPO / "launch" / "train.py")
# The stand-in that plans the run train.py would start from the arguments after train.py and the
# environment the launcher passes on: train.py's parser and its plan (tokenizer, architecture, the
# DeepSpeed config reconciled with the flags), one rank, no process group, no model.
PLANNER = f"""#!{sys.executable}
import json, sys
from smmd_train.config.arguments import parse_args
from smmd_train.distributed.groups import Launch
from smmd_train.run import RunRefused, prepare_run
from smmd_train.config.run_config import RunConfig
try:
    config = RunConfig.from_args(parse_args(sys.argv[sys.argv.index({TRAIN_SCRIPT!r}) + 1:]))
    run = prepare_run(config, Launch(0, 1, 0, 1, "single"), until="plan")
except RunRefused as error:
    sys.exit("refused: " + str(error))
print(json.dumps({{"ds_config": run.plan.ds_config, "lr": run.plan.schedule.lr}}))
"""
# Every variable the launchers read, so that the caller's environment cannot leak into a test.
VARIABLES = {"NUM_NODES", "GPUS_PER_NODE", "HOSTFILE", "MODEL", "DATA", "TOKENIZER", "MODEL_DIR", "TP", "SP",
             "MASTER_ADDR", "MASTER_PORT", "DS_CONFIG", "SEQ_LEN", "MICRO_BATCH", "GRAD_ACCUM", "LR", "WARMUP_STEPS",
             "NUMERIC_LOSS", "MAX_STEPS", "SAVE_STEPS", "OUTPUT_DIR", "EXPORT_DIR", "SMMD_FLAG_SOURCES"}
# The variables passed only when set: variable -> (flag, a value).
ONLY_WHEN_SET = {"MICRO_BATCH": ("--micro_batch_size", "2"), "GRAD_ACCUM": ("--gradient_accumulation_steps", "8"),
                 "LR": ("--lr", "2e-5"), "WARMUP_STEPS": ("--warmup_steps", "50"), "TP": ("--tp", "2"),
                 "SP": ("--sp", "2"), "NUMERIC_LOSS": ("--numeric_loss", "smmd:1 ntl-was:0.3")}


def launch(tmp_path: Path, script: str, cwd=None, stub=STUB, **variables) -> tuple:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "deepspeed").write_text(stub)
    (bin_dir / "deepspeed").chmod(0o755)
    record = tmp_path / "argv.txt"
    record.unlink(missing_ok=True)
    env = {key: value for key, value in os.environ.items() if key not in VARIABLES}
    env.update(PYTHON=sys.executable, DEEPSPEED=str(bin_dir / "deepspeed"), RECORD=str(record),
               **{k: str(v) for k, v in variables.items()})
    completed = subprocess.run(["bash", str(REPO / "launch" / script), "--seed", "7"], env=env, cwd=cwd,
                               capture_output=True, text=True, timeout=hang_guard(120))
    argv = record.read_text().splitlines() if record.exists() else None
    return completed, argv


def sources(tmp_path: Path) -> str:
    """SMMD_FLAG_SOURCES as the stand-in launcher saw it."""
    return Path(str(tmp_path / "argv.txt") + ".sources").read_text()


def flag(argv: list, name: str) -> str:
    return argv[argv.index(name) + 1]


def test_pretrain_single_node_command(tmp_path):
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/data/tok", DATA="/data/a.jsonl /data/b.jsonl",
                             MODEL="7b", GPUS_PER_NODE=4, MASTER_PORT=29811, SP=2)
    assert completed.returncode == 0, completed.stderr
    assert flag(argv, "--num_nodes") == "1" and flag(argv, "--num_gpus") == "4"
    assert flag(argv, "--master_port") == "29811" and "--hostfile" not in argv
    assert argv[argv.index(TRAIN_SCRIPT) + 1:argv.index(TRAIN_SCRIPT) + 3] == [
        "--deepspeed_config", str(REPO / "ds_configs" / "zero3.json")]
    assert flag(argv, "--sp") == "2" and "--tp" not in argv  # TP unset: the config's autotp_size, else 1
    assert flag(argv, "--model") == "7b" and flag(argv, "--tokenizer") == "/data/tok"
    data = argv.index("--data")
    assert argv[data + 1:data + 3] == ["/data/a.jsonl", "/data/b.jsonl"]  # several files stay several
    assert "--numeric_loss" not in argv and "--resume" in argv  # NUMERIC_LOSS unset: train.py's smmd
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
    assert flag(argv, "--tp") == "2" and "--sp" not in argv  # SP unset: train.py's 1
    assert "--warmup_steps" not in argv  # WARMUP_STEPS unset: train.py's
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
    completed = subprocess.run([sys.executable, "-m", "smmd_train.distributed.launcher", "--nodes", "2", "train.py"],
                               capture_output=True, text=True, timeout=hang_guard(60))
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


@pytest.mark.parametrize("script, required", [("pretrain.sh", {"TOKENIZER": "/t"}),
                                              ("continue_pretrain.sh", {"MODEL_DIR": "/models/m"})])
def test_a_flag_the_config_could_decide_is_passed_only_when_its_variable_is_set(tmp_path, script, required):
    """A user's DeepSpeed JSON with its own micro-batch or lr must not meet a flag nobody typed; the
    flags the scripts decide themselves (sequence length, steps, checkpoints, --resume) stay."""
    completed, argv = launch(tmp_path, script, DATA="/d", **required)
    assert completed.returncode == 0, completed.stderr
    # zero3.json leaves the accumulation and the lr "auto": there the recipe's values (RECIPE_DEFAULTS)
    recipe = {"GRAD_ACCUM": "8", **({"LR": "2e-5"} if script == "continue_pretrain.sh" else {})}
    for variable, (name, _) in ONLY_WHEN_SET.items():
        if variable in recipe:
            assert argv.count(name) == 1 and flag(argv, name) == recipe[variable], variable
            continue
        assert name not in argv, f"{name} passed without {variable}"
    assert sources(tmp_path) == ""
    assert flag(argv, "--seq_len") == "4096" and "--resume" in argv
    assert flag(argv, "--max_steps") == {"pretrain.sh": "10000", "continue_pretrain.sh": "2000"}[script]
    assert flag(argv, "--save_steps") == {"pretrain.sh": "500", "continue_pretrain.sh": "250"}[script]

    values = {variable: value for variable, (_, value) in ONLY_WHEN_SET.items()}
    completed, argv = launch(tmp_path, script, DATA="/d", SEQ_LEN=8192, **values, **required)
    assert completed.returncode == 0, completed.stderr
    for variable, (name, value) in ONLY_WHEN_SET.items():
        given = argv.index(name)
        assert argv[given + 1:given + 1 + len(value.split())] == value.split(), variable  # several terms stay several
    assert flag(argv, "--seq_len") == "8192"
    assert sources(tmp_path).split() == [
        "micro_batch_size=MICRO_BATCH", "gradient_accumulation_steps=GRAD_ACCUM", "lr=LR", "warmup_steps=WARMUP_STEPS",
        "tp=TP", "sp=SP", "numeric_loss=NUMERIC_LOSS"]


@pytest.fixture(scope="module")
def user_config(tmp_path_factory) -> Path:
    """A user's DeepSpeed JSON that decides the micro-batch, the accumulation and the lr itself."""
    config = json.loads((REPO / "ds_configs" / "zero3.json").read_text())
    config.update(train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    config["optimizer"]["params"]["lr"] = 5e-5
    path = tmp_path_factory.mktemp("config") / "my.json"
    path.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A local Hugging Face model folder as continue_pretrain.sh takes it (config and tokenizer: the
    plan reads no weights)."""
    from transformers import AutoTokenizer

    from smmd_train.model.presets import preset_config

    directory = tmp_path_factory.mktemp("model")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.save_pretrained(directory)
    preset_config("tiny", vocab_size=-(-len(tokenizer) // 64) * 64).save_pretrained(directory)
    return directory


@pytest.mark.slow  # imports transformers and DeepSpeed and plans the run: seconds
def test_continue_pretrain_without_variables_trains_with_the_user_s_json(tmp_path, model_dir, user_config):
    completed, argv = launch(tmp_path, "continue_pretrain.sh", stub=PLANNER, MODEL_DIR=model_dir, DATA="/d",
                             DS_CONFIG=user_config, OUTPUT_DIR=tmp_path / "run", DS_ACCELERATOR="cpu")
    assert completed.returncode == 0, completed.stderr
    plan = json.loads(completed.stdout.splitlines()[-1])
    assert plan["ds_config"]["train_micro_batch_size_per_gpu"] == 4
    assert plan["ds_config"]["gradient_accumulation_steps"] == 2
    assert plan["ds_config"]["train_batch_size"] == 8  # 4 x 2 x one data-parallel rank
    assert plan["ds_config"]["optimizer"]["params"]["lr"] == 5e-5 and plan["lr"] == 5e-5  # the schedule's peak


@pytest.mark.slow  # imports transformers and DeepSpeed and plans the run: seconds
def test_a_variable_that_contradicts_the_user_s_json_is_refused_by_name(tmp_path, model_dir, user_config):
    completed, _ = launch(tmp_path, "continue_pretrain.sh", stub=PLANNER, MODEL_DIR=model_dir, DATA="/d",
                          DS_CONFIG=user_config, OUTPUT_DIR=tmp_path / "run", DS_ACCELERATOR="cpu",
                          MICRO_BATCH=2, LR="1e-4")
    assert completed.returncode == 1 and completed.stdout == ""
    assert completed.stderr.strip().splitlines()[-2:] == [  # one line per conflict, each naming its variable
        "refused: --micro_batch_size 2 (set by MICRO_BATCH) but the DeepSpeed config says "
        "train_micro_batch_size_per_gpu=4: unset MICRO_BATCH, or make them agree, or set "
        "train_micro_batch_size_per_gpu to \"auto\"",
        "--lr 0.0001 (set by LR) but the DeepSpeed config says optimizer.params.lr=5e-05: unset LR, or make them "
        "agree, or set optimizer.params.lr to \"auto\""]


def test_the_recipe_s_values_apply_only_where_the_config_leaves_them_auto(tmp_path, user_config):
    """2e-5 for continued pretraining and 8 accumulation steps when neither the variable nor the
    DeepSpeed JSON says (zero3.json: "auto"); a JSON with its own values keeps them (no flag to
    contradict it), the variable wins over both."""
    completed, argv = launch(tmp_path, "continue_pretrain.sh", MODEL_DIR="/m", DATA="/d")
    assert completed.returncode == 0 and flag(argv, "--lr") == "2e-5"
    assert flag(argv, "--gradient_accumulation_steps") == "8"
    completed, argv = launch(tmp_path, "continue_pretrain.sh", MODEL_DIR="/m", DATA="/d", DS_CONFIG=user_config)
    assert completed.returncode == 0 and "--lr" not in argv and "--gradient_accumulation_steps" not in argv
    completed, argv = launch(tmp_path, "continue_pretrain.sh", MODEL_DIR="/m", DATA="/d", LR="1e-5", GRAD_ACCUM=2)
    assert completed.returncode == 0 and argv.count("--lr") == 1 and flag(argv, "--lr") == "1e-5"
    assert argv.count("--gradient_accumulation_steps") == 1 and flag(argv, "--gradient_accumulation_steps") == "2"
    completed, argv = launch(tmp_path, "pretrain.sh", TOKENIZER="/t", DATA="/d", DS_CONFIG=tmp_path / "missing.json")
    assert completed.returncode == 0 and "--gradient_accumulation_steps" not in argv  # train.py names the file
