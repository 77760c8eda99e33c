"""What a Ray actor gets of the driver's environment: the secrets, resolved to values."""

from __future__ import annotations

import pytest

pytest.importorskip("ray", reason="the Ray launcher needs pdserve[ray]")

from pdserve.launchers.ray.cluster import actor_secrets  # noqa: E402


def test_actors_get_only_the_secrets_each_as_a_value_even_when_given_as_a_file(tmp_path):
    admin = tmp_path / "admin"
    admin.write_text("admin-key-from-file\n")
    env = {"PDSERVE_CLUSTER_SECRET": "s3cret", "PDSERVE_REDIS_PASSWORD": "redis-pw",
           "PDSERVE_ADMIN_KEY_FILE": str(admin), "PDSERVE_API_KEY": "api", "HOME": "/root",
           "PATH": "/usr/bin", "PDSERVE_REDIS_USERNAME": ""}
    assert actor_secrets(env) == {"PDSERVE_CLUSTER_SECRET": "s3cret", "PDSERVE_REDIS_PASSWORD": "redis-pw",
                                  "PDSERVE_API_KEY": "api", "PDSERVE_ADMIN_KEY": "admin-key-from-file"}


def test_a_value_wins_over_its_file():
    assert actor_secrets({"PDSERVE_CLUSTER_SECRET": "direct",
                          "PDSERVE_CLUSTER_SECRET_FILE": "/nonexistent"}) == {"PDSERVE_CLUSTER_SECRET": "direct"}
