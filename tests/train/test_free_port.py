"""The master port the launch helpers pick (``smmd_train.distributed.launcher.free_port``): free, and below the
kernel's ephemeral range, where an outgoing connection cannot take it before the master binds it (a
port from bind(0) could be taken: EADDRINUSE when a busy machine started a group)."""

import socket

from smmd_train.distributed.launcher import LOWEST_MASTER_PORT, ephemeral_port_range, free_port


def test_the_port_is_free_and_outside_the_ephemeral_range():
    span = ephemeral_port_range()
    ports = {free_port() for _ in range(50)}
    for port in ports:
        with socket.socket() as server:
            server.bind(("127.0.0.1", port))  # free: the master can bind it
        if span is not None and span[0] - 1 > LOWEST_MASTER_PORT:
            assert LOWEST_MASTER_PORT <= port < span[0], (port, span)
    assert len(ports) > 40  # random over ~12,700 ports, not one port again and again


def test_a_taken_port_is_passed_over(monkeypatch):
    """With every candidate but one taken, the one free is found."""
    import smmd_train.distributed.launcher as launcher

    monkeypatch.setattr(launcher, "ephemeral_port_range", lambda: (LOWEST_MASTER_PORT + 3, 60999))
    held = []
    try:
        for port in range(LOWEST_MASTER_PORT, LOWEST_MASTER_PORT + 2):
            taken = socket.socket()
            try:
                taken.bind(("", port))
                taken.listen()
                held.append(taken)
            except OSError:
                taken.close()  # already someone else's: taken either way
        assert free_port() == LOWEST_MASTER_PORT + 2
    finally:
        for taken in held:
            taken.close()
