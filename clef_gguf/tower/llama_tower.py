"""The language tower in llama.cpp: final hidden states (after the last RMSNorm) of every token.

:class:`Tower` is composed, not inherited: its :class:`ContextSequence` decodes on the single
context (the :class:`~clef_gguf.tower.schedule.Sequences` of this backend, media runs as embeddings),
its :class:`~clef_gguf.tower.schedule.Schedule` says what is restored and what decoded, and its
:class:`~clef_gguf.tower.llama_packed.PackedDecoder` decodes several prompts per ``llama_decode`` in a
packed context. The llama.cpp objects are the thin wrappers of ``clef_gguf.tower.llama``.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from pathlib import Path
from types import TracebackType
from typing import cast

import numpy as np

from clef_gguf.core.cpus import available_cpus, check_threads
from clef_gguf.core.limits import CONTEXT_WINDOW, DECODE_CHUNK
from clef_gguf.core.errors import ClefError, InferenceError, InvalidSetting, ModelNotFound
from clef_gguf.tower.llama import (ATTENTION, LlamaAdapter, LlamaContext, LlamaModel, PositionedBatch,
                                   extra_buffer_types, gpu_offload)
from clef_gguf.tower.packing import PACKING, FreeMemory, PackRule, chunks, host_free_memory
from clef_gguf.tower.cache import StateCache, usable
from clef_gguf.pipeline.mediaprompt import MediaPrompt
from clef_gguf.tower.llama_packed import Item, PackedDecoder, Result, _Pool
from clef_gguf.tower.protocol import Forwarded, Prompt, check_pack
from clef_gguf.tower.schedule import Schedule

__all__ = ["PACKING", "PackRule", "Tower", "extra_buffer_types", "gpu_offload"]

log = logging.getLogger("clef_gguf.tower.llama")


class ContextSequence:
    """The llama.cpp backend's :class:`~clef_gguf.tower.schedule.Sequences`: one sequence, held by the
    single context itself (so a sequence is None), kept as llama.cpp's serialized sequence state, and
    decoded through one tower view's adapter."""

    vocab_name = "GGUF vocab"

    def __init__(self, model: LlamaModel, ctx: LlamaContext, pool: _Pool, adapter: LlamaAdapter | None) -> None:
        self._model, self._ctx, self._pool, self._adapter = model, ctx, pool, adapter

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def n_embd(self) -> int:
        return self._model.n_embd

    @property
    def closed(self) -> bool:
        return self._ctx.ptr is None

    def begin(self) -> None:
        self._ctx.clear()

    def resume(self, kept: np.ndarray) -> None:
        self._ctx.clear()
        if not self._ctx.restore(kept, 0):
            self._ctx.clear()
            raise InferenceError("llama.cpp could not restore a saved sequence state")

    def append(self, seq: None, ids: np.ndarray, start: int, media: MediaPrompt | None = None) -> np.ndarray:
        """Append ``ids`` (prompt tokens ``start``...) to the sequence, in chunks of ``n_batch`` from
        the segment's own start: the fixed schedule that makes a restored segment bit-identical to a
        decoded one. Chunks also keep every call under llama.cpp's per-call n_batch assert (an
        abort, not an error). With ``media``, a chunk is further cut where its media runs begin and
        end (one llama_batch is all tokens or all embeddings) and every piece carries its M-RoPE
        positions."""
        at, n_embd = start, self.n_embd  # chunks are of ids; media and positions are of the prompt
        out: np.ndarray = np.empty((len(ids), n_embd), dtype=np.float32)
        self._ctx.use(self._adapter)
        for first, end in chunks(0, len(ids), self._ctx.n_batch):
            try:
                if media is None and not self._ctx.nextn:  # embeddings mode: every token an output
                    self._ctx.decode_tokens(np.ascontiguousarray(ids[first:end]))
                    out[first:end] = self._ctx.rows(end - first, n_embd)
                    continue
                if media is None:
                    # Every position given and no token flagged an output: llama.cpp's batch_get_one
                    # makes a chunk's last token one, which runs the 248,320-row lm_head per chunk
                    # (~0.4 ms on an H200) for a row nothing reads.
                    pos = np.arange(at + first, at + end, dtype=np.int32)
                    self._ctx.decode(self.positioned.tokens(ids[first:end], pos))
                    out[first:end] = self._ctx.rows(end - first, n_embd)
                    continue
                for begin, stop, row in media.pieces(at + first, at + end):
                    pos = media.positions[:, begin:stop]
                    if row is None:
                        batch = self.positioned.tokens(ids[begin - at:stop - at], pos[0])
                    else:
                        batch = self.positioned.embeddings(media.embed()[row:row + stop - begin], pos)
                    self._ctx.decode(batch)
                    out[begin - at:stop - at] = self._ctx.rows(stop - begin, n_embd)
            except InferenceError:
                self._ctx.clear()
                raise
        return out

    def kept_bytes(self, seq: None) -> int:
        return self._ctx.state_size(0)

    def keep(self, seq: None, size: int) -> np.ndarray:
        return self._ctx.save(0, size)

    @property
    def positioned(self) -> PositionedBatch:
        """The batch prompts are decoded with (tokens or media embeddings, positions given, no output
        flagged), made on first use (``n_batch`` x ``n_embd`` floats; in the pool: shared by the views
        of a tower, used under their lock)."""
        if self._pool.positioned is None:
            self._pool.positioned = PositionedBatch(self._ctx.n_batch, self.n_embd)
        return self._pool.positioned


class Tower:
    """``forward`` of one prompt at a time (thread-safe); ``forward_many`` decodes several prompts per
    llama_decode where :data:`PACKING` says it pays. One view of a loaded tower: the base, or a
    fine-tune's (:meth:`adapted`)."""

    def __init__(self, model: LlamaModel, ctx: LlamaContext, path: Path, *, pool: _Pool, lock: threading.Lock,
                 adapter: LlamaAdapter | None = None, cache_tag: str = "") -> None:
        """The model, the single context, the ``pool`` and the ``lock`` are shared by every view of
        one loaded tower (:meth:`load` makes them); the view's own are its ``adapter`` (None: the
        base), its ``cache_tag``, its decoded prefix (its schedule's) and its pack stats (its
        packer's)."""
        self._model, self._ctx, self.path = model, ctx, path
        self._lock, self._pool, self._adapter = lock, pool, adapter
        self._seq = ContextSequence(model, ctx, pool, adapter)
        self._schedule: Schedule[None, np.ndarray] = Schedule(self._seq, lock, cache_tag)
        self._packer = PackedDecoder(model, ctx, pool, self._schedule, adapter)

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int = CONTEXT_WINDOW, threads: int | None = None,
             n_batch: int = DECODE_CHUNK, gpu_layers: int | str = 0, attention: str | None = None,
             pack: int | None = None, free_memory: FreeMemory = host_free_memory) -> Tower:
        """``attention``: a name of ``llama.ATTENTION`` for both contexts; None: the one
        ``LlamaModel.attention`` gives the weights (exact on f32 towers on the CPU, else the default).
        ``n_batch``: tokens per llama_decode. ``pack``: prompts per packed decode (None: :data:`PACKING`'s
        for the device; 1: one at a time). ``free_memory``: the device policy's free bytes, the budget
        of packed decoding (the loader passes it: the tower knows nothing of devices)."""
        path = Path(path)
        if attention is not None and attention not in ATTENTION:
            raise InvalidSetting(f"attention must be one of {sorted(ATTENTION)} (got {attention!r})",
                                 field="attention")
        check_threads(threads)
        for name, value in (("n_batch", n_batch), ("pack", pack)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise InvalidSetting(f"{name} must be a whole number of at least 1 (got {value!r})", field=name)
        if not isinstance(gpu_layers, int) or isinstance(gpu_layers, bool) or gpu_layers < -1:
            raise InvalidSetting(f"gpu_layers must be -1 (all), 0 or a layer count (got "
                                 f"{gpu_layers!r})", field="gpu_layers")
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}", field="tower")
        model = LlamaModel(path, gpu_layers)
        try:
            setting = ATTENTION[attention] if attention is not None else model.attention()
            ctx = LlamaContext(model, n_ctx, min(n_batch, n_ctx), threads or available_cpus(), attention=setting)
        except BaseException:
            model.close()
            raise
        return cls(model, ctx, path, pool=_Pool(free_memory=free_memory, pack=pack), lock=threading.Lock())

    # The sizes and state the schedule checks prompts against: its sequence's, defined there once.
    @property
    def n_embd(self) -> int:
        return self._seq.n_embd

    @property
    def n_vocab(self) -> int:
        return self._seq.n_vocab

    @property
    def n_layer(self) -> int:
        return self._model.n_layer

    @property
    def n_ctx(self) -> int:
        return self._seq.n_ctx

    @property
    def n_batch(self) -> int:
        """Tokens per chunk of a segment (and per ubatch) in the single context."""
        return self._ctx.n_batch

    @property
    def closed(self) -> bool:
        return self._seq.closed

    @property
    def attention(self) -> str:
        """The attention setting of both contexts (a name of ``llama.ATTENTION``)."""
        return self._ctx.attention.name

    def details(self) -> dict[str, str]:
        return {"attention": self.attention}

    @property
    def threads(self) -> int:
        return self._ctx.threads

    @property
    def gpu_layers(self) -> int:
        """Layers offloaded (-1: all); 0 on a CPU-only build whatever was asked."""
        return self._model.gpu_layers

    @property
    def cuda_device(self) -> int | None:
        """llama.cpp's main GPU (device 0: the runtime sets no other) when layers are offloaded."""
        return 0 if self._model.gpu_layers else None

    @property
    def uses_nextn(self) -> bool:
        return self._ctx.nextn

    @property
    def cache_tag(self) -> str:
        """What this view's states depend on beyond the tokens and the weights ("": the base)."""
        return self._schedule.tag

    @property
    def pack_stats(self) -> collections.Counter[int]:
        """Sequences per packed decode, counted since this view was made (``clear()`` to restart)."""
        return self._packer.stats

    @property
    def pack_rule(self) -> PackRule:
        """:data:`PACKING`'s rule for the device, with the pack size the tower was loaded with."""
        rule = PACKING["gpu" if self.gpu_layers else "cpu"]
        return rule if self._pool.pack is None else dataclasses.replace(rule, pack=self._pool.pack)

    def pack_size(self, n_tokens: int) -> int:
        """How many prompts of ``n_tokens`` the policy decodes together here (1: one at a time)."""
        rule = self.pack_rule
        return rule.pack if self.uses_nextn and n_tokens <= rule.max_tokens else 1

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None, media: MediaPrompt | None = None) -> Forwarded:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]`` (token
        counts) on the canonical schedule; ``media``: its images and videos, decoded as embeddings."""
        return self._schedule.forward(ids, prefix, state, cache, media)

    def keep_points(self, ids: np.ndarray, prefix: int, points: list[int], cache: StateCache | None,
                    media: MediaPrompt | None = None) -> int:
        """Snapshots of ``ids[:point]`` for each point, on the canonical schedule (``Schedule.keep_points``)."""
        return self._schedule.keep_points(ids, prefix, points, cache, media)

    def forward_many(self, prompts: list[Prompt], cache: StateCache | None = None,
                     *, pack: int | None = None) -> list[Forwarded | ClefError]:
        """``forward`` for several prompts ``(ids, prefix, state)``: one result per prompt, in order,
        ``(hidden, cached_tokens)`` or the ClefError that prompt raised (the others still run).

        Up to ``pack`` prompts (None: :data:`PACKING` decides, and packs only prompts of up to its
        ``max_tokens``) are sequences of one packed context and share each ``llama_decode`` (the
        packer's waves). Every sequence is decoded on its one-by-one chunks, so the hidden states are
        the ones ``forward`` gives, bit for bit (tests/tower/test_llama_tower.py). ``pack=1`` is ``forward`` for
        each prompt."""
        check_pack(pack)
        cache = usable(cache)
        rule = self.pack_rule
        want, limit = (rule.pack, rule.max_tokens) if pack is None else (pack, self.n_ctx)
        # The memory probe runs a subprocess: before the lock, once, and only where packing may run.
        may_pack = want > 1 and self.uses_nextn and sum(len(p[0]) <= limit for p in prompts) > 1
        budget = self._packer.budget(bool(self.gpu_layers)) if may_pack else 0
        results: list[Result] = [None] * len(prompts)
        with self._lock:
            packable: list[Item] = []
            alone: list[Item] = []
            for i, (ids, prefix, state) in enumerate(prompts):
                try:
                    ids = self._schedule.check(ids)
                except ClefError as exc:
                    results[i] = exc
                    continue
                fits = want > 1 and self.uses_nextn and len(ids) <= limit
                (packable if fits else alone).append((i, ids, prefix, state))
            # The policy's window is fixed, so one context serves every call; an explicit pack
            # sizes it to this call's longest prompt.
            window = min(limit, self.n_ctx) if pack is None else max((len(i[1]) for i in packable), default=0)
            try:
                ctx = self._packer.context(want, window, budget, rule.ubatch) if len(packable) > 1 else None
            except ClefError as exc:  # llama.cpp made no packed context: one at a time, as before
                log.warning("no packed decoding: %s", exc)
                ctx = None
            if ctx is None:
                alone = sorted(packable + alone, key=lambda item: item[0])
            else:
                self._packer.decode(ctx, min(want, ctx.seqs), packable, cache, results)
            for i, ids, prefix, state in alone:
                results[i] = self._schedule.forward_held(ids, prefix, state, cache)
        return cast("list[Forwarded | ClefError]", results)  # every prompt has its result now

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        with self._lock:
            ids = self._schedule.check(ids)
            self._seq.begin()
            return self._seq.append(None, ids, 0)

    def layer_states(self, ids: np.ndarray, prefix: int, state: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """``(final hidden [T, n_embd], [output of decoder layer 0 .. n_layer - 2]``) of one prompt
        decoded from scratch on the ``[prefix][state][rest]`` schedule of ``forward`` (no reuse), for
        the per-layer parity comparison (docs/parity.md). Staging the layers leaves the final states
        bit-identical."""
        with self._lock:
            ids = self._schedule.check(ids)
            if not self._ctx.can_tap_layers:
                raise InferenceError("per-layer states need llama.cpp's staging API (layer inputs)")
            n_layer, n_embd = self._model.n_layer, self.n_embd
            final: np.ndarray = np.empty((len(ids), n_embd), dtype=np.float32)
            inputs = [np.empty((len(ids), n_embd), dtype=np.float32) for _ in range(n_layer)]
            bounds = sorted({0, min(prefix, len(ids)), min(prefix + state, len(ids)), len(ids)})
            self._ctx.clear()
            self._ctx.use(self._adapter)
            self._ctx.tap_layers(n_layer, True)
            try:
                for begin, end in zip(bounds, bounds[1:]):
                    for start, stop in chunks(begin, end, self._ctx.n_batch):
                        self._ctx.decode_tokens(np.ascontiguousarray(ids[start:stop]))
                        final[start:stop] = self._ctx.rows(stop - start, n_embd)
                        for layer in range(n_layer):
                            inputs[layer][start:stop] = self._ctx.layer_rows(layer, stop - start, n_embd)
            finally:
                self._ctx.tap_layers(n_layer, False)
                self._ctx.clear()
            return final, inputs[1:]  # layer 0's input is the token embedding

    def adapted(self, path: str | Path, *, scale: float = 1.0, tag: str) -> Tower:
        """A view of this tower that applies the LoRA adapter GGUF at ``path`` (times ``scale``):
        the same model, contexts and lock, the adapter switched per decode. ``tag`` names the
        adapter (its hash and scale) in the cache keys, so a state decoded through one fine-tune is
        never restored for another; the view keeps its own decoded prefix. Closing the base tower
        frees every adapter; closing a view does nothing."""
        if not tag:
            raise InvalidSetting("a fine-tune's view needs a cache tag", field="adapter")
        with self._lock:
            if self.closed:
                raise InferenceError("the tower is closed")
            adapter = LlamaAdapter(self._model, Path(path), scale)
            self._pool.adapters.append(adapter)
        return type(self)(self._model, self._ctx, self.path, pool=self._pool, lock=self._lock,
                          adapter=adapter, cache_tag=tag)

    @property
    def adapter_path(self) -> Path | None:
        """The LoRA this view applies (None: the base tower)."""
        return self._adapter.path if self._adapter is not None else None

    def close(self) -> None:
        if self._adapter is not None:
            return  # a view: the base tower owns the model, the contexts and the adapters
        with self._lock:
            self._packer.close()
            self._ctx.close()
            for adapter in self._pool.adapters:
                adapter.close()  # after the contexts that applied it, before its model
            self._pool.adapters.clear()
            self._model.close()

    def __enter__(self) -> Tower:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
