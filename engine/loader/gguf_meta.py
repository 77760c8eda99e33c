"""Fast reader of a GGUF file's metadata (key/value section only, no tensor data).

`gguf.GGUFReader` builds a numpy view per array element, which takes seconds for a
49k-token vocabulary; this reads the same section with `struct` in tens of milliseconds.
Format: magic "GGUF", u32 version, u64 tensor count, u64 kv count, then key/value pairs.
"""

from __future__ import annotations

import functools
import struct
from pathlib import Path
from typing import Any, BinaryIO

# GGUF value type codes -> struct format (scalars)
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    def __init__(self, f: BinaryIO) -> None:
        self.f = f

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        data = self.f.read(size)
        if len(data) != size:
            raise ValueError("truncated GGUF metadata")
        return struct.unpack("<" + fmt, data)

    def string(self) -> str:
        (length,) = self.unpack("Q")
        return self.f.read(length).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])[0]
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            (item_type,) = self.unpack("I")
            (count,) = self.unpack("Q")
            if item_type in _SCALARS:
                return list(self.unpack(f"{count}{_SCALARS[item_type]}")) if count else []
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


@functools.lru_cache(maxsize=8)
def _read(path: str, mtime_ns: int, size: int) -> dict[str, Any]:
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        cur = _Cursor(f)
        (version,) = cur.unpack("I")
        if version < 2:
            raise ValueError(f"{path}: GGUF version {version} is not supported (need 2 or later)")
        _tensor_count, kv_count = cur.unpack("QQ")
        meta: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            meta[key] = cur.value(vtype)
        return meta


def read_gguf_metadata(path: str | Path) -> dict[str, Any]:
    """All metadata key/values (arrays as lists). Cached per (path, mtime, size); do not mutate."""
    stat = Path(path).stat()
    return _read(str(path), stat.st_mtime_ns, stat.st_size)


_F32 = 0  # ggml type id of float32 tensors


def _tensor_infos(path: str | Path) -> tuple[dict[str, tuple[tuple[int, ...], int, int]], int]:
    """{name: (dims, ggml type, offset in the data section)} and the data section's start."""
    with open(path, "rb") as f:
        f.read(4)
        cur = _Cursor(f)
        cur.unpack("I")
        tensor_count, kv_count = cur.unpack("QQ")
        alignment = 32
        for _ in range(kv_count):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            value = cur.value(vtype)
            if key == "general.alignment":
                alignment = int(value)
        infos = {}
        for _ in range(tensor_count):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            dims = cur.unpack(f"{n_dims}Q")
            ggml_type, offset = cur.unpack("IQ")
            infos[name] = (tuple(dims), ggml_type, offset)
        start = -(-f.tell() // alignment) * alignment
        return infos, start


def read_gguf_tensor_names(path: str | Path) -> list[str]:
    """Names of the tensors in the file, in file order."""
    return list(_tensor_infos(path)[0])


def read_gguf_f32_tensor(path: str | Path, name: str) -> tuple[float, ...] | None:
    """A small float32 tensor's values (e.g. `rope_freqs.weight`), or None if absent."""
    infos, start = _tensor_infos(path)
    if name not in infos:
        return None
    dims, ggml_type, offset = infos[name]
    if ggml_type != _F32:
        raise ValueError(f"{path}: tensor {name!r} has ggml type {ggml_type}, expected F32")
    count = 1
    for d in dims:
        count *= d
    with open(path, "rb") as f:
        f.seek(start + offset)
        return struct.unpack(f"<{count}f", f.read(4 * count))


GGML_TYPE_NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
                   10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 30: "BF16"}
"""ggml's type ids (ggml.h) by name; the others read as "type N"."""


def read_gguf_tensor_types(path: str | Path) -> dict[str, str]:
    """{tensor name: ggml type name} from the header alone (no tensor data, no torch)."""
    return {name: GGML_TYPE_NAMES.get(kind, f"type {kind}") for name, (_, kind, _) in _tensor_infos(path)[0].items()}
