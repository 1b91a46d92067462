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
from abc import ABC, abstractmethod
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is only handled here, never needed to import this module
    import numpy as np

    from clef_gguf.pipeline.mediaprompt import MediaPrompt

    from clef_gguf.core.errors import ClefError

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
    def key(kind: str, ids: np.ndarray, tag: str = "") -> bytes:
        """``tag`` names what else the cached states depend on (a fine-tune's adapter): towers that
        share a cache under different tags never see each other's entries."""
        return f"{kind}{tag}:".encode() + ids.astype("<i4", copy=False).tobytes()

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


@dataclass
class Plan:
    """How one prompt ``[prefix][state][rest]`` is decoded on one sequence: what is restored first,
    which segments are decoded after it (each from its own start), and what is kept on the way."""

    ids: np.ndarray
    prefix: int
    head: int  # prefix + state tokens
    start: Snapshot | None  # restored first: a cached [prefix][state] or the kept prefix; None: nothing
    cached: int  # tokens restored rather than decoded
    segments: list[tuple[int, int]]
    state_key: bytes | None  # the [prefix][state] snapshot goes there once token ``head`` is decoded
    media: MediaPrompt | None = None  # images/videos: decoded as their embeddings, at M-RoPE positions

    @property
    def keeps_prefix(self) -> bool:
        """Whether the first segment is the prefix, decoded from scratch and kept as the tower's."""
        return self.start is None


def usable(cache: StateCache | None) -> StateCache | None:
    """``cache``, or None where it keeps nothing."""
    return cache if cache is not None and cache.max_bytes > 0 else None


class SegmentedForward(ABC):
    """The canonical decode schedule and its reuse, shared by the towers of both backends and by
    the llama.cpp tower's packed decoding; every cache key and cache rule is here.

    A prompt ``[prefix][state][rest]`` is decoded segment by segment on one sequence. The prefix
    is decoded once and kept; with a cache, a known ``[prefix][state]`` is restored and a known
    prompt is not decoded at all. :meth:`_plan` says which, :meth:`_run` carries a plan out with
    the tower's sequence operations: ``_begin()`` (a fresh sequence), ``_resume(kept)``,
    ``_append(seq, ids, start) -> hidden``, ``_kept_bytes(seq)`` and ``_keep(seq, size) -> kept``
    (a restorable copy), plus ``_lock``, ``closed``, ``n_ctx``, ``n_vocab`` and ``n_embd``."""

    _prefix: tuple[bytes, Snapshot] | None = None
    _lock: threading.Lock
    # What the states depend on beyond the tokens and the weights: "" for the base; a fine-tune's
    # view of the tower names its adapter and scale, so its entries are its own in a shared cache.
    cache_tag = ""
    vocab_name = "vocab"  # what the token ids index, for the error

    @property
    @abstractmethod
    def n_ctx(self) -> int: ...

    @property
    @abstractmethod
    def n_vocab(self) -> int: ...

    @property
    @abstractmethod
    def n_embd(self) -> int: ...

    @property
    @abstractmethod
    def closed(self) -> bool: ...

    @abstractmethod
    def _begin(self) -> Any: ...

    @abstractmethod
    def _resume(self, kept: Any) -> Any: ...

    @abstractmethod
    def _append(self, seq: Any, ids: np.ndarray, start: int, media: MediaPrompt | None = None) -> np.ndarray:
        """Decode ``ids`` (tokens ``start``... of the prompt) after what ``seq`` holds."""

    @abstractmethod
    def _kept_bytes(self, seq: Any) -> int: ...

    @abstractmethod
    def _keep(self, seq: Any, size: int) -> Any: ...

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        import numpy as np

        from clef_gguf.core.errors import InferenceError

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
                cache: StateCache | None = None, media: MediaPrompt | None = None) -> tuple[np.ndarray, int]:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]``, the
        segments given as token counts. ``media``: the prompt's images and videos (in its state);
        their digest joins the cache keys (pad tokens look alike whatever the picture)."""
        import numpy as np

        cache = usable(cache)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        tag = self.cache_tag + (f"#{media.digest}" if media is not None else "")
        if (hit := self._cached_prompt(ids, cache, tag)) is not None:
            return hit
        with self._lock:
            ids = self._checked(ids)
            hidden, cached = self._run(self._plan(ids, prefix, state, cache, media), cache)
        self._remember(ids, hidden, cache, tag)
        return hidden, cached

    def _forward_held(self, ids: np.ndarray, prefix: int, state: int,
                      cache: StateCache | None) -> tuple[np.ndarray, int] | ClefError:
        """``forward`` of checked ids under the lock already held, its error returned, not raised."""
        from clef_gguf.core.errors import ClefError

        if (hit := self._cached_prompt(ids, cache)) is not None:
            return hit
        try:
            hidden, cached = self._run(self._plan(ids, prefix, state, cache), cache)
        except ClefError as exc:
            return exc
        self._remember(ids, hidden, cache)
        return hidden, cached

    def _forward_each(self, prompts: list[tuple[np.ndarray, int, int]], cache: StateCache | None
                      ) -> list[tuple[np.ndarray, int] | ClefError]:
        """``forward`` for each prompt in turn, under one hold of the lock; errors in place."""
        from clef_gguf.core.errors import ClefError

        cache = usable(cache)
        results: list[tuple[np.ndarray, int] | ClefError] = []
        with self._lock:
            for ids, prefix, state in prompts:
                try:
                    checked = self._checked(ids)
                except ClefError as exc:
                    results.append(exc)
                    continue
                results.append(self._forward_held(checked, prefix, state, cache))
        return results

    # ------------------------------------------------------------ the cache's keys and rules
    def _cached_prompt(self, ids: np.ndarray, cache: StateCache | None,
                       tag: str | None = None) -> tuple[np.ndarray, int] | None:
        """The hidden states of a prompt seen before, and its token count (all of it cached)."""
        tag = self.cache_tag if tag is None else tag
        if cache is None or (hit := cache.get(cache.key("prompt", ids, tag))) is None:
            return None
        return hit.hidden.copy(), hit.n_tokens

    def _remember(self, ids: np.ndarray, hidden: np.ndarray, cache: StateCache | None,
                  tag: str | None = None) -> None:
        """Keep a decoded prompt's hidden states, for the next time it comes."""
        tag = self.cache_tag if tag is None else tag
        if cache is not None:
            cache.put(cache.key("prompt", ids, tag), Snapshot(len(ids), None, hidden.copy()))

    def _knows_prefix(self, ids: np.ndarray, prefix: int) -> bool:
        """Whether the kept prefix is this prompt's."""
        return self._prefix is not None and self._prefix[0] == ids[:prefix].tobytes()

    def _joins(self, ids: np.ndarray, prefix: int, state: int, cache: StateCache | None,
               claimed: set[bytes]) -> bool:
        """Whether a prompt may be decoded beside prompts that ``claimed`` these keys: not where one
        of them decodes the same prompt, or the same ``[prefix][state]`` not cached yet (it then
        waits, to be restored from the cache after them, as one by one). Joining claims its keys."""
        if cache is None:
            return True
        prompt_key = cache.key("prompt", ids, self.cache_tag)
        state_key = cache.key("state", ids[:prefix + state], self.cache_tag) if state else None
        if prompt_key in claimed or (state_key is not None and state_key in claimed
                                     and state_key not in cache):
            return False
        claimed.update(k for k in (prompt_key, state_key) if k is not None)
        return True

    def _plan(self, ids: np.ndarray, prefix: int, state: int, cache: StateCache | None,
              media: MediaPrompt | None = None) -> Plan:
        """Restore a cached ``[prefix][state]`` (then decode the rest), else the kept prefix (then
        decode the state, to be cached, and the rest), else decode all three segments. Media lie in
        the state: the prefix is the same with or without them."""
        head, n = prefix + state, len(ids)
        rest = [(head, n)] if head < n else []
        tag = self.cache_tag + (f"#{media.digest}" if media is not None else "")
        state_key = cache.key("state", ids[:head], tag) if cache is not None and state else None
        known = cache.get(state_key) if cache is not None and state_key else None
        if known is not None:
            return Plan(ids, prefix, head, known, head, rest, None, media)
        segments = [(prefix, head)] if state else []
        if self._prefix is not None and self._prefix[0] == ids[:prefix].tobytes():
            return Plan(ids, prefix, head, self._prefix[1], prefix, segments + rest, state_key, media)
        return Plan(ids, prefix, head, None, 0, [(0, prefix), *segments, *rest], state_key, media)

    def _keepable(self, cache: StateCache, state_bytes: int, n_tokens: int) -> bool:
        """Whether a ``[prefix][state]`` snapshot of this size fits the cache at all."""
        return state_bytes + n_tokens * self.n_embd * 4 <= cache.max_bytes

    @staticmethod
    def _keep_state(cache: StateCache, key: bytes | None, n_tokens: int, kept: Any, hidden: np.ndarray) -> None:
        """Keep the ``[prefix][state]`` snapshot a plan's ``state_key`` names."""
        if key is not None:
            cache.put(key, Snapshot(n_tokens, kept, hidden))

    def _run(self, plan: Plan, cache: StateCache | None) -> tuple[np.ndarray, int]:
        """Carry ``plan`` out on one sequence: ``(hidden [T, n_embd], cached_tokens)``."""
        import numpy as np

        ids = plan.ids
        seq = self._begin() if plan.start is None else self._resume(plan.start.seq_state)
        parts: list[np.ndarray] = [] if plan.start is None else [plan.start.hidden]
        for i, (begin, end) in enumerate(plan.segments):
            parts.append(self._append(seq, ids[begin:end], begin, plan.media))
            if i == 0 and plan.keeps_prefix:
                self._prefix = (ids[:end].tobytes(),
                                Snapshot(end, self._keep(seq, self._kept_bytes(seq)), parts[0]))
            if end == plan.head and plan.state_key is not None and cache is not None \
                    and begin == plan.prefix:
                size = self._kept_bytes(seq)
                if self._keepable(cache, size, plan.head):
                    self._keep_state(cache, plan.state_key, plan.head, self._keep(seq, size),
                                     np.concatenate(parts))
        return np.concatenate(parts), plan.cached
