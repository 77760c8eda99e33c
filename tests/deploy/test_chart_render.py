"""The chart lints, renders for the default values and every example, and every rendered object
is a valid Kubernetes 1.35 object; the rendered objects say what the issue asks (labels,
probes, drain, NetworkPolicy, security, autoscaling owning the count, secrets by reference)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from tests.deploy.chart import CHART, EXAMPLES, NAMESPACE, RELEASE, container, find, render, run_helm, template

EXAMPLE_FILES = sorted(EXAMPLES.glob("*.yaml"))
K8S_VERSION = "1.35.0"
CRDS = {"ScaledObject", "PodMonitor", "ServiceMonitor"}
"""Custom resources (KEDA, Prometheus Operator): kubernetes-validate ships only the built-in
schemas, so these are checked field by field in the tests below instead."""
FULL = f"{RELEASE}-pdserve"


def _validate(obj: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_the_examples_are_the_four_the_issue_names():
    assert [f.name for f in EXAMPLE_FILES] == ["autoscaling.yaml", "cpu-1p1d.yaml", "external-redis.yaml",
                                               "gpu-2p4d-nccl.yaml"]


@pytest.mark.parametrize("values", [None, *EXAMPLE_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_helm_lint_strict_passes(helm, values):
    args = ["lint", "--strict", str(CHART)] + (["-f", str(values)] if values else [])
    out = run_helm(helm, *args)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", [None, *EXAMPLE_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_the_secrets_checksum_annotation_is_always_a_string(helm, values):
    # The checksum is 16 hex digits of a hash of secrets generated at each render: unquoted,
    # one render in a few thousand is all decimal digits (or digits and an "e"), which YAML reads
    # as a number, and Kubernetes refuses the Deployment (annotations are strings). Seen once in CI.
    out = template(helm, *([values] if values else []))
    assert out.returncode == 0, out.stderr
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("checksum/secrets:")]
    assert lines, "no checksum/secrets annotation rendered"
    assert [line for line in lines if not re.fullmatch(r'checksum/secrets: "[0-9a-f]{16}"', line)] == []
    for obj in filter(None, yaml.safe_load_all(out.stdout)):
        annotations = obj.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations", {})
        assert all(isinstance(v, str) for v in annotations.values()), (obj["kind"], annotations)


@pytest.mark.parametrize("values", [None, *EXAMPLE_FILES], ids=lambda v: "default" if v is None else v.stem)
def test_every_rendered_object_validates_against_kubernetes_1_35(helm, values):
    objects = render(helm, *([values] if values else []))
    validated = [o["kind"] for o in objects if o["kind"] not in CRDS]
    for obj in objects:
        if obj["kind"] not in CRDS:
            _validate(obj)
    assert {"Deployment", "Service", "Secret", "NetworkPolicy", "PodDisruptionBudget"} <= set(validated)


def test_the_validator_rejects_a_broken_object(helm):
    """The check above is not vacuous: a misspelt field fails strict validation."""
    import kubernetes_validate

    deployment = find(render(helm), "Deployment", f"{FULL}-decode")
    deployment["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate(deployment)


def test_default_values_render_the_three_roles_and_a_bundled_redis(helm):
    objects = render(helm)
    deployments = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Deployment"}
    assert sorted(deployments) == [f"{FULL}-decode", f"{FULL}-prefill", f"{FULL}-redis", f"{FULL}-router"]
    for role in ("router", "prefill", "decode"):
        pod_labels = deployments[f"{FULL}-{role}"]["spec"]["template"]["metadata"]["labels"]
        assert pod_labels["pdserve.io/role"] == role
        assert pod_labels["app.kubernetes.io/name"] == "pdserve"
        assert pod_labels["app.kubernetes.io/instance"] == RELEASE
        assert pod_labels["app.kubernetes.io/component"] == role
    assert sorted(o["metadata"]["name"] for o in objects if o["kind"] == "Service") == [f"{FULL}-redis", f"{FULL}-router"]
    assert sorted(o["metadata"]["name"] for o in objects if o["kind"] == "PodDisruptionBudget") == [
        f"{FULL}-decode", f"{FULL}-prefill", f"{FULL}-router"]


def test_workers_probe_their_own_endpoints_and_get_drain_time_before_sigkill(helm):
    objects = render(helm, EXAMPLES / "gpu-2p4d-nccl.yaml")
    for role, drain in (("prefill", 120), ("decode", 300)):
        c = container(objects, role)
        assert c["startupProbe"]["httpGet"] == {"path": "/startupz", "port": "metrics"}
        assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
        assert c["livenessProbe"]["httpGet"] == {"path": "/livez", "port": "metrics"}
        pod = find(objects, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert pod["terminationGracePeriodSeconds"] == drain + 15
        assert c["args"][c["args"].index("--drain-timeout") + 1] == str(drain)
        assert "lifecycle" not in c, "SIGTERM itself drains a worker"
    router = container(objects, "router")
    assert router["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert router["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert router["lifecycle"] == {"preStop": {"sleep": {"seconds": 5}}}


def test_gpu_example_asks_for_gpus_and_moves_kv_over_nccl(helm):
    objects = render(helm, EXAMPLES / "gpu-2p4d-nccl.yaml")
    for role, replicas in (("prefill", 2), ("decode", 4)):
        c = container(objects, role)
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
        args = c["args"]
        assert args[args.index("--kv-transfer") + 1] == "nccl"
        assert args[args.index("--model") + 1] == "/models/Llama-3.1-8B-Instruct"
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]
        assert find(objects, "Deployment", f"{FULL}-{role}")["spec"]["replicas"] == replicas
    decode_args = container(objects, "decode")["args"]
    assert decode_args[decode_args.index("--max-num-seqs") + 1] == "256"
    assert decode_args[decode_args.index("--gpu-memory-utilization") + 1] == "0.9"


def test_secrets_reach_pods_only_by_reference(helm):
    objects = render(helm, EXAMPLES / "gpu-2p4d-nccl.yaml")
    router_env = {e["name"]: e for e in container(objects, "router")["env"]}
    assert router_env["PDSERVE_API_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "pdserve-keys", "key": "api-key"}}
    assert router_env["PDSERVE_ADMIN_KEY"]["valueFrom"] == {"secretKeyRef": {"name": "pdserve-keys", "key": "admin-key"}}
    for role in ("router", "prefill", "decode"):
        env = {e["name"]: e for e in container(objects, role)["env"]}
        for name in ("PDSERVE_CLUSTER_SECRET", "PDSERVE_REDIS_PASSWORD"):
            assert set(env[name]) == {"name", "valueFrom"}, f"{role}: {name} must come from a Secret"
        assert not any("key" in a.lower() or "password" in a.lower() or "secret" in a.lower()
                       for a in container(objects, role)["args"] if a.startswith("--"))
    configmaps = [o for o in objects if o["kind"] == "ConfigMap"]
    assert [c["metadata"]["name"] for c in configmaps] == [f"{FULL}-dashboard"]


def test_pods_run_as_non_root_on_a_read_only_root_filesystem(helm):
    objects = render(helm)
    for role in ("router", "prefill", "decode", "redis"):
        pod = find(objects, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_network_policy_opens_only_the_routers_ports_outside_the_release(helm):
    objects = render(helm)
    policies = {o["metadata"]["name"]: o["spec"] for o in objects if o["kind"] == "NetworkPolicy"}
    release_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/instance": RELEASE,
                                                    "app.kubernetes.io/name": "pdserve"}}}
    assert policies[f"{FULL}-router"]["ingress"] == [
        {"ports": [{"port": "http", "protocol": "TCP"}, {"port": "grpc", "protocol": "TCP"}]}]
    for role in ("prefill", "decode"):
        assert policies[f"{FULL}-{role}"]["ingress"] == [{"from": [release_pods]}]
    assert policies[f"{FULL}-redis"]["ingress"] == [
        {"ports": [{"port": "redis", "protocol": "TCP"}], "from": [release_pods]}]


def test_router_scales_the_worker_deployments_through_its_service_account(helm):
    objects = render(helm)
    pod = find(objects, "Deployment", f"{FULL}-router")["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == f"{FULL}-router"
    c = pod["containers"][0]
    assert c["args"][c["args"].index("--scaler") + 1] == "kubernetes"
    env = {e["name"]: e for e in c["env"]}
    assert env["PDSERVE_K8S_PREFILL_DEPLOYMENT"]["value"] == f"{FULL}-prefill"
    assert env["PDSERVE_K8S_DECODE_DEPLOYMENT"]["value"] == f"{FULL}-decode"
    assert env["POD_NAMESPACE"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    for role in ("prefill", "decode"):
        worker = find(objects, "Deployment", f"{FULL}-{role}")["spec"]["template"]["spec"]
        assert worker["automountServiceAccountToken"] is False


def test_autoscaling_renders_keda_and_hpa_and_leaves_them_the_replica_count(helm):
    objects = render(helm, EXAMPLES / "autoscaling.yaml")
    for role in ("prefill", "decode"):
        assert "replicas" not in find(objects, "Deployment", f"{FULL}-{role}")["spec"]
    hpa = find(objects, "HorizontalPodAutoscaler", f"{FULL}-prefill")["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-prefill"}
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (1, 4)
    assert hpa["metrics"] == [{"type": "Pods", "pods": {"metric": {"name": "pdserve_queued_prefill_tokens"},
                                                        "target": {"type": "AverageValue", "averageValue": "4096"}}}]
    keda = find(objects, "ScaledObject", f"{FULL}-decode")
    assert keda["apiVersion"] == "keda.sh/v1alpha1"
    spec = keda["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": f"{FULL}-decode"}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (2, 8)
    assert spec["triggers"] == [{"type": "prometheus", "metadata": {
        "serverAddress": "http://prometheus-operated.monitoring.svc:9090",
        "query": f'sum(vllm:num_requests_waiting{{namespace="{NAMESPACE}",pod=~"{FULL}-decode-.*",role="decode"}})',
        "threshold": "8"}}]
    router = container(objects, "router")
    assert router["args"][router["args"].index("--scaler") + 1] == "none"
    assert "serviceAccountName" not in find(objects, "Deployment", f"{FULL}-router")["spec"]["template"]["spec"]


def test_monitoring_scrapes_router_and_workers_and_ships_the_dashboard(helm):
    objects = render(helm, EXAMPLES / "autoscaling.yaml")
    monitor = find(objects, "PodMonitor", FULL)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert [(e["port"], e["path"]) for e in monitor["spec"]["podMetricsEndpoints"]] == [
        ("http", "/metrics"), ("metrics", "/metrics")]
    assert [o for o in render(helm) if o["kind"] in CRDS] == [], "monitors are off by default"
    on = render(helm, sets=("monitoring.serviceMonitor.enabled=true",))
    service_monitor = find(on, "ServiceMonitor", f"{FULL}-router")["spec"]
    assert service_monitor["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert service_monitor["selector"]["matchLabels"]["pdserve.io/role"] == "router"
    dashboard = find(objects, "ConfigMap", f"{FULL}-dashboard")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(dashboard["data"]["pdserve.json"]) == json.loads((CHART / "files" / "dashboard.json").read_text())


def test_the_committed_dashboard_is_what_the_generator_makes():
    pytest.importorskip("grafanalib", reason="grafanalib (test extra) generates the dashboard")
    out = subprocess.run([sys.executable, str(CHART.parents[1] / "dashboard.py"), "--check"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr


def test_dashboard_has_the_panels_the_issue_lists():
    board = json.loads((CHART / "files" / "dashboard.json").read_text())
    panels = {p["title"]: [t["expr"] for t in p.get("targets", [])] for p in board["panels"] if p["type"] != "row"}
    assert sorted(panels) == sorted([
        "Ready workers", "KV cache usage per worker", "Queue: waiting requests and queued prefill tokens",
        "Time to first token", "Inter-token latency", "End-to-end latency", "KV transfer throughput",
        "Request paths and fallbacks", "Admission rejections"])
    assert any("pdserve_path_fallbacks_total" in e for e in panels["Request paths and fallbacks"])
    assert any("pdserve_admission_rejections_total" in e for e in panels["Admission rejections"])
    assert panels["Time to first token"][2] == ("histogram_quantile(0.99, sum by (le) "
                                                "(rate(vllm:time_to_first_token_seconds_bucket[$__rate_interval])))")


def test_notes_say_how_to_reach_the_router_and_the_dashboard(helm):
    out = run_helm(helm, "install", RELEASE, str(CHART), "--dry-run=client", "--namespace", NAMESPACE)
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    assert f"kubectl -n {NAMESPACE} port-forward svc/{FULL}-router 8000:8000" in notes
    assert "http://127.0.0.1:8000/dashboard" in notes
    assert f"ConfigMap {FULL}-dashboard" in notes
