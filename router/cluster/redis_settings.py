"""How every pdserve process reaches the cluster's Redis: URL, credentials, TLS — one place.

The four Redis clients (worker heartbeat, worker block-event publisher, router cluster-state
reader, router block-event reader) and the tests build their clients here, so credentials and
TLS are handled the same way everywhere.

Credentials come from the URL (`redis://user:pass@host:6379/0`, the user's own choice; a URL
on a command line is visible to every user of the host through `ps`) or, when the URL has none,
from the environment:

    PDSERVE_REDIS_USERNAME       ACL user (optional; Redis's "default" user when absent)
    PDSERVE_REDIS_PASSWORD       the password itself
    PDSERVE_REDIS_PASSWORD_FILE  a file whose contents (stripped) are the password

`rediss://` turns TLS on (redis-py reads `ssl_cert_reqs`, `ssl_ca_certs`, ... from the URL's
query string). `pdserve up` strips the credentials off a URL before putting it on a child's
command line and hands them over through the environment instead (`child_env`).

Lives in router/ (imports redis and the standard library only) so pdserve/ may use it too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

__all__ = [
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "USERNAME_ENV",
    "RedisAuth",
    "async_client",
    "redact_url",
    "split_credentials",
    "sync_client",
]

USERNAME_ENV = "PDSERVE_REDIS_USERNAME"
PASSWORD_ENV = "PDSERVE_REDIS_PASSWORD"
PASSWORD_FILE_ENV = "PDSERVE_REDIS_PASSWORD_FILE"


@dataclass(frozen=True)
class RedisAuth:
    """Credentials for one Redis; both None means no AUTH (an open Redis)."""

    username: str | None = None
    """ACL user; None: Redis's default user."""
    password: str | None = field(default=None, repr=False)
    """Password (never printed: repr hides it)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> RedisAuth:
        """From $PDSERVE_REDIS_USERNAME and $PDSERVE_REDIS_PASSWORD, else the file named by
        $PDSERVE_REDIS_PASSWORD_FILE. Raises ValueError naming the path of an unreadable file."""
        env = os.environ if environ is None else environ
        password = env.get(PASSWORD_ENV) or None
        if password is None and env.get(PASSWORD_FILE_ENV):
            path = Path(env[PASSWORD_FILE_ENV])
            try:
                password = path.read_text().strip() or None
            except OSError as exc:
                raise ValueError(f"cannot read the Redis password file {path} ({PASSWORD_FILE_ENV}): {exc}") from exc
        return cls(username=env.get(USERNAME_ENV) or None, password=password)

    def child_env(self) -> dict[str, str]:
        """The environment variables that hand these credentials to a child process."""
        env = {}
        if self.username:
            env[USERNAME_ENV] = self.username
        if self.password:
            env[PASSWORD_ENV] = self.password
        return env


def split_credentials(url: str) -> tuple[str, RedisAuth]:
    """(the URL without user:password, the credentials it held). The URL's scheme, host, port,
    database and query (TLS options) are kept as they were."""
    parts = urlsplit(url)
    if parts.username is None and parts.password is None:
        return url, RedisAuth()
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    netloc = f"{host}:{parts.port}" if parts.port is not None else host
    auth = RedisAuth(
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )
    return urlunsplit(parts._replace(netloc=netloc)), auth


def redact_url(url: str) -> str:
    """The URL for logs: a password in it becomes `***`."""
    bare, auth = split_credentials(url)
    if auth.password is None:
        return url
    parts = urlsplit(bare)
    user = auth.username or ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{parts.netloc}"))


def _client_kwargs(url: str, auth: RedisAuth | None, options: Mapping[str, Any]) -> dict[str, Any]:
    _, in_url = split_credentials(url)
    kwargs = dict(options)
    if in_url.password is None and in_url.username is None:
        auth = RedisAuth.from_env() if auth is None else auth
        if auth.username is not None:
            kwargs.setdefault("username", auth.username)
        if auth.password is not None:
            kwargs.setdefault("password", auth.password)
    return kwargs


def sync_client(url: str, auth: RedisAuth | None = None, **options: Any):
    """A redis.Redis for url. Credentials: the URL's, else `auth`, else the environment
    (RedisAuth.from_env). options go to redis.Redis.from_url (timeouts, retry, ...)."""
    import redis

    return redis.Redis.from_url(url, **_client_kwargs(url, auth, options))


def async_client(url: str, auth: RedisAuth | None = None, **options: Any):
    """A redis.asyncio.Redis for url; credentials as sync_client."""
    import redis.asyncio as aredis

    return aredis.Redis.from_url(url, **_client_kwargs(url, auth, options))
