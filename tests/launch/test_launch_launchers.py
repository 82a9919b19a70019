"""launch/train.py end to end on CPU under each launcher and loss option: z-loss and label smoothing
with a sum of SMMD, DIST2, Gaussian label smoothing and DEL, mpirun (launch/mpirun.sh), srun (plain
and --mpi=pmi2, started as launch/slurm.sbatch starts it) and the model's own loss (--framework_loss)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO, environment, metrics, run
from helpers.train_runs import (
    corpus_fixture,
    deepspeed_command,
    tensorboard_run,
    train_args,
)

from smmd_train.distributed.launcher import free_port

pytestmark = pytest.mark.slow
corpus = corpus_fixture()  # the module's corpus on disk (a module-scoped fixture)


NEW_LOSSES_SUM = ["smmd:0.5", "dist2:0.3", "gauss-ls:0.2", "del:0.1"]


def test_z_loss_label_smoothing_and_a_sum_of_the_new_losses_train_and_are_logged(tmp_path, corpus):
    """--z_loss and --label_smoothing reach the installed loss (the op's own tests check their
    values against float64): loss/z is logged, the total adds it, HParams show both options. The same
    run trains on SMMD + DIST2 + Gaussian label smoothing + DEL (a digit vocabulary): each loss's part
    is in metrics.jsonl and TensorBoard, the parts add up, and HParams show each option of each loss."""
    output = tmp_path / "run"
    run(deepspeed_command(1, *train_args(corpus, output, steps=2, z_loss=1e-3, label_smoothing=0.1,
                                         numeric_loss=NEW_LOSSES_SUM, numeric_policy="digits", dist2_tau=2.0,
                                         gauss_ls_sigma=0.5, del_scale=0.02)), timeout=600)
    logged = metrics(output)
    for step in (1, 2):
        parts = logged[step]
        assert parts["loss/z"] > 0
        assert parts["loss/total"] == pytest.approx(parts["loss/ce"] + parts["loss/z"] + parts["loss/numeric"],
                                                    rel=1e-5)
        assert min(parts["loss/smmd"], parts["loss/dist2"], parts["loss/gauss_ls"], parts["loss/del"]) > 0
        # fp32 per-position means, each rounded once: the weighted sum of the parts is the numeric term
        assert parts["loss/numeric"] == pytest.approx(0.5 * parts["loss/smmd"] + 0.3 * parts["loss/dist2"]
                                                      + 0.2 * parts["loss/gauss_ls"] + 0.1 * parts["loss/del"],
                                                      rel=1e-5)
    settings = json.loads((output / "run_config.json").read_text())["args"]
    assert settings["z_loss"] == 1e-3 and settings["label_smoothing"] == 0.1
    scalars, hparams = tensorboard_run(output)
    assert {"loss/z", "loss/smmd", "loss/mmd", "loss/smooth", "loss/dist2", "loss/gauss_ls", "loss/del"} <= scalars
    assert not {"loss/ntl_was", "loss/ntl_mse", "loss/ntl_number"} & scalars  # only the run's own losses
    assert (hparams["numeric_loss"], hparams["z_loss"], hparams["label_smoothing"]) == (
        "0.5 smmd + 0.3 dist2 + 0.2 gauss-ls + 0.1 del", "0.001", "0.1")
    assert (hparams["dist2_tau"], hparams["dist2_place_weighted"], hparams["gauss_ls_sigma"],
            hparams["del_place_base"], hparams["del_scale"]) == ("2", False, "0.5", "1.02", "0.02")
    assert hparams["ntl_reweigh"] == "unused" and hparams["smmd_mode"] == "smmd"
    # The same first batch on the same (seeded) initial model: label smoothing changes the step-1 CE.
    # (Near the uniform initial prediction it changes it little: the op's tests check the value.)
    plain = tmp_path / "plain"
    run(deepspeed_command(1, *train_args(corpus, plain, steps=1)), timeout=600)
    assert abs(logged[1]["loss/ce"] - metrics(plain)[1]["loss/ce"]) > 1e-3



def test_mpirun_two_ranks(tmp_path, corpus):
    output = tmp_path / "run"
    env = environment(NP="2", PYTHON=sys.executable, MASTER_PORT=str(free_port()),
                      PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    # Also the launcher-level run of a weighted sum of numeric losses (SMMD + 0.3 NTL-WAS).
    run(["bash", REPO / "launch" / "mpirun.sh", *train_args(corpus, output, steps=2,
                                                            numeric_loss=["smmd", "ntl-was:0.3"])[1:]],
        timeout=600, env=env)
    assert json.loads((output / "run_config.json").read_text())["launcher"] == "mpirun"
    assert metrics(output)[0]["run/world_size"] == 2 and metrics(output)[2]["loss/ce"] > 0
    step = metrics(output)[2]
    assert step["loss/smmd"] > 0 and step["loss/ntl_was"] > 0
    assert step["loss/total"] == pytest.approx(step["loss/ce"] + step["loss/numeric"], rel=1e-5)



@pytest.mark.parametrize("mpi", ["none", "pmi2"])
def test_srun_starts_one_job_of_two_ranks(tmp_path, corpus, mpi):
    """train.py as srun starts it from launch/slurm.sbatch (`srun python launch/train.py ...`): two
    processes with Slurm's variables in their real environment (and PMI's with --mpi=pmi2), the master
    address and port as the batch script exports them: one job of world size 2, not two of size 1."""
    output, port = tmp_path / "run", free_port()
    slurm = {"SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_STEP_TASKS_PER_NODE": "2",
             "SLURM_TASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "localhost", "SLURM_STEPID": "0",
             "MASTER_PORT": str(port)}
    ranks = []
    for rank in (0, 1):
        variables = {**slurm, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
        if mpi == "pmi2":
            variables.update(PMI_RANK=str(rank), PMI_SIZE="2", PMI_FD="5", PMI_JOBID="42.0")
        ranks.append(subprocess.Popen([sys.executable, *train_args(corpus, output, steps=2)],
                                      env=environment(**variables), cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [rank.communicate(timeout=hang_guard(600))[0] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    assert json.loads((output / "run_config.json").read_text())["launcher"] == "slurm"
    logged = metrics(output)
    assert logged[0] == {"run/world_size": 2, "run/tp_size": 1, "run/dp_size": 2, "run/sp_size": 1}
    assert logged[2]["loss/ce"] > 0



def test_framework_loss_baseline_keeps_the_models_own_loss(tmp_path, corpus):
    """--framework_loss (the throughput baseline) trains on HF's own CE: no numeric statistics."""

    output = tmp_path / "run"
    completed = run([sys.executable, *train_args(corpus, output, framework_loss=True, steps=2)], timeout=300)
    assert "loss: the model's own" in completed.stdout
    logged = metrics(output)
    assert logged[2]["loss/total"] == logged[2]["loss/ce"] > 0
    assert not {"numeric/accuracy", "numeric/positions", "loss/numeric", "loss/smmd"} & set(logged[2])

