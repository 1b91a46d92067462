"""What the tower can reuse instead of decoding again, under one byte budget.

- the **prefix**: llama.cpp's sequence state after the fixed 36-token system prefix, and its hidden
  states; decoded once per loaded model, kept outside the budget (tens of KiB to ~50 MiB for the 9B);
- **states**: the sequence state (recurrent state + KV cells) after ``[prefix][state]`` and the
  hidden states of those tokens, keyed by their token ids, so that another question set about the
  same document decodes only its schema;
- **prompts**: the hidden states of a whole prompt, so that a repeated request skips the tower.

Reuse never changes an answer: the tower decodes every prompt on one fixed schedule (each segment
in chunks from its own start), so a restored segment is bit-identical to a freshly decoded one.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # numpy is only handled here, never needed to import this module
    import numpy as np

# About three 2,000-token states of the 9B (~150 MB each: 64 MB of KV cells, 50 MB of recurrent
# state, 32 MB of hidden states), or hundreds of short ones.
DEFAULT_MB = 512


@dataclass(frozen=True)
class Snapshot:
    """A sequence state that can be restored, and the hidden states of the tokens it covers."""

    n_tokens: int
    seq_state: np.ndarray | None  # llama.cpp's serialized sequence (uint8); None: prompt entry
    hidden: np.ndarray  # float32 [n_tokens, n_embd]

    @property
    def nbytes(self) -> int:
        return self.hidden.nbytes + (0 if self.seq_state is None else self.seq_state.nbytes)


class StateCache:
    """A byte-bounded LRU of snapshots; ``max_bytes=0`` keeps nothing (every prompt decoded)."""

    def __init__(self, max_bytes: int = DEFAULT_MB << 20):
        self.max_bytes = max(0, int(max_bytes))
        self._entries: OrderedDict[bytes, Snapshot] = OrderedDict()
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
    def key(kind: str, ids: np.ndarray) -> bytes:
        return kind.encode() + b":" + ids.astype("<i4", copy=False).tobytes()

    def get(self, key: bytes) -> Snapshot | None:
        with self._lock:
            found = self._entries.get(key)
            if found is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return found

    def put(self, key: bytes, snapshot: Snapshot) -> bool:
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


class SegmentedForward:
    """The canonical decode schedule and its reuse, shared by the towers of both backends.

    A prompt ``[prefix][state][rest]`` is decoded segment by segment on one sequence. The prefix
    is decoded once and kept; with a cache, a known ``[prefix][state]`` is restored and a known
    prompt is not decoded at all. A tower supplies the sequence operations: ``_begin()`` (a fresh
    sequence), ``_resume(kept)``, ``_append(seq, ids, start) -> hidden``, ``_kept_bytes(seq)`` and
    ``_keep(seq, size) -> kept`` (a restorable copy), plus ``_lock``, ``closed``, ``n_ctx``,
    ``n_vocab`` and ``n_embd``."""

    _prefix: tuple[bytes, Snapshot] | None = None
    vocab_name = "vocab"  # what the token ids index, for the error

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        import numpy as np

        from clef_gguf.errors import InferenceError

        ids = np.ascontiguousarray(ids, dtype=np.int32)
        n = int(ids.shape[0])
        if n == 0 or n > self.n_ctx:
            raise InferenceError(f"a prompt of {n} tokens does not fit the context of {self.n_ctx}")
        bad = ids[(ids < 0) | (ids >= self.n_vocab)]
        if bad.size:  # llama.cpp would reject these, and some vocab calls abort the process on them
            raise InferenceError(f"token id {int(bad[0])} is outside the {self.vocab_name} "
                                 f"of {self.n_vocab}")
        if self.closed:
            raise InferenceError("the tower is closed")
        return ids

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None) -> tuple[np.ndarray, int]:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]``, the
        segments given as token counts."""
        import numpy as np

        cache = cache if cache is not None and cache.max_bytes > 0 else None
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        prompt_key = cache.key("prompt", ids) if cache is not None else None
        if cache is not None and (hit := cache.get(prompt_key)) is not None:
            return hit.hidden.copy(), hit.n_tokens
        with self._lock:
            ids = self._checked(ids)
            hidden, cached = self._forward_locked(ids, prefix, state, cache)
        if cache is not None:
            cache.put(prompt_key, Snapshot(len(ids), None, hidden.copy()))
        return hidden, cached

    def _forward_locked(self, ids: np.ndarray, prefix: int, state: int,
                        cache: StateCache | None) -> tuple[np.ndarray, int]:
        import numpy as np

        head = prefix + state
        state_key = cache.key("state", ids[:head]) if cache is not None and state else None
        known = cache.get(state_key) if state_key else None
        if known is not None:
            seq = self._resume(known.seq_state)
            parts, cached = [known.hidden], head
        else:
            key = ids[:prefix].tobytes()
            if self._prefix is not None and self._prefix[0] == key:
                seq = self._resume(self._prefix[1].seq_state)
                parts, cached = [self._prefix[1].hidden], prefix
            else:
                seq = self._begin()
                parts, cached = [self._append(seq, ids[:prefix], 0)], 0
                self._prefix = (key, Snapshot(prefix, self._keep(seq, self._kept_bytes(seq)), parts[0]))
            if state:
                parts.append(self._append(seq, ids[prefix:head], prefix))
                size = self._kept_bytes(seq)
                if state_key and size + head * self.n_embd * 4 <= cache.max_bytes:
                    cache.put(state_key, Snapshot(head, self._keep(seq, size), np.concatenate(parts)))
        if head < len(ids):
            parts.append(self._append(seq, ids[head:], head))
        return np.concatenate(parts), cached
