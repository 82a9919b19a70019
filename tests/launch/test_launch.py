"""launch/train.py end to end on CPU through the deepspeed launcher: ZeRO-3 from scratch (TensorBoard
read back from the event files, an HF export), SIGKILL and exact resume, a crash mid-save, a longer
resumed run, and a ZeRO-3 checkpoint resumed at TP=2. One ZeRO-3 run is shared: the subject of the
first test and the uninterrupted reference of the resume tests. Layouts and launchers:
test_launch_parallel.py, test_launch_launchers.py."""

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment, metrics, run
from helpers.train_runs import (
    CONTRACT_SCALARS,
    assert_steps_5_and_6_continue,
    corpus_fixture,
    cut_back_to_step_4,
    deepspeed_command,
    eval_ce_of_hf_model,
    tensorboard_run,
    train_args,
)

from smmd_train.distributed.launcher import free_port
from smmd_train.monitor.metrics_file import read_metrics

pytestmark = pytest.mark.slow
corpus = corpus_fixture()  # the module's corpus on disk (a module-scoped fixture)


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory, corpus):
    """One 2-rank ZeRO-3 run from scratch (6 steps, a checkpoint every 2, an evaluation every 3, an
    HF export at the end): the subject of the ZeRO-3 test and the uninterrupted reference of the
    resume tests (evaluating changes no training state)."""
    output, port = tmp_path_factory.mktemp("zero3") / "run", free_port()
    completed = run(deepspeed_command(2, *train_args(corpus, output, steps=6, save_steps=2, eval_steps=3,
                                                     export_hf=output / "hf"), port=port), timeout=600)
    return output, port, completed.stdout + completed.stderr



def test_zero3_from_scratch_with_smmd(zero3_run, corpus):
    output, port, log = zero3_run
    # A clean run warns about nothing (the deepspeed launcher's own note that a one-node launch has
    # no hostfile aside), and says on the console what it did.
    warnings = [line for line in log.splitlines() if re.search(r"warn", line, re.IGNORECASE)
                and "Unable to find hostfile, will proceed with training with local resources only" not in line]
    assert not warnings, warnings
    for said in ("[train] step 3: eval ce", "[train] step 6: saved checkpoint", "[train] done: 6 step(s)",
                 "[train] final loss: total", "[train] throughput:", f"[train] Hugging Face model: {output / 'hf'}"):
        assert said in log, said
    # DeepSpeed's CPU all-reduce segments (64 MiB per rank) are not left behind in /dev/shm.
    assert not list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_127.0.0.1_{port}_*"))
    logged = metrics(output)
    assert logged[0] == {"run/world_size": 2, "run/tp_size": 1, "run/dp_size": 2, "run/sp_size": 1}
    assert sorted(step for step in logged if step) == [1, 2, 3, 4, 5, 6]
    # Evaluated at steps 3 and 6, once each: the last step's evaluation is the final one.
    records = read_metrics(output)
    assert [record["step"] for record in records if "eval/ce" in record] == [3, 6]
    first, last = logged[1], logged[6]
    assert first["loss/total"] == pytest.approx(first["loss/ce"] + first["loss/numeric"], rel=1e-5)
    assert first["numeric/positions"] > 0 and first["loss/smmd"] > 0 and first["comm/loss_bytes"] == 0
    assert last["loss/ce"] < first["loss/ce"]
    scalars, hparams = tensorboard_run(output)
    assert CONTRACT_SCALARS <= scalars
    assert (hparams["world_size"], hparams["tp_size"], hparams["dp_size"], hparams["launcher"]) == \
        ("2", "1", "2", "deepspeed/torchrun")  # settings as text (smmd_train.monitor.dashboards.hparam_value)
    # The exported model scores the eval data exactly as the trained engine did.
    assert eval_ce_of_hf_model(output / "hf", corpus) == pytest.approx(last["eval/ce"], rel=1e-5)
    # Training runs without a KV cache; the exported model generates with one.
    assert json.loads((output / "hf" / "config.json").read_text())["use_cache"] is True
    generation = output / "hf" / "generation_config.json"
    assert not generation.exists() or json.loads(generation.read_text()).get("use_cache", True) is True



def test_sigkill_and_resume_continue_exactly(tmp_path, corpus, zero3_run):
    expected = metrics(zero3_run[0])  # the same run, uninterrupted

    output = tmp_path / "killed"
    command = deepspeed_command(2, *train_args(corpus, output, save_steps=2, resume=True, steps=6))
    process = subprocess.Popen([str(part) for part in command], env=environment(), cwd=REPO,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + hang_guard(400)
    while not (output / "step00000004" / "commit.json").exists():
        assert process.poll() is None and time.monotonic() < deadline, "the run ended before its step-4 commit"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)  # the launcher and both ranks, mid-run
    process.wait()
    run(deepspeed_command(2, *train_args(corpus, output, save_steps=2, resume=True, steps=6)), timeout=600)
    resumed = metrics(output)
    for step in (5, 6):
        for name in ("loss/total", "loss/ce", "loss/smmd", "numeric/positions", "train/lr"):
            assert resumed[step][name] == pytest.approx(expected[step][name], rel=1e-6, abs=1e-9), (step, name)



def test_a_crash_mid_save_never_resumes_from_the_broken_checkpoint(tmp_path, corpus, zero3_run):
    import shutil

    expected = metrics(zero3_run[0])
    output = tmp_path / "run"
    shutil.copytree(zero3_run[0], output, ignore=shutil.ignore_patterns("hf", "tensorboard"))
    # What a crash in the middle of saving step 6 leaves: shards half written, no commit marker,
    # and a "latest" that already names the new tag (DeepSpeed's own save writes it that early).
    (output / "step00000006" / "commit.json").unlink()
    shard = next((output / "step00000006").glob("*model_states.pt"))
    shard.write_bytes(shard.read_bytes()[:100])
    (output / "latest").write_text("step00000006")
    completed = run(deepspeed_command(2, *train_args(corpus, output, steps=6, save_steps=2, resume=True)),
                    timeout=600)
    assert "resumed from step00000004 at step 4" in completed.stdout
    resumed = metrics(output)
    for step in (5, 6):
        assert resumed[step]["loss/total"] == pytest.approx(expected[step]["loss/total"], rel=1e-6)



def test_a_longer_resumed_run_keeps_its_schedule_and_a_forgotten_resume_is_refused(tmp_path, corpus, zero3_run):
    import shutil

    expected = metrics(zero3_run[0])
    output = tmp_path / "run"
    shutil.copytree(zero3_run[0], output, ignore=shutil.ignore_patterns("hf", "tensorboard"))
    # Without --resume, the committed checkpoints are not silently restarted over: every rank stops
    # before any model is built, rank 0 says why in one line, and nothing in the directory changes.
    with pytest.raises(AssertionError) as refused:
        run(deepspeed_command(2, *train_args(corpus, output, steps=8)), timeout=300)
    message = str(refused.value)
    assert message.count("[train] refused: ") == 1 and "pass --resume to continue that run" in message
    assert (output / "latest").read_text() == "step00000006" and metrics(output) == expected
    # With --resume and a larger --max_steps: steps 7-8 train at the 6-step schedule's final rate.
    completed = run(deepspeed_command(2, *train_args(corpus, output, steps=8, resume=True)), timeout=600)
    assert "resumed from step00000006 at step 6" in completed.stdout
    assert "keeps its 6-step horizon, and steps 7-8 train at its final rate 0.0003" in completed.stdout
    resumed = metrics(output)
    assert [resumed[step]["train/lr"] for step in (7, 8)] == pytest.approx([3e-4, 3e-4], rel=1e-6)
    assert resumed[6]["train/lr"] == pytest.approx(expected[6]["train/lr"], rel=1e-9)



def test_a_zero3_checkpoint_without_tp_resumes_at_tp2_through_a_universal_checkpoint(tmp_path, corpus, zero3_run):
    # The 2-rank ZeRO-3 run (two data-parallel ranks of 2 sequences) resumed at --tp 2 (one
    # data-parallel rank of 4): the universal checkpoint DeepSpeed writes without TP holds bare
    # tensors that the AutoTP loader splits only once wrapped.
    output = tmp_path / "tp2"
    cut_back_to_step_4(zero3_run[0], output)
    completed = run(deepspeed_command(2, *train_args(corpus, output, steps=6, resume=True, tp=2, save_steps=2,
                                                     micro_batch_size=4)), timeout=600)
    assert "written by 2 ranks with --tp 1 and this run has 2 with --tp 2" in completed.stdout
    assert "resumed from step00000004 at step 4" in completed.stdout
    assert_steps_5_and_6_continue(metrics(zero3_run[0]), output)
    # Under AutoTP the norms are a ZeRO-3 sub-group of their own. Each sub-group's Adam step counts
    # the optimizer steps (DeepSpeed's universal loader shares one tensor among them, which counted
    # 8 here, and step 6's loss was 7e-6 off, before each got its own copy).
    adam_steps = [float(state["step"]) for path in (output / "step00000006").glob("*_optim_states.pt")
                  for state in torch.load(path, map_location="cpu", weights_only=False)["optimizer_state_dict"]
                  ["optimizer_state_dict"]["state"].values()]
    assert len(adam_steps) == 4 and set(adam_steps) == {6.0}  # 2 TP ranks x (shards, norms)

