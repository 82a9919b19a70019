"""The hang guards: time limits scaled by the host probe, and a failure that says it was one."""

import json
import os
import subprocess
import sys

import pytest
from helpers import host_probe
from helpers.launching import run


@pytest.fixture
def probe_reads(monkeypatch):
    """Set this process's probe reading (restored afterwards)."""
    def set_reading(cpu_seconds, wall_seconds):
        monkeypatch.setenv(host_probe.ENVIRONMENT_KEY, json.dumps(
            {"cpu_seconds": cpu_seconds, "wall_seconds": wall_seconds, "repeats": 3}))
        monkeypatch.setattr(host_probe, "_READING", None)
    return set_reading


def test_a_hang_guard_scales_with_the_slower_of_the_probes_readings(probe_reads):
    reference = host_probe.REFERENCE_SECONDS
    probe_reads(reference / 2, reference / 2)  # a faster host keeps the base value
    assert host_probe.hang_guard(100) == 100
    probe_reads(2 * reference, 1.5 * reference)  # a slower CPU
    assert host_probe.hang_guard(100) == pytest.approx(200)
    probe_reads(reference, 3 * reference)  # a busy machine: the wall reading
    assert host_probe.hang_guard(100) == pytest.approx(300)


def test_a_command_past_its_hang_guard_fails_saying_so_with_the_probe(probe_reads):
    probe_reads(host_probe.REFERENCE_SECONDS / 2, host_probe.REFERENCE_SECONDS / 4)
    with pytest.raises(AssertionError) as failure:
        run([sys.executable, "-c", "import time; time.sleep(60)"], timeout=0.5)
    message = str(failure.value)
    assert "did not finish within 0 s, a hang guard (base 0.5 s x host slowdown 1.00" in message
    assert f"the probe read {host_probe.REFERENCE_SECONDS / 2} CPU-s" in message and "not a speed target" in message


def test_the_probe_measures_a_fresh_import_and_prints_json():
    completed = subprocess.run([sys.executable, host_probe.__file__, "--repeats", "1"], capture_output=True, text=True,
                               timeout=host_probe.hang_guard(120))
    assert completed.returncode == 0, completed.stderr
    reading = json.loads(completed.stdout)
    assert reading["repeats"] == 1 and 0 < reading["cpu_seconds"] and 0 < reading["wall_seconds"]


def test_the_background_probe_is_reaped_once_read_so_its_cpu_lands_in_no_later_window(tmp_path):
    """In a fresh process: start the background probe, read it, then start one more child. Once read (or
    settled), the probe was reaped: the later child's window holds that child's CPU alone."""
    code = f"""
import os, subprocess, sys
os.environ.pop({host_probe.ENVIRONMENT_KEY!r}, None); os.environ.pop({host_probe.FILE_KEY!r}, None)
from helpers import host_probe
host_probe.start_in_background()
host_probe.reading()
assert host_probe._PROBE is None
before = os.times()
subprocess.run([sys.executable, "-c", "pass"], check=True)
after = os.times()
print(after.children_user + after.children_system - before.children_user - before.children_system)
"""
    tests = os.path.dirname(os.path.dirname(host_probe.__file__))  # where `helpers` imports from
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": tests}, timeout=host_probe.hang_guard(120))
    assert completed.returncode == 0, completed.stderr
    # an interpreter that does nothing: well under the probe's seconds of importing torch
    assert float(completed.stdout) < 1.0
