"""How fast this host is, and the hang guards scaled by it.

A test's verdict must not depend on the host's speed: every time limit in the tests (a subprocess's
``timeout``, a wait for ranks, a deadline in a polling loop) is a *hang guard*, there to end a test that
would otherwise never end. Its base value was set generously on the reference host (the probe below read
about ``REFERENCE_SECONDS`` there, 4 xdist workers on 2 idle cores) and is multiplied by how much slower
this host is, measured once per test session:

* the probe: a fresh interpreter imports torch, DeepSpeed and transformers' Llama (what nearly every
  process a test starts does first); its CPU seconds (user + system) and wall seconds, median of
  ``repeats``. The wall reading also sees other work on the machine.
* ``.ci/run`` measures it before the tests (and again after them) and passes it in ``SMMD_HOST_PROBE``;
  a session started without it measures once in the background while the tests are collected
  (``start_in_background``), and the first hang guard waits for that reading.

``python tests/helpers/host_probe.py [--repeats N]`` prints the reading as JSON (what ``.ci/run`` uses).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

# The probe on the host the hang guards' base values were measured on (CPU seconds; 4.95-6.0 there).
REFERENCE_SECONDS = 5.0
PROBE_CODE = "import torch, deepspeed; from transformers import LlamaForCausalLM"
ENVIRONMENT_KEY = "SMMD_HOST_PROBE"  # the reading as JSON
FILE_KEY = "SMMD_HOST_PROBE_FILE"  # where a background probe writes it
# The background probe itself is guarded: past this it is taken as failed and a factor is assumed.
PROBE_WAIT_SECONDS = 300
ASSUMED_WHEN_UNMEASURED = 4.0


def measure(repeats: int = 1) -> dict:
    """The probe's reading: median CPU and wall seconds of ``repeats`` fresh imports."""
    cpu, wall = [], []
    environment = dict(os.environ, DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    for _ in range(repeats):
        before, began = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
        subprocess.run([sys.executable, "-c", PROBE_CODE], check=True, env=environment, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        wall.append(time.perf_counter() - began)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
    return {"cpu_seconds": round(statistics.median(cpu), 2), "wall_seconds": round(statistics.median(wall), 2),
            "repeats": repeats}


def assumed_reading() -> dict:
    """What stands in for a reading where the probe could not run: a slow host's."""
    seconds = ASSUMED_WHEN_UNMEASURED * REFERENCE_SECONDS
    return {"cpu_seconds": seconds, "wall_seconds": seconds, "repeats": 0, "assumed": True}


def start_in_background() -> None:
    """Start one probe in the background unless this session already has a reading (called by the
    test session's controller before the workers start, which inherit the file's path)."""
    if os.environ.get(ENVIRONMENT_KEY) or os.environ.get(FILE_KEY):
        return
    handle, path = tempfile.mkstemp(prefix="smmd-host-probe-", suffix=".json")
    os.close(handle)
    os.unlink(path)  # the reading appears under this name only once it is complete
    os.environ[FILE_KEY] = path
    global _PROBE
    _PROBE = subprocess.Popen([sys.executable, __file__, "--output", path], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)


_PROBE: Optional[subprocess.Popen] = None  # the background probe, where this process started it
_READING: Optional[dict] = None


def settle() -> None:
    """Wait for the background probe this process started, and reap it. Unreaped, it is reaped by the
    next subprocess this process starts, and its CPU (seconds) lands in whatever ``os.times()`` window
    that falls in: a test that counts its own children's CPU calls this first."""
    global _PROBE
    if _PROBE is not None:
        try:
            _PROBE.wait(timeout=PROBE_WAIT_SECONDS)
        except subprocess.TimeoutExpired:  # a host too loaded to finish it: left running, reaped at exit
            return
        _PROBE = None


def reading() -> dict:
    """This session's probe reading (``{"cpu_seconds", "wall_seconds", "repeats"}``; ``"assumed": True``
    where no reading could be had, with a slow host's factor assumed)."""
    global _READING
    if _READING is None:
        if os.environ.get(ENVIRONMENT_KEY):
            _READING = json.loads(os.environ[ENVIRONMENT_KEY])
        elif os.environ.get(FILE_KEY):
            path, deadline = Path(os.environ[FILE_KEY]), time.monotonic() + PROBE_WAIT_SECONDS
            while not path.exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            _READING = json.loads(path.read_text()) if path.exists() else None
            if _READING is not None:
                settle()  # its reading is written last: the process is ending
        if _READING is None:  # no reading came: measure here, once per process
            try:
                _READING = measure()
            except (subprocess.CalledProcessError, OSError):
                _READING = assumed_reading()
    return _READING


def ready() -> bool:
    """Whether a reading is at hand without waiting for the background probe."""
    return bool(_READING or os.environ.get(ENVIRONMENT_KEY)
                or (os.environ.get(FILE_KEY) and Path(os.environ[FILE_KEY]).exists()))


def slowdown() -> float:
    """How many times slower than the reference host this one is now (at least 1): the larger of the
    probe's CPU and wall seconds over ``REFERENCE_SECONDS``."""
    probe = reading()
    return max(1.0, max(probe["cpu_seconds"], probe["wall_seconds"]) / REFERENCE_SECONDS)


def hang_guard(seconds: float) -> float:
    """A time limit whose base value ``seconds`` (generous on the reference host) is scaled to this host."""
    return seconds * slowdown()


def describe(seconds: Optional[float] = None) -> str:
    """One line for a failure message: the limit was a hang guard, and what the probe read."""
    probe = reading()
    base = f"base {seconds:g} s x " if seconds is not None else ""
    return (f"a hang guard ({base}host slowdown {slowdown():.2f}: the probe read {probe['cpu_seconds']} CPU-s, "
            f"{probe['wall_seconds']} s wall against {REFERENCE_SECONDS} on the reference host), not a speed target")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--output", type=Path, default=None, help="write the JSON here (atomically) instead of stdout")
    options = parser.parse_args()
    if options.output is None:
        print(json.dumps(measure(options.repeats)))
    else:  # the background probe: a failed import still leaves a reading, marked assumed
        try:
            text = json.dumps(measure(options.repeats))
        except subprocess.CalledProcessError:
            text = json.dumps(assumed_reading())
        partial = options.output.with_suffix(".partial")
        partial.write_text(text)
        partial.replace(options.output)
