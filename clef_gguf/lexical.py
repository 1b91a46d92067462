"""Lexical rows: lm_head rows of option-span tokens, read straight from the GGUF.

The head averages ``lm_head.weight[x_t]`` over each option's tokens (spec §4 B). We read only the
rows we need from the memory-mapped ``output.weight`` (``token_embd.weight`` only when the model
is tied and has no ``output.weight``), dequantize them to float32 and keep them in a store bounded
by bytes: the full vocab x hidden table would be ~4 GB in float32 for Clef-Flash.
"""

from __future__ import annotations

import ctypes
import enum
import math
import threading
from pathlib import Path

import gguf
import numpy as np

from clef_gguf.errors import CorruptModel, ModelNotFound

OUTPUT, TIED = "output.weight", "token_embd.weight"
# Dequantized rows kept: the device policy's lexical-row budget for Clef-Flash (models/catalog.json)
# holds 4,096 rows of the 9B's width, more than any request's options need.
CACHE_BYTES = 64 << 20


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Parse a GGUF's header and tensor table (mmap); a truncated or foreign file -> CorruptModel."""
    path = Path(path)
    if not path.is_file():
        raise ModelNotFound(f"GGUF file not found: {path}", field="tower")
    ensure_gguf_types()  # PyPI gguf lacks Q2_0: without this a Q2_0 file raises ValueError
    try:
        reader = _Reader(path, "r")
        _check_table(reader)
    except Exception as exc:  # gguf-py raises ValueError, struct.error, IndexError... on bad bytes
        raise CorruptModel(f"{path} is not a readable GGUF file ({exc})", field="tower") from None
    return reader


class _Reader(gguf.GGUFReader):
    """gguf-py's reader, stopped at the first read past the end of the file. On its own it returns
    short arrays there, and walks a damaged array length or entry count one item at a time (for
    billions of steps on a large file)."""

    def _get(self, offset, dtype, count=1, override_order=None):
        arr = super()._get(offset, dtype, count, override_order)
        if len(arr) != int(count):
            raise ValueError(f"the file ends inside the field at offset {int(offset)}")
        return arr

    def _get_field_parts(self, orig_offs, raw_type):
        if raw_type == gguf.GGUFValueType.ARRAY:  # each item takes at least one byte
            n = int(self._get(orig_offs + 4, np.uint64)[0])
            if n > len(self.data) - orig_offs:
                raise ValueError(f"an array of {n} items at offset {orig_offs} overruns the file")
        return super()._get_field_parts(orig_offs, raw_type)

    def _build_fields(self, offs, count):
        if int(count) > len(self.data) // 13:  # a key/value entry takes at least 13 bytes
            raise ValueError(f"{int(count)} metadata entries cannot fit in the file")
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs, count):
        if int(count) > len(self.data) // 24:  # a tensor entry takes at least 24 bytes
            raise ValueError(f"{int(count)} tensor entries cannot fit in the file")
        return super()._build_tensor_info(offs, count)


def _check_table(reader: gguf.GGUFReader) -> None:
    """What gguf-py lets through and llama.cpp may abort on: text metadata that is not UTF-8, and
    tensors that are not 1-4-D, have an empty dimension or more elements than int64 counts (gguf-py
    multiplies the dims in wrapping uint64), split a block, or whose data is misaligned or lies
    outside the file."""
    for f in reader.fields.values():
        if f.types == [gguf.GGUFValueType.STRING]:
            bytes(f.parts[-1]).decode("utf-8")
    for t in reader.tensors:
        dims = [int(d) for d in t.shape]
        block, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
        if not 1 <= len(dims) <= 4 or min(dims) < 1 or math.prod(dims) >= 2**63 or dims[0] % block:
            raise ValueError(f"tensor {t.name} has an impossible {t.tensor_type.name} shape {dims}")
        end = t.data_offset + math.prod(dims) // block * type_size
        if (t.data_offset - reader.data_offset) % reader.alignment or end > len(reader.data):
            raise ValueError(f"tensor {t.name}'s data (offset {t.data_offset}, ending at {end}) is "
                             f"misaligned or past the end of the file ({len(reader.data)} bytes)")


def field_value(reader: gguf.GGUFReader, key: str, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def file_type_name(reader: gguf.GGUFReader) -> str:
    """``general.file_type`` as a quant label (``q8_0``, ``q4_k_m``, ``f32``...)."""
    ft = field_value(reader, "general.file_type")
    if ft is None:
        return "unknown"
    try:
        name = gguf.LlamaFileType(int(ft)).name
    except ValueError:
        return f"ftype_{ft}"
    return name.replace("MOSTLY_", "").replace("ALL_", "").lower()


# ---------------------------------------------------------------- ggml's own dequantizer
class _TypeTraits(ctypes.Structure):
    _fields_ = [("type_name", ctypes.c_char_p), ("blck_size", ctypes.c_int64),
                ("blck_size_interleave", ctypes.c_int64), ("type_size", ctypes.c_size_t),
                ("is_quantized", ctypes.c_bool), ("to_float", ctypes.c_void_p),
                ("from_float_ref", ctypes.c_void_p)]


_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_float), ctypes.c_int64)


def _libggml_base() -> ctypes.CDLL:
    # Already loaded by libllama; CDLL returns the same handle. Its directory is llama-cpp-python's.
    from llama_cpp import _ggml

    for name in ("libggml-base.so", "libggml-base.dylib", "ggml-base.dll"):
        path = _ggml.libggml_base_path / name
        if path.exists():
            return ctypes.CDLL(str(path))
    raise CorruptModel(f"libggml-base not found in {_ggml.libggml_base_path}")


def _type_traits(type_id: int) -> _TypeTraits:
    """ggml's ``ggml_get_type_traits(type)``: name, block size, bytes per block, dequantizer."""
    lib = _libggml_base()
    lib.ggml_get_type_traits.restype = ctypes.POINTER(_TypeTraits)
    lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
    return lib.ggml_get_type_traits(type_id).contents


def _ggml_to_float(raw: np.ndarray, type_id: int, n_cols: int) -> np.ndarray:
    """Dequantize with ggml's routine, for types gguf-py has no numpy code for (Q1_0, Q2_0...)."""
    traits = _type_traits(type_id)
    if not traits.to_float:
        raise CorruptModel(f"ggml has no dequantizer for tensor type {type_id}")
    raw = np.ascontiguousarray(raw)
    out = np.empty((raw.shape[0], n_cols), dtype=np.float32)
    _TO_FLOAT(traits.to_float)(raw.ctypes.data, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                               out.size)
    return out


# ---------------------------------------------------------------- ggml types PyPI gguf lacks
# llama-cpp-python 0.3.36's ggml has GGML_TYPE_Q2_0 = 42 (LLAMA_FTYPE_MOSTLY_Q2_0 = 41); PyPI gguf
# 0.19.0 does not, and GGUFReader raises ValueError on any file holding one such tensor. So we add
# the enum members, with (block size, bytes per block) taken from the ggml we run, so the reader
# slices rows exactly as llama.cpp does; their rows dequantize through ``_ggml_to_float``. A newer
# gguf that knows these values is left untouched. Values from ggml.h / llama.h of that build:
MISSING_TYPES = {42: "Q2_0"}
MISSING_FTYPES = {41: "MOSTLY_Q2_0"}

_done = False
_lock = threading.Lock()


def _add_member(cls: type[enum.IntEnum], name: str, value: int) -> None:
    """Add ``name = value`` to an existing IntEnum (what ``aenum.extend_enum`` does)."""
    if value in cls._value2member_map_ or name in cls._member_map_:
        return
    member = int.__new__(cls, value)
    member._name_, member._value_ = name, value
    member.__objclass__ = cls
    member._sort_order_ = len(cls._member_names_)
    type.__setattr__(cls, name, member)  # EnumType.__setattr__ refuses to touch members
    cls._member_map_[name] = member
    cls._value2member_map_[value] = member
    cls._member_names_.append(name)


def _ggml_sizes(type_id: int, name: str) -> tuple[int, int]:
    traits = _type_traits(type_id)
    found = (traits.type_name or b"").decode()
    if found.lower() != name.lower():  # another ggml numbering: do not guess
        raise RuntimeError(f"ggml type {type_id} is {found!r}, expected {name!r}")
    return int(traits.blck_size), int(traits.type_size)


def ensure_gguf_types() -> None:
    """Idempotent; cheap after the first call. Failures leave gguf as it was."""
    global _done
    if _done:
        return
    with _lock:
        if _done:
            return
        for value, name in MISSING_TYPES.items():
            if value in gguf.GGMLQuantizationType._value2member_map_:
                continue
            try:
                sizes = _ggml_sizes(value, name)
            except (RuntimeError, OSError, ImportError):
                continue  # the file then fails to open with gguf's own clear ValueError
            _add_member(gguf.GGMLQuantizationType, name, value)
            gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(value)] = sizes
        for value, name in MISSING_FTYPES.items():
            _add_member(gguf.LlamaFileType, name, value)
        _done = True


class LexicalRows:
    """``rows(token_ids) -> float32 [n, H]``: dequantized rows in a bounded store (thread-safe).

    The store holds at most ``max_bytes`` of rows (least recently used evicted), so a client
    cycling through the vocabulary cannot grow it past the device policy's budget. Lookups are
    array operations (a token -> slot table and one gather), not a Python loop per token.
    """

    def __init__(self, reader: gguf.GGUFReader, max_bytes: int = CACHE_BYTES):
        tensors = {t.name: t for t in reader.tensors}
        tensor = tensors.get(OUTPUT) or tensors.get(TIED)
        if tensor is None:
            raise CorruptModel(f"{reader.data.filename if hasattr(reader.data, 'filename') else 'GGUF'}"
                               f" has neither {OUTPUT} nor {TIED}", field="tower")
        if len(tensor.shape) != 2:  # rows of hidden_size values, one per token
            raise CorruptModel(f"{tensor.name} has shape {[int(d) for d in tensor.shape]}, "
                               "not [hidden, vocab]", field="tower")
        self.tensor_name = tensor.name
        self.type = gguf.GGMLQuantizationType(tensor.tensor_type)
        self._data = tensor.data
        self._init_store(*(int(x) for x in tensor.shape[:2]), max_bytes)  # ggml order: [H, vocab]

    def _init_store(self, hidden_size: int, vocab_size: int, max_bytes: int) -> None:
        self.hidden_size, self.vocab_size = hidden_size, vocab_size
        self.capacity = int(max(1, min(self.vocab_size, max_bytes // (4 * self.hidden_size))))
        self._store = np.empty((self.capacity, self.hidden_size), dtype=np.float32)
        self._slot = np.full(self.vocab_size, -1, dtype=np.int64)  # token id -> slot, -1: absent
        self._owner = np.full(self.capacity, -1, dtype=np.int64)  # slot -> token id
        self._used = np.zeros(self.capacity, dtype=np.int64)  # slot -> tick of its last use
        self._tick = 0
        self._lock = threading.Lock()

    @property
    def type_name(self) -> str:
        """The stored type of the rows (before dequantization), e.g. Q8_0 or BF16."""
        return self.type.name

    @property
    def cached(self) -> np.ndarray:
        """Token ids whose rows are in the store."""
        return np.sort(self._owner[self._owner >= 0])

    def _dequantize(self, ids: np.ndarray) -> np.ndarray:
        raw = np.asarray(self._data[ids])
        if self.type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            return raw.astype(np.float32).reshape(len(ids), self.hidden_size)
        try:
            rows = gguf.quants.dequantize(raw, self.type)
        except NotImplementedError:
            rows = _ggml_to_float(raw, int(self.type), self.hidden_size)
        return np.asarray(rows, dtype=np.float32).reshape(len(ids), self.hidden_size)

    def _admit(self, missing: np.ndarray, keep: np.ndarray) -> None:
        """Put ``missing`` rows in the slots least recently used, never in those of ``keep``."""
        used = self._used.copy()
        used[keep] = np.iinfo(np.int64).max
        slots = np.argpartition(used, missing.size - 1)[:missing.size]
        evicted = self._owner[slots]
        self._slot[evicted[evicted >= 0]] = -1
        self._store[slots] = self._dequantize(missing)
        self._owner[slots] = missing
        self._slot[missing] = slots

    def rows(self, token_ids: np.ndarray) -> np.ndarray:
        token_ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if token_ids.size == 0:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        bad = token_ids[(token_ids < 0) | (token_ids >= self.vocab_size)]
        if bad.size:
            raise CorruptModel(f"token id {int(bad[0])} is outside {self.tensor_name} "
                               f"({self.vocab_size} rows)")
        unique = np.unique(token_ids)
        if unique.size > self.capacity:  # more distinct rows than the store holds: no caching
            return self._dequantize(unique)[np.searchsorted(unique, token_ids)]
        with self._lock:
            self._tick += 1
            slots = self._slot[unique]
            missing = unique[slots < 0]
            if missing.size:
                self._admit(missing, slots[slots >= 0])
            slots = self._slot[token_ids]
            self._used[slots] = self._tick
            return self._store[slots]
