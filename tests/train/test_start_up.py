"""smmd_train.start_up.collector_paused, in a fresh interpreter each (it changes process-wide state: the
collector's switch and the permanent generation): paused inside, one collection at the end that frees
the block's cyclic garbage, the survivors frozen, the collector back as it was, on every exit path."""

import subprocess
import sys
import textwrap

import pytest
from helpers.launching import REPO

CHECKS = """
import gc, weakref
from smmd_train.start_up import collector_paused

class Node:
    pass

def cycle():
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a

{setup}
frozen_before = gc.get_freeze_count()
try:
    with collector_paused():
        assert not gc.isenabled()
        early = weakref.ref(cycle())
        gc.collect()  # an explicit pass while paused still runs (as ZeRO-3's start calls it)
        assert early() is None
        garbage = weakref.ref(cycle())  # unreachable at once, only a collection frees it
        kept = [cycle() for _ in range(100)]
        {inside}
except RuntimeError as error:
    assert str(error) == "failed in the start-up"
assert garbage() is None, "the block's cyclic garbage outlived its end"
assert gc.get_freeze_count() >= frozen_before + 200, (frozen_before, gc.get_freeze_count())
assert gc.isenabled() == {enabled_after}
garbage_after = weakref.ref(cycle())
gc.collect()
assert garbage_after() is None  # the collector collects what comes after
print("ok")
"""


@pytest.mark.parametrize("setup, inside, enabled_after", [
    ("", "pass", True),
    ("", "raise RuntimeError('failed in the start-up')", True),
    ("gc.disable()", "pass", False),  # a collector the process had turned off stays off
])
def test_the_collector_is_paused_then_collects_once_and_freezes(setup, inside, enabled_after):
    script = textwrap.dedent(CHECKS).format(setup=setup, inside=inside, enabled_after=enabled_after)
    completed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                               env={"PYTHONPATH": str(REPO / "plugin")})
    assert completed.returncode == 0 and completed.stdout.strip() == "ok", completed.stderr
