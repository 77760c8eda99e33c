"""The dashboard's HTTP routes (thin: read, encode).

    GET /dashboard                      the page (HTML shell: no data, no secret, no key needed)
    GET /dashboard/static/{file}        its script, style and the vendored uPlot (no key needed)
    HEAD of either                      the same status and headers, no body (link checkers,
                                        load balancers and `curl -I` probe the page this way)
    GET /v1/dashboard/state             DashboardState.body() (API key)
    GET /v1/dashboard/history?since=T   the samples after unix time T, all when absent (API key)

The static files are read once from the package (they ship in the wheel; no build step) and
served from a fixed table, so no request path ever reaches the file system. The page gets a
Content-Security-Policy that allows scripts, styles and calls to this origin only, and no
inline script or style: a page that holds keys must not run anything it did not ship.
"""

from __future__ import annotations

from importlib import resources
from pathlib import PurePosixPath

from fastapi import APIRouter, Query
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from router.errors import NotFound
from router.ops.dashboard import paths
from router.ops.dashboard.history import History
from router.ops.dashboard.state import DashboardState

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
SHELL_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff",
                 "referrer-policy": "no-referrer", "x-frame-options": "DENY", "cache-control": "no-cache"}
DATA_HEADERS = {"cache-control": "no-store"}
MEDIA_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
               ".css": "text/css; charset=utf-8", ".png": "image/png"}
TEXT = "text/plain; charset=utf-8"
"""LICENSE, VERSION and anything else without a known suffix."""


def static_files() -> dict[str, tuple[bytes, str]]:
    """Relative path -> (content, media type) of every file under the package's static/."""
    root = resources.files("router.ops.dashboard") / "static"
    table: dict[str, tuple[bytes, str]] = {}

    def walk(folder, prefix: PurePosixPath) -> None:
        for entry in folder.iterdir():
            name = prefix / entry.name
            if entry.is_dir():
                walk(entry, name)
            elif entry.is_file():
                table[str(name)] = (entry.read_bytes(), MEDIA_TYPES.get(name.suffix, TEXT))

    walk(root, PurePosixPath())
    return table


def page_html(page: bytes, api_key_required: bool) -> bytes:
    """index.html, telling the page whether to ask for the API key before its first call."""
    return page.replace(b"__API_KEY__", b"required" if api_key_required else b"none")


def shell_response(content: bytes, media_type: str, request: Request) -> Response:
    """A shell file; for HEAD its headers alone, content-length still the file's (RFC 9110
    9.3.2: the headers a GET would send). Starlette sends a Response's body whatever the method."""
    if request.method != "HEAD":
        return Response(content, media_type=media_type, headers=SHELL_HEADERS)
    return Response(b"", media_type=media_type, headers={**SHELL_HEADERS, "content-length": str(len(content))})


def dashboard_routes(state: DashboardState, history: History, api_key_required: bool) -> APIRouter:
    files = static_files()
    page = page_html(files.pop("index.html")[0], api_key_required)
    api = APIRouter()

    @api.get(paths.PAGE)
    @api.get(f"{paths.PAGE}/")
    @api.head(paths.PAGE, include_in_schema=False)  # schema: one operation per path, its GET
    @api.head(f"{paths.PAGE}/", include_in_schema=False)
    async def dashboard_page(request: Request) -> Response:
        return shell_response(page, MEDIA_TYPES[".html"], request)

    @api.get(paths.STATIC_PREFIX + "{name:path}")
    @api.head(paths.STATIC_PREFIX + "{name:path}", include_in_schema=False)
    async def dashboard_static(name: str, request: Request) -> Response:
        if name not in files:
            raise NotFound(f"No dashboard file {name!r}.")
        content, media_type = files[name]
        return shell_response(content, media_type, request)

    @api.get(paths.STATE)
    async def dashboard_state() -> JSONResponse:
        return JSONResponse(await state.body(), headers=DATA_HEADERS)

    @api.get(paths.HISTORY)
    async def dashboard_history(since: float | None = Query(None)) -> JSONResponse:
        return JSONResponse(history.to_json(since), headers=DATA_HEADERS)

    return api
