"""The language tower in llama.cpp: final hidden states (after the last RMSNorm) of every token.

Thin ctypes wrappers over llama-cpp-python's low-level API, each owning its resource. We do not
use ``Llama``/``embed()``: it builds Python lists, forces 256 recurrent-state slots (~12 GiB for
the 9B) and runs the 248K-row lm_head for every token. Instead the staging API
``llama_set_embeddings_nextn(ctx, true, false)`` hands back the post-``output_norm`` state of
every token while the lm_head runs for one row only (llama-cpp-notes.md §1).
"""

from __future__ import annotations

import collections
import ctypes
import logging
import threading
from pathlib import Path

import llama_cpp as ll
import numpy as np

from clef_gguf.cpus import available_cpus
from clef_gguf.errors import CorruptModel, InferenceError, InvalidValue, ModelNotFound
from clef_gguf.statecache import Snapshot, StateCache

log = logging.getLogger("clef_gguf.llama")

# ---------------------------------------------------------------- llama.cpp log capture
# llama.cpp reports load failures only through its log; keep the tail to put it in our errors.
# ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continues the previous line. Info is chatty
# (every load prints ~100 lines), so it goes to DEBUG.
_LOG_TAIL: collections.deque[tuple[int, str]] = collections.deque(maxlen=40)
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
_last_level = [1]


@ll.llama_log_callback
def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level == 5:
        level = _last_level[0]
    _last_level[0] = level
    line = text.decode("utf-8", "replace")
    _LOG_TAIL.append((level, line))
    log.log(_LEVELS.get(level, logging.DEBUG), "%s", line.rstrip())


ll.llama_log_set(_on_log, ctypes.c_void_p(0))
ll.llama_backend_init()


def _log_errors() -> str:
    lines = [text.strip() for level, text in _LOG_TAIL if level >= 3 and text.strip()]
    return "; ".join(lines[-4:])


# ---------------------------------------------------------------- staging API binding
def _bind(names: tuple[str, ...], argtypes: list, restype):
    """The nextn functions are exported only under C++-mangled names in 0.3.36."""
    for name in names:
        fn = getattr(ll.llama_cpp._lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = argtypes, restype
            return fn
    return None


_set_nextn = _bind(("llama_set_embeddings_nextn", "_Z26llama_set_embeddings_nextnP13llama_contextbb"),
                   [ctypes.c_void_p, ctypes.c_bool, ctypes.c_bool], None)
_get_nextn = _bind(("llama_get_embeddings_nextn", "_Z26llama_get_embeddings_nextnP13llama_context"),
                   [ctypes.c_void_p], ctypes.POINTER(ctypes.c_float))


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan...)."""
    return bool(ll.llama_supports_gpu_offload())


def extra_buffer_types() -> bool:
    """ggml's extra weight buffers (CPU repacking, AMX) unless this build has AMX: a native build on
    an AMX CPU (Sapphire Rapids and later) segfaults decoding Q8_0 towers there, so it gets the
    plain kernels: slower on Q4_0/Q8_0, never a crash."""
    return b"AMX_INT8 = 1" not in ll.llama_print_system_info()


# ---------------------------------------------------------------- header checks
# qwen35 hyperparameters llama.cpp 0.3.36 reads but does not check against the tensors: a bad value
# reaches a GGML_ASSERT (the process aborts) or a graph that never finishes. Its layer limit:
LLAMA_MAX_LAYERS = 512
_INT_TYPES = {"UINT8", "INT8", "UINT16", "INT16", "UINT32", "INT32", "UINT64", "INT64"}


def check_header(reader, path: Path) -> None:
    """Refuse (CorruptModel) a qwen35 GGUF, parsed by ``lexical.open_gguf``, that llama.cpp would
    abort or hang on: block count, width, rotary dims, GDN inner size, norm epsilon or vocab."""

    def refuse(why: str):
        raise CorruptModel(f"{path} is a damaged qwen35 tower: {why}", field="tower")

    def number(key: str, kinds: set[str] = _INT_TYPES, required: bool = True):
        f = reader.fields.get(key)
        if f is None and not required:  # llama.cpp has a default for it
            return None
        if f is None or len(f.types) != 1 or f.types[0].name not in kinds:
            refuse(f"{key} is missing or not a {'whole ' if 'INT32' in kinds else ''}number")
        return f.contents()

    shapes = {t.name: [int(d) for d in t.shape] for t in reader.tensors}
    n_layer = number("qwen35.block_count")
    blocks = {int(n.split(".")[1]) for n in shapes if n.split(".")[0] == "blk"
              and n.split(".")[1].isdigit()}
    if not 1 <= n_layer <= LLAMA_MAX_LAYERS or blocks != set(range(n_layer)):
        refuse(f"qwen35.block_count is {n_layer}, the tensors have {len(blocks)} blocks")
    n_embd = number("qwen35.embedding_length")
    if shapes.get("token_embd.weight", [None])[0] != n_embd:
        refuse(f"qwen35.embedding_length {n_embd} is not token_embd.weight's width "
               f"{shapes.get('token_embd.weight')}")
    head = number("qwen35.attention.key_length", required=False)
    n_rot = number("qwen35.rope.dimension_count", required=False)
    n_rot = head if n_rot is None else n_rot  # llama.cpp's default
    if n_rot is not None and (n_rot < 2 or n_rot % 2 or (head is not None and n_rot > head)):
        refuse(f"qwen35.rope.dimension_count {n_rot} is not an even count <= key_length {head}")
    # Rotary pairs given to each of the (up to 4) position axes: at most the n_rot / 2 there are.
    sections = reader.fields.get("qwen35.rope.dimension_sections")
    if n_rot is not None and sections is not None and sections.types[-1].name in _INT_TYPES:
        values = sections.contents()
        values = [int(v) for v in values] if isinstance(values, list) else [int(values)]
        if len(values) > 4 or min(values, default=0) < 0 or sum(values) > n_rot // 2:
            refuse(f"qwen35.rope.dimension_sections {values} do not split {n_rot // 2} pairs")
    inner = number("qwen35.ssm.inner_size")
    wrong = [n for n, s in shapes.items() if n.endswith(".ssm_out.weight") and s[0] != inner]
    if inner < 1 or wrong:
        refuse(f"qwen35.ssm.inner_size {inner} is not the width of {wrong[:1] or 'ssm_out'}")
    eps = number("qwen35.attention.layer_norm_rms_epsilon", {"FLOAT32", "FLOAT64"})
    if not 0 < eps < 1:  # NaN fails too
        refuse(f"qwen35.attention.layer_norm_rms_epsilon is {eps}")
    tokens = reader.fields.get("tokenizer.ggml.tokens")  # llama.cpp asserts they are distinct
    if tokens is not None and len({bytes(tokens.parts[i]) for i in tokens.data}) < len(tokens.data):
        refuse("tokenizer.ggml.tokens holds the same token twice")


class _Model:
    """Owns a ``llama_model*`` loaded with mmap, ``gpu_layers`` of it offloaded."""

    def __init__(self, path: Path, gpu_layers: int = 0):
        params = ll.llama_model_default_params()
        params.load_mode = ll.LLAMA_LOAD_MODE_MMAP
        params.n_gpu_layers = gpu_layers  # -1: all; without a GPU backend llama.cpp uses the CPU
        self.gpu_layers = gpu_layers if gpu_offload() else 0
        params.use_extra_bufts = extra_buffer_types()
        _LOG_TAIL.clear()
        self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
        if not self.ptr:
            detail = _log_errors() or "llama.cpp gave no reason"
            raise CorruptModel(f"llama.cpp could not load {path}: {detail}", field="tower")
        self.n_embd = int(ll.llama_model_n_embd(self.ptr))
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.ptr)))

    def close(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


class _Context:
    """Owns a ``llama_context*`` for one sequence: one recurrent slot, no lm_head over the prompt."""

    def __init__(self, model: _Model, n_ctx: int, n_batch: int, threads: int):
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # fixed: GDN chunking makes results depend slightly on it
        params.n_seq_max = 1  # one recurrent-state slot (~50 MiB for the 9B), not 256
        params.n_threads = params.n_threads_batch = self.threads = threads
        params.pooling_type = ll.LLAMA_POOLING_TYPE_NONE
        params.attention_type = ll.LLAMA_ATTENTION_TYPE_CAUSAL
        self.nextn = _set_nextn is not None and _get_nextn is not None
        # Fallback when the staging API is missing: embeddings mode (pays the lm_head per token).
        params.embeddings = not self.nextn
        # nextn: only the last token of a chunk is an output (1 lm_head row). Embeddings mode makes
        # every token an output, and a smaller n_outputs_max there aborts the process.
        params.n_outputs_max = 1 if self.nextn else 0
        _LOG_TAIL.clear()
        self.ptr = ll.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise InferenceError(f"llama.cpp could not create a context: {_log_errors()}")
        if self.nextn:
            _set_nextn(self.ptr, True, False)  # masked=False: every token, whatever batch.logits
        self.n_ctx = int(ll.llama_n_ctx(self.ptr))
        self.n_batch = int(ll.llama_n_batch(self.ptr))

    def rows(self, n: int, n_embd: int) -> np.ndarray:
        ptr = _get_nextn(self.ptr) if self.nextn else ll.llama_get_embeddings(self.ptr)
        if not ptr:
            raise InferenceError("llama.cpp returned no hidden states")
        # A view into llama.cpp's output buffer, valid until the next decode: copy it out.
        return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()

    def close(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


class Tower:
    """``hidden_states(ids) -> float32 [T, n_embd]`` for one prompt at a time (thread-safe)."""

    def __init__(self, model: _Model, ctx: _Context, path: Path):
        self._model, self._ctx, self.path = model, ctx, path
        self._lock = threading.Lock()
        self._prefix: tuple[bytes, Snapshot] | None = None  # the system prefix, decoded once

    @classmethod
    def load(cls, path: str | Path, *, n_ctx: int = 16384, threads: int | None = None,
             n_batch: int = 512, gpu_layers: int = 0) -> Tower:
        path = Path(path)
        if threads is not None and (not isinstance(threads, int) or threads < 1):
            raise InvalidValue(f"threads must be a whole number >= 1 (got {threads!r})",
                               field="threads")
        if not isinstance(gpu_layers, int) or isinstance(gpu_layers, bool) or gpu_layers < -1:
            raise InvalidValue(f"gpu_layers must be -1 (all), 0 or a layer count (got "
                               f"{gpu_layers!r})", field="gpu_layers")
        if not path.is_file():
            raise ModelNotFound(f"GGUF file not found: {path}", field="tower")
        model = _Model(path, gpu_layers)
        try:
            ctx = _Context(model, n_ctx, min(n_batch, n_ctx), threads or available_cpus())
        except BaseException:
            model.close()
            raise
        return cls(model, ctx, path)

    @property
    def n_embd(self) -> int:
        return self._model.n_embd

    @property
    def n_vocab(self) -> int:
        return self._model.n_vocab

    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

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

    def _checked(self, ids: np.ndarray) -> np.ndarray:
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        n = int(ids.shape[0])
        if n == 0 or n > self.n_ctx:
            raise InferenceError(f"a prompt of {n} tokens does not fit the context of {self.n_ctx}")
        bad = ids[(ids < 0) | (ids >= self.n_vocab)]
        if bad.size:  # llama.cpp would reject these, and some vocab calls abort the process on them
            raise InferenceError(f"token id {int(bad[0])} is outside the GGUF vocab "
                                 f"of {self.n_vocab}")
        if self._ctx.ptr is None:
            raise InferenceError("the tower is closed")
        return ids

    def _clear(self) -> None:
        ll.llama_memory_clear(ll.llama_get_memory(self._ctx.ptr), True)

    def _decode(self, ids: np.ndarray) -> np.ndarray:
        """Append ``ids`` to the sequence, in chunks of ``n_batch`` from the segment's own start:
        the fixed schedule that makes a restored segment bit-identical to a decoded one. Chunks
        also keep every call under llama.cpp's per-call n_batch assert (an abort, not an error)."""
        out = np.empty((len(ids), self.n_embd), dtype=np.float32)
        step = self._ctx.n_batch
        for start in range(0, len(ids), step):
            chunk = np.ascontiguousarray(ids[start:start + step])
            batch = ll.llama_batch_get_one(
                chunk.ctypes.data_as(ctypes.POINTER(ll.llama_token)), len(chunk))
            rc = ll.llama_decode(self._ctx.ptr, batch)
            if rc != 0:
                self._clear()
                raise InferenceError(f"llama_decode failed with code {rc}: {_log_errors()}")
            out[start:start + len(chunk)] = self._ctx.rows(len(chunk), self.n_embd)
        return out

    def _state_size(self) -> int:
        return int(ll.llama_state_seq_get_size_ext(self._ctx.ptr, 0, 0))

    def _save(self, size: int | None = None) -> np.ndarray:
        """The whole sequence (KV cells + recurrent state), serialized by llama.cpp."""
        size = self._state_size() if size is None else size
        buf = np.empty(size, dtype=np.uint8)
        got = ll.llama_state_seq_get_data_ext(
            self._ctx.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0, 0)
        if got != size:
            raise InferenceError(f"llama.cpp saved {got} of {size} bytes of the sequence state")
        return buf

    def _restore(self, buf: np.ndarray) -> None:
        self._clear()
        got = ll.llama_state_seq_set_data_ext(
            self._ctx.ptr, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), buf.size, 0, 0)
        if got != buf.size:
            self._clear()
            raise InferenceError("llama.cpp could not restore a saved sequence state")

    def hidden_states(self, ids: np.ndarray) -> np.ndarray:
        """Hidden states of one prompt decoded from scratch, as one segment (no reuse)."""
        with self._lock:
            ids = self._checked(ids)
            self._clear()
            return self._decode(ids)

    def forward(self, ids: np.ndarray, prefix: int, state: int,
                cache: StateCache | None = None) -> tuple[np.ndarray, int]:
        """``(hidden [T, n_embd], cached_tokens)`` of a prompt ``[prefix][state][rest]``, the
        segments given as token counts. The prefix is decoded once and restored after; with a
        ``cache``, a known ``[prefix][state]`` is restored and a known prompt is not decoded."""
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
        head = prefix + state
        state_key = cache.key("state", ids[:head]) if cache is not None and state else None
        known = cache.get(state_key) if state_key else None
        if known is not None:
            self._restore(known.seq_state)
            parts, cached = [known.hidden], head
        else:
            key = ids[:prefix].tobytes()
            if self._prefix is not None and self._prefix[0] == key:
                self._restore(self._prefix[1].seq_state)
                parts, cached = [self._prefix[1].hidden], prefix
            else:
                self._clear()
                parts, cached = [self._decode(ids[:prefix])], 0
                self._prefix = (key, Snapshot(prefix, self._save(), parts[0]))
            if state:
                parts.append(self._decode(ids[prefix:head]))
                size = self._state_size()
                if state_key and size + head * self.n_embd * 4 <= cache.max_bytes:
                    cache.put(state_key, Snapshot(head, self._save(size), np.concatenate(parts)))
        if head < len(ids):
            parts.append(self._decode(ids[head:]))
        return np.concatenate(parts), cached

    def close(self) -> None:
        with self._lock:
            self._ctx.close()
            self._model.close()

    def __enter__(self) -> Tower:
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
