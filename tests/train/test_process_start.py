"""smmd_train.distributed.process_start, in fresh interpreters (it changes process-wide state): while paused, the
collector does not run; after keep_imports it runs again, a cycle made later is collected, and what was
alive before (a cycle the "imports" left) is frozen and no collection finalizes it. A collector that was
off before stays off."""

import subprocess
import sys

import pytest
from helpers.host_probe import hang_guard
from helpers.launching import REPO

SCRIPT = """
import gc, sys
from smmd_train.distributed.process_start import keep_imports, pause_collections

class Node:
    def __init__(self, name):
        self.name = name
    def __del__(self):
        print("finalized", self.name, flush=True)

def cycle(name):
    a, b = Node(name), Node(name)
    a.other, b.other = b, a

if sys.argv[1] == "off":
    gc.disable()
pause_collections()
print("paused", gc.isenabled(), flush=True)
cycle("import-time")
gc.collect()  # explicit collections still run: the frozen objects are what they skip
cycle("import-time-left")
keep_imports()
print("after", gc.isenabled(), gc.get_freeze_count() > 0, flush=True)
gc.collect()
cycle("later")
gc.collect()
print("end", flush=True)
gc.freeze()  # no finalization at exit, so the output above is all there is
"""


@pytest.mark.parametrize("before, printed", [
    ("on", ["paused False", "finalized import-time", "finalized import-time", "after True True",
            "finalized later", "finalized later", "end"]),
    ("off", ["paused False", "finalized import-time", "finalized import-time", "after False True",
             "finalized later", "finalized later", "end"])])
def test_paused_then_frozen_then_collected_again(before, printed):
    completed = subprocess.run([sys.executable, "-c", SCRIPT, before], capture_output=True, text=True,
                               timeout=hang_guard(60), env={"PYTHONPATH": str(REPO / "plugin")})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == printed


MEMOIZED = """
import functools, gc
import deepspeed.runtime.zero.partitioned_param_coordinator  # noqa: F401
from smmd_train.compat import deepspeed_lru_caches

cache_type = type(functools.lru_cache()(print))
gc.freeze()
print(sum(type(value) is cache_type and str(value.__module__).startswith("deepspeed.") for value in gc.get_objects()))
print("PartitionedParameterCoordinator.__params_to_release" in [cache.__qualname__ for cache in deepspeed_lru_caches()])
"""


def test_deepspeed_s_memoized_methods_are_found_when_frozen():
    # ZeRO-3's coordinator memoizes a method whose cache holds the coordinator, hence every parameter and
    # its process group; frozen (as train.py freezes what it imported) gc.get_objects() does not list it.
    completed = subprocess.run([sys.executable, "-c", MEMOIZED], capture_output=True, text=True,
                               timeout=hang_guard(120),
                               env={"PYTHONPATH": str(REPO / "plugin"), "DS_ACCELERATOR": "cpu"})
    assert completed.returncode == 0, completed.stderr
    assert completed.stdout.splitlines() == ["0", "True"]
