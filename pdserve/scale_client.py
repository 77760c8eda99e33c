"""`pdserve scale prefill=2 decode=3 [--url URL] [--wait]`: the command-line client of the
router's roles API (PUT /v1/roles/{role} {"replicas": N}); with no assignments it prints
GET /v1/roles as a table.

The admin key comes from --admin-key-file, $PDSERVE_ADMIN_KEY or $PDSERVE_ADMIN_KEY_FILE
(never a flag value: argv is visible to every user of the host). GET /v1/roles also takes the
API key ($PDSERVE_API_KEY / _FILE) when no admin key is given.

Exit codes: 0 done; 1 the router refused or could not be reached, or --wait timed out;
2 bad command line (`prefill=x`, `gpu=2`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from router.ops.scaling import SCALABLE_ROLES

ADMIN_KEY_ENV = "PDSERVE_ADMIN_KEY"
ADMIN_KEY_FILE_ENV = "PDSERVE_ADMIN_KEY_FILE"
API_KEY_ENV = "PDSERVE_API_KEY"
API_KEY_FILE_ENV = "PDSERVE_API_KEY_FILE"
WAIT_POLL_S = 0.5


class UsageError(ValueError):
    """Bad command line (exit 2)."""


class ScaleFailed(RuntimeError):
    """The router refused, could not be reached, or --wait timed out (exit 1)."""


@dataclass(frozen=True)
class Assignment:
    role: str
    replicas: int


def add_scale_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("assignments", nargs="*", metavar="ROLE=N",
                        help=f"desired replicas per role ({', '.join(SCALABLE_ROLES)}); none: show the roles")
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the router's HTTP address")
    parser.add_argument("--admin-key-file", type=Path, default=None,
                        help="file holding the admin key (else $PDSERVE_ADMIN_KEY or $PDSERVE_ADMIN_KEY_FILE)")
    parser.add_argument("--wait", action="store_true", help="wait until each role has ready == desired")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds --wait (and each call) may take")


def parse_assignments(texts: list[str]) -> list[Assignment]:
    """'prefill=2' ... -> assignments. Raises UsageError naming the bad one."""
    out: dict[str, Assignment] = {}
    for text in texts:
        role, sep, value = text.partition("=")
        if not sep:
            raise UsageError(f"{text!r}: expected ROLE=N, e.g. prefill=2")
        if role not in SCALABLE_ROLES:
            raise UsageError(f"{text!r}: unknown role {role!r} (roles: {', '.join(SCALABLE_ROLES)})")
        if not value.isdigit():
            raise UsageError(f"{text!r}: replicas must be a whole number >= 0, got {value!r}")
        if role in out:
            raise UsageError(f"{text!r}: {role} is given twice")
        out[role] = Assignment(role, int(value))
    return list(out.values())


def _key_from(env_name: str, file_env_name: str, file: Path | None = None) -> str | None:
    path = file or (Path(os.environ[file_env_name]) if os.environ.get(file_env_name) else None)
    if file is None and os.environ.get(env_name):
        return os.environ[env_name]
    if path is None:
        return None
    try:
        key = path.read_text().strip()
    except OSError as exc:
        raise UsageError(f"cannot read the key file {path}: {exc.strerror}") from None
    if not key:
        raise UsageError(f"the key file {path} is empty")
    return key


def headers(args: argparse.Namespace, write: bool) -> dict[str, str]:
    """Authorization: the admin key; for a read without one, the API key."""
    key = _key_from(ADMIN_KEY_ENV, ADMIN_KEY_FILE_ENV, args.admin_key_file)
    if key is None and not write:
        key = _key_from(API_KEY_ENV, API_KEY_FILE_ENV)
    return {"Authorization": f"Bearer {key}"} if key else {}


def _request(client, method: str, path: str, args: argparse.Namespace, **kwargs):
    import httpx

    try:
        response = client.request(method, f"{args.url.rstrip('/')}{path}", **kwargs)
    except httpx.HTTPError as exc:
        raise ScaleFailed(f"cannot reach the router at {args.url}: {exc}") from None
    if response.status_code >= 400:
        raise ScaleFailed(f"{method} {path}: {response.status_code} {_error_message(response)}")
    return response.json()


def _error_message(response) -> str:
    try:
        return str(response.json()["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return response.text.strip()[:300]


def roles_by_name(body: dict) -> dict[str, dict]:
    return {entry["role"]: entry for entry in body.get("roles", [])}


def format_roles(body: dict) -> str:
    """GET /v1/roles as a table: one line per role, then one indented line per worker."""
    lines = [f"scaler: {body.get('scaler', 'none')}",
             f"{'ROLE':<8} {'DESIRED':>7} {'READY':>5} {'DRAINING':>8} {'RESTARTS':>8}"]
    for entry in body.get("roles", []):
        desired = "-" if entry.get("desired") is None else entry["desired"]
        lines.append(f"{entry['role']:<8} {desired:>7} {entry.get('ready', 0):>5} "
                     f"{entry.get('draining', 0):>8} {entry.get('restarts', 0):>8}")
        for worker in entry.get("workers", []):
            wid = worker.get("worker_id") or worker.get("id", "?")
            lines.append(f"  {wid:<14} {worker.get('state', '?'):<9} {worker.get('address', '')}")
    return "\n".join(lines)


def settled(entry: dict, replicas: int) -> bool:
    return entry.get("desired") == replicas and entry.get("ready") == replicas and not entry.get("draining")


def scale(args: argparse.Namespace) -> int:
    import httpx

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per poll of --wait

    assignments = parse_assignments(args.assignments)
    with httpx.Client(timeout=args.timeout) as client:
        if not assignments:
            print(format_roles(_request(client, "GET", "/v1/roles", args, headers=headers(args, write=False))))
            return 0
        for a in assignments:
            body = _request(client, "PUT", f"/v1/roles/{a.role}", args, json={"replicas": a.replicas},
                            headers=headers(args, write=True))
            print(f"{a.role}: desired {body.get('desired', a.replicas)} (ready {body.get('ready', '?')})", flush=True)
        if args.wait:
            _wait(client, args, assignments)
    return 0


def _wait(client, args: argparse.Namespace, assignments: list[Assignment]) -> None:
    deadline = time.monotonic() + args.timeout
    while True:
        body = _request(client, "GET", "/v1/roles", args, headers=headers(args, write=False))
        roles = roles_by_name(body)
        if all(settled(roles.get(a.role, {}), a.replicas) for a in assignments):
            print(format_roles(body))
            return
        if time.monotonic() > deadline:
            state = ", ".join(f"{a.role} ready {roles.get(a.role, {}).get('ready')}/{a.replicas}" for a in assignments)
            raise ScaleFailed(f"not settled within {args.timeout:g} s ({state})")
        time.sleep(WAIT_POLL_S)


def cmd_scale(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    try:
        return scale(args)
    except UsageError as exc:
        print(f"pdserve scale: {exc}", file=sys.stderr)
        return 2
    except ScaleFailed as exc:
        print(f"pdserve scale: {exc}", file=sys.stderr)
        return 1
