"""How the numeracy study's tiers run their children (train.py, evaluate.py): their environment, a run
measured by its own rusage, the lock of in-process evaluations,
and JSON records written whole."""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from pathlib import Path

from benchmarks.common import REPO

# One in-process evaluation at a time under --jobs: loading a model with transformers is not
# thread-safe (the empty-weights context a load enters patches torch.nn.Module process-wide, as far as we can
# tell); seen in Tier C: a second thread's tied lm_head came back unmaterialized and was re-initialized at
# random ("lm_head.weight | MISSING"), scoring 0%. The training runs stay side by side.
EVALUATION_LOCK = threading.Lock()


def write_json(path: Path, value: dict) -> None:
    """Written under a temporary name and renamed, so an interrupted write never leaves half a file."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(partial, path)


def child_environment(threads_per_run: int, on_gpu: bool) -> dict:
    """Environment of train.py and evaluate.py: no inherited rendezvous (a plain process then picks a
    free port, so concurrent runs do not collide), one BLAS pool size per run, DeepSpeed on CPU when
    there is no GPU."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS=str(threads_per_run), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    if not on_gpu:
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env


class RunFailed(Exception):
    pass


def run_measured(command: list, log: Path, env: dict) -> tuple:
    """Run ``command`` with its output in ``log``: (wall seconds, CPU seconds of the child and everything it
    waited for), or ``RunFailed`` with the log's tail. The CPU is the child's own rusage (``os.wait4``), so
    runs side by side (``--jobs``) each count their own, which ``os.times`` deltas would mix."""
    wall_seconds, usage = run_watched(command, log, env)
    return wall_seconds, usage.ru_utime + usage.ru_stime


def run_watched(command: list, log: Path, env: dict, watch=None, poll_seconds: float = 0.5) -> tuple:
    """Run ``command`` with its output in ``log`` until it ends: (wall seconds, its ``os.wait4`` rusage),
    or ``RunFailed`` with the log's tail; killed if this process is interrupted. ``watch(pid)``, if
    given, is called every ``poll_seconds`` while it runs."""
    began = time.monotonic()
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=env, cwd=REPO)
        try:
            while True:
                pid, status, usage = os.wait4(process.pid, 0 if watch is None else os.WNOHANG)
                if pid:
                    break
                watch(process.pid)
                time.sleep(poll_seconds)
        except BaseException:
            process.kill()
            process.wait()
            raise
        process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        tail = "".join(log.read_text(errors="replace").replace("\r", "\n").splitlines(keepends=True)[-25:])
        raise RunFailed(f"{' '.join(command[:3])} ... exited {process.returncode}; {log}:\n{tail}")
    return time.monotonic() - began, usage
