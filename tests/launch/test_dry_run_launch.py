"""train.py --dry_run as users start it (``python launch/train.py --dry_run``, ``launch/pretrain.sh --dry_run``)
against real 2-rank starts of the same command lines: the plan, the parameters each rank holds and the bytes
the loss exchanges agree exactly with what the real run logs, and a refusal is the same line in both."""

import json
import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment, metrics, run, run_many
from helpers.train_runs import corpus_fixture, deepspeed_command, train_args

corpus = corpus_fixture()  # the module's corpus on disk (a module-scoped fixture)


def dry(arguments: list, world_size: int = 2) -> list:
    """The dry run of a real start's ``arguments`` (train.py and its flags) for ``world_size`` ranks."""
    return [sys.executable, *map(str, arguments), "--dry_run", "--world_size", str(world_size)]


def lines(output: str, prefix: str) -> list:
    return [line for line in output.splitlines() if line.startswith(prefix)]


@pytest.mark.slow
def test_a_dry_run_at_world_2_agrees_with_real_2_rank_runs(tmp_path, corpus):
    # Two layouts of the tiny preset: AutoTP 2 with the fused linear head (the loss exchanges, forward and
    # backward) and 2 micro-batches per step, and ZeRO-3 over 2 data-parallel ranks (each parameter split).
    layouts = {"tp2": dict(tp=2, fused_linear=True, micro_batch_size=1, gradient_accumulation_steps=2),
               "dp2": dict(tp=1, micro_batch_size=1)}
    commands = {}
    for name, options in layouts.items():
        commands[name] = deepspeed_command(2, *train_args(corpus, tmp_path / name, steps=3, **options))
        commands[f"{name} dry"] = dry(train_args(corpus, tmp_path / f"{name}-dry", steps=3, **options))
    completed = run_many(commands, timeout=600)
    for name in layouts:
        real, checked = tmp_path / name, tmp_path / f"{name}-dry"
        recorded, record = json.loads((real / "run_config.json").read_text()), \
            json.loads((checked / "dry_run.json").read_text())
        # the plan: the layout and the resolved DeepSpeed config
        assert {key: recorded[key] for key in ("world_size", "tp_size", "dp_size", "sp_size")} == \
            {key: record[key] for key in ("world_size", "tp_size", "dp_size", "sp_size")}
        assert recorded["deepspeed_config"] == record["deepspeed_config"]
        # what rank 0 holds: the same two numbers, measured on the engine's parameters and counted from shapes
        assert recorded["rank_parameters"] == {key: record["parameters"][key]
                                               for key in ("tensor_parallel", "zero_partition")}
        for prefix in ("[train] world 2 = ", "[train] parameters on rank 0: ", "[train] warning: "):
            real_lines = [line.split(" (deepspeed/torchrun)")[0] for line in lines(completed[name].stdout, prefix)]
            dry_lines = [line.split(" (dry run)")[0] for line in lines(completed[f"{name} dry"].stdout, prefix)]
            assert real_lines == dry_lines, prefix
        # what rank 0 sends: the loss's exchange in each step, forward and backward, byte for byte
        logged = metrics(real)
        assert [logged[step]["comm/loss_bytes"] for step in (1, 2, 3)] == record["loss_exchange"]["bytes_per_step"]
        assert [logged[step]["comm/loss_backward_bytes"] for step in (1, 2, 3)] == \
            record["loss_exchange"]["backward_bytes_per_step"]
        if name == "tp2":
            assert all(sent > 0 for sent in record["loss_exchange"]["backward_bytes_per_step"])


@pytest.mark.slow
def test_a_refusal_is_the_same_line_in_a_dry_run_and_a_real_start(tmp_path, corpus):
    # --tp 4 on 2 ranks of a model with 2 KV heads: two problems, one line each, before any model exists
    arguments = train_args(corpus, tmp_path / "run", steps=2, tp=4)
    outcomes = {}
    for name, command in (("real", deepspeed_command(2, *arguments)), ("dry", dry(arguments))):
        completed = subprocess.run([str(part) for part in command], env=environment(), cwd=REPO, capture_output=True,
                                   text=True, timeout=hang_guard(300))
        outcomes[name] = (completed.returncode != 0, lines(completed.stderr, "[train] refused: "))
    assert outcomes["real"][0] and outcomes["dry"][0]
    assert outcomes["real"][1] == outcomes["dry"][1] == [
        "[train] refused: --tp 4 is more than the model's num_key_value_heads=2: AutoTP splits attention by whole "
        "key/value heads (each with its query heads), so rank 2 would hold none; use --tp 2 or less (it need not "
        "divide 2) and data parallelism for the other ranks",
        "[train] refused: tensor_parallel.autotp_size=4 (--tp) must divide the world size 2 (the ranks are split "
        "into world/autotp_size data-parallel groups of autotp_size ranks)"]


def test_pretrain_sh_runs_the_dry_run_in_one_process_for_nodes_x_gpus_per_node(tmp_path, corpus):
    # 2 nodes of 4 GPUs at TP 2, no hostfile (a dry run starts nothing on the nodes), the script's own
    # accumulation of 8: the table of rank 0 of 8, exit 0
    variables = dict(NUM_NODES="2", GPUS_PER_NODE="4", MODEL="tiny", TP="2", TOKENIZER=str(corpus / "tokenizer"),
                     DATA=str(corpus / "train.jsonl"), SEQ_LEN="48", MAX_STEPS="3", OUTPUT_DIR=str(tmp_path / "run"),
                     PYTHON=sys.executable, HOSTFILE=str(tmp_path / "no-hostfile"))
    completed = run(["bash", REPO / "launch" / "pretrain.sh", "--dry_run"], timeout=120,
                    env=environment(**variables))
    assert "[train] world 8 = 4 data-parallel x 2 tensor-parallel x 1 sequence-parallel (dry run)" in completed.stdout
    record = json.loads((tmp_path / "run" / "dry_run.json").read_text())
    assert (record["nodes"], record["gpus_per_node"], record["gradient_accumulation_steps"]) == (2, 4, 8)
    assert record["resume_tag"] is None  # the scripts pass --resume: an empty output dir starts at step 0
    without = {key: value for key, value in environment(**variables).items() if key != "GPUS_PER_NODE"}
    refused = subprocess.run(["bash", str(REPO / "launch" / "pretrain.sh"), "--dry_run"], env=without,
                             capture_output=True, text=True, timeout=hang_guard(60))
    assert refused.returncode != 0 and "a dry run checks the NUM_NODES x GPUS_PER_NODE ranks of the job: set " \
                                       "GPUS_PER_NODE" in refused.stderr
