"""DeepSpeed's own unit tests of its fused linear CE (``vocab_parallel_linear_cross_entropy``: parity
with F.linear + F.cross_entropy for every reduction, fp16/bf16 corner cases, autocast with fp32
parameters, input validation, 2-rank uneven TP), run on ``linear_numeric_cross_entropy`` at weight 0.

Nothing of DeepSpeed's is vendored: set ``SMMD_DEEPSPEED_TESTS`` to the ``tests/`` directory of a
DeepSpeed checkout that has the file below (skipped otherwise). The file is copied to a temporary
directory (with the checkout's tests/conftest.py, whose hooks run the 2-rank cases) with its import
pointed at helpers.deepspeed_adapter and its five message patterns turned into ours (the only
changes), and run by pytest in a subprocess.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.host_probe import hang_guard

SUITE = Path("unit/v1/sequence_parallelism/test_vocab_parallel_linear_cross_entropy.py")
CHANGES = {
    "from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy":
        "from helpers.deepspeed_adapter import vocab_parallel_linear_cross_entropy",
    'match="Unsupported reduction"': 'match="must be one of"',
    'match="matching non-hidden dimensions"': 'match="targets hold"',
    'match="local_vocab, hidden"': 'match="V_local, H"',
    'match="chunk_size must be positive"': 'match="must be a positive int"',
    'match="out of range"': 'match="outside the vocabulary"',
}


@pytest.mark.slow
def test_deepspeeds_fused_linear_ce_suite_passes_on_ours(tmp_path):
    tests = os.environ.get("SMMD_DEEPSPEED_TESTS")
    if not tests or not (Path(tests) / SUITE).is_file():
        pytest.skip(f"set SMMD_DEEPSPEED_TESTS to a DeepSpeed checkout's tests/ directory holding {SUITE}")
    source = (Path(tests) / SUITE).read_text()
    for theirs, ours in CHANGES.items():
        assert theirs in source, f"the suite changed: {theirs!r} not found"
        source = source.replace(theirs, ours)
    (tmp_path / SUITE.name).write_text(source)
    shutil.copy(Path(tests) / "conftest.py", tmp_path)  # the hooks that run DistributedTest's ranks
    here = Path(__file__).resolve().parent.parent  # tests/, for helpers.deepspeed_adapter
    environment = dict(os.environ, DS_ACCELERATOR="cpu", LOCAL_SIZE="2",  # DeepSpeed's CPU harness: 2 ranks
                       PYTHONPATH=os.pathsep.join([str(here), tests, os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             str(tmp_path / SUITE.name)], cwd=tmp_path, env=environment,
                            capture_output=True, text=True, timeout=hang_guard(900))
    summary = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-2000:]
    passed = int(re.search(r"(\d+) passed", summary).group(1)) if "passed" in summary else 0
    assert result.returncode == 0 and "failed" not in summary and "skipped" not in summary, result.stdout[-4000:]
    assert passed >= 30, summary
