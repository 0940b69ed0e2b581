"""The test and benchmark harness hands out ports a server can still bind a moment later."""

from __future__ import annotations

import socket

from stepguard.bench.harness import _ephemeral_range, free_port


def test_a_free_port_lies_below_the_range_the_kernel_gives_outgoing_connections():
    low, _ = _ephemeral_range()

    ports = [free_port() for _ in range(50)]

    assert all(10000 <= port < low for port in ports)
    assert len(set(ports)) == len(ports)


def test_a_free_port_can_be_bound():
    port = free_port()

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
