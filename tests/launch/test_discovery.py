"""Which launcher started a rank, and its place, from the environment each launcher really exports:
srun (plain, --mpi=pmix, --mpi=pmi2, --gpus-per-task=1), mpirun (Open MPI, MPICH's hydra), the
deepspeed launcher, torchrun. Every case is rank 3 of 16 (two nodes of 8 tasks). MPI must not be
initialised outside mpirun: mpi4py is made unimportable, so any attempt fails the test."""

import sys

import pytest

from smmd_train.distributed import Launch, discover_launch

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


@pytest.fixture(autouse=True)
def no_mpi(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # `from mpi4py import MPI` raises ImportError


@pytest.mark.parametrize("environ, launcher", [
    ({**SRUN, **EIGHT_DEVICES}, "slurm"),
    ({**SRUN, **PMIX, **EIGHT_DEVICES}, "slurm"),
    ({**SRUN, **PMI2, **EIGHT_DEVICES}, "slurm"),
    ({**OPEN_MPI, **EIGHT_DEVICES}, "mpirun"),
    ({**HYDRA, **EIGHT_DEVICES}, "mpirun"),
    ({**DEEPSPEED, **EIGHT_DEVICES}, "deepspeed/torchrun"),
    ({**TORCHRUN, **EIGHT_DEVICES}, "deepspeed/torchrun"),
    ({**SRUN, **PMIX, **TORCHRUN}, "deepspeed/torchrun"),  # torchrun started by srun: torchrun numbers the ranks
], ids=["srun", "srun-pmix", "srun-pmi2", "openmpi-mpirun", "mpich-mpirun", "deepspeed", "torchrun", "srun-torchrun"])
def test_each_launcher_gives_rank_3_of_16(environ, launcher):
    environ = dict(environ)
    assert discover_launch(environ) == Launch(3, 16, 3, 8, launcher, device_index=3)
    assert (environ["RANK"], environ["WORLD_SIZE"], environ["LOCAL_RANK"], environ["LOCAL_SIZE"]) == ("3", "16", "3",
                                                                                                         "8")
    assert (environ["MASTER_ADDR"], environ["MASTER_PORT"]) == ("node-001", "29500")


@pytest.mark.parametrize("mpi", [{}, PMIX, PMI2], ids=["srun", "srun-pmix", "srun-pmi2"])
def test_one_device_per_task_drives_device_0(mpi):
    """srun --gpus-per-task=1: each task sees one device; DeepSpeed takes LOCAL_RANK for the device."""
    environ = {**SRUN, **mpi, "CUDA_VISIBLE_DEVICES": "3"}
    assert discover_launch(environ) == Launch(3, 16, 3, 8, "slurm", device_index=0)
    assert environ["LOCAL_RANK"] == "0"


def test_a_task_with_some_but_not_all_devices_is_refused():
    with pytest.raises(RuntimeError, match=r"sees 2 devices \(CUDA_VISIBLE_DEVICES=6,7\) but its node runs 8 tasks"):
        discover_launch({**SRUN, "CUDA_VISIBLE_DEVICES": "6,7"})


def test_an_mpi_launcher_inside_an_allocation_is_not_taken_for_srun():
    """mpirun (hydra) started from a batch script: its ranks inherit the daemons' SLURM_PROCID, while
    PMI_RANK numbers them; PMI wins when the two disagree."""
    environ = {**SRUN, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_STEP_NUM_TASKS": "2", **HYDRA}
    assert discover_launch(environ) == Launch(3, 16, 3, 8, "mpirun", device_index=3)


def test_uneven_tasks_per_node_and_slurm_needs_a_master_address():
    environ = {**SRUN, "SLURM_PROCID": "10", "SLURM_LOCALID": "2", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "12",
               "SLURM_STEP_TASKS_PER_NODE": "8,4"}
    assert discover_launch(environ) == Launch(10, 12, 2, 4, "slurm", device_index=2)
    without_master = {key: value for key, value in SRUN.items() if key != "MASTER_ADDR"}
    with pytest.raises(RuntimeError, match="under Slurm set MASTER_ADDR"):
        discover_launch(without_master)


def test_mpirun_without_a_master_address_needs_mpi():
    """Rank 0's address reaches the others over MPI only; without mpi4py that is an ImportError."""
    with pytest.raises(ImportError):
        discover_launch({key: value for key, value in OPEN_MPI.items() if key not in MASTER})


def test_a_plain_process_is_a_single_rank():
    environ = {}
    assert discover_launch(environ) == Launch(0, 1, 0, 1, "single", device_index=0)
    assert environ["MASTER_ADDR"] == "127.0.0.1" and int(environ["MASTER_PORT"]) > 0
