"""Log output of every pdserve process: one handler on stderr, text or JSON lines.

`pdserve up` runs its router and workers as children that share its terminal, so every line
names its process: text lines carry `[decode-0]` (the worker id, else the role), JSON lines the
fields worker_id and role, plus request_id while a request is being handled
(proto/log_context.py holds both, so the router and the workers can set them without
importing the command line).

    text: 2026-01-01 12:00:00,000 INFO [decode-0] worker_runtime.process: decode worker ...
    json: {"ts": "2026-01-01T12:00:00.000+00:00", "level": "INFO", "logger": "...",
           "message": "...", "worker_id": "decode-0", "role": "decode"}
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from datetime import datetime, timezone
from typing import Literal, get_args

from proto.log_context import current_request_id, identity, set_identity

__all__ = ["LOG_FORMATS", "ContextFilter", "JsonFormatter", "TextFormatter", "add_log_args", "configure_logging"]

LogFormat = Literal["text", "json"]
LOG_FORMATS: tuple[str, ...] = get_args(LogFormat)
DEFAULT_LOG_STATS_INTERVAL_S = 10.0

_TEXT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
_TEXT_NAMED = "%(asctime)s %(levelname)s [%(component)s] %(name)s: %(message)s"


def add_log_args(g) -> None:
    """--log-format and --log-stats-interval (workers, router, `pdserve up`, which passes both on
    to its children through their specs)."""
    g.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                   help="log lines as text, or as JSON lines with worker_id, role and request_id fields")
    g.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_STATS_INTERVAL_S,
                   help="seconds between stats lines (throughput, requests, KV usage, prefix-cache hits, "
                        "transfers), logged only when they changed; 0: none")


class ContextFilter(logging.Filter):
    """Stamps each record with this process's worker_id, role and name (for the text prefix) and
    the current request id. Attached to the handler, so records of every logger get it."""

    def filter(self, record: logging.LogRecord) -> bool:
        who = identity()
        record.worker_id = who.worker_id
        record.role = who.role
        record.component = who.name
        record.request_id = current_request_id()
        return True


class TextFormatter(logging.Formatter):
    """The classic line, with `[name]` after the level when this process has one."""

    def __init__(self) -> None:
        super().__init__(_TEXT)
        self._named = logging.Formatter(_TEXT_NAMED)

    def format(self, record: logging.LogRecord) -> str:
        if getattr(record, "component", None):
            return self._named.format(record)
        return super().format(record)


class JsonFormatter(logging.Formatter):
    """One JSON object per line. A record logged with `extra={"stats": {...}}` (the stats lines)
    carries those numbers as a `stats` object too."""

    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "worker_id": getattr(record, "worker_id", None),
            "role": getattr(record, "role", None),
        }
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            body["request_id"] = request_id
        stats = getattr(record, "stats", None)
        if isinstance(stats, dict):
            body["stats"] = stats
        if record.exc_info:
            body["exception"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False, default=str)


def configure_logging(level: str, fmt: str = "text", role: str | None = None,
                      worker_id: str | None = None) -> None:
    """Route every logger to one stderr handler in `fmt`, naming this process (role, worker id)
    in each line. Replaces handlers installed before (an earlier call, basicConfig). Raises
    ValueError for an unknown format or level."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}; got {fmt!r}")
    set_identity(role, worker_id)
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(ContextFilter())
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def component_of(args: argparse.Namespace) -> tuple[str | None, str | None]:
    """(role, worker_id) of the command being run: workers and the router are named in their log
    lines, and so is `pdserve up` (its lines interleave with its children's)."""
    command = getattr(args, "command", None)
    if command in ("prefill", "decode"):
        return command, getattr(args, "worker_id", None)
    if command in ("router", "up"):
        return command, None
    return None, None
