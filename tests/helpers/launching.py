"""Start real launchers (deepspeed, mpirun, plain python) from tests, on loopback, with timeouts.

Command lines come from ``smmd_train.config.arguments`` and ``smmd_train.distributed.launcher`` (the
builders the demo, the benchmarks and the shell launchers use too).
"""

import os
import subprocess
from pathlib import Path

from smmd_train.config.arguments import train_command, train_flags  # noqa: F401  (re-exported)
from smmd_train.distributed.launcher import launch_command  # noqa: F401  (re-exported)
from smmd_train.monitor.metrics_file import read_metrics

from .host_probe import describe, hang_guard

REPO = Path(__file__).resolve().parents[2]  # the checkout under test
TRAIN = REPO / "launch" / "train.py"


# What a launcher exports to say where a process stands (every launcher smmd_train.distributed.groups knows).
LAUNCHER_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "CROSS_RANK",
                      "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"}
LAUNCHER_PREFIXES = ("SLURM_", "PMI_", "PMIX_", "OMPI_", "MPI_", "TORCHELASTIC_")


def without_launcher_variables(environ) -> dict:
    """A copy of ``environ`` with nothing a launcher exports (the tests may themselves run under one)."""
    return {key: value for key, value in environ.items()
            if key not in LAUNCHER_VARIABLES and not key.startswith(LAUNCHER_PREFIXES)}


def environment(**extra) -> dict:
    env = dict(without_launcher_variables(os.environ), DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def run(command: list, timeout: float, env=None, cwd=None) -> subprocess.CompletedProcess:
    """Run to completion; on failure or timeout the assertion carries the output's tail. ``timeout``:
    the hang guard's base value, scaled to this host (:func:`helpers.host_probe.hang_guard`)."""
    command = [str(part) for part in command]
    try:
        completed = subprocess.run(command, env=env or environment(), cwd=cwd or REPO, capture_output=True,
                                   text=True, timeout=hang_guard(timeout))
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"")[-4000:] if isinstance(error.stdout, bytes) else (error.stdout or "")[-4000:]
        raise AssertionError(f"{command[:3]}... did not finish within {hang_guard(timeout):.0f} s, "
                             f"{describe(timeout)}:\n{output}") from None
    if completed.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {completed.returncode}:\n"
                             f"{completed.stdout[-3000:]}\n{completed.stderr[-5000:]}")
    return completed


def run_many(commands: dict, timeout: float, env=None, jobs: int = 3) -> dict:
    """``run`` each of ``commands`` (name -> command), ``jobs`` at a time; name -> CompletedProcess.
    Launches of tiny models spend much of their time starting up and waiting on each other's
    collectives, so a few side by side finish well before the same one after the other."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {name: pool.submit(run, command, timeout, env) for name, command in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def metrics(output_dir) -> dict:
    """train.py's metrics.jsonl as step -> merged metrics (the last record of each name wins, as after
    a resume re-logs steps)."""
    merged = {}
    for record in read_metrics(output_dir):
        merged.setdefault(record.pop("step"), {}).update(record)
    return merged
