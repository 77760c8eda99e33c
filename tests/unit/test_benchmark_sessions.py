"""benchmarks/peers/servers.Processes: each process leads a process group of its own (so the
group can be stopped), and by default a session of its own; own_sessions=False keeps it in the
benchmark's session (under autogroup scheduling nice then ranks the engines below the clients)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from benchmarks.peers.servers import Processes

pytestmark = pytest.mark.timeout(60)
PRINT_IDS = "import os; print(os.getpid(), os.getpgid(0), os.getsid(0), flush=True); import time; time.sleep(30)"


def _ids(log: Path) -> tuple[int, int, int]:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        lines = log.read_text().splitlines()
        if len(lines) >= 2:  # the "$ argv" line, then the ids
            pid, pgid, sid = map(int, lines[1].split())
            return pid, pgid, sid
        time.sleep(0.05)
    raise AssertionError(f"no ids in {log}: {log.read_text()!r}")


@pytest.mark.parametrize("own_sessions", [True, False])
def test_a_started_process_leads_its_group_and_a_session_only_when_asked(tmp_path, own_sessions):
    with Processes(tmp_path, own_sessions=own_sessions) as procs:
        proc = procs.start("ids", [sys.executable, "-c", PRINT_IDS])
        pid, pgid, sid = _ids(proc.log)
        assert pid == proc.popen.pid and pgid == pid  # stoppable as a group
        assert (sid == pid) is own_sessions
        if not own_sessions:
            assert sid == os.getsid(0)
        procs.stop(proc, grace_s=5)
        assert not proc.alive()
