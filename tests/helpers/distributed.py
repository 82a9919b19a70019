"""Run a function on real gloo ranks (separate processes) under a hard timeout.

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on ``world_size`` processes,
each in a process group of its own (gloo on 127.0.0.1, ``pg_timeout`` seconds), and returns one
:class:`Outcome` per rank. If any rank does not finish in ``timeout`` seconds (a hang guard's base value,
scaled to this host by :func:`helpers.host_probe.hang_guard`) all are killed and the test fails: a hang
is a failure, never a stuck CI job.

The processes start from a fork server (``multiprocessing``'s "forkserver") that imported torch,
``torch.distributed`` and ``smmd_scale`` once: a rank is a fork of a process that holds no threads, no
process group and nothing a test made, without its own second of imports. What a test's ranks import
beyond that (DeepSpeed, transformers and ``torch._dynamo`` with them) they import themselves, as a fresh
process would; ``test_shutdown`` depends on ``torch._dynamo`` not being there before its group.

By default a pool of worker processes kept for the session (started once; each call
makes a new process group on a new port and destroys it after ``fn``, and the worker's environment
variables are restored), since starting ranks costs time per call (each imports the test module
and what it needs) and the loss tests make dozens of calls. ``fresh=True`` starts new processes for the
call, for a test whose ranks change what outlives a process group (DeepSpeed's global groups, an
engine, threads a shutdown test counts). A pool whose call fails by a hang or a dead rank is
killed whole and started again on the next call.
"""

import atexit
import datetime
import itertools
import multiprocessing
import os
import pickle
import queue
import time
import traceback
from typing import NamedTuple

import torch.distributed as dist

from smmd_train.distributed.launcher import free_port

from .host_probe import describe, hang_guard


class Outcome(NamedTuple):
    rank: int
    ok: bool
    value: object  # fn's return value, or "ExceptionType: message"
    traceback: str = ""


def _run_rank(rank, world_size, port, pg_timeout, fn, args) -> Outcome:
    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        return Outcome(rank, True, fn(rank, world_size, *args))
    except BaseException as error:  # reported to the parent, which fails the test
        return Outcome(rank, False, f"{type(error).__name__}: {error}", traceback.format_exc())
    finally:
        if dist.is_initialized():  # fn may have shut it down itself
            dist.destroy_process_group()


def _worker(rank, world_size, port, pg_timeout, fn, args, results, environ):
    _take_environment(environ)
    results.put((None, _run_rank(rank, world_size, port, pg_timeout, fn, args)))


def _take_environment(environ: dict) -> None:
    """The test process's environment when it started this rank (a fork server's children would have the
    server's, from when it started), as a spawned process has it."""
    os.environ.clear()
    os.environ.update(environ)


def _pool_worker(inbox, results, environ):
    """A pooled rank: runs calls until it gets None, each with the environment it was started with."""
    _take_environment(environ)
    while (task := inbox.get()) is not None:
        call, rank, world_size, port, pg_timeout, payload = task
        try:
            fn, args = pickle.loads(payload)  # the test module is imported here, once per worker
            outcome = _run_rank(rank, world_size, port, pg_timeout, fn, args)
        except BaseException as error:
            outcome = Outcome(rank, False, f"{type(error).__name__}: {error}", traceback.format_exc())
        results.put((call, outcome))
        _take_environment(environ)


# What the fork server imports before it forks a rank (see the module's docstring).
PRELOADED = ["torch", "torch.distributed", "smmd_scale", "helpers.distributed"]


def _context():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOADED)  # read when the server starts, on the first rank
    return context


class _Pool:
    def __init__(self):
        self.context = _context()
        self.results = self.context.Queue()
        self.workers = []  # (process, inbox), rank i runs on worker i
        self.calls = itertools.count()

    def processes(self, world_size: int) -> list:
        while len(self.workers) < world_size:
            inbox = self.context.Queue()
            process = self.context.Process(target=_pool_worker, args=(inbox, self.results, dict(os.environ)),
                                           daemon=True)
            process.start()
            self.workers.append((process, inbox))
        return [process for process, _ in self.workers[:world_size]]

    def submit(self, world_size, port, pg_timeout, fn, args) -> int:
        call, payload = next(self.calls), pickle.dumps((fn, args))
        self.processes(world_size)
        for rank, (_, inbox) in enumerate(self.workers[:world_size]):
            inbox.put((call, rank, world_size, port, pg_timeout, payload))
        return call

    def close(self):
        for process, inbox in self.workers:
            process.kill()
            process.join(timeout=10)
            inbox.close()
        self.workers = []
        self.results = self.context.Queue()  # a killed worker may have left the old one half written


_POOL = _Pool()
atexit.register(_POOL.close)


def run_ranks(fn, world_size: int, *args, timeout: float = 180, pg_timeout: float = 60, fresh: bool = False) -> list:
    port = free_port()
    if fresh:
        context = _context()
        results = context.Queue()
        processes = [context.Process(target=_worker, args=(rank, world_size, port, pg_timeout, fn, args, results,
                                                                   dict(os.environ)),
                                     daemon=True) for rank in range(world_size)]
        for process in processes:
            process.start()
        call = None
    else:
        call = _POOL.submit(world_size, port, pg_timeout, fn, args)
        results, processes = _POOL.results, _POOL.processes(world_size)
    outcomes, deadline, finished = {}, time.monotonic() + hang_guard(timeout), False
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(outcomes))} did not finish within "
                                     f"{hang_guard(timeout):.0f} s, {describe(timeout)}; finished: {sorted(outcomes)}")
            try:
                outcome_call, outcome = results.get(timeout=min(remaining, 1.0))
                if outcome_call == call:
                    outcomes[outcome.rank] = outcome
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0) or (call is not None and not p.is_alive())]
                if dead and len(outcomes) + len(dead) >= world_size:
                    raise AssertionError(f"a rank died without reporting (exit codes "
                                         f"{[p.exitcode for p in processes]})") from None
        finished = True
    finally:
        if fresh:
            for process in processes:
                process.join(timeout=10)
                if process.is_alive():
                    process.kill()
        elif not finished:
            _POOL.close()
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
