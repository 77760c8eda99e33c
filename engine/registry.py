"""A small typed registry for pluggable parts (model families, attention backends, ...).

Entries are registered by name, either as the object itself or as a lazy
``"module:attr"`` import path so that optional heavy dependencies load only when chosen.
"""

from __future__ import annotations

import importlib
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Maps names to objects of one kind; an unknown name lists the known ones."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T | str] = {}

    def register(self, name: str, entry: T | str) -> None:
        """Add ``entry`` (an object or a lazy ``"module:attr"`` path). Raises on duplicates."""
        if name in self._entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self._entries[name] = entry

    def get(self, name: str) -> T:
        """Return the entry for ``name``, importing it if it was registered lazily.

        Raises KeyError naming the known entries when ``name`` is unknown.
        """
        if name not in self._entries:
            known = ", ".join(sorted(self._entries)) or "none"
            raise KeyError(f"unknown {self.kind} {name!r}; known: {known}")
        entry = self._entries[name]
        if isinstance(entry, str):
            module_name, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module_name), attr)
            self._entries[name] = entry
        return entry  # type: ignore[return-value]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
