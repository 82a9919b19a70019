"""Run a function on real gloo ranks (spawned processes) under a hard timeout.

``run_ranks(fn, world_size, *args)`` starts ``world_size`` processes on 127.0.0.1, each with its
own process group (gloo, ``pg_timeout`` seconds), calls ``fn(rank, world_size, *args)`` and
returns one :class:`Outcome` per rank. If any rank does not finish in ``timeout`` seconds all are
killed and the test fails: a hang is a failure, never a stuck CI job.
"""

import datetime
import multiprocessing
import os
import queue
import time
import traceback
from typing import NamedTuple

import torch.distributed as dist

from smmd_train.launcher import free_port


class Outcome(NamedTuple):
    rank: int
    ok: bool
    value: object  # fn's return value, or "ExceptionType: message"
    traceback: str = ""


def _worker(rank, world_size, port, pg_timeout, fn, args, results):
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        results.put(Outcome(rank, True, fn(rank, world_size, *args)))
    except BaseException as error:  # reported to the parent, which fails the test
        results.put(Outcome(rank, False, f"{type(error).__name__}: {error}", traceback.format_exc()))
    finally:
        if dist.is_initialized():  # fn may have shut it down itself
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout: float = 180, pg_timeout: float = 60) -> list:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [context.Process(target=_worker, args=(rank, world_size, port, pg_timeout, fn, args, results),
                                 daemon=True) for rank in range(world_size)]
    for process in processes:
        process.start()
    outcomes, deadline = {}, time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish within "
                                     f"{timeout:.0f} s (a hang); finished: {sorted(outcomes)}")
            try:
                outcome = results.get(timeout=min(remaining, 1.0))
                outcomes[outcome.rank] = outcome
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and len(outcomes) + len(dead) >= world_size:
                    raise AssertionError(f"a rank died without reporting (exit codes "
                                         f"{[p.exitcode for p in processes]})") from None
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
    return [outcomes[rank] for rank in range(world_size)]


def values_or_raise(outcomes) -> list:
    """The ranks' return values; fail with every failing rank's traceback otherwise."""
    failed = [outcome for outcome in outcomes if not outcome.ok]
    if failed:
        raise AssertionError("\n".join(f"rank {o.rank}: {o.value}\n{o.traceback}" for o in failed))
    return [outcome.value for outcome in outcomes]


COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier", "all_gather_object")


class CollectiveSpy:
    """Counts the collectives (and all_reduce payload bytes) that really run; nothing is mocked."""

    def __init__(self):
        self.calls, self.bytes = 0, 0
        self._originals = {}

    def __enter__(self):
        for name in COLLECTIVES:
            original = getattr(dist, name)
            self._originals[name] = original

            def counted(*args, _original=original, _name=name, **kwargs):
                self.calls += 1
                if _name == "all_reduce":
                    self.bytes += args[0].numel() * args[0].element_size()
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._originals.items():
            setattr(dist, name, original)
