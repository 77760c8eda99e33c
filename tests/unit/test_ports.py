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


def test_a_pick_never_takes_a_port_the_caller_is_about_to_bind(monkeypatch):
    """pdserve up picks its embedded Redis's port before the router binds the ports it was
    given (nothing listens there yet): that pick must skip them (it took a router's --grpc-port
    once in CI: "Address already in use")."""
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 32768)
    draws = iter([31727, 31727, 25000])
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
    monkeypatch.setattr(ports, "port_is_free", lambda port, host="127.0.0.1": True)
    assert ports.free_port(avoid={31727, 8000}) == 25000


def test_the_embedded_redis_picks_around_the_ports_it_is_told_to_avoid(monkeypatch):
    from pdserve import redis_server

    seen = []
    monkeypatch.setattr(redis_server, "free_port", lambda host, avoid=(): seen.append(set(avoid)) or 31000)
    monkeypatch.setattr(redis_server.EmbeddedRedis, "_launch", lambda self, executable, port: None)
    monkeypatch.setattr(redis_server, "bundled_redis_server", lambda: __import__("pathlib").Path(__file__))
    redis_server.EmbeddedRedis(avoid_ports=(8000, 0, 31727)).start()
    assert seen == [{8000, 31727}]  # 0 (any port) is nothing to avoid


def test_the_ray_launchers_redis_actor_picks_around_the_routers_ports_too(monkeypatch):
    """The same race under `--launcher ray`: its Redis actor starts before the router binds."""
    pytest.importorskip("ray", reason="the Ray launcher needs pdserve[ray]")
    from pdserve import redis_server
    from pdserve.launchers.ray import actors

    made = []
    monkeypatch.setattr(redis_server, "EmbeddedRedis", lambda **kwargs: made.append(kwargs))
    monkeypatch.setattr(actors, "_configure_logging", lambda *args: None)
    actor = actors.RedisActor.__ray_metadata__.modified_class  # the class under Ray's wrapper
    actor.__init__(object.__new__(actor), "127.0.0.1", (8000, 50051))
    assert made == [{"host": "127.0.0.1", "avoid_ports": (8000, 50051)}]


def test_ports_picked_together_are_distinct_even_when_a_draw_repeats(monkeypatch):
    """Two free_port() in a row once gave a test's --port and --grpc-port the same port
    (nothing had bound the first yet)."""
    monkeypatch.setattr(ports, "ephemeral_ports_start", lambda: 32768)
    draws = iter([21907, 21907, 25000, 26000, 27000])
    monkeypatch.setattr(ports.random, "randrange", lambda low, high: next(draws))
    monkeypatch.setattr(ports, "port_is_free", lambda port, host="127.0.0.1": True)
    assert ports.free_ports(3, avoid={26000}) == [21907, 25000, 27000]
