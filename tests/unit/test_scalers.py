"""Scalers: the registry and the signed desired counts (pure)."""

from __future__ import annotations

import pytest

from pdserve.scalers import SCALERS, make_scaler
from pdserve.scalers.desired_state import DesiredCount, decode_desired
from pdserve.scalers.local import LocalScaler

SECRET = b"scaler-test-secret"
CLUSTER = "scaletest"


def test_the_registry_builds_the_local_scaler_and_lists_known_names_for_an_unknown_one():
    assert SCALERS.names() == ["kubernetes", "local", "ray"]
    assert SCALERS.get("local") is LocalScaler
    with pytest.raises(KeyError) as info:
        make_scaler("k8s", "redis://127.0.0.1:1/0", CLUSTER, SECRET)
    assert info.value.args[0] == "unknown scaler 'k8s'; known: kubernetes, local, ray"


def test_the_local_scaler_needs_redis_and_the_cluster_secret():
    with pytest.raises(ValueError, match="the local scaler needs --redis-url"):
        LocalScaler(None, CLUSTER, SECRET)
    with pytest.raises(ValueError, match="the local scaler needs the cluster secret"):
        LocalScaler("redis://127.0.0.1:1/0", CLUSTER, None)


def test_a_desired_count_verifies_only_with_its_secret_cluster_and_role():
    value = DesiredCount("decode", 3, 1234).encode(CLUSTER, SECRET)
    assert decode_desired("decode", value, CLUSTER, SECRET) == DesiredCount("decode", 3, 1234)
    for role, cluster, secret in (("prefill", CLUSTER, SECRET), ("decode", "other", SECRET),
                                  ("decode", CLUSTER, b"wrong")):
        with pytest.raises(ValueError, match="not signed with the cluster secret"):
            decode_desired(role, value, cluster, secret)
    forged = value.replace("3 ", "9 ", 1)
    with pytest.raises(ValueError, match="desired count for decode is not signed"):
        decode_desired("decode", forged, CLUSTER, SECRET)
    with pytest.raises(ValueError, match="desired count for decode is malformed: '7'"):
        decode_desired("decode", "7", CLUSTER, SECRET)


