"""smmd_train.distributed.process_end.skip_final_collections, in fresh interpreters (it changes process-wide state):
interpreter finalization collects a reference cycle left at exit, and after the call it does not, while
what the process printed and wrote before is all there."""

import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO

SCRIPT = """
import sys
from smmd_train.distributed.process_end import skip_final_collections

class Node:
    def __del__(self):
        print("finalized a cycle", flush=True)

a, b = Node(), Node()
a.other, b.other = b, a
del a, b
with open(sys.argv[2], "w") as handle:
    handle.write("written")
print("done", flush=True)
if sys.argv[1] == "skip":
    skip_final_collections()
"""


@pytest.mark.parametrize("end, printed", [("plain", ["done"] + ["finalized a cycle"] * 2), ("skip", ["done"])])
def test_finalization_collects_nothing_after_the_call(tmp_path, end, printed):
    written = tmp_path / "out.txt"
    completed = subprocess.run([sys.executable, "-c", SCRIPT, end, str(written)], capture_output=True, text=True,
                               timeout=hang_guard(60), env={"PYTHONPATH": str(REPO / "plugin")})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == printed
    assert written.read_text() == "written"
