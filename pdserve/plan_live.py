"""`pdserve plan --live URL`: the running router's recommendation (GET /v1/plan), printed with
the arithmetic behind it — the same numbers the dashboard's planner panel and --autoscale use.

The API key comes from $PDSERVE_API_KEY or $PDSERVE_API_KEY_FILE, never a flag (argv is visible
to every user of the host). Exit codes: 0 printed; 1 the router refused or could not be reached.
"""

from __future__ import annotations

import json
import sys

from pdserve.scale_client import API_KEY_ENV, API_KEY_FILE_ENV, UsageError, _error_message, _key_from

TIMEOUT_S = 30.0


def fetch_plan(url: str) -> dict:
    """GET {url}/v1/plan with the API key from the environment. Raises RuntimeError saying why not."""
    import httpx

    try:
        key = _key_from(API_KEY_ENV, API_KEY_FILE_ENV)
    except UsageError as exc:
        raise RuntimeError(str(exc)) from None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        response = httpx.get(f"{url.rstrip('/')}/v1/plan", headers=headers, timeout=TIMEOUT_S)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach the router at {url}: {exc}") from None
    if response.status_code != 200:
        raise RuntimeError(f"GET /v1/plan: {response.status_code} {_error_message(response)}")
    return response.json()


def _ms(value) -> str:
    return "-" if value is None else f"{value:g} ms"


def render_plan(body: dict) -> str:
    """The plan as text: counts and reasons per role, the arithmetic, the autoscaler's state."""
    slo, auto = body["slo"], body["autoscale"]
    lines = [f"live plan over the last {body['window_s']:g} s (SLO: TTFT p99 {_ms(slo['ttft_ms'])}, "
             f"ITL p99 {_ms(slo['itl_ms'])})",
             f"  {'role':<8} {'current':>7} {'recommended':>11}  why"]
    for role in ("prefill", "decode"):
        lines.append(f"  {role:<8} {body['current'][role]:>7} {body['recommended'][role]:>11}  "
                     f"{body['reasons'][role]}")
    lines.append("arithmetic:")
    lines += [f"  {line}" for line in body["arithmetic"]]
    bounds = ", ".join(f"{role} {auto['min'][role]}..{auto['max'][role]}" for role in ("prefill", "decode"))
    state = "on" if auto["enabled"] else "off"
    last = auto["last_action"]
    done = "none yet" if last is None else f"{last['role']} {last['from']} -> {last['to']} ({last['why']})"
    lines.append(f"autoscale: {state} ({bounds}); last action: {done}")
    return "\n".join(lines)


def run_live(url: str, as_json: bool) -> int:
    try:
        body = fetch_plan(url)
    except RuntimeError as exc:
        print(f"pdserve plan --live: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2) if as_json else render_plan(body))
    return 0
