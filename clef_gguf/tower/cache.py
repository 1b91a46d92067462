"""What the tower can reuse instead of decoding again, under one byte budget.

- the **prefix**: llama.cpp's sequence state after the fixed 36-token system prefix, and its hidden
  states; decoded once per loaded model, kept outside the budget (tens of KiB to ~50 MiB for the 9B);
- **states**: the sequence state (recurrent state + KV cells) after ``[prefix][state]`` and the
  hidden states of those tokens, keyed by their token ids, so that another question set about the
  same document decodes only its schema;
- **prompts**: the hidden states of a whole prompt, so that a repeated request skips the tower.

Reuse never changes an answer: the tower decodes every prompt on one fixed schedule (each segment
in chunks from its own start), so a restored segment is bit-identical to a freshly decoded one. That
schedule, with every cache key and rule, is ``clef_gguf.tower.schedule``'s: this module only holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

if TYPE_CHECKING:  # numpy is only handled here, never needed to import this module
    import numpy as np

# About three 2,000-token states of the 9B (~150 MB each: 64 MB of KV cells, 50 MB of recurrent
# state, 32 MB of hidden states), or hundreds of short ones.
DEFAULT_MB = 512


class Kept(Protocol):
    """What a backend keeps of a sequence to restore it later; its size is what the budget counts."""

    @property
    def nbytes(self) -> int: ...


K = TypeVar("K", bound=Kept)


@dataclass(frozen=True)
class Snapshot(Generic[K]):
    """A sequence state that can be restored, and the hidden states of the tokens it covers."""

    n_tokens: int
    # llama.cpp's serialized sequence (uint8), or the NVFP4 tower's copy of its cache; None: prompt entry
    seq_state: K | None
    hidden: np.ndarray  # float32 [n_tokens, n_embd]

    @property
    def nbytes(self) -> int:
        return self.hidden.nbytes + (0 if self.seq_state is None else self.seq_state.nbytes)


class StateCache:
    """A byte-bounded LRU of snapshots; ``max_bytes=0`` keeps nothing (every prompt decoded)."""

    def __init__(self, max_bytes: int = DEFAULT_MB << 20):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[bytes, Snapshot[Any]] = OrderedDict()
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

    @staticmethod
    def key(kind: str, ids: np.ndarray, tag: str = "") -> bytes:
        """``tag`` names what else the cached states depend on (a fine-tune's adapter): towers that
        share a cache under different tags never see each other's entries."""
        return f"{kind}{tag}:".encode() + ids.astype("<i4", copy=False).tobytes()

    def get(self, key: bytes) -> Snapshot[Any] | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: bytes, snapshot: Snapshot[Any]) -> bool:
        """Keep ``snapshot`` if it fits the budget at all, evicting the least recently used."""
        size = snapshot.nbytes
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            while self._entries and self._bytes + size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.nbytes
            self._entries[key] = snapshot
            self._bytes += size
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0


def usable(cache: StateCache | None) -> StateCache | None:
    """``cache``, or None where it keeps nothing."""
    return cache if cache is not None and cache.max_bytes > 0 else None
