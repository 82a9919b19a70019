"""The launcher helper repeats a run once only for a native abort, and fails on anything else."""

import sys

import pytest

from launching import NATIVE_ABORT, run

SCRIPT = """
import pathlib, sys
marker = pathlib.Path(sys.argv[1])
count = int(marker.read_text()) if marker.exists() else 0
marker.write_text(str(count + 1))
if count < int(sys.argv[2]):
    sys.stderr.write({message!r} + "\\n")
    sys.exit(int(sys.argv[3]))
print("ok")
"""


def attempt(tmp_path, failures: int, message: str = NATIVE_ABORT, code: int = 250):
    script = tmp_path / "flaky.py"
    script.write_text(SCRIPT.format(message=message))
    marker = tmp_path / "count"
    try:
        return run([sys.executable, script, marker, failures, code], timeout=60), int(marker.read_text())
    except AssertionError as error:
        return error, int(marker.read_text())


def test_one_native_abort_is_run_again(tmp_path):
    with pytest.warns(UserWarning, match="aborted in native code"):
        completed, runs = attempt(tmp_path, failures=1)
    assert runs == 2 and completed.stdout.strip() == "ok"


def test_a_second_native_abort_fails(tmp_path):
    with pytest.warns(UserWarning):
        error, runs = attempt(tmp_path, failures=2)
    assert runs == 2 and isinstance(error, AssertionError) and "exited 250" in str(error)


def test_other_failures_are_not_repeated(tmp_path):
    error, runs = attempt(tmp_path, failures=1, message="ValueError: bad input", code=1)
    assert runs == 1 and isinstance(error, AssertionError) and "bad input" in str(error)
