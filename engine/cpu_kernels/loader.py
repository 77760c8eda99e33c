"""Build the C kernels of this package with the host's C compiler, once per source, compiler and
CPU, and load them with ctypes.

The shared library is cached under `~/.cache/pdserve/cpu_kernels/` (`$PDSERVE_CACHE_DIR/
cpu_kernels` when set), named by a hash of the source, the flags, the compiler's version and
the CPU's feature flags (it is built with -march=native, so a cache shared between different
CPUs gets one file per CPU). A build writes a temporary file and renames it into place, so
workers starting together each load a whole file. Without a compiler (or when the build fails)
`load` returns None with the reason, and the callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

from engine.loader.weights_cache import default_cache_dir

KERNEL_DIR = Path(__file__).resolve().parent
SOURCE = "paged_decode.c"
CFLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
    "-fPIC", "-shared", "-std=gnu11",
)
BUILD_TIMEOUT_S = 120.0
"""Longest a compiler run may take (a build takes about a second)."""


@dataclass(frozen=True)
class Loaded:
    """A loaded library, or why there is none (library None)."""

    library: ctypes.CDLL | None
    path: Path | None
    reason: str = ""


def cache_dir() -> Path:
    return default_cache_dir() / "cpu_kernels"


def compiler() -> str | None:
    """$CC when set, else the first of cc, gcc, clang on PATH."""
    wanted = os.environ.get("CC")
    if wanted:
        return shutil.which(wanted)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: str) -> str:
    out = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
    return out.stdout.splitlines()[0] if out.stdout else cc


def library_name(source_text: str, cc: str) -> str:
    key = "\n".join((source_text, " ".join(CFLAGS), _compiler_version(cc), platform.machine(), _cpu_flags()))
    return f"{Path(SOURCE).stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(target: Path, cc: str) -> None:
    """Compile SOURCE into `target` (atomically). Raises RuntimeError with the compiler's output."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *CFLAGS, "-o", tmp, str(KERNEL_DIR / SOURCE)],
                             capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{cc} exited {out.returncode}: {(out.stderr or out.stdout).strip()[-2000:]}")
        os.replace(tmp, target)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"{cc} took more than {BUILD_TIMEOUT_S:g} s") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


_lock = threading.Lock()
_loaded: Loaded | None = None


def load() -> Loaded:
    """The kernel library, built on first use; the same answer for the rest of the process."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> Loaded:
    cc = compiler()
    if cc is None:
        return Loaded(None, None, "no C compiler (cc, gcc or clang; or $CC) on PATH")
    try:
        target = cache_dir() / library_name((KERNEL_DIR / SOURCE).read_text(), cc)
        if not target.exists():
            build(target, cc)
        return Loaded(ctypes.CDLL(str(target)), target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return Loaded(None, None, f"building {SOURCE} failed: {e}")
