"""pdserve.ports: free ports are picked below the kernel's ephemeral range, where port-0 binds
(metrics servers, outgoing connections) cannot take them between the pick and the use."""

from __future__ import annotations

import socket

import pytest

from pdserve import ports


def test_a_pick_is_free_and_below_the_ephemeral_range():
    low = ports.ephemeral_ports_start()
    picks = {ports.free_port() for _ in range(20)}
    if low > ports.LOWEST:
        assert all(ports.LOWEST <= p < low for p in picks), (picks, low)
    assert all(ports.port_is_free(p) for p in picks)


def test_a_listening_port_is_not_free():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        assert not ports.port_is_free(sock.getsockname()[1])


def test_a_range_starting_too_low_falls_back_to_a_port_zero_bind(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 1024)
    port = ports.free_port()
    assert 0 < port < 65536 and ports.port_is_free(port)


def test_no_free_port_in_the_range_raises_naming_it(monkeypatch):
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 32768)
    monkeypatch.setattr(ports, "port_is_free", lambda port, host="127.0.0.1": False)
    with pytest.raises(RuntimeError, match=r"^no free port found in 20000\.\.32767 on 127\.0\.0\.1$"):
        ports.free_port()
