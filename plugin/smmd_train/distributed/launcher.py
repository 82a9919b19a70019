"""The one builder of deepspeed launcher command lines, for Python callers (the demo, the sweep, the
benchmarks, the tests) and, through ``python -m smmd_train.distributed.launcher``, for the shell launchers
(``launch/pretrain.sh``, ``launch/continue_pretrain.sh``).

    launch_command("launch/train.py", "--model", "tiny", processes=2)
    # deepspeed --num_nodes 1 --num_gpus 2 --master_addr 127.0.0.1 --master_port <free> launch/train.py --model tiny

Defaults are DeepSpeed's wherever DeepSpeed knows better: without ``processes`` it starts one rank
per device it detects on each node (and honours CUDA_VISIBLE_DEVICES, which ``--num_gpus`` would
override); with a hostfile it picks the master itself (the first host), so no master address is
passed unless one is given.
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from smmd_cli.options import option, parse_options

EPHEMERAL_PORTS = "/proc/sys/net/ipv4/ip_local_port_range"
LOWEST_MASTER_PORT = 20000


def ephemeral_port_range() -> Optional[tuple]:
    """(first, last) of the ports the kernel hands out for outgoing connections and ``bind(0)``, or None."""
    try:
        with open(EPHEMERAL_PORTS) as handle:
            first, last = (int(word) for word in handle.read().split())
        return first, last
    except (OSError, ValueError):
        return None


def free_port(attempts: int = 200) -> int:
    """A TCP port free on every interface of this machine now (so on loopback too), for a master port:
    chosen at random below the kernel's ephemeral range, where no outgoing connection (a gloo pair, a
    store client) can take it between this probe and the master's own bind. A port from ``bind(0)``
    lies inside that range and can (seen as EADDRINUSE when a busy machine started a group); where the
    range is unknown or leaves no room below it, that is the fallback."""
    span = ephemeral_port_range()
    if span is not None and span[0] - 1 > LOWEST_MASTER_PORT:
        chooser = random.Random()  # (its own, so that a seeded global random never repeats ports)
        for _ in range(attempts):
            port = chooser.randint(LOWEST_MASTER_PORT, span[0] - 1)
            with socket.socket() as probe:
                try:
                    probe.bind(("", port))
                except OSError:
                    continue
                return port
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


def deepspeed_launcher() -> str:
    """The ``deepspeed`` launcher of this Python environment (a virtualenv's bin/ first)."""
    return shutil.which("deepspeed", path=str(Path(sys.executable).parent)) or "deepspeed"


def launch_command(script, *script_args, processes: Optional[int] = None, launcher="deepspeed",
                   master_port: Optional[int] = None, master_addr: Optional[str] = None, nodes: int = 1,
                   hostfile: Optional[str] = None, deepspeed: Optional[str] = None) -> list:
    """How to start ``script``.

    ``launcher="deepspeed"``: ``processes`` ranks on each node (default: one per device DeepSpeed
    detects). One node without ``hostfile``: this machine, on ``master_addr`` (default 127.0.0.1)
    and ``master_port`` (default: a free port). With ``hostfile``: its first ``nodes`` hosts; the
    master is ``master_addr:master_port`` if given, else DeepSpeed's choice (the first host, port
    29500). ``deepspeed`` names the launcher program (default: this environment's).
    ``launcher="python"``: one plain process. A list: start the script after it as given (e.g.
    ``["torchrun", "--nproc_per_node", "8"]``).
    """
    if isinstance(launcher, (list, tuple)):
        return [*map(str, launcher), str(script), *map(str, script_args)]
    if launcher == "python":
        if processes not in (None, 1):
            raise ValueError(f"launcher='python' starts one process, not {processes}; use launcher='deepspeed'")
        return [sys.executable, str(script), *map(str, script_args)]
    if launcher != "deepspeed":
        raise ValueError(f"launcher={launcher!r} must be 'deepspeed' or 'python'")
    if nodes < 1:
        raise ValueError(f"nodes={nodes} must be at least 1")
    if nodes != 1 and not hostfile:
        raise ValueError(f"nodes={nodes} needs a hostfile naming them")
    command = [deepspeed or deepspeed_launcher()]
    if hostfile:
        command += ["--hostfile", str(hostfile)]
    command += ["--num_nodes", str(nodes)]
    if processes is not None:
        command += ["--num_gpus", str(processes)]
    if hostfile:
        command += ["--master_addr", master_addr] if master_addr else []
        command += ["--master_port", str(master_port)] if master_port else []
    else:
        command += ["--master_addr", master_addr or "127.0.0.1", "--master_port", str(master_port or free_port())]
    return [*command, str(script), *map(str, script_args)]


@dataclass(frozen=True, kw_only=True)
class LauncherOptions:
    nodes: int = option("--nodes", type=int, default=1, help="nodes to use (more than 1 needs --hostfile)")
    gpus_per_node: Optional[int] = option("--gpus_per_node", type=int,
                                          help="ranks per node (default: DeepSpeed counts the devices)")
    hostfile: Optional[str] = option("--hostfile",
                                     help="DeepSpeed hostfile ('<host> slots=<N>' lines) for multi-node runs")
    master_addr: Optional[str] = option("--master_addr",
                                        help="default: 127.0.0.1 on one node, the first host with a hostfile")
    master_port: Optional[int] = option("--master_port", type=int,
                                        help="default: a free port on one node, 29500 with a hostfile")
    deepspeed: Optional[str] = option("--deepspeed",
                                      help="the launcher program (default: this Python environment's deepspeed)")
    script: str = option()
    script_args: list = option(nargs=argparse.REMAINDER)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``python -m smmd_train.distributed.launcher [options] SCRIPT [ARGS ...]``: run SCRIPT under the deepspeed
    launcher that :func:`launch_command` builds."""
    options, parser = parse_options(LauncherOptions, argv, prog="python -m smmd_train.distributed.launcher",
                                    description=main.__doc__)
    try:
        command = launch_command(options.script, *options.script_args, processes=options.gpus_per_node,
                                 nodes=options.nodes, hostfile=options.hostfile, master_addr=options.master_addr,
                                 master_port=options.master_port, deepspeed=options.deepspeed)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: {error}\n")
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()


def run_to_completion(command: list, log, timeout_seconds: float, grace_seconds: float = 30.0) -> Optional[int]:
    """Run a launcher ``command`` with its output to ``log``; its exit code, or None when it ran past
    ``timeout_seconds``. The launcher runs in a process group of its own, and a timeout ends the whole
    group — the ranks it started too, not only the launcher (SIGTERM, then SIGKILL after
    ``grace_seconds``), so a timed-out run does not keep its devices."""
    process = subprocess.Popen([str(part) for part in command], stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    try:
        return process.wait(timeout=timeout_seconds)
    except subprocess.TimeoutExpired:
        for sig, wait_seconds in ((signal.SIGTERM, grace_seconds), (signal.SIGKILL, None)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:  # the group is gone
                break
            try:
                process.wait(timeout=wait_seconds)
                _wait_for_group(process.pid, wait_seconds)
                break
            except subprocess.TimeoutExpired:
                continue
        return None


def _wait_for_group(group: int, seconds: Optional[float]) -> None:
    """Wait until no process of ``group`` is left (its leader may exit before the ranks it started)."""
    deadline = time.monotonic() + (seconds if seconds is not None else 30.0)
    while time.monotonic() < deadline:
        try:
            os.killpg(group, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise subprocess.TimeoutExpired(f"process group {group}", seconds)
