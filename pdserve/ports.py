"""Picking a free local TCP port for a server started next (embedded Redis, tests, benchmarks).

A port picked by binding port 0 comes from the kernel's ephemeral range, the same range every
other port-0 bind and outgoing connection draws from: between the pick and the server's own
bind, a worker's metrics server or a Ray process can take it (it happened to a router's port
in the e2e tests). So the pick is made below that range, where only explicit binds land, and
falls back to a port-0 bind where the range starts too low to leave room.
"""

from __future__ import annotations

import random
import socket
from collections.abc import Collection
from pathlib import Path

LOCALHOST = "127.0.0.1"
LOWEST = 20000
"""Picks start here: well above the registered services most hosts run (Redis 6379, 8000s)."""
TRIES = 500


def free_port(host: str = LOCALHOST, avoid: Collection[int] = ()) -> int:
    """A port nothing listens on at `host` a moment ago, below the ephemeral range when there
    is room, and none of `avoid` (ports the caller is about to bind for something else: a
    launcher picking Redis's port before its router binds the ports it was given). Raises
    RuntimeError when TRIES picks all found a listener."""
    low = ephemeral_ports_start()
    for _ in range(TRIES):
        if low <= LOWEST:  # nothing to pick below such a range
            with socket.socket() as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in avoid:
                return port
            continue
        port = random.randrange(LOWEST, low)
        if port not in avoid and port_is_free(port, host):
            return port
    raise RuntimeError(f"no free port found in {LOWEST}..{low - 1} on {host}")


def free_ports(count: int, host: str = LOCALHOST, avoid: Collection[int] = ()) -> list[int]:
    """`count` distinct free ports (free_port each, avoiding the ones picked before it): two
    picks in a row may draw the same port, nothing having bound the first yet (it happened to
    a test's --port and --grpc-port)."""
    picked: list[int] = []
    for _ in range(count):
        picked.append(free_port(host, {*avoid, *picked}))
    return picked


def port_is_free(port: int, host: str = LOCALHOST) -> bool:
    """Nothing listens there (TIME_WAIT leftovers of closed connections do not count)."""
    return bind_error(host, port) is None


def bind_error(host: str, port: int) -> OSError | None:
    """Why a server could not listen on host:port now (taken, no such address, ...), or None.
    TIME_WAIT leftovers of closed connections do not count (SO_REUSEADDR, as servers bind)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            return exc
        return None


def ephemeral_ports_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where it cannot be read)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
