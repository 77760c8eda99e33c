"""router/cluster/redis_settings.py: where every pdserve Redis client gets its credentials and TLS."""

from __future__ import annotations

import asyncio

import pytest
import redis

from router.cluster.redis_settings import (
    PASSWORD_ENV,
    PASSWORD_FILE_ENV,
    USERNAME_ENV,
    RedisAuth,
    async_client,
    redact_url,
    split_credentials,
    sync_client,
)


def kwargs_of(client) -> dict:
    return client.connection_pool.connection_kwargs


def test_credentials_come_from_the_environment_when_the_url_has_none(monkeypatch):
    monkeypatch.setenv(USERNAME_ENV, "pdserve")
    monkeypatch.setenv(PASSWORD_ENV, "s3cret")
    client = sync_client("redis://127.0.0.1:6379/0")
    assert (kwargs_of(client)["username"], kwargs_of(client)["password"]) == ("pdserve", "s3cret")


def test_the_password_file_is_read_when_no_password_variable_is_set(monkeypatch, tmp_path):
    (tmp_path / "pw").write_text("from-file\n")
    monkeypatch.delenv(PASSWORD_ENV, raising=False)
    monkeypatch.delenv(USERNAME_ENV, raising=False)
    monkeypatch.setenv(PASSWORD_FILE_ENV, str(tmp_path / "pw"))
    assert RedisAuth.from_env() == RedisAuth(username=None, password="from-file")


def test_an_unreadable_password_file_is_an_error_naming_it(tmp_path):
    missing = tmp_path / "none"
    with pytest.raises(ValueError, match=f"cannot read the Redis password file {missing}"):
        RedisAuth.from_env({PASSWORD_FILE_ENV: str(missing)})


def test_credentials_in_the_url_win_over_the_environment(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    client = sync_client("redis://alice:p%40ss@127.0.0.1:6379/2")
    assert (kwargs_of(client)["username"], kwargs_of(client)["password"]) == ("alice", "p@ss")
    assert kwargs_of(client)["db"] == 2


def test_explicit_auth_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, "from-env")
    client = sync_client("redis://127.0.0.1:6379/0", RedisAuth(password="given"))
    assert kwargs_of(client)["password"] == "given"


def test_no_credentials_anywhere_means_no_auth():
    client = sync_client("redis://127.0.0.1:6379/0", RedisAuth())
    assert (kwargs_of(client).get("username"), kwargs_of(client).get("password")) == (None, None)


def test_rediss_urls_give_tls_clients_with_the_urls_tls_options(tmp_path):
    url = f"rediss://127.0.0.1:6380/0?ssl_cert_reqs=required&ssl_ca_certs={tmp_path}/ca.pem"
    client = sync_client(url, RedisAuth(password="pw"), socket_timeout=0.5)
    assert issubclass(client.connection_pool.connection_class, redis.SSLConnection)
    kwargs = kwargs_of(client)
    assert (kwargs["ssl_cert_reqs"], kwargs["ssl_ca_certs"]) == ("required", f"{tmp_path}/ca.pem")
    assert (kwargs["password"], kwargs["socket_timeout"]) == ("pw", 0.5)

    async def main() -> None:
        aclient = async_client(url, RedisAuth(password="pw"))
        assert aclient.connection_pool.connection_class.__name__ == "SSLConnection"
        assert aclient.connection_pool.connection_kwargs["ssl_ca_certs"] == f"{tmp_path}/ca.pem"
        await aclient.aclose()

    asyncio.run(main())


def test_split_credentials_strips_user_and_password_and_keeps_the_rest():
    url, auth = split_credentials("rediss://bob:pw@redis.internal:6380/1?ssl_cert_reqs=none")
    assert url == "rediss://redis.internal:6380/1?ssl_cert_reqs=none"
    assert auth == RedisAuth(username="bob", password="pw")
    assert split_credentials("redis://127.0.0.1:6379/0") == ("redis://127.0.0.1:6379/0", RedisAuth())


def test_a_redacted_url_hides_the_password_and_repr_hides_it_too():
    assert redact_url("redis://bob:pw@h:6379/0") == "redis://bob:***@h:6379/0"
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"
    assert "pw" not in repr(RedisAuth(username="bob", password="pw"))


def test_child_env_hands_the_credentials_over_by_name():
    assert RedisAuth(username="u", password="p").child_env() == {USERNAME_ENV: "u", PASSWORD_ENV: "p"}
    assert RedisAuth().child_env() == {}
