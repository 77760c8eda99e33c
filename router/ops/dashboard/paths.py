"""The dashboard's URL paths, shared by its routes and the API key guard (one definition).

Only the shell (the page and its static files: code, style, the vendored chart library) is
served without the API key: it carries no data and no secret. Every data route is under /v1 and
keeps the key.
"""

from __future__ import annotations

PAGE = "/dashboard"
STATIC_PREFIX = "/dashboard/static/"
STATE = "/v1/dashboard/state"
HISTORY = "/v1/dashboard/history"


def is_shell(method: str, path: str) -> bool:
    """True for a GET or HEAD of the page or one of its static files."""
    if method not in ("GET", "HEAD"):
        return False
    return path in (PAGE, f"{PAGE}/") or path.startswith(STATIC_PREFIX)
