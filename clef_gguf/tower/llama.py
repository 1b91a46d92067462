"""Thin ctypes wrappers over llama-cpp-python's low-level API, each owning its resource.

We do not use ``Llama``/``embed()``: it builds Python lists, forces 256 recurrent-state slots (~12 GiB
for the 9B) and runs the 248K-row lm_head for every token. Instead the staging API
``llama_set_embeddings_nextn(ctx, true, false)`` hands back the post-``output_norm`` state of every
token while the lm_head runs for one row only (docs/design/llama-cpp-notes.md §1).

Importing this module adds nothing to what importing llama_cpp itself does (llama-cpp-python's own
import sets its default log callback): our log callback is installed and the backend initialised
once, on the first model load (:func:`ensure_backend`), so an application that set its own callback
keeps it until it loads a tower.

Each wrapper sits beside the ctypes declarations it needs, as in llama-cpp-python's ``_internals.py``:
what frees a resource sits beside what makes it, which is why this module runs past 400 lines.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import re
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import llama_cpp as ll
import numpy as np

from clef_gguf.core.errors import AdapterMismatch, CorruptModel, InferenceError
from clef_gguf.core.limits import MiB

if TYPE_CHECKING:
    from clef_gguf.tower.packing import Slot

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- llama.cpp's log
# llama.cpp reports load failures only through its log: the lines a call logs on its own thread are
# collected while it runs (:func:`captured`), to put them in our errors. ggml levels: 1 debug, 2 info,
# 3 warn, 4 error, 5 continues the previous line. Info is chatty (every load prints ~100 lines), so
# it goes to DEBUG.
_LEVELS = {1: logging.DEBUG, 2: logging.DEBUG, 3: logging.WARNING, 4: logging.ERROR}
# Warnings about what we do on purpose, logged at DEBUG: media prompts jump M-RoPE positions past
# an image's extent (the reference's get_rope_index), which llama.cpp's KV cache remarks on.
EXPECTED_WARNINGS = ("non-consecutive token position",)
# Per thread: .lines, the list the running call collects into; .level, the last line's level.
_capture = threading.local()
_init_lock = threading.Lock()
_initialised = False


@ll.llama_log_callback
def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    if level == 5:
        level = getattr(_capture, "level", 1)
    _capture.level = level
    line = text.decode("utf-8", "replace")
    lines = getattr(_capture, "lines", None)
    if lines is not None:
        lines.append((level, line))
    expected = any(part in line for part in EXPECTED_WARNINGS)
    log.log(logging.DEBUG if expected else _LEVELS.get(level, logging.DEBUG), "%s", line.rstrip())


def ensure_backend() -> None:
    """Route llama.cpp's log to :data:`log` and initialise its backend, once per process."""
    global _initialised
    if _initialised:
        return
    with _init_lock:
        if not _initialised:
            ll.llama_log_set(_on_log, ctypes.c_void_p(0))
            ll.llama_backend_init()
            _initialised = True


@contextlib.contextmanager
def captured() -> Iterator[list[tuple[int, str]]]:
    """The ``(level, line)`` pairs llama.cpp logs on this thread inside the ``with`` block."""
    ensure_backend()
    outer = getattr(_capture, "lines", None)
    lines: list[tuple[int, str]] = []
    _capture.lines = lines
    try:
        yield lines
    finally:
        _capture.lines = outer
        if outer is not None:
            outer.extend(lines)


def errors_in(lines: list[tuple[int, str]]) -> str:
    """The last warnings and errors of ``lines``, for an error message."""
    found = [text.strip() for level, text in lines if level >= 3 and text.strip()]
    return "; ".join(found[-4:])


# ---------------------------------------------------------------- staging API binding
def _bind(names: tuple[str, ...], argtypes: list[Any], restype: Any) -> Any:
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
# Per-layer staging: the input of decoder layer ``i`` (= the output of layer ``i - 1``) of every token,
# for the parity tool's per-layer comparison; off by default.
_set_layer_inp = _bind(("llama_set_embeddings_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb"),
                       [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None)
_get_layer_inp = _bind(("llama_get_embeddings_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj"),
                       [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float))


# ---------------------------------------------------------------- attention setting
@dataclass(frozen=True)
class Attention:
    """How the full-attention layers run: the K/V cache type and whether flash attention may."""

    name: str
    kv_type: int | None  # ggml type of K and V; None: llama.cpp's default (f16)
    flash_attn: int  # llama_flash_attn_type


# ggml's CPU flash attention takes an f16-accumulating path for ubatches of < 64 query tokens, which
# every segment tail of the decode schedule can be: 2-7e-5 max |dp| on f32 towers, against <= 6e-7
# with an f32 cache and no flash attention (flash attention alone casts an f32 cache back to f16).
# Elsewhere the weights' rounding dominates, and the exact setting only costs memory (docs/parity.md).
ATTENTION: dict[str, Attention] = {
    "exact-f32": Attention("exact-f32", ll.GGML_TYPE_F32, ll.LLAMA_FLASH_ATTN_TYPE_DISABLED),
    "default": Attention("default", None, ll.LLAMA_FLASH_ATTN_TYPE_AUTO),
    # flash attention forced on or off (--flash-attention on/off, as `clef-gguf tune` may choose)
    "flash-on": Attention("flash-on", None, ll.LLAMA_FLASH_ATTN_TYPE_ENABLED),
    "flash-off": Attention("flash-off", None, ll.LLAMA_FLASH_ATTN_TYPE_DISABLED),
}
# (llama_ftype of the weights, device) -> the setting; anything not listed gets "default". GPU
# kernels were not measured (CUDA's flash attention works in f16 whatever the cache type).
ATTENTION_BY_WEIGHTS: dict[tuple[int, str], str] = {
    (ll.LLAMA_FTYPE_ALL_F32, "cpu"): "exact-f32",
}


def ll_ftype_name(ftype: int) -> str:
    """``LLAMA_FTYPE_MOSTLY_Q4_K_M`` -> ``q4_k_m`` (``ftype_N`` for a number llama-cpp-python does not name)."""
    for name in dir(ll):
        if name.startswith(("LLAMA_FTYPE_MOSTLY_", "LLAMA_FTYPE_ALL_")) and getattr(ll, name) == ftype:
            return name.split("_", 3)[3].lower()
    return f"ftype_{ftype}"


def gpu_offload() -> bool:
    """Whether this llama.cpp build has a GPU backend (CUDA, Metal, Vulkan...)."""
    return bool(ll.llama_supports_gpu_offload())


def extra_buffer_types() -> bool:
    """ggml's extra weight buffers (CPU repacking, AMX) unless this build has AMX: a native build on
    an AMX CPU (Sapphire Rapids and later) segfaults decoding Q8_0 towers there, so it gets the
    plain kernels: slower on Q4_0/Q8_0, never a crash."""
    return b"AMX_INT8 = 1" not in ll.llama_print_system_info()


def _bytes_ptr(buf: np.ndarray) -> Any:
    return buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))


# ---------------------------------------------------------------- the tower's mapped pages
# llama.cpp maps the whole GGUF and reads all of it in at once (MAP_POPULATE), then copies the tensors
# its CPU kernels repack (Q4_K, Q4_0, IQ4_NL...) into buffers of their own, and with GPU layers into VRAM.
# Those tensors' mapped pages are never read again, yet they stayed in the process: a 9B Q4_K_M held
# its 5.4 GB file mapped beside 3.0 GB of repacked copies. So while the model loads, after each tensor,
# this process's pages of the mapping are dropped (MADV_DONTNEED on a read-only shared mapping: the
# pages stay in the page cache and the file is unchanged); the first decode maps back only the pages
# the CPU reads from the file. Linux only (elsewhere nothing is dropped).
_MADV_DONTNEED = 4
_MAPS = Path("/proc/self/maps")
_libc: Any = None


def _madvise() -> Any:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return _libc.madvise


def drop_mapped(path: Path) -> int:
    """Drop this process's resident pages of every mapping of ``path`` (they stay in the page cache and
    come back on the next read); the bytes of mapping covered. 0 where the system has no ``/proc``."""
    try:
        maps = _MAPS.read_text()
    except OSError:
        return 0
    target, covered = str(path.resolve()), 0
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == target:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if _madvise()(start, end - start, _MADV_DONTNEED) == 0:
                covered += end - start
    return covered


_dropping: dict[int, Path] = {}  # the loads in progress, by the key their callback is handed


@ll.llama_progress_callback
def _on_progress(_progress: float, key: ctypes.c_void_p) -> bool:
    path = _dropping.get(int(key or 0))
    if path is not None:
        drop_mapped(path)
    return True  # go on loading


class LlamaModel:
    """Owns a ``llama_model*`` loaded with mmap, ``gpu_layers`` of it offloaded; the mapped pages its
    load read are dropped as it goes (:func:`drop_mapped`)."""

    def __init__(self, path: Path, gpu_layers: int = 0):
        ensure_backend()
        params = ll.llama_model_default_params()
        params.load_mode = ll.LLAMA_LOAD_MODE_MMAP
        params.n_gpu_layers = gpu_layers  # -1: all; without a GPU backend llama.cpp uses the CPU
        self.gpu_layers = gpu_layers if gpu_offload() else 0
        params.use_extra_bufts = extra_buffer_types()
        key = id(self)
        _dropping[key] = path
        params.progress_callback = _on_progress
        params.progress_callback_user_data = ctypes.c_void_p(key)
        try:
            with captured() as lines:
                self.ptr = ll.llama_model_load_from_file(str(path).encode(), params)
            drop_mapped(path)  # the last tensor's pages too
        finally:
            del _dropping[key]
        if not self.ptr:
            detail = errors_in(lines) or "llama.cpp gave no reason"
            raise CorruptModel(f"llama.cpp could not load {path}: {detail}", field="tower")
        self.n_embd = int(ll.llama_model_n_embd(self.ptr))
        self.n_vocab = int(ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.ptr)))
        self.n_layer = int(ll.llama_model_n_layer(self.ptr))
        file_type = self.meta("general.file_type")
        self.ftype = int(file_type) if file_type and file_type.isdigit() else -1

    def meta(self, key: str) -> str | None:
        """A GGUF metadata value of this model as text (up to 63 bytes), None where absent."""
        buf = ctypes.create_string_buffer(64)
        n = ll.llama_model_meta_val_str(self.ptr, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    @property
    def device(self) -> str:
        return "gpu" if self.gpu_layers else "cpu"

    @property
    def weights(self) -> str:
        """llama.cpp's name of the file type, lower case (q4_k_m, bf16...)."""
        return ll_ftype_name(self.ftype)

    def attention(self) -> Attention:
        """The attention setting for these weights on this device when none is asked for:
        :data:`ATTENTION_BY_WEIGHTS`'s exactness rule, else the default (``clef-gguf tune`` may ask another)."""
        return ATTENTION[ATTENTION_BY_WEIGHTS.get((self.ftype, self.device), "default")]

    def close(self) -> None:
        if self.ptr:
            ll.llama_model_free(self.ptr)
            self.ptr = None


class LlamaAdapter:
    """Owns a ``llama_adapter_lora*`` loaded on a model: a LoRA applied at run time, on any quant of
    the base it was made for. llama.cpp checks every ``X.lora_a``/``X.lora_b`` against base tensor
    ``X`` (a file for another base fails here); it is freed before its model."""

    def __init__(self, model: LlamaModel, path: Path, scale: float = 1.0):
        with captured() as lines:
            self.ptr = ll.llama_adapter_lora_init(model.ptr, str(path).encode())
        if not self.ptr:
            detail = errors_in(lines) or "llama.cpp gave no reason"
            raise AdapterMismatch(f"llama.cpp could not load the adapter {path}: {detail}", field="adapter")
        self.path, self.scale = path, float(scale)
        self.model = model

    def close(self) -> None:
        if self.ptr:
            ll.llama_adapter_lora_free(self.ptr)
            self.ptr = None


_COMPUTE_BUFFER = re.compile(r"compute buffer size =\s*([0-9.]+) MiB")


class LlamaContext:
    """Owns a ``llama_context*`` for one sequence: one recurrent slot, no lm_head over the prompt.

    ``seqs > 1`` makes the packed context instead: ``seqs`` sequences, each in a KV stream of its
    own of ``n_ctx // seqs`` cells (``kv_unified`` off: in one shared pool a sequence's attention
    runs over other cells and its sums change, 0.09 max |dh| on the 110M model), ``n_batch``
    tokens per ubatch. It needs the nextn API (embeddings mode splits ubatches per sequence).

    ``eval_callback``: llama.cpp's ``ggml_backend_sched_eval_callback``, shown every graph tensor
    (the importance-matrix collector, ``tower/imatrix_collector.py``); the caller keeps it alive.

    ``attention`` sets the K/V cache type and flash attention; a saved sequence state carries both
    (the V layout and the cell type), so contexts that exchange states must share it."""

    def __init__(self, model: LlamaModel, n_ctx: int, n_batch: int, threads: int, seqs: int = 1,
                 attention: Attention = ATTENTION["default"], eval_callback: Any = None):
        params = ll.llama_context_default_params()
        if eval_callback is not None:
            params.cb_eval = eval_callback
            params.op_offload = False  # the callback reads activations in host memory
        params.n_ctx = n_ctx
        params.n_batch = n_batch
        params.n_ubatch = n_batch  # fixed: GDN chunking makes results depend slightly on it
        params.n_seq_max = seqs  # one recurrent-state slot each (~50 MiB for the 9B), not 256
        params.kv_unified = False
        params.n_threads = params.n_threads_batch = self.threads = threads
        params.pooling_type = ll.LLAMA_POOLING_TYPE_NONE
        params.attention_type = ll.LLAMA_ATTENTION_TYPE_CAUSAL
        if attention.kv_type is not None:
            params.type_k = params.type_v = attention.kv_type
        params.flash_attn_type = attention.flash_attn
        self.attention = attention
        self.nextn = _set_nextn is not None and _get_nextn is not None
        self.adapter: LlamaAdapter | None = None  # the LoRA the next decode applies (None: the base)
        # Fallback when the staging API is missing: embeddings mode (pays the lm_head per token).
        params.embeddings = not self.nextn
        # nextn: only the last token of a chunk is an output (1 lm_head row). Embeddings mode makes
        # every token an output, and a smaller n_outputs_max there aborts the process. llama.cpp
        # wants room for one output per sequence; packed batches flag none (no lm_head at all).
        params.n_outputs_max = seqs if self.nextn else 0
        with captured() as lines:
            self.ptr = ll.llama_init_from_model(model.ptr, params)
        if not self.ptr:
            raise InferenceError(f"llama.cpp could not create a context: {errors_in(lines)}")
        if self.nextn:
            _set_nextn(self.ptr, True, False)  # masked=False: every token, whatever batch.logits
        self.n_ctx = int(ll.llama_n_ctx(self.ptr))
        self.n_batch = int(ll.llama_n_batch(self.ptr))
        self.seqs = seqs
        # llama.cpp reports its compute buffers (one per backend) only in its log.
        self.compute_bytes = int(sum(float(m.group(1)) for _, text in lines
                                     if (m := _COMPUTE_BUFFER.search(text))) * MiB)

    def use(self, adapter: LlamaAdapter | None) -> None:
        """Apply ``adapter`` (None: none) from the next decode on. llama.cpp keeps the set on the
        context and rebuilds its graph on the next decode after a change; the same set costs
        nothing. Saved sequence states do not depend on it (only the states decoded after)."""
        if adapter is self.adapter:
            return
        if adapter is None:
            ll.llama_set_adapters_lora(self.ptr, None, 0, None)
        else:
            ptrs = (ll.llama_adapter_lora_p_ctypes * 1)(adapter.ptr)
            scales = (ctypes.c_float * 1)(adapter.scale)
            ll.llama_set_adapters_lora(self.ptr, ptrs, 1, scales)
        self.adapter = adapter

    def rows(self, n: int, n_embd: int) -> np.ndarray:
        ptr = _get_nextn(self.ptr) if self.nextn else ll.llama_get_embeddings(self.ptr)
        if not ptr:
            raise InferenceError("llama.cpp returned no hidden states")
        # A view into llama.cpp's output buffer, valid until the next decode: copy it out.
        return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()

    @property
    def can_tap_layers(self) -> bool:
        return self.nextn and _set_layer_inp is not None and _get_layer_inp is not None

    def tap_layers(self, n_layer: int, on: bool) -> None:
        """Stage (or stop staging) the input of each of the ``n_layer`` decoder layers."""
        for layer in range(n_layer):
            _set_layer_inp(self.ptr, layer, on)

    def layer_rows(self, layer: int, n: int, n_embd: int) -> np.ndarray:
        """The last decode's input of decoder ``layer``, one row per token (see :meth:`tap_layers`)."""
        ptr = _get_layer_inp(self.ptr, layer)
        if not ptr:
            raise InferenceError(f"llama.cpp staged no input of layer {layer}")
        return np.ctypeslib.as_array(ptr, shape=(n, n_embd)).copy()

    def clear(self) -> None:
        """Empty every sequence (KV cells and recurrent state)."""
        ll.llama_memory_clear(ll.llama_get_memory(self.ptr), True)

    def decode(self, batch: Any) -> None:
        """``llama_decode`` of a ``llama_batch``; a failure -> InferenceError with llama.cpp's words."""
        with captured() as lines:
            rc = ll.llama_decode(self.ptr, batch)
        if rc != 0:
            raise InferenceError(f"llama_decode failed with code {rc}: {errors_in(lines)}")

    def decode_tokens(self, ids: np.ndarray) -> None:
        """Append ``ids`` (int32, contiguous) to sequence 0. With nextn no token is an output: left to
        itself llama.cpp makes the last one, which runs the 248,320-row lm_head for a row nothing reads
        (and reads its whole weight matrix into memory: 0.8 GB of a 9B Q4_K_M's file)."""
        batch = ll.llama_batch_get_one(ids.ctypes.data_as(ctypes.POINTER(ll.llama_token)), len(ids))
        if self.nextn:
            flags = np.zeros(len(ids), dtype=np.int8)  # a local: alive until the decode returns
            batch.logits = flags.ctypes.data_as(ctypes.POINTER(ctypes.c_int8))
        self.decode(batch)

    def state_size(self, seq: int, partial: bool = False) -> int:
        """Bytes of sequence ``seq``'s saved state; ``partial``: its recurrent part and header only."""
        flags = ll.LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY if partial else 0
        return int(ll.llama_state_seq_get_size_ext(self.ptr, seq, flags))

    def save(self, seq: int, size: int) -> np.ndarray:
        """Sequence ``seq`` (KV cells + recurrent state), serialized by llama.cpp."""
        buf: np.ndarray = np.empty(size, dtype=np.uint8)
        got = ll.llama_state_seq_get_data_ext(self.ptr, _bytes_ptr(buf), size, seq, 0)
        if got != size:
            raise InferenceError(f"llama.cpp saved {got} of {size} bytes of a sequence state")
        return buf

    def restore(self, buf: np.ndarray, seq: int) -> bool:
        """Load a saved state into sequence ``seq``; False where llama.cpp refused it."""
        return bool(ll.llama_state_seq_set_data_ext(self.ptr, _bytes_ptr(buf), buf.size, seq, 0) == buf.size)

    def close(self) -> None:
        if self.ptr:
            ll.llama_free(self.ptr)
            self.ptr = None


class LlamaBatch:
    """Owns a ``llama_batch`` of up to ``size`` tokens, each in one sequence, none an output."""

    def __init__(self, size: int):
        self.size = size
        self.batch = ll.llama_batch_init(size, 0, 1)
        b = self.batch
        self.token, self.pos, self.n_seq_id, self.logits = (
            np.ctypeslib.as_array(p, shape=(size,)) for p in (b.token, b.pos, b.n_seq_id, b.logits))

    def fill(self, group: Sequence[Slot]) -> int:
        """The next chunk of each slot of ``group``, each in its slot's sequence; the token count."""
        n = 0
        for slot in group:
            start, end = slot.chunks[0]
            self.token[n:n + end - start] = slot.ids[start:end]
            self.pos[n:n + end - start] = np.arange(start, end, dtype=np.int32)
            for i in range(n, n + end - start):
                self.batch.seq_id[i][0] = slot.seq
            n += end - start
        self.n_seq_id[:n] = 1
        self.logits[:n] = 0  # nextn hands back every token's state; no lm_head row at all
        self.batch.n_tokens = n
        return n

    def close(self) -> None:
        if self.size:
            ll.llama_batch_free(self.batch)
            self.size = 0


# llama.cpp's M-RoPE positions per embedding: (t, y, x, 0), section-major in ``llama_batch.pos``.
MROPE_SECTIONS = 4


class PositionedBatch:
    """Owns the arrays of a one-sequence ``llama_batch`` with explicit positions: token ids (one
    position each; llama.cpp repeats it over the M-RoPE sections) or input embeddings (media:
    ``MROPE_SECTIONS`` positions each, section-major). ``llama_batch_init`` sizes ``pos`` for one
    position per token, so the arrays are numpy's, the struct points into them."""

    def __init__(self, size: int, n_embd: int):
        self.size, self.n_embd = size, n_embd
        self._token = np.zeros(size, dtype=np.int32)
        self._embd = np.zeros(size * n_embd, dtype=np.float32)
        self._pos = np.zeros(size * MROPE_SECTIONS, dtype=np.int32)
        self._n_seq_id = np.ones(size, dtype=np.int32)
        self._seq0 = np.zeros(1, dtype=np.int32)
        self._seq_id = (ctypes.POINTER(ctypes.c_int32) * size)(
            *[self._seq0.ctypes.data_as(ctypes.POINTER(ctypes.c_int32))] * size)
        self._logits = np.zeros(size, dtype=np.int8)  # nextn hands back every token's state

    def _batch(self, n: int, embd: bool) -> Any:
        b: Any = ll.llama_batch()  # ctypes fields: pointers into the arrays above, or NULL
        b.n_tokens = n
        ptr = lambda a, t: a.ctypes.data_as(ctypes.POINTER(t))  # noqa: E731
        b.token = None if embd else ptr(self._token, ll.llama_token)
        b.embd = ptr(self._embd, ctypes.c_float) if embd else None
        b.pos = ptr(self._pos, ll.llama_pos)
        b.n_seq_id = ptr(self._n_seq_id, ctypes.c_int32)
        b.seq_id = ctypes.cast(self._seq_id, ctypes.POINTER(ctypes.POINTER(ctypes.c_int32)))
        b.logits = ptr(self._logits, ctypes.c_int8)
        return b

    def tokens(self, ids: np.ndarray, pos: np.ndarray) -> Any:
        """A batch of ``ids`` at positions ``pos`` (one each)."""
        n = len(ids)
        self._token[:n] = ids
        self._pos[:n] = pos
        return self._batch(n, embd=False)

    def embeddings(self, rows: np.ndarray, pos: np.ndarray) -> Any:
        """A batch of input embeddings ``rows`` [n, n_embd] at M-RoPE positions ``pos`` [3, n]
        (t, y, x; the fourth section is 0)."""
        n = len(rows)
        self._embd[:n * self.n_embd] = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
        self._pos[:MROPE_SECTIONS * n] = 0
        for section in range(3):
            self._pos[section * n:(section + 1) * n] = pos[section]
        return self._batch(n, embd=True)
