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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from engine.loader.weights_cache import default_cache_dir

KERNEL_DIR = Path(__file__).resolve().parent
CFLAGS = (
    "-O3", "-march=native", "-fno-math-errno", "-fno-trapping-math", "-ffp-contract=fast",
    "-fPIC", "-shared", "-std=gnu11",
)
BUILD_TIMEOUT_S = 120.0
"""Longest a compiler run may take (a build takes a few seconds)."""


@dataclass(frozen=True)
class Source:
    """One C file of this package and the flags it needs beyond CFLAGS."""

    file: str
    flags: tuple[str, ...] = ()

    @property
    def path(self) -> Path:
        return KERNEL_DIR / self.file


PAGED_DECODE = Source("paged_decode.c")
RMS_NORM = Source("rms_norm.c")
INT4_LINEAR = Source("int4_linear.c", ("-fopenmp",))
"""-fopenmp: its parallel loops run on the calling thread's OpenMP team. The library asks for
libgomp.so.1 by that name, so in a process where torch has loaded its own libgomp the dynamic
linker hands it that one, and both share one pool of threads (no second pool spinning on the
same cores)."""
INT8X_LINEAR = Source("int8x_linear.c", ("-fopenmp",))
"""The int4 linears' int8-activation path (AVX512-VNNI, or AVX2 with FMA and F16C); -fopenmp as
INT4_LINEAR."""


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


def int4_kernel_host(int4_activations: str = "auto") -> str | None:
    """Why a worker on this host could not build and run the int4 kernel's path for
    `int4_activations`, or None when it could (a compiler, and in the CPU's flags AVX512-BF16 for
    bfloat16 activations; AVX512-VNNI with it, or AVX2 with FMA and F16C, for int8; either for
    auto): what `pdserve plan` predicts by."""
    if compiler() is None:
        return "no C compiler"
    flags = set(_cpu_flags().split())
    int8 = {"avx512_vnni", "avx512_bf16"} <= flags or {"avx2", "fma", "f16c"} <= flags
    if int4_activations == "int8":
        return None if int8 else "the CPU has neither AVX512-VNNI nor AVX2 with FMA and F16C"
    if "avx512_bf16" in flags or (int4_activations == "auto" and int8):
        return None
    if int4_activations == "auto":
        return "the CPU has neither AVX512-BF16 nor AVX512-VNNI or AVX2 with FMA and F16C"
    return "the CPU has no AVX512-BF16"


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


def library_name(source_text: str, cc: str, source: Source = PAGED_DECODE) -> str:
    flags = " ".join((*CFLAGS, *source.flags))
    key = "\n".join((source_text, flags, _compiler_version(cc), platform.machine(), _cpu_flags()))
    return f"{Path(source.file).stem}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"


def build(target: Path, cc: str, source: Source = PAGED_DECODE, path: Path | None = None) -> None:
    """Compile `source` into `target` (atomically), from `path` when given (another copy of that
    source, e.g. an older revision for a benchmark) else the package's file. Raises RuntimeError
    with the compiler's output."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=target.stem, suffix=".so.tmp", dir=target.parent)
    os.close(fd)
    try:
        out = subprocess.run([cc, *CFLAGS, *source.flags, "-o", tmp, str(path or source.path)],
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
_loaded: dict[Source, Loaded] = {}


def load(source: Source = PAGED_DECODE) -> Loaded:
    """The library of `source`, built on first use; the same answer for the rest of the process."""
    with _lock:
        if source not in _loaded:
            _loaded[source] = _load(source)
        return _loaded[source]


K = TypeVar("K")


def load_kernel(source: Source, wrap: Callable[[Loaded], K]) -> tuple[K | None, str]:
    """(wrap(the library of `source`), "") or (None, why there is none: no library, or the
    ValueError wrap raised, e.g. a CPU without the instructions it needs)."""
    loaded = load(source)
    if loaded.library is None:
        return None, loaded.reason
    try:
        return wrap(loaded), ""
    except ValueError as e:
        return None, str(e)


def _load(source: Source = PAGED_DECODE) -> Loaded:
    cc = compiler()
    if cc is None:
        return Loaded(None, None, "no C compiler (cc, gcc or clang; or $CC) on PATH")
    try:
        target = cache_dir() / library_name(source.path.read_text(), cc, source)
        if not target.exists():
            build(target, cc, source)
        return Loaded(ctypes.CDLL(str(target)), target)
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return Loaded(None, None, f"building {source.file} failed: {e}")
