"""An importance matrix from decision prompts: llama-imatrix's statistic, collected in this process.

llama.cpp's very-low-bit quantizers weigh each input column of a weight by the mean square of the
activations that column meets (``convert/imatrix_file.py``). ``llama-imatrix`` measures that on text
chunks through llama.cpp's evaluation callback; it cannot feed a decision model the prompts it
actually reads. :class:`Collector` does what ``tools/imatrix/imatrix.cpp`` ``collect_imatrix`` does,
on the prompts the runtime decodes:

* a context made with ``cb_eval`` (``tower.llama.LlamaContext``) shows the scheduler's every graph
  tensor to :meth:`Collector._on_tensor`; it asks for the ``MUL_MAT`` nodes whose ``src0`` is a
  layer weight (``blk.*.weight``), then reads their ``src1`` (the matmul's input, one row per token)
  and adds its squares per input column, in float64, keyed by the weight's name, and the row count;
* ``convert/imatrix_file.py``'s ``write`` stores the sums and counts in llama-imatrix's GGUF format,
  byte-compatible with its save code, which llama.cpp's own loader reads.

Unlike imatrix.cpp, matmuls of fewer than 16 rows count: a prompt's last chunk is its own text, not
a generation step. Left out, as imatrix.cpp leaves them out by default: ``output.weight`` (the runtime never multiplies
by it: it reads option rows, ``pipeline/lexical.py``) and ``token_embd.weight`` (a row lookup). LoRA
matrices (``*.weight.lora_a``) are not weights of the tower. Clef towers are dense ``qwen35``: no
``MUL_MAT_ID`` (experts) and no 3-D weights, which are refused rather than half-collected.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import llama_cpp as ll
import numpy as np
from llama_cpp._ggml import libggml

from clef_gguf.core.cpus import available_cpus
from clef_gguf.core.errors import ConversionError, InferenceError
from clef_gguf.core.limits import DECODE_CHUNK, KiB
from clef_gguf.formats.gguf import TOWER_ARCH
from clef_gguf.tower.llama import LlamaAdapter, LlamaContext, LlamaModel
from clef_gguf.tower.packing import chunks

# llama_ftype of the towers llama.cpp quantizes from (and whose activations are the model's own).
SOURCE_FTYPES = {0: "f32", 1: "f16", 32: "bf16"}
GGML_TYPE_F32 = 0
GGML_MAX_DIMS, GGML_MAX_SRC, GGML_MAX_OP_PARAMS, GGML_MAX_NAME = 4, 10, 64, 64  # ggml.h


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the vendored ``ggml/include/ggml.h`` (llama-cpp-python 0.3.36);
    :func:`check_layout` proves it against the library before any context is made."""

    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p),
                ("ne", ctypes.c_int64 * GGML_MAX_DIMS), ("nb", ctypes.c_size_t * GGML_MAX_DIMS),
                ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * (GGML_MAX_OP_PARAMS // 4)),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * GGML_MAX_SRC),
                ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
                ("data", ctypes.c_void_p), ("name", ctypes.c_char * GGML_MAX_NAME),
                ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8)]


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


def _declare(name: str, argtypes: list[Any], restype: Any) -> Any:
    fn = getattr(libggml, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


_init = _declare("ggml_init", [_InitParams], ctypes.c_void_p)
_free = _declare("ggml_free", [ctypes.c_void_p], None)
_new_2d = _declare("ggml_new_tensor_2d", [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64],
                   ctypes.c_void_p)
_mul_mat = _declare("ggml_mul_mat", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p], ctypes.c_void_p)
_set_name = _declare("ggml_set_name", [ctypes.c_void_p, ctypes.c_char_p], ctypes.c_void_p)
_get_name = _declare("ggml_get_name", [ctypes.c_void_p], ctypes.c_void_p)
_get_data = _declare("ggml_get_data", [ctypes.c_void_p], ctypes.c_void_p)
_nbytes = _declare("ggml_nbytes", [ctypes.c_void_p], ctypes.c_size_t)
_op_name = _declare("ggml_op_name", [ctypes.c_int], ctypes.c_char_p)
_is_host = _declare("ggml_backend_buffer_is_host", [ctypes.c_void_p], ctypes.c_bool)
_layout: int | None = None  # GGML_OP_MUL_MAT, once check_layout has passed


def check_layout() -> int:
    """Build ``mul_mat(a, b)`` in a scratch ggml context and read it through :class:`GgmlTensor`:
    a mismatch (another ggml) is an error here, not a misread pointer in the callback. Returns
    ``GGML_OP_MUL_MAT`` as this library numbers it."""
    global _layout
    if _layout is not None:
        return _layout
    ctx = _init(_InitParams(64 * KiB, None, False))
    if not ctx:
        raise InferenceError("ggml could not make a scratch context")
    try:
        a, b = _new_2d(ctx, GGML_TYPE_F32, 3, 5), _new_2d(ctx, GGML_TYPE_F32, 3, 2)
        _set_name(a, b"blk.0.probe.weight")
        out = _mul_mat(ctx, a, b)
        ta, tm = GgmlTensor.from_address(a), GgmlTensor.from_address(out)
        fine = (tuple(ta.ne) == (3, 5, 1, 1) and tuple(ta.nb) == (4, 12, 60, 60)
                and ta.type == GGML_TYPE_F32 and ta.data == _get_data(a)
                and a + GgmlTensor.name.offset == _get_name(a) and ta.name == b"blk.0.probe.weight"
                and tm.src[0] == a and tm.src[1] == b and tuple(tm.ne) == (5, 2, 1, 1)
                and _op_name(tm.op) == b"MUL_MAT" and _nbytes(b) == 24)
        if not fine:
            raise InferenceError("this llama.cpp's struct ggml_tensor is not the one clef-gguf reads "
                                 "(llama-cpp-python 0.3.36): cannot collect an importance matrix")
        _layout = int(tm.op)
        return _layout
    finally:
        _free(ctx)


def weight_name(raw: bytes) -> str:
    """A ``src0`` name as imatrix.cpp's ``filter_tensor_name`` keys it: a backend copy
    ``CUDA0#blk.0.attn_q.weight#0`` is the weight ``blk.0.attn_q.weight``."""
    name = raw.decode("utf-8", "replace")
    return name.split("#")[1] if "#" in name else name


def collected(name: str) -> bool:
    """Layer weights only (imatrix.cpp's default): not LoRA matrices, KV views or the lm_head."""
    return name.startswith("blk.") and name.endswith(".weight")


@dataclass(frozen=True)
class Collected:
    """Per weight: the sum over every decoded token of its input's squares [ne0] (float64) and the
    number of tokens; ``prompts``: prompts decoded (llama-imatrix's "chunks"), ``tokens``: theirs."""

    sums: dict[str, np.ndarray]
    counts: dict[str, int]
    prompts: int
    tokens: int
    chunk_size: int  # the context window the prompts were decoded in


class Collector:
    """A tower loaded with an evaluation callback; :meth:`add` decodes one prompt and adds its
    statistics. Use as a context manager (it owns a llama.cpp model and context)."""

    def __init__(self, tower: str | Path, *, n_ctx: int, threads: int | None = None,
                 n_batch: int = DECODE_CHUNK):
        self._mul_mat = check_layout()
        self._model = LlamaModel(Path(tower), gpu_layers=0)  # host memory: the callback reads it there
        self._ctx: LlamaContext | None = None
        self._adapter: LlamaAdapter | None = None
        try:
            arch = self._model.meta("general.architecture")
            if arch != TOWER_ARCH:
                raise ConversionError(f"{Path(tower).name} is a {arch!r} GGUF, not a {TOWER_ARCH} Clef tower",
                                      field="model")
            if self._model.ftype not in SOURCE_FTYPES:
                raise ConversionError(
                    f"{Path(tower).name} is quantized (llama file type {self._model.ftype}): an "
                    "importance matrix is measured on the f32/f16/bf16 tower it will quantize, so "
                    "that its statistics are the model's own; pass that model", field="model")
            # Kept on self: llama.cpp holds only the C pointer of the callback.
            self._callback = ll.ggml_backend_sched_eval_callback(self._on_tensor)
            self._ctx = LlamaContext(self._model, n_ctx, min(n_batch, n_ctx), threads or available_cpus(),
                                 attention=self._model.attention(), eval_callback=self._callback)
        except BaseException:
            self.close()
            raise
        self._sums: dict[str, np.ndarray] = {}
        self._counts: dict[str, int] = {}
        self._error: str | None = None  # what went wrong inside the callback, raised after decode
        self.prompts = self.tokens = 0

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
        assert self._ctx is not None
        return self._ctx.n_ctx

    def use_adapter(self, path: str | Path, scale: float = 1.0) -> None:
        """Decode through this LoRA from now on: a fine-tune's activations, for its quant's imatrix."""
        self._adapter = LlamaAdapter(self._model, Path(path), scale)

    # ------------------------------------------------------------ the callback
    def _on_tensor(self, t: int, ask: bool, _user: Any) -> bool:
        """``ggml_backend_sched_eval_callback``: with ``ask``, whether we want ``t``'s data; without,
        ``t`` is computed. An exception cannot cross into C: it is kept and False stops the graph."""
        try:
            node = GgmlTensor.from_address(t)
            if node.op != self._mul_mat:
                return False
            weight = GgmlTensor.from_address(node.src[0])
            name = weight_name(weight.name)
            if not collected(name):
                return False
            if not ask:
                self._accumulate(name, weight, node.src[1])
            return True
        except BaseException as exc:  # noqa: BLE001 - reported by add() after the decode
            self._error = self._error or f"{type(exc).__name__}: {exc}"
            return False

    def _accumulate(self, name: str, weight: GgmlTensor, src1_ptr: int) -> None:
        x = GgmlTensor.from_address(src1_ptr)
        if weight.ne[2] * weight.ne[3] != 1:
            raise ConversionError(f"{name} is a 3-D weight: not a dense {TOWER_ARCH} tower")
        if x.type != GGML_TYPE_F32 or x.nb[0] != 4:
            raise ConversionError(f"the input of {name} is not contiguous float32 rows (ggml type {x.type})")
        if x.buffer and not _is_host(x.buffer):
            raise ConversionError(f"the input of {name} is in device memory")
        ne0, rows = int(x.ne[0]), int(x.ne[1] * x.ne[2] * x.ne[3])
        raw = (ctypes.c_char * _nbytes(src1_ptr)).from_address(x.data)
        view = np.lib.stride_tricks.as_strided(
            np.frombuffer(raw, dtype=np.float32), shape=tuple(reversed(x.ne)), strides=tuple(reversed(x.nb)))
        flat = view.reshape(rows, ne0)  # a copy only when ggml's rows are not packed
        acc = self._sums.setdefault(name, np.zeros(ne0, dtype=np.float64))
        if acc.size != ne0:
            raise ConversionError(f"inconsistent input width for {name}: {ne0} vs {acc.size}")
        acc += np.square(flat).sum(axis=0, dtype=np.float64)
        self._counts[name] = self._counts.get(name, 0) + rows

    # ------------------------------------------------------------ prompts
    def add(self, ids: np.ndarray) -> None:
        """Decode one prompt from an empty sequence (chunks of ``n_batch``, as the runtime decodes a
        segment) and add every layer weight's input statistics."""
        assert self._ctx is not None
        ids = np.ascontiguousarray(ids, dtype=np.int32)
        if not 0 < len(ids) <= self._ctx.n_ctx:
            raise InferenceError(f"a prompt of {len(ids)} tokens does not fit the {self._ctx.n_ctx}-token context")
        if ids.min() < 0 or ids.max() >= self.n_vocab:
            raise InferenceError(f"token ids outside the tower's vocabulary of {self.n_vocab}")
        self._ctx.clear()
        self._ctx.use(self._adapter)
        for start, end in chunks(0, len(ids), self._ctx.n_batch):
            self._ctx.decode_tokens(np.ascontiguousarray(ids[start:end]))
            if self._error is not None:
                raise InferenceError(f"collecting activations failed: {self._error}")
        self.prompts += 1
        self.tokens += len(ids)

    def result(self) -> Collected:
        bad = [name for name, acc in self._sums.items() if not np.isfinite(acc).all()]
        if bad:  # imatrix.cpp exits on these too: the weights would be NaN
            raise InferenceError(f"non-finite activations at the input of {bad[0]}")
        return Collected({k: v.copy() for k, v in self._sums.items()}, dict(self._counts),
                         self.prompts, self.tokens, self.n_ctx)

    def close(self) -> None:
        # The context that applied the adapter first, the adapter before its model.
        if self._ctx is not None:
            self._ctx.close()
        if self._adapter is not None:
            self._adapter.close()
        self._model.close()

    def __enter__(self) -> Collector:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
