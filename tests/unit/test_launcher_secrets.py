"""`pdserve up` hands secrets to its children through the environment, never argv."""

from __future__ import annotations

import shutil
from pathlib import Path

from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV
from pdserve.launchers.secrets import secrets_env
from router.cluster.redis_settings import PASSWORD_ENV, USERNAME_ENV, RedisAuth


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


class FakePopen:
    """Records what `pdserve up` would start, starts nothing; "ready" at once (writes the
    ready file the real child would)."""

    started: list[tuple[list[str], dict[str, str]]] = []

    def __init__(self, cmd, env=None, **kwargs) -> None:
        FakePopen.started.append((list(cmd), dict(env or {})))
        self.pid = 4242
        Path(cmd[cmd.index("--ready-file") + 1]).write_text("1 2\n")

    def poll(self):
        return None


class FakeStore:
    """The Redis side of the scaler (not under test here): desired counts as set."""

    def __init__(self, redis_url, cluster, secret, max_replicas, auth=None) -> None:
        self.desired: dict[str, int] = {}

    def set_initial(self, counts):
        self.desired = dict(counts)

    def read(self):
        return self.desired

    def publish_status(self, fields):
        pass


def launched_with(monkeypatch, argv: list[str], environ: dict[str, str]):
    import subprocess

    from pdserve.cli import build_parser
    from pdserve.launchers import local

    for name in ("PDSERVE_API_KEY", "PDSERVE_API_KEY_FILE", CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV,
                 PASSWORD_ENV, USERNAME_ENV):
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    FakePopen.started = []
    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(local, "ScaleStore", FakeStore)
    cluster = local.LocalCluster(build_parser().parse_args(["up", *argv]))
    try:
        cluster.start()
    finally:
        shutil.rmtree(cluster.workdir, ignore_errors=True)
    return cluster, FakePopen.started


def test_api_key_and_redis_password_from_flags_reach_children_only_through_the_environment(monkeypatch, capsys):
    cluster, started = launched_with(
        monkeypatch, ["--api-key", "key-on-argv", "--redis-url", "redis://ops:pw-in-url@10.0.0.5:6379/0"], {})
    assert [cmd[3] for cmd, _ in started] == ["decode", "prefill", "router"]
    for cmd, env in started:
        assert not any("key-on-argv" in a or "pw-in-url" in a or a == "--api-key" for a in cmd), cmd
        assert cmd[cmd.index("--redis-url") + 1] == "redis://10.0.0.5:6379/0"
        assert (env[PASSWORD_ENV], env[USERNAME_ENV], env["PDSERVE_API_KEY"]) == ("pw-in-url", "ops", "key-on-argv")
    assert len({env[CLUSTER_SECRET_ENV] for _, env in started}) == 1  # one generated secret, shared
    assert capsys.readouterr().err.splitlines() == [
        "pdserve up: --api-key is visible to every user of this host (ps); prefer PDSERVE_API_KEY or "
        "PDSERVE_API_KEY_FILE in the environment"]
    assert cluster.redis is None


def test_secrets_the_user_put_in_the_environment_are_inherited_and_not_warned_about(monkeypatch, capsys):
    _, started = launched_with(monkeypatch, ["--redis-url", "redis://10.0.0.5:6379/0"], {
        "PDSERVE_API_KEY": "env-key", CLUSTER_SECRET_ENV: "env-secret", PASSWORD_ENV: "env-pw"})
    for cmd, env in started:
        assert (env["PDSERVE_API_KEY"], env[CLUSTER_SECRET_ENV], env[PASSWORD_ENV]) == ("env-key", "env-secret", "env-pw")
    assert capsys.readouterr().err == ""
