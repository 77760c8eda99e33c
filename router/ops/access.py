"""Who may read and who may change the cluster's roles: the admin key decision (pure, no I/O).

The HTTP guard (router.api.http_guards.AdminGuardMiddleware) and the gRPC guard
(router.api.grpc_guards.AdminInterceptor) both ask `AdminAccess`, so the two protocols refuse
alike. The admin key is distinct from the API key: the API key lets a client generate text,
the admin key lets it add and remove workers.

Changes (scale, drain):
  - admin key set: `Authorization: Bearer <admin key>` or 401;
  - no admin key: open when the router binds only to a loopback address (every caller is on
    this host, as with `pdserve up`'s default 127.0.0.1), else 403 — no key could help, the
    operator must set one.
Reads (GET /v1/roles): the API key when one is set (the admin key also works), else open, like
/v1/cluster.
"""

from __future__ import annotations

import ipaddress
from typing import Literal

from router.api.api_key import ApiKey
from router.errors import Forbidden, RouterError, Unauthorized

Access = Literal["read", "admin"]

NO_ADMIN_KEY = (
    "The admin API is disabled: this router listens on {host!r}, beyond loopback, and has no admin "
    "key. Set PDSERVE_ADMIN_KEY or PDSERVE_ADMIN_KEY_FILE (or --admin-key) to scale and drain "
    "workers remotely."
)


def is_loopback_host(host: str) -> bool:
    """True when binding `host` accepts connections from this machine only. A wildcard ("",
    0.0.0.0, ::) or any name but "localhost" is not loopback (a name may resolve anywhere)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def admin_route_access(method: str, path: str) -> Access | None:
    """Which check an HTTP route needs: "read" for GET of the roles, "admin" for scaling and
    draining, None for every other route (the API key guard decides those)."""
    if path == "/v1/roles" or path.startswith("/v1/roles/"):
        return "read" if method in ("GET", "HEAD") else "admin"
    if path.startswith("/v1/workers/"):
        return "admin"
    return None


class AdminAccess:
    """Decides one call from its Authorization value; holds digests of the keys, never the keys."""

    def __init__(self, admin_key: str | None, api_key: str | None, bind_host: str) -> None:
        if admin_key is not None and api_key is not None and admin_key == api_key:
            raise ValueError("the admin key must differ from the API key: every API client could scale "
                             "and drain workers otherwise")
        self._admin = ApiKey(admin_key) if admin_key is not None else None
        self._api = ApiKey(api_key) if api_key is not None else None
        self._host = bind_host
        self._loopback = is_loopback_host(bind_host)

    def refusal(self, access: Access, authorization: str | None) -> RouterError | None:
        """None when the call may go on, else the error to answer (Unauthorized, Forbidden)."""
        if access == "read":
            return self._read_refusal(authorization)
        return self._admin_refusal(authorization)

    def _admin_refusal(self, authorization: str | None) -> RouterError | None:
        if self._admin is None:
            return None if self._loopback else Forbidden(NO_ADMIN_KEY.format(host=self._host))
        return None if self._admin.allows(authorization) else Unauthorized()

    def _read_refusal(self, authorization: str | None) -> RouterError | None:
        if self._api is None or self._api.allows(authorization):
            return None
        if self._admin is not None and self._admin.allows(authorization):
            return None
        return Unauthorized()
