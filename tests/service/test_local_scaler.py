"""The local scaler (router side) and the supervisor's store (pdserve up side) through a real
(embedded) Redis: signed desired counts in, status out."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.launchers.scale_store import ScaleStore
from pdserve.redis_server import EmbeddedRedis
from pdserve.scalers.desired_state import DesiredCount
from pdserve.scalers.local import LocalScaler
from router.cluster.keys import desired_replicas_key, scaler_status_key
from router.ops.scaling import RoleScale, ScaleError, ScalerUnavailable
from router.cluster.redis_settings import PASSWORD_ENV, sync_client

pytestmark = pytest.mark.timeout(60)

SECRET = b"scaler-test-secret"
CLUSTER = "scaletest"
PASSWORD = "scaler-test-password"


@pytest.fixture
def redis_url(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, PASSWORD)
    with EmbeddedRedis(password=PASSWORD) as server:
        yield server.url


def run(coro):
    return asyncio.run(coro)


async def with_scaler(url: str, fn):
    scaler = LocalScaler(url, CLUSTER, SECRET)
    try:
        return await fn(scaler)
    finally:
        await scaler.aclose()


def test_without_a_supervisor_the_local_scaler_is_unavailable(redis_url):
    for call in (lambda s: s.desired(), lambda s: s.scale("decode", 2)):
        with pytest.raises(ScalerUnavailable, match="no pdserve up supervisor is running for cluster 'scaletest'"):
            run(with_scaler(redis_url, call))


def test_a_scale_request_reaches_the_supervisors_store_and_restarts_come_back(redis_url):
    store = ScaleStore(redis_url, CLUSTER, SECRET, max_replicas=4)
    store.set_initial({"decode": 1, "prefill": 1})
    store.publish_status({"kind": "local", "restarts:decode": "2", "restarts:prefill": "0"})
    assert run(with_scaler(redis_url, lambda s: s.desired())) == {
        "prefill": RoleScale("prefill", 1, 0), "decode": RoleScale("decode", 1, 2)}
    assert run(with_scaler(redis_url, lambda s: s.scale("decode", 3))) == RoleScale("decode", 3, 2)
    assert store.read() == {"decode": 3, "prefill": 1}
    assert run(with_scaler(redis_url, lambda s: s.desired()))["decode"] == RoleScale("decode", 3, 2)
    store.close()


def test_the_local_scaler_rejects_unknown_roles_and_bad_counts(redis_url):
    for role, replicas, message in (("gpu", 1, "unknown role 'gpu'; roles: prefill, decode"),
                                    ("decode", -1, "replicas must be an integer >= 0; got -1"),
                                    ("decode", True, "replicas must be an integer >= 0; got True"),
                                    ("decode", 1.5, "replicas must be an integer >= 0; got 1.5")):
        with pytest.raises(ScaleError) as info:
            run(with_scaler(redis_url, lambda s: s.scale(role, replicas)))
        assert str(info.value) == message


def test_the_store_ignores_unsigned_older_and_too_large_counts_and_rewrites_lost_ones(redis_url):
    store = ScaleStore(redis_url, CLUSTER, SECRET, max_replicas=4)
    store.set_initial({"decode": 1, "prefill": 1})
    redis = sync_client(redis_url)
    key = desired_replicas_key(CLUSTER)
    redis.hset(key, "decode", "5 99999999999999999999 deadbeef")  # a Redis writer without the secret
    assert store.read() == {"decode": 1, "prefill": 1}
    redis.hset(key, "decode", DesiredCount("decode", 3, 1).encode(CLUSTER, SECRET))  # replay of an old one
    assert store.read() == {"decode": 1, "prefill": 1}
    redis.hset(key, "decode", DesiredCount.now("decode", 5).encode(CLUSTER, SECRET))  # above --max-replicas
    assert store.read() == {"decode": 1, "prefill": 1}
    redis.delete(key)  # the embedded Redis restarted empty
    assert store.read() == {"decode": 1, "prefill": 1}
    assert sorted(redis.hgetall(key)) == [b"decode", b"prefill"]
    store.publish_status({"kind": "local"})
    assert 0 < redis.pttl(scaler_status_key(CLUSTER)) <= 5000
    store.clear_status()
    assert redis.exists(scaler_status_key(CLUSTER)) == 0
    store.close()


def test_each_scaler_acts_only_for_a_supervisor_of_its_own_launcher(redis_url):
    from pdserve.scalers.ray import RayScaler

    store = ScaleStore(redis_url, CLUSTER, SECRET, max_replicas=4)
    store.set_initial({"decode": 1, "prefill": 1})
    store.publish_status({"kind": "ray", "restarts:decode": "1", "restarts:prefill": "0"})

    async def scale_with(scaler_class):
        scaler = scaler_class(redis_url, CLUSTER, SECRET)
        try:
            return await scaler.scale("decode", 2)
        finally:
            await scaler.aclose()

    with pytest.raises(ScalerUnavailable) as info:
        run(scale_with(LocalScaler))
    assert str(info.value) == ("cluster 'scaletest' is supervised by a 'ray' launcher, not 'local': "
                               "start the router with --scaler ray")
    assert store.read() == {"decode": 1, "prefill": 1}
    assert run(scale_with(RayScaler)) == RoleScale("decode", 2, 1)
    assert store.read() == {"decode": 2, "prefill": 1}
    store.clear_status()
    with pytest.raises(ScalerUnavailable, match="no pdserve up --launcher ray supervisor is running"):
        run(scale_with(RayScaler))
    store.close()
