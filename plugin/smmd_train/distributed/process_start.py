"""The start of a process that imports torch, transformers, DeepSpeed and datasets, without the cyclic
garbage collector's passes over what they import.

While a rank imports them (about 4,000 modules, 450,000 objects that live as long as the process), CPython
runs a full collection each time the objects that survived earlier ones grow by a quarter: each pass
walks every object imported so far. After the imports every later full pass walks them again: DeepSpeed's
ZeRO-3 set-up calls ``gc.collect()`` (``defragment``), and so does the ordered shutdown
(``smmd_train.distributed.groups.shutdown_distributed``), about 0.2 CPU-s each here.

:func:`pause_collections` at the start of a program turns the collector off; :func:`keep_imports` after
the imports moves everything alive into the permanent generation (``gc.freeze()``), which later passes
skip, and turns the collector back on. A 1-rank, 4-step train.py run of the tiny preset went from 6.0-6.5
to 4.5-5.3 CPU-s (four runs each, alternating, 2026-11-28, 2 cores); its peak RSS grew 4-8 MB of ~600 MB.
The cost: the reference cycles that the imports left behind are never freed.

Where to call :func:`keep_imports`: in the program's entry (``cli()``, a script's top level), before the
first process group exists, and never inside a function whose frame will hold the run. An object frozen
is never collected, and it keeps what it refers to alive. The imports leave tracebacks behind (an
``ImportError`` caught by a module that tries an optional import), whose frames point back along the
stack that was importing: frozen inside ``main()``, they kept ``main()``'s frame, and through its locals
the engine and every process group, past the ordered shutdown (``shutdown_distributed`` reported 2 groups
still referenced). The shutdown's own collection must free the engines' cycles, so nothing that will hold
them may be frozen. Code that looks for objects with ``gc.get_objects()`` does not see frozen ones
(``smmd_train.compat.release_deepspeed_process_groups`` also walks DeepSpeed's modules for that reason).
"""

from __future__ import annotations

import gc

_paused = False


def pause_collections() -> None:
    """Turn the cyclic collector off for the imports that follow (it was on: :func:`keep_imports` turns it
    back on; it was off: it stays off)."""
    global _paused
    _paused = gc.isenabled()
    gc.disable()


def keep_imports() -> None:
    """Freeze every object alive (the imported modules, before the run makes anything it drops) and turn
    the collector back on if :func:`pause_collections` turned it off."""
    global _paused
    gc.freeze()
    if _paused:
        gc.enable()
        _paused = False
