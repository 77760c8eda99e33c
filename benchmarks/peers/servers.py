"""Starting the servers under comparison, driving them with `pdserve bench`, stopping them.

Lifecycle of every process started here: started as the leader of its own process group (so
the whole group can be signalled; `pdserve up`'s workers and Redis are in it) with stdout and
stderr in a log file of the work dir -> ready (a check per kind of server) -> stopped by `Processes.stop`
(the signal to the group, SIGKILL to the group after a grace period). `Processes` is a context
manager whose exit stops everything still running on every path: return, exception, Ctrl-C,
and SIGTERM once `exit_on_sigterm()` has run.

Benchmarks drive every server with the same `pdserve bench` command line (only --base-url and
the result file differ), as a subprocess, and read back the JSON it saves (vLLM's fields).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

HOST = "127.0.0.1"
BUILD_SCRIPT = Path(__file__).resolve().with_name("build_llamacpp.sh")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Proc:
    """One started process (the leader of its own process group) and its log file."""

    name: str
    popen: subprocess.Popen
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def session_kwargs(own_session: bool) -> dict[str, object]:
    """subprocess.Popen keywords: the child leads a process group of its own (stoppable as a
    group, out of reach of a terminal's Ctrl-C), and with own_session a session of its own too
    (see Processes)."""
    return {"start_new_session": True} if own_session else {"process_group": 0}


class Processes:
    """Owns the processes a benchmark starts; stops them all on exit. Not thread-safe.

    own_sessions: each process also leads a session of its own (the default). Where the kernel
    schedules by autogroup (/proc/sys/kernel/sched_autogroup_enabled = 1), CPU is shared
    between sessions first and nice counts only inside one, so a pdserve engine's lowered
    priority (EngineConfig.engine_nice) then does not rank it below the router or the bench
    clients. False keeps every process in this script's session: what `pdserve up` does with
    its own children, and what a benchmark that times token streams against pdserve alone
    wants. A comparison with another server keeps the default, so both stand alike."""

    def __init__(self, workdir: Path, own_sessions: bool = True) -> None:
        self.workdir = workdir
        self.own_sessions = own_sessions
        self._procs: list[Proc] = []

    def start(self, name: str, cmd: Sequence[str], cores: str | None = None,
              env: dict[str, str] | None = None) -> Proc:
        """Start `cmd` (pinned to `cores`, a taskset list like "0" or "0,1", when given).
        Does not block; raises OSError when the program cannot be run."""
        argv = (["taskset", "-c", cores] if cores else []) + list(cmd)
        log = self.workdir / f"{name}.log"
        with log.open("w") as out:
            out.write("$ " + " ".join(argv) + "\n")
            out.flush()
            popen = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, **session_kwargs(self.own_sessions))
        proc = Proc(name, popen, log)
        self._procs.append(proc)
        return proc

    def stop(self, proc: Proc, sig: int = signal.SIGTERM, grace_s: float = 30.0) -> None:
        """`sig` to the leader, then SIGKILL to the whole group after grace_s (and always at
        the end, for children the leader left behind). Blocks up to ~grace_s. Idempotent."""
        if proc.alive():
            try:
                os.kill(proc.popen.pid, sig)
                proc.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
            except ProcessLookupError:
                pass
        try:
            os.killpg(proc.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass  # the group is already gone
        proc.popen.wait()
        if proc in self._procs:
            self._procs.remove(proc)

    def stop_all(self) -> None:
        for proc in reversed(list(self._procs)):  # clients and routers before workers
            self.stop(proc)

    def __enter__(self) -> Processes:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop_all()


def exit_on_sigterm() -> None:
    """Turn SIGTERM into SystemExit, so `finally` and `with Processes(...)` clean up."""
    def raise_exit(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, raise_exit)


def wait_until(check: Callable[[], bool], proc: Proc, timeout_s: float, what: str) -> None:
    """Poll `check` every 0.2 s until it holds; raises RuntimeError (quoting proc's log) when
    proc exits first or timeout_s passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        if not proc.alive():
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode} before {what}:\n"
                               f"{proc.log_tail()}")
        time.sleep(0.2)
    raise RuntimeError(f"{proc.name}: no {what} within {timeout_s:.0f} s:\n{proc.log_tail()}")


def http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def free_port() -> int:
    from pdserve.ports import free_port as pick

    return pick(HOST)


def free_ports(count: int) -> list[int]:
    from pdserve.ports import free_ports as pick

    return pick(count, HOST)


def pdserve_command(*args: str) -> list[str]:
    """`python -m pdserve ...` (the `pdserve` CLI) with this Python, run from the repo root, so
    it works from a checkout whether or not the console script's install is current."""
    return [sys.executable, "-m", "pdserve", *args]


def pinned_cores(count: int) -> list[int]:
    """The first `count` cores this process may run on; raises when it has fewer."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        raise RuntimeError(f"this benchmark needs {count} cores; this process may use {cores}")
    return cores[:count]


# ------------------------------------------------------------------ servers
@dataclass(frozen=True)
class Server:
    """A started OpenAI-compatible server."""

    label: str
    base_url: str
    proc: Proc


def start_pdserve_up(procs: Processes, label: str, flags: Sequence[str], cores: str,
                     timeout_s: float = 600.0) -> Server:
    """`pdserve up` on free ports, pinned to `cores`; blocks until it says it is up and
    /health answers."""
    port, grpc_port = free_ports(2)
    cmd = pdserve_command("up", "--host", HOST, "--port", str(port), "--grpc-port", str(grpc_port),
                          "--cluster", f"bench-{os.getpid()}", *flags)
    proc = procs.start(label, cmd, cores=cores)
    base_url = f"http://{HOST}:{port}"
    wait_until(lambda: "pdserve is up" in proc.log_tail(100_000) and http_ok(base_url + "/health"),
               proc, timeout_s, "'pdserve is up'")
    return Server(label, base_url, proc)


def build_llama_server() -> Path:
    """Run build_llamacpp.sh (a no-op once built) and return the binary's path."""
    done = subprocess.run(["bash", str(BUILD_SCRIPT)], stdout=subprocess.PIPE, text=True, check=True)
    return Path(done.stdout.strip().splitlines()[-1])


def start_llama_server(procs: Processes, binary: Path, model: Path, *, alias: str, parallel: int,
                       ctx_per_slot: int, threads: int, cores: str, timeout_s: float = 300.0) -> Server:
    """llama-server with `parallel` slots of ctx_per_slot tokens each; blocks until /health
    answers 200 (it answers 503 while the model loads)."""
    port = free_port()
    cmd = [str(binary), "--model", str(model), "--alias", alias, "--host", HOST, "--port", str(port),
           "--parallel", str(parallel), "--ctx-size", str(parallel * ctx_per_slot),
           "--threads", str(threads), "--threads-batch", str(threads)]
    proc = procs.start("llama-server", cmd, cores=cores)
    base_url = f"http://{HOST}:{port}"
    wait_until(lambda: http_ok(base_url + "/health"), proc, timeout_s, "200 from /health")
    return Server("llama.cpp", base_url, proc)


# ------------------------------------------------------------------ pdserve bench
@dataclass(frozen=True)
class BenchRun:
    """A `pdserve bench` process under way and where its JSON will be."""

    proc: Proc
    result: Path


def start_bench(procs: Processes, name: str, base_url: str, flags: Sequence[str], out_dir: Path) -> BenchRun:
    """Start `pdserve bench --base-url base_url *flags --save-result` into out_dir/name.json.
    Does not block."""
    cmd = pdserve_command("bench", "--base-url", base_url, *flags, "--save-result",
                          "--result-dir", str(out_dir), "--result-filename", f"{name}.json")
    return BenchRun(procs.start(f"bench-{name}", cmd), out_dir / f"{name}.json")


def finish_bench(procs: Processes, run: BenchRun, timeout_s: float) -> dict:
    """Wait for the bench process; return its saved JSON. Raises RuntimeError (with its log)
    when it fails or outlives timeout_s (then it is stopped)."""
    try:
        run.proc.popen.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        procs.stop(run.proc, grace_s=5)
        raise RuntimeError(f"{run.proc.name} ran past {timeout_s:.0f} s:\n{run.proc.log_tail()}") from None
    procs.stop(run.proc)
    if run.proc.popen.returncode != 0 or not run.result.exists():
        raise RuntimeError(f"{run.proc.name} failed ({run.proc.popen.returncode}):\n{run.proc.log_tail()}")
    return json.loads(run.result.read_text())


def run_bench(procs: Processes, name: str, base_url: str, flags: Sequence[str], out_dir: Path,
              timeout_s: float) -> dict:
    """start_bench + finish_bench: blocks until the run is over."""
    return finish_bench(procs, start_bench(procs, name, base_url, flags, out_dir), timeout_s)
