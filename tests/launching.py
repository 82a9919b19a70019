"""Start real launchers (deepspeed, mpirun, plain python) from tests, on loopback, with timeouts."""

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

from distributed import free_port

REPO = Path(__file__).resolve().parents[1]
# DeepSpeed compiles a small shared-memory op on first use (30-60 s); every test shares one cache.
EXTENSIONS = os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


def environment(**extra) -> dict:
    env = dict(os.environ, DS_ACCELERATOR="cpu", TORCH_EXTENSIONS_DIR=EXTENSIONS, MASTER_ADDR="127.0.0.1",
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT"):
        env.pop(key, None)
    env.update(extra)
    return env


def deepspeed_command(num_gpus: int, script, *args, port=None) -> list:
    launcher = shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"
    return [launcher, "--num_gpus", str(num_gpus), "--master_addr", "127.0.0.1", "--master_port",
            str(port or free_port()), str(script), *map(str, args)]


# Rarely (once in about ten full suites on 2 cores, never in isolation) a rank of a 2-process CPU
# job aborts in native code (gloo / DeepSpeed's shared-memory op) with this message and SIGABRT.
# Such a run is repeated once, with a warning in the test summary; any other failure fails at once.
NATIVE_ABORT = "terminate called without an active exception"


def run(command: list, timeout: float, env=None, cwd=None, _retried: bool = False) -> subprocess.CompletedProcess:
    """Run to completion; on failure or timeout the assertion carries the output's tail."""
    command = [str(part) for part in command]
    try:
        completed = subprocess.run(command, env=env or environment(), cwd=cwd or REPO, capture_output=True,
                                   text=True, timeout=timeout)
    except subprocess.TimeoutExpired as error:
        output = (error.stdout or b"")[-4000:] if isinstance(error.stdout, bytes) else (error.stdout or "")[-4000:]
        raise AssertionError(f"{command[:3]}... did not finish within {timeout} s:\n{output}") from None
    if completed.returncode != 0 and NATIVE_ABORT in completed.stderr and not _retried:
        warnings.warn(f"{' '.join(command[:3])}... aborted in native code ({NATIVE_ABORT!r}); running it once more")
        return run(command, timeout, env=env, cwd=cwd, _retried=True)
    if completed.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {completed.returncode}:\n"
                             f"{completed.stdout[-3000:]}\n{completed.stderr[-5000:]}")
    return completed


def metrics(output_dir) -> dict:
    """train.py's metrics.jsonl as step -> merged metrics (the last record of each name wins, as after
    a resume re-logs steps)."""
    merged = {}
    for line in Path(output_dir, "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        merged.setdefault(record.pop("step"), {}).update(record)
    return merged
