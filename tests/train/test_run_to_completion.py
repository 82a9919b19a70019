"""A launcher run that times out ends with every process it started (the ranks too), so a timed-out
sweep run does not keep its devices; a finished run returns its exit code."""

import os
import sys
import time

from helpers.host_probe import hang_guard

from smmd_train.distributed.launcher import run_to_completion

# A "launcher" that starts a "rank" which ignores nothing and outlives it unless killed.
LAUNCHER = ("import subprocess, sys, time; "
            "rank = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
            "print(rank.pid, flush=True); time.sleep(120)")


def test_a_timeout_ends_the_launcher_and_the_ranks_it_started(tmp_path):
    log_path = tmp_path / "run.log"
    began = time.monotonic()
    with open(log_path, "w") as log:
        code = run_to_completion([sys.executable, "-c", LAUNCHER], log, timeout_seconds=2, grace_seconds=2)
    # Ended by run_to_completion's 2 s timeout: on its own the launcher would sleep 120 s.
    assert code is None and time.monotonic() - began < 100
    rank = int(log_path.read_text().split()[0])
    deadline = time.monotonic() + hang_guard(10)
    while time.monotonic() < deadline:
        try:
            os.kill(rank, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"the rank {rank} outlived its timed-out launcher")


def test_a_finished_run_returns_its_exit_code(tmp_path):
    with open(tmp_path / "run.log", "w") as log:
        assert run_to_completion([sys.executable, "-c", "import sys; print('hi'); sys.exit(3)"], log, 60) == 3
    assert (tmp_path / "run.log").read_text() == "hi\n"
