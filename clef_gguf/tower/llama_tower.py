"""The language tower in llama.cpp: final hidden states (after the last RMSNorm) of every token.

One prompt at a time on the canonical schedule (``statecache.SegmentedForward``), its media runs
as embeddings; several per ``llama_decode`` in a packed context is ``tower_packed``'s part of the
class. The llama.cpp objects are the thin wrappers of ``clef_gguf.tower.llama``.
"""

from __future__ import annotations

import collections
import copy
import threading
from pathlib import Path
from types import TracebackType

import numpy as np

from clef_gguf.core.cpus import available_cpus, check_threads
from clef_gguf.core.limits import CONTEXT_WINDOW
from clef_gguf.core.errors import InferenceError, InvalidSetting, ModelNotFound
from clef_gguf.tower.llama import ATTENTION, _Adapter, _Context, _Model, _Positioned, extra_buffer_types, gpu_offload
from clef_gguf.tower.packing import PACKING, FreeMemory, PackRule, chunks, host_free_memory
from clef_gguf.tower.cache import Snapshot
from clef_gguf.pipeline.mediaprompt import MediaPrompt
from clef_gguf.tower.llama_packed import PackedDecoding, _Pool

__all__ = ["PACKING", "PackRule", "Tower", "extra_buffer_types", "gpu_offload"]

class Tower(PackedDecoding):
    """``hidden_states(ids) -> float32 [T, n_embd]`` for one prompt at a time (thread-safe);
    ``forward_many`` decodes several prompts per llama_decode where :data:`PACKING` says it pays."""

    vocab_name = "GGUF vocab"

    def __init__(self, model: _Model, ctx: _Context, path: Path, free_memory: FreeMemory = host_free_memory):
        self._model, self._ctx, self.path = model, ctx, path
        self._lock = threading.Lock()
        self._pool = _Pool(free_memory=free_memory)
        self._adapter: _Adapter | None = None  # the LoRA this view applies; None: the base
        self._prefix: tuple[bytes, Snapshot] | None = None  # the system prefix, decoded once
        # the prefix in the packed layout, keyed by (prefix ids, stream count)
        self._packed_prefix: tuple[bytes, np.ndarray] | None = None
        self.pack_stats: collections.Counter[int] = collections.Counter()  # sequences per packed decode

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int = CONTEXT_WINDOW, threads: int | None = None,
             n_batch: int = 512, gpu_layers: int | str = 0, attention: str | None = None,
             free_memory: FreeMemory = host_free_memory) -> Tower:
        """``attention``: a name of ``llama.ATTENTION`` for both contexts; None: the one
        ``llama.ATTENTION_BY_WEIGHTS`` gives the weights (exact on f32 towers on the CPU).
        ``free_memory``: the device policy's free bytes, the budget of packed decoding (the loader
        passes it: the tower knows nothing of devices)."""
        path = Path(path)
        if attention is not None and attention not in ATTENTION:
            raise InvalidSetting(f"attention must be one of {sorted(ATTENTION)} (got {attention!r})",
                                 field="attention")
        check_threads(threads)
        if not isinstance(gpu_layers, int) or isinstance(gpu_layers, bool) or gpu_layers < -1:
            raise InvalidSetting(f"gpu_layers must be -1 (all), 0 or a layer count (got "
                                 f"{gpu_layers!r})", field="gpu_layers")
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}", field="tower")
        model = _Model(path, gpu_layers)
        try:
            setting = ATTENTION[attention] if attention is not None else model.attention()
            ctx = _Context(model, n_ctx, min(n_batch, n_ctx), threads or available_cpus(), attention=setting)
        except BaseException:
            model.close()
            raise
        return cls(model, ctx, path, free_memory)

    @property
    def n_embd(self) -> int:
        return self._model.n_embd

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def n_layer(self) -> int:
        return self._model.n_layer

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def n_batch(self) -> int:
        """Tokens per chunk of a segment (and per ubatch) in the single context."""
        return self._ctx.n_batch

    @property
    def closed(self) -> bool:
        return self._ctx.ptr is None

    @property
    def attention(self) -> str:
        """The attention setting of both contexts (a name of ``llama.ATTENTION``)."""
        return self._ctx.attention.name

    def details(self) -> dict[str, str]:
        return {"attention": self.attention}

    def _decode(self, ids: np.ndarray, at: int = 0, media: MediaPrompt | None = None) -> np.ndarray:
        """Append ``ids`` (prompt tokens ``at``...) to the sequence, in chunks of ``n_batch`` from the
        segment's own start: the fixed schedule that makes a restored segment bit-identical to a
        decoded one. Chunks also keep every call under llama.cpp's per-call n_batch assert (an
        abort, not an error). With ``media``, a chunk is further cut where its media runs begin and
        end (one llama_batch is all tokens or all embeddings) and every piece carries its M-RoPE
        positions."""
        out: np.ndarray = np.empty((len(ids), self.n_embd), dtype=np.float32)
        self._ctx.use(self._adapter)
        for start, end in chunks(0, len(ids), self._ctx.n_batch):
            try:
                if media is None:
                    self._ctx.decode_tokens(np.ascontiguousarray(ids[start:end]))
                    out[start:end] = self._ctx.rows(end - start, self.n_embd)
                    continue
                for begin, stop, row in media.pieces(at + start, at + end):
                    pos = media.positions[:, begin:stop]
                    if row is None:
                        batch = self._positioned.tokens(ids[begin - at:stop - at], pos[0])
                    else:
                        batch = self._positioned.embeddings(media.embed()[row:row + stop - begin], pos)
                    self._ctx.decode(batch)
                    out[begin - at:stop - at] = self._ctx.rows(stop - begin, self.n_embd)
            except InferenceError:
                self._ctx.clear()
                raise
        return out

    @property
    def _positioned(self) -> _Positioned:
        """The batch media prompts are decoded with, made on first use (``n_batch`` x ``n_embd``
        floats; shared by the views of this tower, used under their lock)."""
        if self._pool.positioned is None:
            self._pool.positioned = _Positioned(self._ctx.n_batch, self.n_embd)
        return self._pool.positioned

    def _restore(self, buf: np.ndarray) -> None:
        self._ctx.clear()
        if not self._ctx.restore(buf, 0):
            self._ctx.clear()
            raise InferenceError("llama.cpp could not restore a saved sequence state")

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        with self._lock:
            ids = self._checked(ids)
            self._ctx.clear()
            return self._decode(ids)

    def layer_states(self, ids: np.ndarray, prefix: int, state: int) -> tuple[np.ndarray, list[np.ndarray]]:
        """``(final hidden [T, n_embd], [output of decoder layer 0 .. n_layer - 2]``) of one prompt
        decoded from scratch on the ``[prefix][state][rest]`` schedule of ``forward`` (no reuse), for
        the per-layer parity comparison (docs/parity.md). Staging the layers leaves the final states
        bit-identical."""
        with self._lock:
            ids = self._checked(ids)
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

    # The sequence operations of the shared schedule (statecache.SegmentedForward): one
    # sequence, held by the context itself.
    def _begin(self) -> None:
        self._ctx.clear()

    def _resume(self, kept: np.ndarray) -> None:
        self._restore(kept)

    def _append(self, _seq: None, ids: np.ndarray, start: int, media: MediaPrompt | None = None) -> np.ndarray:
        return self._decode(ids, start, media)

    def _kept_bytes(self, _seq: None) -> int:
        return self._ctx.state_size(0)

    def _keep(self, _seq: None, size: int) -> np.ndarray:
        return self._ctx.save(0, size)

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
            adapter = _Adapter(self._model, Path(path), scale)
            self._pool.adapters.append(adapter)
        view = copy.copy(self)
        view._adapter, view.cache_tag = adapter, tag
        view._prefix = view._packed_prefix = None
        view.pack_stats = collections.Counter()
        return view

    @property
    def adapter_path(self) -> Path | None:
        """The LoRA this view applies (None: the base tower)."""
        return self._adapter.path if self._adapter is not None else None

    def close(self) -> None:
        if self._adapter is not None:
            return  # a view: the base tower owns the model, the contexts and the adapters
        with self._lock:
            self._close_packed()
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
