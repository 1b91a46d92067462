"""The canonical decode schedule and its reuse, over whichever backend decodes.

A prompt ``[prefix][state][rest]`` is decoded segment by segment on one sequence, each segment from
its own start (the backend chunks it the same way every time), so a restored segment is bit-identical
to a decoded one. The prefix is decoded once per tower view and kept; with a cache, a known
``[prefix][state]`` is restored and a known prompt is not decoded at all.

As in mlx-lm, where ``models/cache.py`` only holds and ``generate.py`` schedules over a model and its
cache: :class:`Schedule` plans (:meth:`Schedule.plan`) and runs (:meth:`Schedule.run`) over the small
:class:`Sequences` protocol a backend implements; ``tower.cache`` only holds entries. Every cache key
and cache rule is here, for both backends and for the llama.cpp tower's packed decoding.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

from clef_gguf.tower.cache import Kept, Snapshot, StateCache, usable

if TYPE_CHECKING:  # numpy only runs inside the methods, as in tower.cache
    import numpy as np

    from clef_gguf.core.errors import ClefError
    from clef_gguf.pipeline.mediaprompt import MediaPrompt
    from clef_gguf.tower.protocol import Forwarded, Prompt

S = TypeVar("S")  # a sequence being decoded: llama.cpp's is held by its context (None), torch's is a cache
K = TypeVar("K", bound=Kept)  # what a snapshot keeps of one, to resume it


class Sequences(Protocol[S, K]):
    """What a backend gives the schedule: a sequence's operations, and the facts a prompt is checked
    against before anything is decoded."""

    @property
    def n_ctx(self) -> int: ...

    @property
    def n_vocab(self) -> int: ...

    @property
    def n_embd(self) -> int: ...

    @property
    def closed(self) -> bool: ...

    @property
    def vocab_name(self) -> str:
        """What the token ids index, for the error."""
        ...

    def begin(self) -> S:
        """A fresh, empty sequence."""
        ...

    def resume(self, kept: K) -> S:
        """A sequence holding what ``kept`` holds (a snapshot's ``seq_state``)."""
        ...

    def append(self, seq: S, ids: np.ndarray, start: int, media: MediaPrompt | None = None) -> np.ndarray:
        """Decode ``ids`` (tokens ``start``... of the prompt) after what ``seq`` holds:
        their hidden states, float32 ``[len(ids), n_embd]``."""
        ...

    def kept_bytes(self, seq: S) -> int:
        """The size of ``keep(seq, ...)``, known before it is made (the cache may refuse it)."""
        ...

    def keep(self, seq: S, size: int) -> K:
        """A restorable copy of ``seq``; ``size``: its ``kept_bytes``."""
        ...


@dataclass
class Plan(Generic[K]):
    """How one prompt ``[prefix][state][rest]`` is decoded on one sequence: what is restored first,
    which segments are decoded after it (each from its own start), and what is kept on the way."""

    ids: np.ndarray
    prefix: int
    head: int  # prefix + state tokens
    start: Snapshot[K] | None  # restored first: a cached [prefix][state] or the kept prefix; None: nothing
    cached: int  # tokens restored rather than decoded
    segments: list[tuple[int, int]]
    state_key: bytes | None  # the [prefix][state] snapshot goes there once token ``head`` is decoded
    media: MediaPrompt | None = None  # images/videos: decoded as their embeddings, at M-RoPE positions
    marks: dict[int, bytes] = field(default_factory=dict)  # more snapshots: a segment's end -> its cache key

    @property
    def keeps_prefix(self) -> bool:
        """Whether the first segment is the prefix, decoded from scratch and kept as the tower's."""
        return self.start is None


class Schedule(Generic[S, K]):
    """One tower view's schedule over its backend's ``seqs``. ``lock`` is the tower's, shared by its
    views (they decode on one context): :meth:`forward` and :meth:`forward_each` take it, the other
    methods run under it. ``tag`` names what the states depend on beyond the tokens and the weights:
    "" for the base, a fine-tune's adapter and scale for its view, so that its entries are its own in
    a shared cache."""

    def __init__(self, seqs: Sequences[S, K], lock: threading.Lock, tag: str = "") -> None:
        self.seqs, self.lock, self.tag = seqs, lock, tag
        # The system prefix (its ids' bytes, its snapshot): decoded once, kept outside the cache's budget.
        self.prefix: tuple[bytes, Snapshot[K]] | None = None

    def check(self, ids: np.ndarray) -> np.ndarray:
        """``ids`` as contiguous int32, or the InferenceError llama.cpp would otherwise abort on."""
        import numpy as np

        from clef_gguf.core.errors import InferenceError

        seqs = self.seqs
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        n = int(ids.shape[0])
        if n == 0 or n > seqs.n_ctx:
            raise InferenceError(f"a prompt of {n} tokens does not fit the context of {seqs.n_ctx}")
        bad = ids[(ids < 0) | (ids >= seqs.n_vocab)]
        if bad.size:  # llama.cpp would reject these, and some vocab calls abort the process on them
            raise InferenceError(f"token id {int(bad[0])} is outside the {seqs.vocab_name} "
                                 f"of {seqs.n_vocab}")
        if seqs.closed:
            raise InferenceError("the tower is closed")
        return ids

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None, media: MediaPrompt | None = None) -> Forwarded:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]``, the
        segments given as token counts. ``media``: the prompt's images and videos (in its state);
        their digest joins the cache keys (pad tokens look alike whatever the picture)."""
        import numpy as np

        cache = usable(cache)
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        tag = self.tag + (f"#{media.digest}" if media is not None else "")
        if (hit := self.cached_prompt(ids, cache, tag)) is not None:
            return hit
        with self.lock:
            ids = self.check(ids)
            hidden, cached = self.run(self.plan(ids, prefix, state, cache, media), cache)
        self.remember(ids, hidden, cache, tag)
        return hidden, cached

    def forward_held(self, ids: np.ndarray, prefix: int, state: int,
                     cache: StateCache | None) -> Forwarded | ClefError:
        """``forward`` of checked ids under the lock already held, its error returned, not raised."""
        from clef_gguf.core.errors import ClefError

        if (hit := self.cached_prompt(ids, cache)) is not None:
            return hit
        try:
            hidden, cached = self.run(self.plan(ids, prefix, state, cache), cache)
        except ClefError as exc:
            return exc
        self.remember(ids, hidden, cache)
        return hidden, cached

    def forward_each(self, prompts: list[Prompt], cache: StateCache | None) -> list[Forwarded | ClefError]:
        """``forward`` for each prompt in turn, under one hold of the lock; errors in place."""
        from clef_gguf.core.errors import ClefError

        cache = usable(cache)
        results: list[Forwarded | ClefError] = []
        with self.lock:
            for ids, prefix, state in prompts:
                try:
                    checked = self.check(ids)
                except ClefError as exc:
                    results.append(exc)
                    continue
                results.append(self.forward_held(checked, prefix, state, cache))
        return results

    # ------------------------------------------------------------ the cache's keys and rules
    def cached_prompt(self, ids: np.ndarray, cache: StateCache | None, tag: str | None = None) -> Forwarded | None:
        """The hidden states of a prompt seen before, and its token count (all of it cached)."""
        tag = self.tag if tag is None else tag
        if cache is None or (hit := cache.get(cache.key("prompt", ids, tag))) is None:
            return None
        return hit.hidden.copy(), hit.n_tokens

    def remember(self, ids: np.ndarray, hidden: np.ndarray, cache: StateCache | None,
                 tag: str | None = None) -> None:
        """Keep a decoded prompt's hidden states, for the next time it comes."""
        tag = self.tag if tag is None else tag
        if cache is not None:
            cache.put(cache.key("prompt", ids, tag), Snapshot(len(ids), None, hidden.copy()))

    def knows_prefix(self, ids: np.ndarray, prefix: int) -> bool:
        """Whether the kept prefix is this prompt's."""
        return self.prefix is not None and self.prefix[0] == ids[:prefix].tobytes()

    def joins(self, ids: np.ndarray, prefix: int, state: int, cache: StateCache | None,
              claimed: set[bytes]) -> bool:
        """Whether a prompt may be decoded beside prompts that ``claimed`` these keys: not where one
        of them decodes the same prompt, or the same ``[prefix][state]`` not cached yet (it then
        waits, to be restored from the cache after them, as one by one). Joining claims its keys."""
        if cache is None:
            return True
        prompt_key = cache.key("prompt", ids, self.tag)
        state_key = cache.key("state", ids[:prefix + state], self.tag) if state else None
        if prompt_key in claimed or (state_key is not None and state_key in claimed
                                     and state_key not in cache):
            return False
        claimed.update(k for k in (prompt_key, state_key) if k is not None)
        return True

    def state_cached(self, ids: np.ndarray, prefix: int, state: int, cache: StateCache | None) -> bool:
        """Whether the cache holds this prompt's ``[prefix][state]`` (its plan restores it)."""
        return cache is not None and state > 0 and cache.key("state", ids[:prefix + state], self.tag) in cache

    def plan(self, ids: np.ndarray, prefix: int, state: int, cache: StateCache | None,
             media: MediaPrompt | None = None) -> Plan[K]:
        """Restore a cached ``[prefix][state]`` (then decode the rest), else the kept prefix (then
        decode the state, to be cached, and the rest), else decode all three segments. Media lie in
        the state: the prefix is the same with or without them."""
        head, n = prefix + state, len(ids)
        rest = [(head, n)] if head < n else []
        tag = self.tag + (f"#{media.digest}" if media is not None else "")
        state_key = cache.key("state", ids[:head], tag) if cache is not None and state else None
        known = cache.get(state_key) if cache is not None and state_key else None
        if known is not None:
            return Plan(ids, prefix, head, known, head, rest, None, media)
        segments = [(prefix, head)] if state else []
        if self.prefix is not None and self.prefix[0] == ids[:prefix].tobytes():
            return Plan(ids, prefix, head, self.prefix[1], prefix, segments + rest, state_key, media)
        return Plan(ids, prefix, head, None, 0, [(0, prefix), *segments, *rest], state_key, media)

    def keep_points(self, ids: np.ndarray, prefix: int, points: list[int], cache: StateCache | None,
                    media: MediaPrompt | None = None) -> int:
        """Decode ``ids`` up to the last of ``points`` (token counts past the prefix) in segments
        ending at each, keeping a ``[prefix][state]`` snapshot at each point: a prompt that shares
        ``ids[:point]`` then restores it and decodes only what follows (``plan``). Returns the
        tokens decoded (0 where every point is cached already, or nothing can be kept)."""
        cache = usable(cache)
        points = sorted({p for p in points if prefix < p <= len(ids)})
        if cache is None or not points:
            return 0
        tag = self.tag + (f"#{media.digest}" if media is not None else "")
        with self.lock:
            ids = self.check(ids[:points[-1]])
            marks = {p: cache.key("state", ids[:p], tag) for p in points}
            if all(key in cache for key in marks.values()):
                return 0
            segments = list(zip([prefix, *points[:-1]], points))
            if self.prefix is not None and self.knows_prefix(ids, prefix):
                plan = Plan(ids, prefix, points[-1], self.prefix[1], prefix, segments, None, media, marks)
            else:
                plan = Plan(ids, prefix, points[-1], None, 0, [(0, prefix), *segments], None, media, marks)
            self.run(plan, cache)
        return points[-1] - plan.cached

    def keepable(self, cache: StateCache, state_bytes: int, n_tokens: int) -> bool:
        """Whether a ``[prefix][state]`` snapshot of this size fits the cache at all."""
        return state_bytes + n_tokens * self.seqs.n_embd * 4 <= cache.max_bytes

    @staticmethod
    def keep_state(cache: StateCache, key: bytes | None, n_tokens: int, kept: K, hidden: np.ndarray) -> None:
        """Keep the ``[prefix][state]`` snapshot a plan's ``state_key`` names."""
        if key is not None:
            cache.put(key, Snapshot(n_tokens, kept, hidden))

    def run(self, plan: Plan[K], cache: StateCache | None) -> Forwarded:
        """Carry ``plan`` out on one sequence: ``(hidden [T, n_embd], cached_tokens)``."""
        import numpy as np

        seqs, ids = self.seqs, plan.ids
        if plan.start is None:
            seq = seqs.begin()
        else:  # a plan starts from the kept prefix or a cached state, never from a prompt entry
            assert plan.start.seq_state is not None
            seq = seqs.resume(plan.start.seq_state)
        parts: list[np.ndarray] = [] if plan.start is None else [plan.start.hidden]
        for i, (begin, end) in enumerate(plan.segments):
            parts.append(seqs.append(seq, ids[begin:end], begin, plan.media))
            if i == 0 and plan.keeps_prefix:
                self.prefix = (ids[:end].tobytes(), Snapshot(end, seqs.keep(seq, seqs.kept_bytes(seq)), parts[0]))
            if end == plan.head and plan.state_key is not None and cache is not None \
                    and begin == plan.prefix:
                size = seqs.kept_bytes(seq)
                if self.keepable(cache, size, plan.head):
                    self.keep_state(cache, plan.state_key, plan.head, seqs.keep(seq, size), np.concatenate(parts))
            elif end in plan.marks and cache is not None:
                size = seqs.kept_bytes(seq)
                if self.keepable(cache, size, end):
                    self.keep_state(cache, plan.marks[end], end, seqs.keep(seq, size), np.concatenate(parts))
        return np.concatenate(parts), plan.cached
