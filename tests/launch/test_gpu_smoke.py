"""The GPU smoke suite runs on CPU in CI (so it cannot rot before the first lent GPU): every check
passes or is skipped as CUDA-only, and it prints its table."""

import sys

import pytest
from helpers.launching import REPO, environment, run

pytestmark = pytest.mark.slow


def test_the_smoke_suite_runs_on_cpu_and_prints_its_table(tmp_path):
    completed = run([sys.executable, "-m", "benchmarks.gpu_smoke", "--device", "cpu", "--quick", "--work_dir",
                     tmp_path / "smoke"], timeout=900, env=environment(), cwd=REPO)
    table = [line for line in completed.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| check | status |") and len(table) >= 20
    statuses = [line.split("|")[2].strip() for line in table[2:]]
    assert set(statuses) <= {"ok", "skipped"} and statuses.count("ok") >= 15, completed.stdout
    assert "FAILED" not in completed.stdout and " checks ok or skipped in " in completed.stdout
