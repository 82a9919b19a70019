"""Which launcher started a rank, and its place, from the environment each launcher really exports:
srun (plain, --mpi=pmix, --mpi=pmi2, --gpus-per-task=1), mpirun (Open MPI, MPICH's hydra), the
deepspeed launcher, torchrun, torchrun under srun, one plain process. Every case runs in a process of
its own with the variables in its real ``os.environ`` (os.environ is not a dict: ``None in
os.environ`` raises, which a dict standing in for it hid), as the launcher would start it; most are
rank 3 of 16 (two nodes of 8 tasks). MPI must not be initialised outside mpirun: each process makes
mpi4py unimportable first, so any attempt shows as an ImportError. train.py itself under srun (one
job of 2 gloo ranks) is test_launch.py's."""

import json
import os
import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO, without_launcher_variables

MASTER = {"MASTER_ADDR": "node-001", "MASTER_PORT": "29500"}
SRUN = {"SLURM_PROCID": "3", "SLURM_LOCALID": "3", "SLURM_NODEID": "0", "SLURM_NTASKS": "16",
        "SLURM_STEP_NUM_TASKS": "16", "SLURM_STEP_TASKS_PER_NODE": "8(x2)", "SLURM_TASKS_PER_NODE": "8(x2)",
        "SLURM_JOB_NODELIST": "node-[001-002]", "SLURM_STEPID": "0", **MASTER}
PMIX = {"PMIX_RANK": "3", "PMIX_NAMESPACE": "slurm.pmix.42.0", "PMIX_SERVER_URI41": "pmix-server.1;tcp4://..."}
PMI2 = {"PMI_RANK": "3", "PMI_SIZE": "16", "PMI_FD": "5", "PMI_JOBID": "42.0"}
OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "16", "OMPI_COMM_WORLD_LOCAL_RANK": "3",
            "OMPI_COMM_WORLD_LOCAL_SIZE": "8", "PMIX_RANK": "3", **MASTER}
HYDRA = {"PMI_RANK": "3", "PMI_SIZE": "16", "MPI_LOCALRANKID": "3", "MPI_LOCALNRANKS": "8", "PMI_FD": "7", **MASTER}
DEEPSPEED = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_SIZE": "8", "CROSS_RANK": "0", **MASTER}
TORCHRUN = {"RANK": "3", "LOCAL_RANK": "3", "WORLD_SIZE": "16", "LOCAL_WORLD_SIZE": "8", "GROUP_RANK": "0",
            "TORCHELASTIC_RUN_ID": "none", **MASTER}
EIGHT_DEVICES = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}

# What the process runs: discovery on its own os.environ, then what it found and what it exported.
DISCOVER = """
import dataclasses, json, os, sys
sys.modules["mpi4py"] = None  # `from mpi4py import MPI` raises ImportError: MPI stays uninitialised
from smmd_train.distributed.groups import discover_launch
try:
    launch = dataclasses.asdict(discover_launch())
except Exception as error:
    print(json.dumps({"error": type(error).__name__, "message": str(error)}))
else:
    print(json.dumps({"launch": launch, "environ": {key: os.environ.get(key) for key in
                      ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}}))
"""


def rank_3_of_16(launcher, device_index=3):
    return {"rank": 3, "world_size": 16, "local_rank": 3, "local_size": 8, "launcher": launcher,
            "device_index": device_index}


# name: (the variables the launcher exports, what discovery must find: a Launch's fields or (error, message))
CASES = {
    "srun": ({**SRUN, **EIGHT_DEVICES}, rank_3_of_16("slurm")),
    "srun-pmix": ({**SRUN, **PMIX, **EIGHT_DEVICES}, rank_3_of_16("slurm")),
    "srun-pmi2": ({**SRUN, **PMI2, **EIGHT_DEVICES}, rank_3_of_16("slurm")),
    "openmpi-mpirun": ({**OPEN_MPI, **EIGHT_DEVICES}, rank_3_of_16("mpirun")),
    "mpich-mpirun": ({**HYDRA, **EIGHT_DEVICES}, rank_3_of_16("mpirun")),
    "deepspeed": ({**DEEPSPEED, **EIGHT_DEVICES}, rank_3_of_16("deepspeed/torchrun")),
    "torchrun": ({**TORCHRUN, **EIGHT_DEVICES}, rank_3_of_16("deepspeed/torchrun")),
    # torchrun started by srun: torchrun numbers the ranks
    "srun-torchrun": ({**SRUN, **PMIX, **TORCHRUN}, rank_3_of_16("deepspeed/torchrun")),
    # srun --gpus-per-task=1: each task sees one device; DeepSpeed takes LOCAL_RANK for the device
    "srun-one-device": ({**SRUN, "CUDA_VISIBLE_DEVICES": "3"}, rank_3_of_16("slurm", device_index=0)),
    "srun-pmix-one-device": ({**SRUN, **PMIX, "CUDA_VISIBLE_DEVICES": "3"}, rank_3_of_16("slurm", device_index=0)),
    "srun-pmi2-one-device": ({**SRUN, **PMI2, "CUDA_VISIBLE_DEVICES": "3"}, rank_3_of_16("slurm", device_index=0)),
    "srun-some-devices": ({**SRUN, "CUDA_VISIBLE_DEVICES": "6,7"},
                          ("RuntimeError", "sees 2 devices (CUDA_VISIBLE_DEVICES=6,7) but its node runs 8 tasks")),
    # mpirun (hydra) started from a batch script: its ranks inherit the daemons' SLURM_PROCID, while
    # PMI_RANK numbers them; PMI wins when the two disagree.
    "mpirun-inside-an-allocation": ({**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2",
                                     **HYDRA}, rank_3_of_16("mpirun")),
    "srun-uneven-nodes": ({**SRUN, "SLURM_PROCID": "10", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
                           "SLURM_STEP_NUM_TASKS": "12", "SLURM_STEP_TASKS_PER_NODE": "8,4"},
                          {"rank": 10, "world_size": 12, "local_rank": 2, "local_size": 4, "launcher": "slurm",
                           "device_index": 2}),
    "srun-without-master": ({key: value for key, value in SRUN.items() if key != "MASTER_ADDR"},
                            ("RuntimeError", "under Slurm set MASTER_ADDR")),
    # Rank 0's address reaches the others over MPI only; without mpi4py (made unimportable) the import fails.
    "mpirun-without-master": ({key: value for key, value in OPEN_MPI.items() if key not in MASTER},
                              ("ModuleNotFoundError", "import of mpi4py halted")),
    "one-process": ({}, {"rank": 0, "world_size": 1, "local_rank": 0, "local_size": 1, "launcher": "single",
                         "device_index": 0}),
}


@pytest.fixture(scope="module")
def discovered() -> dict:
    """name -> what the case's process printed. The processes start together (each imports torch for
    about 2 s, so one after the other would take half a minute)."""
    base = without_launcher_variables(os.environ)
    processes = {name: subprocess.Popen([sys.executable, "-c", DISCOVER], env={**base, **variables}, cwd=REPO,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for name, (variables, _) in CASES.items()}
    results = {}
    for name, process in processes.items():
        stdout, stderr = process.communicate(timeout=hang_guard(300))
        assert process.returncode == 0, f"{name}: exited {process.returncode}\n{stderr[-3000:]}"
        results[name] = json.loads(stdout.strip().splitlines()[-1])
    return results


@pytest.mark.parametrize("name", CASES)
def test_each_launcher_is_recognised_in_a_real_process(discovered, name):
    variables, expected = CASES[name]
    result = discovered[name]
    if isinstance(expected, tuple):
        error, message = expected
        assert (result.get("error"), message in result.get("message", "")) == (error, True), result
        return
    assert result.get("launch") == expected, result
    environ = result["environ"]
    # What DeepSpeed and torch read next: LOCAL_RANK is the device index (see discover_launch).
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"], environ["LOCAL_SIZE"]) == (
        str(expected["rank"]), str(expected["world_size"]), str(expected["device_index"]), str(expected["local_size"]))
    if "MASTER_ADDR" in variables:
        assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == (variables["MASTER_ADDR"],
                                                                    variables["MASTER_PORT"])
    else:
        assert environ["MASTER_ADDR"] == "127.0.0.1" and int(environ["MASTER_PORT"]) > 0
