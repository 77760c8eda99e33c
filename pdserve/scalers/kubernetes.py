"""`kubernetes`: the router's Scaler for a cluster installed by the Helm chart.

Each scalable role is one Deployment; its desired count is the Deployment's Scale subresource
(`spec.replicas`), and the Deployment controller reconciles to it (a removed pod gets SIGTERM and
drains within terminationGracePeriodSeconds). The requests, and so the RBAC the chart's
templates/scaler-rbac.yaml grants (nothing more):

    desired()  GET   /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale      per role
               GET   /api/v1/namespaces/{ns}/pods?labelSelector={scale.status.selector}
    scale()    PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale
                     {"spec": {"replicas": N}}   (application/merge-patch+json)
               GET   /api/v1/namespaces/{ns}/pods?labelSelector=...
    restarts = the sum of the role's pods' containers' restartCount (the pod list is the only
    way to learn it; it needs `list pods` in the namespace, which cannot be narrowed by name).

Where things come from (KubernetesSettings.from_env):
    API server, token, CA   $KUBECONFIG when set, else the pod's service account
                            (KUBERNETES_SERVICE_HOST/PORT, /var/run/secrets/kubernetes.io/serviceaccount)
    namespace               $POD_NAMESPACE, else the service account's (or kubeconfig context's)
    Deployment names        $PDSERVE_K8S_PREFILL_DEPLOYMENT / $PDSERVE_K8S_DECODE_DEPLOYMENT,
                            default pdserve-prefill / pdserve-decode
Redis and the cluster secret are not used: Kubernetes holds the desired counts.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.ops.scaling import SCALABLE_ROLES, RoleScale, ScaleError, ScalerUnavailable

logger = logging.getLogger(__name__)

__all__ = ["API_TIMEOUT_S", "DEPLOYMENT_ENV", "KubernetesScaler", "KubernetesSettings"]

API_TIMEOUT_S = 3.0
"""Bound of each public call (all its API requests together); below the roles API's 5 s, so
the router reports this scaler's reason rather than its own timeout."""
DEPLOYMENT_ENV = {"prefill": "PDSERVE_K8S_PREFILL_DEPLOYMENT", "decode": "PDSERVE_K8S_DECODE_DEPLOYMENT"}
NAMESPACE_ENV = "POD_NAMESPACE"
_VERBS = {"GET": "get", "PATCH": "patch", "PUT": "update", "LIST": "list"}


@dataclass(frozen=True)
class KubernetesSettings:
    """Where the role Deployments are. Frozen at the router's start."""

    namespace: str | None = None
    """None: the API config's namespace (the service account's, or the kubeconfig context's)."""
    deployments: Mapping[str, str] = field(default_factory=lambda: {r: f"pdserve-{r}" for r in SCALABLE_ROLES})
    """Scalable role -> Deployment name."""
    timeout_s: float = API_TIMEOUT_S

    def __post_init__(self) -> None:
        if set(self.deployments) != set(SCALABLE_ROLES) or not all(self.deployments.values()):
            raise ValueError(f"a Deployment name is needed for each of {', '.join(SCALABLE_ROLES)}; "
                             f"got {dict(self.deployments)}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0; got {self.timeout_s}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> KubernetesSettings:
        names = {role: environ.get(env) or f"pdserve-{role}" for role, env in DEPLOYMENT_ENV.items()}
        return cls(namespace=environ.get(NAMESPACE_ENV) or None, deployments=names)


SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
"""Where Kubernetes mounts a pod's service-account token, CA and namespace."""


def load_config(environ: Mapping[str, str] = os.environ, service_account: str = SERVICE_ACCOUNT_DIR):
    """The API server and credentials: $KUBECONFIG when set, else in-cluster (the service
    account's files, and $KUBERNETES_SERVICE_HOST/PORT from the process environment). Raises
    ValueError saying which was tried."""
    from lightkube import KubeConfig
    from lightkube.core.exceptions import ConfigError

    path = environ.get("KUBECONFIG")
    try:
        return KubeConfig.from_file(path) if path else KubeConfig.from_service_account(service_account)
    except (ConfigError, KeyError, OSError) as exc:
        where = f"the kubeconfig {path!r}" if path else "the in-cluster service account (no $KUBECONFIG)"
        raise ValueError(f"cannot load the Kubernetes API settings from {where}: {exc}") from None


class KubernetesScaler:
    """Scaler over the Kubernetes API. One per router; async, one event loop."""

    name = "kubernetes"

    def __init__(self, redis_url: str | None, cluster: str, secret: bytes | None,
                 settings: KubernetesSettings | None = None, config=None) -> None:
        """redis_url, cluster, secret: unused (the registry's common signature). Raises
        ValueError when no API settings can be loaded or lightkube is not installed."""
        try:
            from httpx2 import Timeout
            from lightkube import AsyncClient
        except ImportError as exc:
            raise ValueError(f"needs the kubernetes extra: pip install 'pdserve[kubernetes]' ({exc})") from None
        self.settings = settings or KubernetesSettings.from_env()
        self._client = AsyncClient(config or load_config(), namespace=self.settings.namespace,
                                   timeout=Timeout(self.settings.timeout_s), trust_env=False)
        self.namespace = self._client.namespace

    async def desired(self) -> dict[str, RoleScale]:
        """Per role: the Deployment's spec.replicas and its pods' restarts. Raises
        ScalerUnavailable (API server unreachable, Deployment missing, permission denied)."""
        scales = await self._bounded(asyncio.gather(*(self._role_scale(r) for r in SCALABLE_ROLES)))
        return {s.role: s for s in scales}

    async def scale(self, role: str, replicas: int) -> RoleScale:
        """Set the role Deployment's spec.replicas. Raises ScaleError (unknown role, count not
        an int >= 0), ScalerUnavailable."""
        check_request(role, replicas)
        return await self._bounded(self._patch(role, replicas))

    async def aclose(self) -> None:
        await self._client.close()

    async def _role_scale(self, role: str) -> RoleScale:
        from lightkube.resources.apps_v1 import Deployment

        scale = await self._call("GET", role, self._client.get(Deployment.Scale, self._deployment(role)))
        return RoleScale(role, scale.spec.replicas, await self._restarts(role, scale))  # type: ignore[arg-type]

    async def _patch(self, role: str, replicas: int) -> RoleScale:
        from lightkube.resources.apps_v1 import Deployment
        from lightkube.types import PatchType

        call = self._client.patch(Deployment.Scale, self._deployment(role), {"spec": {"replicas": replicas}},
                                  patch_type=PatchType.MERGE)
        scale = await self._call("PATCH", role, call)
        logger.info("Deployment %s/%s scaled to %d replicas", self.namespace, self._deployment(role), replicas)
        return RoleScale(role, replicas, await self._restarts(role, scale))  # type: ignore[arg-type]

    async def _restarts(self, role: str, scale) -> int:
        from lightkube.resources.core_v1 import Pod

        labels = parse_selector(scale.status.selector if scale.status else None)
        if labels is None:
            logger.warning("Deployment %s: no equality label selector; restarts not counted", self._deployment(role))
            return 0

        async def count() -> int:
            pods = [pod async for pod in self._client.list(Pod, labels=labels)]
            return sum(container.restartCount for pod in pods if pod.status
                       for container in pod.status.containerStatuses or [])

        return await self._call("LIST", role, count(), resource="pods")

    async def _call(self, method: str, role: str, call, resource: str = "deployments/scale"):
        """One API request; its errors as ScalerUnavailable naming what failed (the one map)."""
        from httpx2 import HTTPError, TimeoutException
        from lightkube.core.exceptions import ApiError

        target = "pods" if resource == "pods" else f"{resource} {self._deployment(role)!r}"
        try:
            return await call
        except ApiError as exc:
            code = exc.status.code
            if code == 404:
                raise ScalerUnavailable(f"Deployment {self._deployment(role)!r} ({role}) not found in namespace "
                                        f"{self.namespace!r} (set {DEPLOYMENT_ENV[role]})") from None
            if code in (401, 403):
                raise ScalerUnavailable(f"the router's service account may not {_VERBS[method]} {target} in "
                                        f"namespace {self.namespace!r} (HTTP {code}: {exc.status.message})") from None
            raise ScalerUnavailable(f"the Kubernetes API answered HTTP {code} to {method} {target}: "
                                    f"{exc.status.message}") from None
        except TimeoutException:
            raise ScalerUnavailable(self._no_answer()) from None
        except (HTTPError, OSError) as exc:
            raise ScalerUnavailable(f"cannot reach the Kubernetes API server: {exc or type(exc).__name__}") from None

    async def _bounded(self, call):
        try:
            return await asyncio.wait_for(call, self.settings.timeout_s + 0.5)
        except asyncio.TimeoutError:
            raise ScalerUnavailable(self._no_answer()) from None

    def _no_answer(self) -> str:
        return f"the Kubernetes API server did not answer within {self.settings.timeout_s:g} s"

    def _deployment(self, role: str) -> str:
        return self.settings.deployments[role]


def check_request(role: str, replicas: object) -> None:
    """The local scaler's rules and messages: a scalable role, an int >= 0."""
    if role not in SCALABLE_ROLES:
        raise ScaleError(f"unknown role {role!r}; roles: {', '.join(SCALABLE_ROLES)}")
    if isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 0:
        raise ScaleError(f"replicas must be an integer >= 0; got {replicas!r}")


def parse_selector(selector: str | None) -> dict[str, str] | None:
    """'a=b,c=d' (a Scale's status.selector from matchLabels) -> {a: b, c: d}; None for an
    empty or set-based selector (the chart's Deployments use matchLabels only)."""
    if not selector:
        return None
    labels = {}
    for term in selector.split(","):
        key, sep, value = term.partition("=")
        if not sep or value.startswith("=") or key.endswith("!") or not key or " " in term or "(" in term:
            return None
        labels[key] = value
    return labels
