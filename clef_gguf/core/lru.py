"""A byte-bounded LRU, thread-safe: the one container behind the tower's state cache and the vision
cache (each decides what it keeps and how its keys are made; this only holds and evicts).

``max_bytes=0`` keeps nothing. An entry larger than the whole budget is refused rather than emptying
the cache for it. ``hits``/``misses`` count ``get`` calls (tests and diagnostics read them).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

V = TypeVar("V")


class ByteLRU(Generic[V]):
    """Keys (bytes) to values, least recently used evicted first, ``size(value)`` bytes each."""

    def __init__(self, max_bytes: int, size: Callable[[V], int]) -> None:
        self.max_bytes = max(0, int(max_bytes))
        self._size = size
        self._entries: OrderedDict[bytes, V] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Whether ``key`` is held, without counting a hit or refreshing it (planning only)."""
        with self._lock:
            return key in self._entries

    def get(self, key: bytes) -> V | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: bytes, value: V) -> bool:
        """Keep ``value`` if it fits the budget at all, evicting the least recently used."""
        size = self._size(value)
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= self._size(old)
            while self._entries and self._bytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= self._size(evicted)
            self._entries[key] = value
            self._bytes += size
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
