"""Several prompts per ``llama_decode``: the packed half of :class:`clef_gguf.tower.llama_tower.Tower`.

Where the policy (``packing.PACKING``) says it pays, up to ``pack`` prompts are sequences of one packed
context and share each decode; each is decoded on its one-by-one chunks, so the hidden states are the
ones ``forward`` gives, bit for bit. The state layouts of the packed context are ``clef_gguf.tower.packing``'s.
A mixin of the tower: it uses the tower's model, contexts, lock and shared ``_Pool``.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field
from typing import TypeAlias, cast

import numpy as np

from clef_gguf.core.errors import ClefError, InferenceError
from clef_gguf.tower.llama import _Adapter, _Batch, _Context, _Model, _Positioned
from clef_gguf.tower.packing import (PACK_MEMORY_SHARE, PACKING, SEQ_HEADER, FreeMemory, PackRule, Slot, chunks,
                                     host_free_memory, next_group, to_one_stream, to_streams)
from clef_gguf.tower.cache import Plan, SegmentedForward, StateCache, usable
from clef_gguf.tower.protocol import Forwarded, Prompt, check_pack

log = logging.getLogger("clef_gguf.tower.llama")

# A prompt of forward_many with its place in the input: (index, checked ids, prefix, state).
_Item: TypeAlias = tuple[int, np.ndarray, int, int]
_Result: TypeAlias = Forwarded | ClefError | None

@dataclass
class _Pool:
    """What every view of one loaded tower shares besides the model, its context and its lock:
    the packed context, its cost probes, and the fine-tunes' adapters (freed with the model)."""

    # forward_many's context of several sequences, made on first use (see Tower._packed_context)
    packed: tuple[_Context, _Batch, int] | None = None  # context, its batch, KV window
    costs: tuple[int, int] | None = None  # (recurrent state, KV per token) bytes
    refused: int | None = None  # the smallest KV window the memory budget refused
    budget: int | None = None  # bytes a packed context may take, probed on first need
    adapters: list[_Adapter] = field(default_factory=list)
    positioned: _Positioned | None = None  # media prompts' batch (Tower._positioned)
    free_memory: FreeMemory = host_free_memory  # what the packed context's budget is a share of


class PackedDecoding(SegmentedForward):
    """``forward_many`` and the packed context it decodes in (see the module docstring)."""

    _model: _Model
    _ctx: _Context
    _lock: threading.Lock
    _pool: _Pool
    _adapter: _Adapter | None
    _packed_prefix: tuple[bytes, np.ndarray] | None
    pack_stats: collections.Counter[int]

    @property
    def threads(self) -> int:
        return self._ctx.threads

    @property
    def gpu_layers(self) -> int:
        """Layers offloaded (-1: all); 0 on a CPU-only build whatever was asked."""
        return self._model.gpu_layers

    @property
    def uses_nextn(self) -> bool:
        return self._ctx.nextn

    # ------------------------------------------------------------ several prompts per decode
    @property
    def pack_rule(self) -> PackRule:
        return PACKING["gpu" if self.gpu_layers else "cpu"]

    def pack_size(self, n_tokens: int) -> int:
        """How many prompts of ``n_tokens`` the policy decodes together here (1: one at a time)."""
        rule = self.pack_rule
        return rule.pack if self.uses_nextn and n_tokens <= rule.max_tokens else 1

    def forward_many(self, prompts: list[Prompt], cache: StateCache | None = None,
                     *, pack: int | None = None) -> list[Forwarded | ClefError]:
        """``forward`` for several prompts ``(ids, prefix, state)``: one result per prompt, in order,
        ``(hidden, cached_tokens)`` or the ClefError that prompt raised (the others still run).

        Up to ``pack`` prompts (None: :data:`PACKING` decides, and packs only prompts of up to its
        ``max_tokens``) are sequences of one packed context and share each ``llama_decode``. Every
        sequence is decoded on its one-by-one chunks, so the hidden states are the ones ``forward``
        gives, bit for bit (tests/test_tower.py). ``pack=1`` is ``forward`` for each prompt."""
        check_pack(pack)
        cache = usable(cache)
        rule = self.pack_rule
        want, limit = (rule.pack, rule.max_tokens) if pack is None else (pack, self.n_ctx)
        # The memory probe runs a subprocess: before the lock, once, and only where packing may run.
        may_pack = want > 1 and self.uses_nextn and sum(len(p[0]) <= limit for p in prompts) > 1
        budget = self._pack_budget() if may_pack else 0
        results: list[_Result] = [None] * len(prompts)
        with self._lock:
            packable: list[_Item] = []
            alone: list[_Item] = []
            for i, (ids, prefix, state) in enumerate(prompts):
                try:
                    ids = self._checked(ids)
                except ClefError as exc:
                    results[i] = exc
                    continue
                fits = want > 1 and self.uses_nextn and len(ids) <= limit
                (packable if fits else alone).append((i, ids, prefix, state))
            # The policy's window is fixed, so one context serves every call; an explicit pack
            # sizes it to this call's longest prompt.
            window = min(limit, self.n_ctx) if pack is None else max((len(i[1]) for i in packable), default=0)
            try:
                ctx = self._packed_context(want, window, budget) if len(packable) > 1 else None
            except ClefError as exc:  # llama.cpp made no packed context: one at a time, as before
                log.warning("no packed decoding: %s", exc)
                ctx = None
            if ctx is None:
                alone = sorted(packable + alone, key=lambda item: item[0])
            else:
                self._forward_packed(ctx, min(want, ctx.seqs), packable, cache, results)
            for i, ids, prefix, state in alone:
                results[i] = self._forward_held(ids, prefix, state, cache)
        return cast("list[Forwarded | ClefError]", results)  # every prompt has its result now

    def _forward_packed(self, ctx: _Context, seqs: int, items: list[_Item],
                        cache: StateCache | None, results: list[_Result]) -> None:
        """Waves of up to ``seqs`` prompts. With a cache, a prompt whose whole prompt, or whose state
        not cached yet, another prompt of the wave decodes waits for the next wave and is restored
        from the cache there, as one by one; so does one with another prefix than the snapshot's (it
        then runs alone and replaces the snapshot)."""
        pending = items
        while pending:
            wave: list[_Item] = []
            later: list[_Item] = []
            claimed: set[bytes] = set()
            for item in pending:
                i, ids, prefix, state = item
                if len(wave) == seqs:
                    later.append(item)
                    continue
                if (hit := self._cached_prompt(ids, cache)) is not None:
                    results[i] = hit
                    continue
                if not self._joins(ids, prefix, state, cache, claimed):
                    later.append(item)
                    continue
                if not self._knows_prefix(ids, prefix):
                    if wave:
                        later.append(item)
                    else:
                        results[i] = self._forward_held(ids, prefix, state, cache)
                    continue
                wave.append(item)
            if wave:
                self._wave(ctx, wave, cache, results)
            pending = later

    def _wave(self, ctx: _Context, wave: list[_Item], cache: StateCache | None,
              results: list[_Result]) -> None:
        try:
            self._wave_decode(ctx, wave, cache, results)
        except ClefError as exc:  # a failed decode or restore: each prompt again on its own
            log.warning("packed decode failed (%s); decoding its %d prompts one at a time", exc, len(wave))
            ctx.clear()
            for i, ids, prefix, state in wave:
                if results[i] is None:
                    results[i] = self._forward_held(ids, prefix, state, cache)

    def _slot(self, i: int, plan: Plan, n_stream: int) -> Slot:
        """A wave's prompt: its plan's restored state in the packed layout, and its chunks."""
        assert plan.start is not None and plan.start.seq_state is not None  # a known prefix or state
        if self._prefix is not None and plan.start is self._prefix[1]:
            # Keyed by the stream count too: another view may have remade the packed context.
            key = self._prefix[0] + n_stream.to_bytes(4, "little")
            if self._packed_prefix is None or self._packed_prefix[0] != key:
                self._packed_prefix = (key, to_streams(plan.start.seq_state, n_stream))
            source = self._packed_prefix[1]
        else:
            source = to_streams(plan.start.seq_state, n_stream)
        step = self._ctx.n_batch
        return Slot(i, plan.ids, source, [plan.start.hidden], plan.cached,
                    [c for begin, end in plan.segments for c in chunks(begin, end, step)],
                    plan.head if plan.state_key else 0, plan.state_key)

    def _wave_decode(self, ctx: _Context, wave: list[_Item],
                     cache: StateCache | None, results: list[_Result]) -> None:
        assert self._pool.packed is not None
        _, batch, _ = self._pool.packed
        plans = [(i, self._plan(ids, prefix, state, cache)) for i, ids, prefix, state in wave]
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
            self.pack_stats[len(group)] += 1
            rows, at = ctx.rows(n, self.n_embd), 0
            for slot in group:
                start, end = slot.chunks.pop(0)
                slot.parts.append(rows[at:at + end - start])
                at += end - start
                if end == slot.save_at and cache is not None:
                    self._save_packed(ctx, slot, cache)
        for slot in slots:
            hidden = np.concatenate(slot.parts)
            results[slot.index] = (hidden, slot.cached)
            self._remember(slot.ids, hidden, cache)

    def _save_packed(self, ctx: _Context, slot: Slot, cache: StateCache) -> None:
        """The state cache entry ``forward`` would have made after ``[prefix][state]``."""
        size = ctx.state_size(slot.seq)
        if not self._keepable(cache, size - 4 * (ctx.seqs - 1), slot.save_at):
            return
        buf = ctx.save(slot.seq, size)
        recurrent = ctx.state_size(slot.seq, partial=True) - SEQ_HEADER
        self._keep_state(cache, slot.state_key, slot.save_at, to_one_stream(buf, ctx.seqs, slot.seq, recurrent),
                         np.concatenate(slot.parts))

    def _pack_budget(self) -> int:
        """Bytes a packed context may take: ``PACK_MEMORY_SHARE`` of what the device policy leaves
        free (host RAM, or the GPU's memory when the tower is offloaded), probed once."""
        if self._pool.budget is None:
            self._pool.budget = int(self._free_memory() * PACK_MEMORY_SHARE)
        return self._pool.budget

    def _free_memory(self) -> int:
        return self._pool.free_memory(bool(self.gpu_layers))

    def _packed_context(self, seqs: int, window: int, budget: int) -> _Context | None:
        """The context of up to ``seqs`` sequences of ``window`` tokens each, or None where memory
        does not allow two. Its recurrent state (one slot per sequence, ~50 MiB each for the 9B), its KV
        streams and its compute buffer must fit ``budget``. Kept until a call needs more."""
        window = -(-max(window, 1) // 256) * 256  # llama.cpp rounds each stream to 256 cells
        ubatch = max(self.pack_rule.ubatch, self._ctx.n_batch)
        if self._pool.refused is not None and window >= self._pool.refused:
            return None  # asked and refused before
        if self._pool.packed is not None:
            ctx, _, held = self._pool.packed
            if ctx.seqs >= seqs and held >= window:
                return ctx
            seqs, window = max(seqs, ctx.seqs), max(window, held)
            self._close_packed()
        recurrent, kv = self._state_costs()
        seqs = min(seqs, budget // (recurrent + window * kv))
        if seqs < 2:
            log.info("no packed decoding: 2 sequences of %d tokens do not fit %d MiB", window, budget >> 20)
            self._pool.refused = window
            return None
        ctx = _Context(self._model, seqs * window, ubatch, self.threads, seqs, self._ctx.attention)
        if ctx.compute_bytes + seqs * (recurrent + window * kv) > budget:
            ctx.close()
            log.info("no packed decoding: its compute buffer (%d MiB) does not fit %d MiB",
                     ctx.compute_bytes >> 20, budget >> 20)
            self._pool.refused = window
            return None
        self._pool.packed, self._packed_prefix = (ctx, _Batch(ubatch), window), None
        return ctx

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

    def _close_packed(self) -> None:
        if self._pool.packed is not None:
            ctx, batch, _ = self._pool.packed
            batch.close()
            ctx.close()
            self._pool.packed = self._packed_prefix = None
