"""`pdserve router`'s scaling flags: --scaler through the scalers registry, --max-replicas, and
the admin key from the flag, PDSERVE_ADMIN_KEY or PDSERVE_ADMIN_KEY_FILE."""

from __future__ import annotations

import sys
import types

import pytest

from engine.registry import Registry
from pdserve.cli import build_parser
from pdserve.router_main import admin_key_from, make_scaler


def router_args(*flags: str):
    return build_parser().parse_args(["router", *flags])


@pytest.fixture(autouse=True)
def no_admin_key_in_env(monkeypatch):
    monkeypatch.delenv("PDSERVE_ADMIN_KEY", raising=False)
    monkeypatch.delenv("PDSERVE_ADMIN_KEY_FILE", raising=False)


def test_the_defaults_are_no_scaler_16_replicas_and_no_admin_key():
    args = router_args()
    assert (args.scaler, args.max_replicas, admin_key_from(args)) == ("none", 16, None)


def test_the_admin_key_comes_from_the_flag_then_the_environment_then_the_file(monkeypatch, tmp_path):
    key_file = tmp_path / "admin-key"
    key_file.write_text("from-file\n")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY_FILE", str(key_file))
    assert admin_key_from(router_args()) == "from-file"
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "from-env")
    assert admin_key_from(router_args()) == "from-env"
    assert admin_key_from(router_args("--admin-key", "from-flag")) == "from-flag"


def test_an_empty_admin_key_file_refuses_to_start(monkeypatch, tmp_path):
    key_file = tmp_path / "admin-key"
    key_file.write_text("\n")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY_FILE", str(key_file))
    with pytest.raises(SystemExit, match="is empty: refusing to serve without the key it promises"):
        admin_key_from(router_args())


class RecordedScaler:
    name = "recorded"

    def __init__(self, redis_url, cluster, secret) -> None:
        self.built_with = (redis_url, cluster, secret)


@pytest.fixture
def scalers(monkeypatch):
    """A stand-in pdserve.scalers module holding a registry with one scaler."""
    registry: Registry = Registry("scaler")
    registry.register("recorded", RecordedScaler)
    monkeypatch.setitem(sys.modules, "pdserve.scalers", types.SimpleNamespace(SCALERS=registry))
    return registry


def test_none_builds_no_scaler(scalers):
    assert make_scaler("none", "redis://x", "c", b"s") is None


def test_a_named_scaler_is_built_from_the_registry_with_redis_cluster_and_secret(scalers):
    scaler = make_scaler("recorded", "redis://127.0.0.1:1", "c1", b"secret")
    assert isinstance(scaler, RecordedScaler)
    assert scaler.built_with == ("redis://127.0.0.1:1", "c1", b"secret")


def test_an_unknown_scaler_names_the_known_ones(scalers):
    with pytest.raises(SystemExit) as exc:
        make_scaler("k8s", None, "c", b"s")
    assert str(exc.value) == "--scaler: unknown scaler 'k8s'; known: recorded; or none"


def test_a_missing_scalers_package_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pdserve.scalers", None)
    with pytest.raises(SystemExit) as exc:
        make_scaler("local", None, "c", b"s")
    assert str(exc.value).startswith("--scaler local: no scalers are available in this installation (")
