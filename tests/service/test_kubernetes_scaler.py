"""The kubernetes scaler against an HTTPS API-server double (tests/kube_api_double.py): the exact
requests it sends (method, path, body, bearer token), its error mapping, and a real router
process with --scaler kubernetes answering PUT /v1/roles/{role} through it."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.scalers import make_scaler
from pdserve.scalers.kubernetes import KubernetesScaler, KubernetesSettings, load_config
from router.ops.scaling import RoleScale, ScaleError, ScalerUnavailable
from tests.kube_api_double import NAMESPACE, TOKEN, KubeApiDouble, KubeState, selector_of
from tests.service.test_router_roles_process import stop

pytestmark = pytest.mark.timeout(120)

PREFILL, DECODE = "rel-prefill", "rel-decode"
SCALE = "/apis/apps/v1/namespaces/serving/deployments/{}/scale"
PODS = "/api/v1/namespaces/serving/pods"
REPO = Path(__file__).resolve().parents[2]
ENV = {"POD_NAMESPACE": NAMESPACE, "PDSERVE_K8S_PREFILL_DEPLOYMENT": PREFILL,
       "PDSERVE_K8S_DECODE_DEPLOYMENT": DECODE}


@pytest.fixture
def api(tmp_path, monkeypatch):
    state = KubeState(replicas={PREFILL: 1, DECODE: 2}, restarts={PREFILL: [0], DECODE: [1, 3]})
    with KubeApiDouble(tmp_path, state) as double:
        monkeypatch.setenv("KUBECONFIG", str(double.kubeconfig))
        for name, value in ENV.items():
            monkeypatch.setenv(name, value)
        yield double


def call(fn, settings: KubernetesSettings | None = None):
    async def go():
        scaler = KubernetesScaler(None, "default", None, settings=settings)
        try:
            return await fn(scaler)
        finally:
            await scaler.aclose()

    return asyncio.run(go())


def summary(api: KubeApiDouble) -> list[tuple]:
    return [(r.method, r.path, r.query.get("labelSelector", [None])[0], r.body) for r in api.state.requests]


def test_desired_reads_both_deployments_scale_and_sums_their_pods_restarts(api):
    assert call(lambda s: s.desired()) == {"prefill": RoleScale("prefill", 1, 0), "decode": RoleScale("decode", 2, 4)}
    assert sorted(summary(api), key=str) == sorted([
        ("GET", SCALE.format(PREFILL), None, None), ("GET", PODS, selector_of(PREFILL), None),
        ("GET", SCALE.format(DECODE), None, None), ("GET", PODS, selector_of(DECODE), None)], key=str)
    assert {r.headers["authorization"] for r in api.state.requests} == {f"Bearer {TOKEN}"}


def test_scale_patches_the_roles_scale_subresource_with_a_merge_patch(api):
    assert call(lambda s: s.scale("decode", 5)) == RoleScale("decode", 5, 4)
    patch, pods = api.state.requests
    assert (patch.method, patch.path, patch.body) == ("PATCH", SCALE.format(DECODE), {"spec": {"replicas": 5}})
    assert patch.headers["content-type"] == "application/merge-patch+json"
    assert patch.headers["authorization"] == f"Bearer {TOKEN}"
    assert (pods.method, pods.path, pods.query["labelSelector"]) == ("GET", PODS, [selector_of(DECODE)])
    assert api.state.replicas == {PREFILL: 1, DECODE: 5}


def test_bad_role_or_count_is_a_scale_error_with_the_local_scalers_messages_and_sends_nothing(api):
    for role, replicas, message in (("gpu", 1, "unknown role 'gpu'; roles: prefill, decode"),
                                    ("decode", -1, "replicas must be an integer >= 0; got -1"),
                                    ("decode", True, "replicas must be an integer >= 0; got True"),
                                    ("decode", 1.5, "replicas must be an integer >= 0; got 1.5")):
        with pytest.raises(ScaleError) as info:
            call(lambda s: s.scale(role, replicas))
        assert str(info.value) == message
    assert api.state.requests == []


def test_a_missing_deployment_is_unavailable_naming_it_and_its_env_var(api):
    del api.state.replicas[PREFILL]
    with pytest.raises(ScalerUnavailable) as info:
        call(lambda s: s.scale("prefill", 2))
    assert str(info.value) == ("Deployment 'rel-prefill' (prefill) not found in namespace 'serving' "
                               "(set PDSERVE_K8S_PREFILL_DEPLOYMENT)")


def test_a_forbidden_request_is_unavailable_naming_the_missing_permission(api):
    api.state.forbidden.add(("patch", "deployments/scale"))
    with pytest.raises(ScalerUnavailable) as info:
        call(lambda s: s.scale("decode", 3))
    assert str(info.value).startswith("the router's service account may not patch deployments/scale "
                                      "'rel-decode' in namespace 'serving' (HTTP 403: ")
    api.state.forbidden = {("list", "pods")}
    with pytest.raises(ScalerUnavailable, match=r"^the router's service account may not list pods in namespace "
                                                r"'serving' \(HTTP 403: "):
        call(lambda s: s.desired())


def test_an_api_server_that_does_not_answer_is_unavailable_within_the_bound(api):
    api.state.hang.add(DECODE)
    settings = KubernetesSettings(namespace=NAMESPACE, deployments={"prefill": PREFILL, "decode": DECODE},
                                  timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ScalerUnavailable) as info:
        call(lambda s: s.desired(), settings)
    assert str(info.value) == "the Kubernetes API server did not answer within 0.5 s"
    assert time.monotonic() - started < 5.0


def test_an_unreachable_api_server_is_unavailable(api):
    api.__exit__(None, None, None)  # nothing listens there any more
    with pytest.raises(ScalerUnavailable, match="^cannot reach the Kubernetes API server: "):
        call(lambda s: s.desired())


def test_in_cluster_the_service_accounts_token_ca_and_namespace_are_used(api, tmp_path, monkeypatch):
    account = tmp_path / "serviceaccount"
    account.mkdir()
    (account / "token").write_text(TOKEN)
    (account / "namespace").write_text(NAMESPACE)
    (account / "ca.crt").write_bytes((tmp_path / "api.crt").read_bytes())  # the double's own CA
    monkeypatch.delenv("KUBECONFIG")
    monkeypatch.delenv("POD_NAMESPACE")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "127.0.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", api.url.rsplit(":", 1)[1])

    async def go():
        scaler = KubernetesScaler(None, "default", None, config=load_config(service_account=str(account)))
        try:
            return scaler.namespace, await scaler.scale("prefill", 4)
        finally:
            await scaler.aclose()

    assert asyncio.run(go()) == (NAMESPACE, RoleScale("prefill", 4, 0))
    patch = api.state.requests[0]
    assert (patch.method, patch.path, patch.headers["authorization"]) == (
        "PATCH", SCALE.format(PREFILL), f"Bearer {TOKEN}")


def test_settings_come_from_the_environment_with_documented_defaults():
    assert KubernetesSettings.from_env({}) == KubernetesSettings(
        None, {"prefill": "pdserve-prefill", "decode": "pdserve-decode"})
    assert KubernetesSettings.from_env(ENV) == KubernetesSettings(NAMESPACE, {"prefill": PREFILL, "decode": DECODE})


def test_without_kubeconfig_or_service_account_the_registry_refuses_with_the_reason(monkeypatch):
    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(ValueError, match=r"^cannot load the Kubernetes API settings from the in-cluster "
                                         r"service account \(no \$KUBECONFIG\)"):
        make_scaler("kubernetes", None, "default", None)


def start_router(tmp_path: Path, env: dict[str, str]) -> tuple[subprocess.Popen, int]:
    ready, log = tmp_path / "ready", tmp_path / "router.log"
    cmd = [sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", "0", "--grpc-port", "0",
           "--ready-file", str(ready), "--scaler", "kubernetes"]
    with log.open("w") as out:
        process = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, **env, "PYTHONPATH": str(REPO)},
                                   stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if ready.exists() and ready.read_text().endswith("\n"):
            return process, int(ready.read_text().split()[0])
        assert process.poll() is None, f"router exited with {process.returncode}:\n{log.read_text()}"
        time.sleep(0.2)
    stop(process)
    raise AssertionError(f"router not ready in 90 s:\n{log.read_text()}")


def test_a_router_process_with_the_kubernetes_scaler_scales_the_deployment(api, tmp_path):
    env = {**ENV, "KUBECONFIG": str(api.kubeconfig), "PDSERVE_ADMIN_KEY": "k8s-admin"}
    process, http_port = start_router(tmp_path, env)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{http_port}", timeout=30,
                          headers={"authorization": "Bearer k8s-admin"}) as client:
            put = client.put("/v1/roles/prefill", json={"replicas": 3})
            roles = client.get("/v1/roles").json()
    finally:
        stop(process)
    assert put.status_code == 200, put.text
    assert api.state.replicas == {PREFILL: 3, DECODE: 2}
    assert ("PATCH", SCALE.format(PREFILL), None, {"spec": {"replicas": 3}}) in summary(api)
    assert roles["scaler"] == "kubernetes"
    assert [(r["role"], r["desired"], r["restarts"]) for r in roles["roles"]] == [("prefill", 3, 0), ("decode", 2, 4)]
