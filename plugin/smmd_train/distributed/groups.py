"""Process-group start-up for every launcher users run: the deepspeed launcher (or torchrun),
mpirun (ranks learn rank, size and the master address through mpi4py), Slurm's srun, or a
single plain ``python`` process; and the matching ordered shutdown (``shutdown_distributed``).

DeepSpeed's own MPI discovery takes the master address from ``hostname -I`` (the first network
card) and overwrites MASTER_ADDR/MASTER_PORT; here the address is whatever the user or launcher
set, rank 0's host name under MPI otherwise, and 127.0.0.1 for a single process. Discovery imports
nothing heavy (torch, DeepSpeed and the compat inventory load where a process group starts or ends).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Optional, TypeVar

from .launcher import free_port
from .preflight import comm_build_wait


@dataclass(frozen=True)
class Launch:
    rank: int
    world_size: int
    local_rank: int
    local_size: int
    launcher: str  # "deepspeed/torchrun", "mpirun", "slurm" or "single"
    device_index: Optional[int] = None  # the accelerator this rank drives (None: local_rank)


# What each MPI launcher exports before the program starts: (rank, size, local rank, local size).
_OPEN_MPI = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
             "OMPI_COMM_WORLD_LOCAL_SIZE")
_MPICH = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")  # hydra (mpiexec of MPICH, Intel MPI)
# What srun exports as well with --mpi=pmi2 / --mpi=pmix: the same numbering as SLURM_PROCID.
_PMI_RANKS = (("PMI_RANK", "PMI_SIZE"), ("PMIX_RANK", None))


def _tasks_on_node(tasks_per_node: str, node_id: int) -> int:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``"8(x2),4"``) -> the count on node ``node_id``."""
    counts = []
    for part in tasks_per_node.split(","):
        count, _, repeat = part.partition("(x")
        counts += [int(count)] * int(repeat.rstrip(")") or 1)
    return counts[min(node_id, len(counts) - 1)]


def _srun_started_this_task(environ) -> bool:
    """Whether srun itself started this process (one task of a job step), not an MPI launcher run
    inside a Slurm allocation (whose ranks inherit SLURM_PROCID from the step that started its
    daemons): any PMI/PMIx rank that srun's --mpi plugin exported agrees with SLURM_PROCID."""
    if "SLURM_PROCID" not in environ or "OMPI_COMM_WORLD_RANK" in environ:
        return False
    size = environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS"))
    for rank_key, size_key in _PMI_RANKS:
        if rank_key in environ and environ[rank_key] != environ["SLURM_PROCID"]:
            return False
        if size_key is not None and size_key in environ and environ[size_key] != size:
            return False
    return size is not None


def _device_index(local_rank: int, local_size: int, environ) -> int:
    """The accelerator a rank drives: its local rank when it sees every device of its node, device 0
    when the scheduler gave each task one device (Slurm ``--gpus-per-task=1``, ``--gpu-bind``)."""
    visible = [device for device in environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if device.strip()]
    if not visible or len(visible) >= local_size:
        return local_rank
    if len(visible) == 1:
        return 0
    raise RuntimeError(f"this task sees {len(visible)} devices (CUDA_VISIBLE_DEVICES="
                       f"{environ['CUDA_VISIBLE_DEVICES']}) but its node runs {local_size} tasks: train.py drives "
                       "one device per rank; give each task "
                       "one device (srun --gpus-per-task=1) or every task the node's devices (--gpus-per-node)")


def discover_launch(environ=os.environ) -> Launch:
    """Work out rank/size and set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT.

    The launcher is recognised in this order: RANK and WORLD_SIZE (the deepspeed launcher, torchrun,
    also inside srun); a task that srun started (SLURM_PROCID; srun --mpi=pmix / pmi2 export PMIx /
    PMI ranks too, with the same numbering, and MPI is never initialised under srun); mpirun (Open
    MPI's OMPI_COMM_WORLD_*, or PMI_RANK from MPICH's hydra); else a single process. MPI (mpi4py)
    is initialised only under mpirun, and only to agree on a master address the user did not set.

    LOCAL_RANK is exported as the device index (``Launch.device_index``), which DeepSpeed takes it for
    (``set_device(LOCAL_RANK)``, ZeRO-3's local device): with one device per task it is 0 whatever
    the task's place on its node (``Launch.local_rank``).
    """
    if "RANK" in environ and "WORLD_SIZE" in environ:
        launch = Launch(int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", 0)),
                        # neither said: assume one node (the TP-within-a-node check then cannot refuse wrongly)
                        int(environ.get("LOCAL_SIZE", environ.get("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"]))),
                        "deepspeed/torchrun")
    elif _srun_started_this_task(environ):
        size = int(environ.get("SLURM_STEP_NUM_TASKS", environ.get("SLURM_NTASKS")))
        per_node = environ.get("SLURM_STEP_TASKS_PER_NODE", environ.get("SLURM_TASKS_PER_NODE"))
        local_size = _tasks_on_node(per_node, int(environ.get("SLURM_NODEID", 0))) if per_node else size
        launch = Launch(int(environ["SLURM_PROCID"]), size, int(environ.get("SLURM_LOCALID", 0)), local_size, "slurm")
        if "MASTER_ADDR" not in environ:
            raise RuntimeError("under Slurm set MASTER_ADDR to the first node of the allocation (launch/slurm.sbatch "
                               "does: scontrol show hostnames $SLURM_JOB_NODELIST | head -n 1)")
    elif any(names[0] in environ for names in (_OPEN_MPI, _MPICH)) or "PMIX_RANK" in environ:
        launch = _mpirun_launch(environ)
    else:
        launch = Launch(0, 1, 0, 1, "single")
        environ.setdefault("MASTER_ADDR", "127.0.0.1")
        environ.setdefault("MASTER_PORT", str(free_port()))
    launch = replace(launch, device_index=_device_index(launch.local_rank, launch.local_size, environ))
    environ.setdefault("MASTER_PORT", "29500")
    environ.update(RANK=str(launch.rank), WORLD_SIZE=str(launch.world_size), LOCAL_RANK=str(launch.device_index),
                   LOCAL_SIZE=str(launch.local_size))
    return launch


def _mpirun_launch(environ) -> Launch:
    """Rank and size from the variables mpirun exported (MPI itself where one is missing), and rank 0's
    master address and port broadcast over MPI unless both are set."""
    names = _OPEN_MPI if _OPEN_MPI[0] in environ else _MPICH
    known = [environ.get(name) for name in names]
    world = None
    if None in known or "MASTER_ADDR" not in environ or "MASTER_PORT" not in environ:
        from mpi4py import MPI

        world = MPI.COMM_WORLD
        node = world.Split_type(MPI.COMM_TYPE_SHARED)
        known = [value if value is not None else measured for value, measured in
                 zip(known, (world.Get_rank(), world.Get_size(), node.Get_rank(), node.Get_size()))]
    if world is not None and ("MASTER_ADDR" not in environ or "MASTER_PORT" not in environ):
        master = environ.get("MASTER_ADDR") or socket.gethostname()
        port = environ.get("MASTER_PORT") or str(free_port())
        master, port = world.bcast((master, port), root=0)  # every rank uses rank 0's choice
        environ.setdefault("MASTER_ADDR", master)
        environ.setdefault("MASTER_PORT", port)
    return Launch(*(int(value) for value in known), "mpirun")


def load_backends() -> None:
    """Import what :func:`init_distributed` needs before it starts the default group: DeepSpeed, its
    accelerator and ``torch._dynamo``. A program may call it first, to import them all before it
    freezes what it imported (``smmd_train.distributed.process_start``)."""
    import deepspeed  # noqa: F401
    from deepspeed.accelerator import get_accelerator  # noqa: F401

    from .. import compat

    # Imported after the default group exists, torch._dynamo (which transformers imports for its
    # model and config classes) keeps a reference to the group that destroy_process_group cannot
    # drop, so every run ended with "process group(s) are still referenced"; imported first, it
    # holds none.
    compat.import_torch_dynamo()


def init_distributed(timeout_minutes: float = 30.0) -> Launch:
    """Start the default process group (gloo on CPU, the accelerator's backend otherwise).

    ``timeout_minutes`` bounds how long a collective waits for a rank that died or hangs, so a
    job with a lost rank exits instead of waiting forever.
    """
    import deepspeed
    import torch
    from deepspeed.accelerator import get_accelerator

    load_backends()
    # DeepSpeed's ZeRO-3 (0.19) calls the collectives torch 2.13 renamed; torch warns on every rank
    # at every first call. Nothing the user can act on, so the warning of a clean run stays empty.
    warnings.filterwarnings(
        "ignore", category=FutureWarning,
        message=r"`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated")
    launch = discover_launch()
    accelerator = get_accelerator()
    if accelerator.device_name() == "cpu":
        # OMP_NUM_THREADS wins when set (e.g. several runs sharing a box); else split the cores.
        threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or (os.cpu_count() or 1) // max(launch.local_size, 1)
        torch.set_num_threads(max(1, threads))
    else:
        accelerator.set_device(launch.device_index)
    if launch.local_rank == 0:  # the ranks of a node share the lock: one line per node
        wait = comm_build_wait(accelerator)
        if wait:
            print(f"[train] {wait}", flush=True)
    deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(), auto_mpi_discovery=False,
                               timeout=datetime.timedelta(minutes=timeout_minutes))
    release_cpu_allreduce_segment()
    return launch


def release_cpu_allreduce_segment() -> None:
    """Unlink this rank's DeepSpeed CPU shared-memory all-reduce segment once every rank has it mapped.

    On CPU, DeepSpeed's shared-memory all-reduce creates a 64 MiB ``/dev/shm`` segment per rank,
    named after MASTER_ADDR/MASTER_PORT, during ``init_distributed`` (each rank maps every peer's)
    and never removes it: every CPU job would leave them behind until the machine runs out of
    memory. After a barrier all ranks have mapped all segments, so the names can go now; the
    memory lives on until the processes exit, even if they are killed.
    """
    import torch.distributed as dist

    from .. import compat

    if not dist.is_initialized():
        return
    if dist.get_world_size() > 1:
        dist.barrier()
    try:
        os.unlink(os.path.join("/dev/shm", compat.cpu_allreduce_segment(dist.get_rank())))
    except FileNotFoundError:  # not a CPU run, or ranks on several hosts (DeepSpeed makes none)
        pass


# DeepSpeed engines that shutdown_distributed() destroys before the process groups (see there).
_ENGINES: list = []


def destroy_at_shutdown(engine):
    """Have ``shutdown_distributed()`` call ``engine.destroy()`` (and forget the engine) before it
    destroys the process groups, on every exit path; returns ``engine``. ZeRO-3's module hooks
    otherwise keep the model, and through it the groups, alive until the interpreter exits."""
    _ENGINES.append(engine)
    return engine


def shutdown_distributed(wait_for_peers: Optional[bool] = None) -> int:
    """Leave the job in order: wait for every rank, destroy the registered DeepSpeed engines and
    every process group, and let the groups' native threads stop, all before the interpreter starts
    to shut down. Returns how many groups are still referenced afterwards (0 expected; a warning
    names the risk otherwise).

    Use ``try: main() finally: shutdown_distributed()`` with ``destroy_at_shutdown(engine)`` after
    ``deepspeed.initialize``. When an exception is propagating (called from ``finally``/``except``)
    it does not wait for the other ranks (one may be inside a collective that a barrier would be
    mismatched with), it clears the locals of the exception's frames (they hold the engine), and a
    teardown error becomes a warning rather than hiding the first error. ``wait_for_peers``
    overrides the first choice.

    Why: after a collective completes, its gloo worker thread (``pt_gloo_runloop``) still holds the
    work for a moment. If Python dropped the collective's tensors meanwhile, that thread needs the
    GIL to free them; once the interpreter is finalizing, Python 3.11 ends a thread that asks for
    the GIL with ``pthread_exit``, whose unwind meets gloo's noexcept work destructor: ``terminate
    called without an active exception``, SIGABRT (rare: the worker must be late by the whole of
    the script's end). ``dist.destroy_process_group()`` alone does not prevent it: it only
    unregisters the groups, while DeepSpeed (engine, ZeRO-3 hooks and caches, parameters'
    ``ds_process_group``, AutoTP layers' ``mp_group``, ``deepspeed.utils.groups``) keeps the
    ProcessGroup objects, and their threads, alive into finalization. A group's destructor joins
    its threads (with the GIL released, the interpreter still whole) only when its last reference
    goes, hence the steps below.
    """
    import gc
    import sys
    import traceback
    import weakref

    import torch.distributed as dist

    from .. import compat

    error = sys.exc_info()[1]
    failing = error is not None and not (isinstance(error, SystemExit) and error.code in (None, 0))
    if not dist.is_initialized() and not _ENGINES:
        return 0
    chained = error
    while chained is not None:  # the error and those it was raised while handling
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__context__
    try:
        groups = []
        if dist.is_initialized():
            if (not failing if wait_for_peers is None else wait_for_peers) and dist.get_world_size() > 1:
                dist.barrier()  # no rank leaves (rank 0 hosts the TCPStore) while another still communicates
            groups = [weakref.ref(group) for group in compat.process_groups()]
        while _ENGINES:
            _ENGINES.pop().destroy()
        if groups:
            dist.destroy_process_group()  # every group c10d made: DeviceMesh's and DeepSpeed's sub-groups too
        compat.release_deepspeed_process_groups()
        gc.collect()  # engines and models are full of reference cycles
    except Exception as teardown_error:
        if not failing:
            raise
        warnings.warn(f"shutdown_distributed() failed ({teardown_error!r}) while handling {error!r}", RuntimeWarning,
                      stacklevel=2)
        return -1
    alive = sum(group() is not None for group in groups)
    if alive:
        warnings.warn(f"{alive} process group(s) are still referenced after shutdown_distributed(); their gloo "
                      "threads run into interpreter shutdown, where the process can abort ('terminate called "
                      "without an active exception'). Register engines with destroy_at_shutdown() and drop "
                      "whatever else holds a group first.", RuntimeWarning, stacklevel=2)
    return alive


Result = TypeVar("Result")

# How long the other ranks wait for rank 0's own work (tokenizing a corpus, writing an export): far
# beyond the process-group timeout, which is sized for collectives. A rank 0 that dies ends the wait
# at once (its gloo connection closes); one that hangs is stopped by this.
RANK_ZERO_WORK_TIMEOUT = datetime.timedelta(hours=24)


def run_on_rank_zero(work: Callable[[], Result], timeout: datetime.timedelta = RANK_ZERO_WORK_TIMEOUT
                     ) -> Optional[Result]:
    """Run ``work`` on rank 0 while the other ranks wait; returns its result on rank 0, None elsewhere.

    The others wait on a gloo group made for this wait, with ``timeout`` rather than the process
    group's (30 minutes by default: NCCL's watchdog would kill ranks that wait inside a collective
    while rank 0 tokenizes a corpus or writes a 70b export). Any exception on rank 0 reaches every
    rank as soon as it is raised: the same type with the message prefixed "on rank 0: " where the type
    can be rebuilt from a message, else a RuntimeError naming the type. Call on every rank.
    """
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return work()
    waiting = dist.new_group(backend="gloo", timeout=timeout)
    try:
        outcome, result = [None], None
        if dist.get_rank() == 0:
            try:
                result = work()
            except BaseException as error:
                outcome = [_portable(error)]
                dist.broadcast_object_list(outcome, src=0, group=waiting)
                raise
        dist.broadcast_object_list(outcome, src=0, group=waiting)
    finally:
        dist.destroy_process_group(waiting)
    if outcome[0] is not None:
        raise _rebuilt(*outcome[0])
    return result


def _portable(error: BaseException) -> tuple:
    """(the error's class, or None when it cannot be pickled, its type name, its message)."""
    error_type = type(error)
    try:
        pickle.loads(pickle.dumps(error_type))
    except Exception:  # a class defined inside a function, say
        error_type = None
    return error_type, type(error).__qualname__, str(error)


def _rebuilt(error_type, name: str, message: str) -> BaseException:
    if error_type is not None:
        try:
            return error_type(f"on rank 0: {message}")
        except Exception:  # a constructor that takes other arguments than a message
            pass
    return RuntimeError(f"on rank 0: {name}: {message}")


def rank_zero_first(build: Callable[[], Result]) -> Result:
    """Run ``build`` on rank 0, then on the other ranks (which then reuse what rank 0 cached).

    While rank 0 builds, the others wait as :func:`run_on_rank_zero` does: however long it takes,
    and an error of any type on rank 0 is raised on every rank at once, before any other rank starts.
    """
    import torch.distributed as dist

    result = run_on_rank_zero(build)
    if dist.is_initialized() and dist.get_rank() != 0:
        result = build()
    return result
