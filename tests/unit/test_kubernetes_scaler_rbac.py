"""The chart's scaler RBAC (deploy/helm/pdserve/templates/scaler-rbac.yaml) is the minimum the
kubernetes scaler needs: every request the real scaler sends (recorded by the API double while
it reads and scales both roles) is allowed by a rule, and every rule, verb and resource name is
used by some request. The template is read without helm: its few template expressions are
substituted textually, and the test fails if one it does not know appears."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import yaml

from pdserve.scalers.kubernetes import KubernetesScaler, KubernetesSettings
from tests.kube_api_double import NAMESPACE, KubeApiDouble, KubeState

pytestmark = pytest.mark.timeout(60)

TEMPLATE = Path(__file__).resolve().parents[2] / "deploy/helm/pdserve/templates/scaler-rbac.yaml"
FULLNAME = "rel-pdserve"
DEPLOYMENTS = {"prefill": f"{FULLNAME}-prefill", "decode": f"{FULLNAME}-decode"}


def rendered_objects() -> dict[str, dict]:
    """kind -> object of the template, as helm would render it with router.scaler=kubernetes."""
    text = re.sub(r"\{\{-? /\*.*?\*/ -?\}\}", "", TEMPLATE.read_text(), flags=re.S)
    text = re.sub(r'\{\{ printf "%s-(\w+)" \$fullname \| quote \}\}', rf'"{FULLNAME}-\1"', text)
    text = text.replace("{{ $fullname }}", FULLNAME).replace("{{ .Release.Namespace }}", NAMESPACE)
    lines = [line for line in text.splitlines() if not line.strip().startswith("{{")]
    body = "\n".join(lines)
    assert "{{" not in body, f"a template expression this test does not know: {body}"
    return {doc["kind"]: doc for doc in yaml.safe_load_all(body) if doc}


def recorded_permissions(tmp_path: Path) -> set[tuple[str, str, str, str | None]]:
    """(apiGroup, resource, verb, name) of every request the scaler sends in desired() and
    scale() of both roles."""
    state = KubeState(replicas={name: 1 for name in DEPLOYMENTS.values()})

    async def exercise(kubeconfig: Path) -> None:
        from lightkube import KubeConfig

        scaler = KubernetesScaler(None, "default", None, KubernetesSettings(NAMESPACE, DEPLOYMENTS),
                                  KubeConfig.from_file(kubeconfig))
        try:
            await scaler.desired()
            for role in DEPLOYMENTS:
                await scaler.scale(role, 2)
        finally:
            await scaler.aclose()

    with KubeApiDouble(tmp_path, state) as api:
        asyncio.run(exercise(api.kubeconfig))
    return {permission_of(r.method, r.path) for r in state.requests}


def permission_of(method: str, path: str) -> tuple[str, str, str, str | None]:
    scale = re.fullmatch(rf"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/([^/]+)/scale", path)
    if scale:
        return "apps", "deployments/scale", {"GET": "get", "PATCH": "patch", "PUT": "update"}[method], scale[1]
    assert (method, path) == ("GET", f"/api/v1/namespaces/{NAMESPACE}/pods"), f"unexpected request {method} {path}"
    return "", "pods", "list", None


def granted(rules: list[dict]) -> set[tuple[str, str, str, str | None]]:
    return {(group, resource, verb, name) for rule in rules for group in rule["apiGroups"]
            for resource in rule["resources"] for verb in rule["verbs"]
            for name in rule.get("resourceNames", [None])}


def test_the_scaler_role_grants_exactly_the_requests_the_scaler_sends(tmp_path):
    objects = rendered_objects()
    assert granted(objects["Role"]["rules"]) == recorded_permissions(tmp_path) == {
        ("apps", "deployments/scale", "get", f"{FULLNAME}-prefill"),
        ("apps", "deployments/scale", "get", f"{FULLNAME}-decode"),
        ("apps", "deployments/scale", "patch", f"{FULLNAME}-prefill"),
        ("apps", "deployments/scale", "patch", f"{FULLNAME}-decode"),
        ("", "pods", "list", None),
    }


def test_the_binding_gives_the_role_to_the_routers_service_account_only():
    objects = rendered_objects()
    assert sorted(objects) == ["Role", "RoleBinding", "ServiceAccount"]
    binding = objects["RoleBinding"]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": objects["Role"]["metadata"]["name"]}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": f"{FULLNAME}-router", "namespace": NAMESPACE}]
    assert objects["ServiceAccount"]["metadata"]["name"] == f"{FULLNAME}-router"


def test_the_rbac_renders_only_for_the_kubernetes_scaler_with_rbac_create():
    first = TEMPLATE.read_text().split("*/ -}}", 1)[1].lstrip().splitlines()[0]
    assert first == '{{- if and (eq .Values.router.scaler "kubernetes") .Values.rbac.create }}'
