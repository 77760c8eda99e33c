"""`pdserve up` hands secrets to its children through the environment, never argv."""

from __future__ import annotations

from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV
from pdserve.launcher import secrets_env
from router.redis_settings import PASSWORD_ENV, USERNAME_ENV, RedisAuth


def test_a_cluster_secret_is_generated_when_the_user_set_none():
    first = secrets_env({}, RedisAuth(), None)
    second = secrets_env({}, RedisAuth(), None)
    assert set(first) == {CLUSTER_SECRET_ENV}
    assert len(first[CLUSTER_SECRET_ENV]) >= 43  # 256 bits, URL-safe base64
    assert first[CLUSTER_SECRET_ENV] != second[CLUSTER_SECRET_ENV]


def test_the_users_cluster_secret_is_inherited_not_replaced():
    assert secrets_env({CLUSTER_SECRET_ENV: "mine"}, RedisAuth(), None) == {}
    assert secrets_env({CLUSTER_SECRET_FILE_ENV: "/run/secret"}, RedisAuth(), None) == {}


def test_redis_credentials_and_the_api_key_go_to_the_environment():
    env = secrets_env({CLUSTER_SECRET_ENV: "mine"}, RedisAuth(username="u", password="pw"), "key-1")
    assert env == {USERNAME_ENV: "u", PASSWORD_ENV: "pw", "PDSERVE_API_KEY": "key-1"}
