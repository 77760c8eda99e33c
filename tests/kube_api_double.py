"""A Kubernetes API server double for the kubernetes scaler's tests: a real HTTPS server on
127.0.0.1 (self-signed certificate, bearer token) that serves Deployments' Scale subresource and
a pod list, and records every request (method, path, query, headers, body).

Only the other side of the seam is faked: the scaler under test is the real one, with lightkube
talking HTTPS to this server through a real kubeconfig file.
"""

from __future__ import annotations

import base64
import datetime
import ipaddress
import json
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

TOKEN = "test-service-account-token"
NAMESPACE = "serving"
SCALE_PATH = "/apis/apps/v1/namespaces/{ns}/deployments/{name}/scale"
PODS_PATH = "/api/v1/namespaces/{ns}/pods"


@dataclass(frozen=True)
class Recorded:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: object | None


@dataclass
class KubeState:
    """What the double serves: Deployment name -> replicas, and per Deployment its pods'
    container restart counts. `forbidden`: (verb, resource) pairs answered 403; `hang`: names
    whose requests get no answer for 10 s."""

    replicas: dict[str, int] = field(default_factory=dict)
    restarts: dict[str, list[int]] = field(default_factory=dict)
    forbidden: set[tuple[str, str]] = field(default_factory=set)
    hang: set[str] = field(default_factory=set)
    requests: list[Recorded] = field(default_factory=list)


def selector_of(name: str) -> str:
    return f"app.kubernetes.io/instance=rel,app.kubernetes.io/component={name}"


def scale_object(name: str, replicas: int) -> dict:
    return {"apiVersion": "autoscaling/v1", "kind": "Scale",
            "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas, "selector": selector_of(name)}}


def status_object(code: int, reason: str, message: str) -> dict:
    return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
            "message": message, "reason": reason, "code": code}


def pod_list(restarts: list[int]) -> dict:
    items = [{"metadata": {"name": f"pod-{i}", "namespace": NAMESPACE},
              "status": {"containerStatuses": [{"name": "worker", "image": "pdserve", "imageID": "",
                                                "ready": True, "restartCount": n}]}}
             for i, n in enumerate(restarts)]
    return {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items}


class _Handler(BaseHTTPRequestHandler):
    state: KubeState
    timeout = 20  # seconds a connection may sit idle (a client that never speaks)

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        self._serve("GET")

    def do_PATCH(self) -> None:
        self._serve("PATCH")

    def do_PUT(self) -> None:
        self._serve("PUT")

    def _serve(self, method: str) -> None:
        url = urlsplit(self.path)
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        record = Recorded(method, url.path, parse_qs(url.query), {k.lower(): v for k, v in self.headers.items()},
                          json.loads(raw) if raw else None)
        self.state.requests.append(record)
        if self.headers.get("authorization") != f"Bearer {TOKEN}":
            return self._reply(401, status_object(401, "Unauthorized", "Unauthorized"))
        code, body = self._answer(record)
        self._reply(code, body)

    def _answer(self, r: Recorded) -> tuple[int, dict]:
        pods = PODS_PATH.format(ns=NAMESPACE)
        if r.path == pods and r.method == "GET":
            return self._pods(r)
        prefix, suffix = SCALE_PATH.format(ns=NAMESPACE, name="\0").split("\0")
        if not (r.path.startswith(prefix) and r.path.endswith(suffix)):
            return 404, status_object(404, "NotFound", f"the server could not find {r.path}")
        name = r.path[len(prefix):-len(suffix)]
        if name in self.state.hang:
            time.sleep(10)
        verb = {"GET": "get", "PATCH": "patch", "PUT": "update"}[r.method]
        if (verb, "deployments/scale") in self.state.forbidden:
            return 403, status_object(403, "Forbidden", f'deployments.apps "{name}" is forbidden: User '
                                      f'"system:serviceaccount:{NAMESPACE}:router" cannot {verb} resource '
                                      f'"deployments/scale" in API group "apps"')
        if name not in self.state.replicas:
            return 404, status_object(404, "NotFound", f'deployments.apps "{name}" not found')
        if r.method != "GET":
            self.state.replicas[name] = int(r.body["spec"]["replicas"])  # type: ignore[index]
        return 200, scale_object(name, self.state.replicas[name])

    def _pods(self, r: Recorded) -> tuple[int, dict]:
        if ("list", "pods") in self.state.forbidden:
            return 403, status_object(403, "Forbidden", 'pods is forbidden: cannot list resource "pods"')
        selector = r.query.get("labelSelector", [""])[0]
        names = [n for n in self.state.replicas if selector_of(n) == selector]
        return 200, pod_list(self.state.restarts.get(names[0], []) if names else [])

    def _reply(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _self_signed(directory: Path) -> tuple[Path, Path]:
    """(cert, key) for 127.0.0.1, valid for a day."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-api-double")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = directory / "api.crt", directory / "api.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class KubeApiDouble:
    """Context manager: serves `state` over HTTPS on 127.0.0.1; `kubeconfig` is a file that
    points at it (CA data, bearer token, a context without a namespace)."""

    def __init__(self, directory: Path, state: KubeState) -> None:
        self.state = state
        cert, key = _self_signed(directory)
        handler = type("Handler", (_Handler,), {"state": state})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._server.block_on_close = False  # a hung handler must not hold up the test's end
        self._server.handle_error = lambda request, address: None  # a client that gave up on a hung reply
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        # The handshake happens in each request's thread (on its first read), never in the accept
        # loop, where one stalled client would hold up every other request and the shutdown.
        self._server.socket = context.wrap_socket(self._server.socket, server_side=True,
                                                  do_handshake_on_connect=False)
        self.url = f"https://127.0.0.1:{self._server.server_port}"
        self.kubeconfig = directory / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "test",
            "clusters": [{"name": "test", "cluster": {
                "server": self.url, "certificate-authority-data": base64.b64encode(cert.read_bytes()).decode()}}],
            "users": [{"name": "router", "user": {"token": TOKEN}}],
            "contexts": [{"name": "test", "context": {"cluster": "test", "user": "router"}}],
        }))
        self._thread = threading.Thread(target=self._server.serve_forever, name="kube-api-double", daemon=True)

    def __enter__(self) -> KubeApiDouble:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
