"""Rendered containers run as local processes: what a kubelet would do with a container's
command, args and env, done on 127.0.0.1.

- env: `value` as is; `secretKeyRef` from the test's secrets; `fieldRef` from the pod's fields
  (status.podIP -> 127.0.0.1, metadata.name -> the pod name, metadata.namespace).
- args: `$(VAR)` expanded from the container's env, as Kubernetes does.
- addresses: each Service's DNS name (short or qualified) -> 127.0.0.1 and its port -> the local
  port of what it fronts; each containerPort -> a free local port; a bind to 0.0.0.0 -> 127.0.0.1
  (tests stay on loopback; the NetworkPolicy guards the pod's own bind-all).
- the image's `pdserve` entry point -> this checkout's `python -m pdserve`.
- the pod's /tmp emptyDir -> a fresh folder per pod.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.deploy.chart import ROOT

ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


@dataclass(frozen=True)
class Pod:
    """How one rendered container becomes a local process."""

    name: str
    namespace: str
    secrets: dict[tuple[str, str], str]
    """(Secret name, key) -> value."""
    tmp: Path
    """The folder standing in for the pod's /tmp emptyDir."""

    def field(self, path: str) -> str:
        return {"status.podIP": "127.0.0.1", "metadata.name": self.name,
                "metadata.namespace": self.namespace}[path]

    def env(self, container: dict) -> dict[str, str]:
        """The container's environment, references resolved (an unknown one raises KeyError)."""
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            source = entry.get("valueFrom")
            if source is None:
                value = entry["value"]
            elif "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                value = self.secrets[(ref["name"], ref["key"])]
            else:
                value = self.field(source["fieldRef"]["fieldPath"])
            env[entry["name"]] = ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), value)
        return {k: str(self.tmp) + v[len("/tmp"):] if v == "/tmp" or v.startswith("/tmp/") else v
                for k, v in env.items()}


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes' $(VAR) expansion of args from the container's env."""
    return [ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), a) for a in args]


def localize(args: list[str], ports: dict[int, int], services: dict[str, dict[int, int]]) -> list[str]:
    """Container ports and Service addresses -> loopback ones; 0.0.0.0 -> 127.0.0.1."""
    out = []
    for arg in args:
        for service, port_map in services.items():
            arg = re.sub(rf"\b{re.escape(service)}(\.[a-z0-9.-]+)?:(\d+)",
                         lambda m, pm=port_map: f"127.0.0.1:{pm[int(m.group(2))]}", arg)
        if arg == "0.0.0.0":
            arg = "127.0.0.1"
        elif arg.isdigit() and int(arg) in ports:
            arg = str(ports[int(arg)])
        out.append(arg)
    return out


def command(container: dict) -> list[str]:
    """The image's `pdserve` entry point is this checkout's `python -m pdserve`."""
    cmd = container["command"]
    assert cmd == ["pdserve"], f"unexpected entry point {cmd}"
    return [sys.executable, "-m", "pdserve"]


def start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """The process, in its own process group, its output in `log`."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **env}
    return subprocess.Popen(argv, cwd=ROOT, env=full_env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(process: subprocess.Popen, timeout_s: float = 30) -> None:
    """SIGTERM, then SIGKILL after timeout_s; bounded either way."""
    if process.poll() is not None:
        return
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
