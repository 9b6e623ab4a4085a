"""Loopback ports for the servers a test starts.

A port is found by binding port 0 and closing the socket, so nothing holds it until the
server binds it. Two such lookups in a row can return the same port (the kernel may hand a
closed port out again), and a test that starts an admin server and a gateway on "two" ports
then talks to one server through both addresses. ``free_ports`` holds every socket until all
are bound, so the ports it returns differ from one another.
"""

from __future__ import annotations

import contextlib
import socket


def free_ports(count: int) -> list[int]:
    """``count`` different loopback ports that nothing listened on a moment ago."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            sock.bind(("127.0.0.1", 0))
            ports.append(int(sock.getsockname()[1]))
    assert len(set(ports)) == count, ports  # bound at the same time, so distinct
    return ports


def free_port() -> int:
    """One loopback port nothing listened on a moment ago."""
    return free_ports(1)[0]
