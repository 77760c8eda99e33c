"""One child process of `pdserve up`: started from a spec's argv, watched without blocking.

Each child runs in its own process group, so a Ctrl-C at the terminal reaches only the
supervisor, which then stops the children in order (router first, then workers draining);
and each gets SIGTERM (a drain) if the supervisor itself dies, so none outlives it (Linux's
PR_SET_PDEATHSIG; elsewhere the supervisor's own stop is the only guard).
"""

from __future__ import annotations

import ctypes
import logging
import signal
import subprocess
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)  # loaded before fork: the child only calls it
except OSError:  # not glibc: no parent-death signal
    _LIBC = None


def die_with_parent() -> None:
    """Runs in the child between fork and exec: SIGTERM when the supervisor dies."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def describe_exit(code: int) -> str:
    """'exited with code 3' / 'was killed by SIGKILL'."""
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


class ChildProcess:
    """`python -m pdserve <argv>`; ready once its ready file holds a full line."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], ready_file: Path | None) -> None:
        self.name, self.ready_file = name, ready_file
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)  # a previous incarnation's ports are not ours
        self.process = subprocess.Popen([sys.executable, "-m", "pdserve", *argv], env=env,
                                        process_group=0, preexec_fn=die_with_parent)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def where(self) -> str:
        return f"pid {self.process.pid}"

    def poll(self) -> int | None:
        """The exit code once it has exited (reaped), else None. Never blocks."""
        return self.process.poll()

    def is_ready(self) -> bool:
        """The child wrote its ready file (a complete line). Never blocks."""
        if self.ready_file is None:
            return True
        try:
            return self.ready_file.read_text().endswith("\n")
        except FileNotFoundError:
            return False

    def terminate(self) -> None:
        """SIGTERM (a worker drains, a router stops taking requests and finishes its streams)."""
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def wait(self, timeout_s: float) -> int | None:
        """Blocks at most timeout_s; the exit code, or None if still running."""
        try:
            return self.process.wait(timeout=max(timeout_s, 0.0))
        except subprocess.TimeoutExpired:
            return None

    def _signal(self, signum: int) -> None:
        if self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:  # exited between poll and kill
                pass
