"""Several prompts per ``llama_decode``: the packed waves of :meth:`clef_gguf.tower.llama_tower.Tower.forward_many`.

Where the policy (``packing.PACKING``) says it pays, up to ``pack`` prompts are sequences of one packed
context and share each decode; each is decoded on its one-by-one chunks, so the hidden states are the
ones ``forward`` gives, bit for bit. The state layouts of the packed context are ``clef_gguf.tower.packing``'s.
A collaborator of the tower, not a part of it: a :class:`PackedDecoder` is given the tower view's model,
single context, shared :class:`_Pool`, adapter and schedule, and runs under the tower's lock.
"""

from __future__ import annotations

import collections
import logging
from dataclasses import dataclass, field
from typing import TypeAlias

import numpy as np

from clef_gguf.core.errors import ClefError, InferenceError
from clef_gguf.tower.llama import LlamaAdapter, LlamaBatch, LlamaContext, LlamaModel, PositionedBatch
from clef_gguf.tower.packing import (PACK_MEMORY_SHARE, SEQ_HEADER, FreeMemory, Slot, chunks, host_free_memory,
                                     next_group, to_one_stream, to_streams)
from clef_gguf.tower.cache import StateCache
from clef_gguf.tower.protocol import Forwarded
from clef_gguf.tower.schedule import Plan, Schedule

log = logging.getLogger("clef_gguf.tower.llama")

# A prompt of forward_many with its place in the input: (index, checked ids, prefix, state).
Item: TypeAlias = tuple[int, np.ndarray, int, int]
Result: TypeAlias = Forwarded | ClefError | None  # None: not run yet


@dataclass
class _Pool:
    """What every view of one loaded tower shares besides the model, its context and its lock:
    the packed context, its cost probes, and the fine-tunes' adapters (freed with the model)."""

    # forward_many's context of several sequences, made on first use (see PackedDecoder.context)
    packed: tuple[LlamaContext, LlamaBatch, int] | None = None  # context, its batch, KV window
    costs: tuple[int, int] | None = None  # (recurrent state, KV per token) bytes
    refused: int | None = None  # the smallest KV window the memory budget refused
    budget: int | None = None  # bytes a packed context may take, probed on first need
    adapters: list[LlamaAdapter] = field(default_factory=list)
    positioned: PositionedBatch | None = None  # media prompts' batch (ContextSequence.positioned)
    free_memory: FreeMemory = host_free_memory  # what the packed context's budget is a share of
    pack: int | None = None  # prompts per packed decode asked at load (None: the device's PACKING rule)


class PackedDecoder:
    """One tower view's packed waves, and the packed context (in the shared pool) they decode in.
    Every method runs under the tower's lock, which ``Tower.forward_many`` holds."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext, pool: _Pool, schedule: Schedule[None, np.ndarray],
                 adapter: LlamaAdapter | None) -> None:
        self._model, self._ctx, self._pool = model, ctx, pool  # ctx: the single context
        self._schedule, self._adapter = schedule, adapter
        self.stats: collections.Counter[int] = collections.Counter()  # sequences per packed decode
        # This view's prefix in the packed layout, keyed by (prefix ids, stream count).
        self._packed_prefix: tuple[bytes, np.ndarray] | None = None

    def budget(self, offloaded: bool) -> int:
        """Bytes a packed context may take: ``PACK_MEMORY_SHARE`` of what the device policy leaves
        free (host RAM, or the GPU's memory when the tower is ``offloaded``), probed once."""
        if self._pool.budget is None:
            self._pool.budget = int(self._pool.free_memory(offloaded) * PACK_MEMORY_SHARE)
        return self._pool.budget

    def context(self, seqs: int, window: int, budget: int, ubatch: int) -> LlamaContext | None:
        """The context of up to ``seqs`` sequences of ``window`` tokens each, or None where memory
        does not allow two. Its recurrent state (one slot per sequence, ~50 MiB each for the 9B), its KV
        streams and its compute buffer must fit ``budget``. Kept until a call needs more. ``ubatch``:
        the policy's tokens per packed decode (at least the single context's chunk)."""
        window = -(-max(window, 1) // 256) * 256  # llama.cpp rounds each stream to 256 cells
        ubatch = max(ubatch, self._ctx.n_batch)
        if self._pool.refused is not None and window >= self._pool.refused:
            return None  # asked and refused before
        if self._pool.packed is not None:
            ctx, _, held = self._pool.packed
            if ctx.seqs >= seqs and held >= window:
                return ctx
            seqs, window = max(seqs, ctx.seqs), max(window, held)
            self.close()
        recurrent, kv = self._state_costs()
        seqs = min(seqs, budget // (recurrent + window * kv))
        if seqs < 2:
            log.info("no packed decoding: 2 sequences of %d tokens do not fit %d MiB", window, budget >> 20)
            self._pool.refused = window
            return None
        ctx = LlamaContext(self._model, seqs * window, ubatch, self._ctx.threads, seqs, self._ctx.attention)
        if ctx.compute_bytes + seqs * (recurrent + window * kv) > budget:
            ctx.close()
            log.info("no packed decoding: its compute buffer (%d MiB) does not fit %d MiB",
                     ctx.compute_bytes >> 20, budget >> 20)
            self._pool.refused = window
            return None
        self._pool.packed, self._packed_prefix = (ctx, LlamaBatch(ubatch), window), None
        return ctx

    def decode(self, ctx: LlamaContext, seqs: int, items: list[Item], cache: StateCache | None,
               results: list[Result]) -> None:
        """Waves of up to ``seqs`` prompts. With a cache, a prompt whose whole prompt, or whose state
        not cached yet, another prompt of the wave decodes waits for the next wave and is restored
        from the cache there, as one by one; so does one with another prefix than the snapshot's (it
        then runs alone and replaces the snapshot)."""
        pending = items
        while pending:
            wave: list[Item] = []
            later: list[Item] = []
            claimed: set[bytes] = set()
            for item in pending:
                i, ids, prefix, state = item
                if len(wave) == seqs:
                    later.append(item)
                    continue
                if (hit := self._schedule.cached_prompt(ids, cache)) is not None:
                    results[i] = hit
                    continue
                if not self._schedule.joins(ids, prefix, state, cache, claimed):
                    later.append(item)
                    continue
                if not self._schedule.knows_prefix(ids, prefix):
                    if wave:
                        later.append(item)
                    else:
                        results[i] = self._schedule.forward_held(ids, prefix, state, cache)
                    continue
                wave.append(item)
            if wave:
                self._wave(ctx, wave, cache, results)
            pending = later

    def close(self) -> None:
        """Free the packed context (shared by the views; the next packed call makes it again)."""
        if self._pool.packed is not None:
            ctx, batch, _ = self._pool.packed
            batch.close()
            ctx.close()
            self._pool.packed = self._packed_prefix = None

    def _wave(self, ctx: LlamaContext, wave: list[Item], cache: StateCache | None,
              results: list[Result]) -> None:
        try:
            self._wave_decode(ctx, wave, cache, results)
        except ClefError as exc:  # a failed decode or restore: each prompt again on its own
            log.warning("packed decode failed (%s); decoding its %d prompts one at a time", exc, len(wave))
            ctx.clear()
            for i, ids, prefix, state in wave:
                if results[i] is None:
                    results[i] = self._schedule.forward_held(ids, prefix, state, cache)

    def _slot(self, i: int, plan: Plan[np.ndarray], n_stream: int) -> Slot:
        """A wave's prompt: its plan's restored state in the packed layout, and its chunks."""
        assert plan.start is not None and plan.start.seq_state is not None  # a known prefix or state
        kept = self._schedule.prefix
        if kept is not None and plan.start is kept[1]:
            # Keyed by the stream count too: another view may have remade the packed context.
            key = kept[0] + n_stream.to_bytes(4, "little")
            if self._packed_prefix is None or self._packed_prefix[0] != key:
                self._packed_prefix = (key, to_streams(plan.start.seq_state, n_stream))
            source = self._packed_prefix[1]
        else:
            source = to_streams(plan.start.seq_state, n_stream)
        step = self._ctx.n_batch
        return Slot(i, plan.ids, source, [plan.start.hidden], plan.cached,
                    [c for begin, end in plan.segments for c in chunks(begin, end, step)],
                    plan.head if plan.state_key else 0, plan.state_key)

    def _wave_decode(self, ctx: LlamaContext, wave: list[Item],
                     cache: StateCache | None, results: list[Result]) -> None:
        assert self._pool.packed is not None
        _, batch, _ = self._pool.packed
        plans = [(i, self._schedule.plan(ids, prefix, state, cache)) for i, ids, prefix, state in wave]
        slots = [self._slot(i, plan, ctx.seqs) for i, plan in plans]
        # Equal chunk lists next to each other: equal chunks are on consecutive sequence ids.
        slots.sort(key=lambda s: [e - b for b, e in reversed(s.chunks)])
        ctx.clear()
        ctx.use(self._adapter)
        for seq, slot in enumerate(slots):
            slot.seq = seq
            if not ctx.restore(slot.source, seq):
                raise InferenceError(f"llama.cpp could not restore a state into sequence {seq}")
        while group := next_group(slots, ctx.n_batch):
            n = batch.fill(group)
            ctx.decode(batch.batch)
            self.stats[len(group)] += 1
            rows, at = ctx.rows(n, self._model.n_embd), 0
            for slot in group:
                start, end = slot.chunks.pop(0)
                slot.parts.append(rows[at:at + end - start])
                at += end - start
                if end == slot.save_at and cache is not None:
                    self._save_packed(ctx, slot, cache)
        for slot in slots:
            hidden = np.concatenate(slot.parts)
            results[slot.index] = (hidden, slot.cached)
            self._schedule.remember(slot.ids, hidden, cache)

    def _save_packed(self, ctx: LlamaContext, slot: Slot, cache: StateCache) -> None:
        """The state cache entry ``forward`` would have made after ``[prefix][state]``."""
        size = ctx.state_size(slot.seq)
        if not self._schedule.keepable(cache, size - 4 * (ctx.seqs - 1), slot.save_at):
            return
        buf = ctx.save(slot.seq, size)
        recurrent = ctx.state_size(slot.seq, partial=True) - SEQ_HEADER
        self._schedule.keep_state(cache, slot.state_key, slot.save_at,
                                  to_one_stream(buf, ctx.seqs, slot.seq, recurrent), np.concatenate(slot.parts))

    def _state_costs(self) -> tuple[int, int]:
        """(recurrent state of one sequence, KV of one token) in bytes, from llama.cpp's own state
        sizes for a one-token sequence in the single context (cleared again: it is only ever used
        after a clear or a restore)."""
        if self._pool.costs is None:
            self._ctx.clear()
            try:
                self._ctx.decode_tokens(np.zeros(1, dtype=np.int32))
                full = self._ctx.state_size(0)
                recurrent = self._ctx.state_size(0, partial=True) - SEQ_HEADER
            finally:
                self._ctx.clear()
            self._pool.costs = (recurrent, max(1, full - recurrent - SEQ_HEADER - 8))
        return self._pool.costs
